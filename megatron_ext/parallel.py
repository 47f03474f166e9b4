"""Process groups: the one module that reads megatron-core's global ``parallel_state``.

Invariant: ranks of a TP group are consecutive (one node holds whole TP groups), pipeline
stages span nodes, data parallel is what is left (megatron-core's default order
``tp-cp-ep-dp-pp``). Everything downstream receives a ``ParallelContext`` with its groups
passed in explicitly.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.compat import check_versions
from megatron_ext.config import JobConfig
from megatron_ext.cpu_platform import apply_cpu_platform, get_distributed_backend
from megatron_ext.derived import get_stage_placement, get_virtual_pipeline_size
from megatron_ext.model.v_placement import get_v_embedding_ranks
from megatron_ext.pipeline.placement import get_stage_index


@dataclasses.dataclass(frozen=True)
class StagePlacement:
    """Where one rank sits in the pipeline (read from megatron-core once, by the caller).

    ``placement`` says which stage each local chunk runs (``pipeline/placement.py``): "loop"
    (megatron-core's: the last stage on rank p-1) or "v" (ZBV: the first and the last on rank 0)."""

    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int
    vp_size: int | None
    placement: str = "loop"

    def get_stage(self, vp_stage: int) -> int:
        """The pipeline stage this rank runs as local chunk ``vp_stage``."""
        return get_stage_index(self.pp_rank, vp_stage, self.pp_size, self.vp_size or 1, self.placement)

    def is_first(self, vp_stage: int) -> bool:
        return self.get_stage(vp_stage) == 0

    def is_last(self, vp_stage: int) -> bool:
        return self.get_stage(vp_stage) == self.pp_size * (self.vp_size or 1) - 1


@dataclasses.dataclass
class ParallelContext:
    """This rank's place in the layout and the groups it talks over."""

    device: torch.device
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    vp_size: int | None
    tp_group: Any
    pp_group: Any
    dp_group: Any
    mp_group: Any  # TP x PP ranks sharing one DP and one CP rank: they hold one copy of the model
    stage_placement: str = "loop"  # "v" under ZBV / DualPipeV (pipeline/placement.py)
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: Any = None  # the CP ranks splitting one micro-batch's sequence (same TP, PP and DP rank)
    dp_cp_group: Any = None  # DP x CP: gradients, token counts and loss sums reduce over it (None: dp_group)
    replica_group: Any = None  # TP x CP x PP: the ranks reading the same samples (None: mp_group)

    @property
    def data_group(self) -> Any:
        """The ranks that read the same samples and must agree on a step's padded length (TP x CP x
        PP; without CP megatron-core's model-parallel group)."""
        return self.replica_group if self.replica_group is not None else self.mp_group

    @property
    def reduce_group(self) -> Any:
        """Where the loss sums and token counts of a step reduce: DP x CP (without CP, DP)."""
        return self.dp_cp_group if self.dp_cp_group is not None else self.dp_group

    @property
    def placement(self) -> StagePlacement:
        return StagePlacement(
            self.pp_rank, self.pp_size, self.tp_rank, self.tp_size, self.vp_size, self.stage_placement
        )

    @property
    def is_last_stage(self) -> bool:
        """This pipeline rank holds the last stage, where the loss is: rank p-1 under the loop
        placement, rank 0 under V."""
        return self.pp_rank == (0 if self.stage_placement == "v" else self.pp_size - 1)

    @property
    def is_logging_rank(self) -> bool:
        """The last TP, CP and DP rank of the pipeline rank holding the loss (the last rank of the
        world under the loop placement)."""
        if self.stage_placement != "v":
            return self.rank == self.world_size - 1
        last = (self.tp_rank, self.cp_rank, self.dp_rank) == (self.tp_size - 1, self.cp_size - 1, self.dp_size - 1)
        return self.is_last_stage and last

    def describe_place(self) -> str:
        """'pipeline stage 1 of 2, tensor rank 0, context-parallel rank 1, data-parallel rank 0' (the CP
        rank only under CP): how errors and the stall watchdog name a rank."""
        cp = f", context-parallel rank {self.cp_rank}" if self.cp_size > 1 else ""
        return (
            f"pipeline stage {self.pp_rank} of {self.pp_size}, tensor rank {self.tp_rank}{cp}, "
            f"data-parallel rank {self.dp_rank}"
        )


def init_distributed(device: torch.device, timeout_minutes: int) -> None:
    """Join the torchrun world (env:// rendezvous) on gloo (CPU) or NCCL (CUDA)."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "MASTER_ADDR" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # `python pretrain_gpt.py ...` without torchrun: a one-process world on loopback.
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group(
        backend=get_distributed_backend(device),
        timeout=datetime.timedelta(minutes=timeout_minutes),
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
    )


def check_tp_inside_node(tp_size: int) -> None:
    """TP groups are consecutive ranks; they stay inside a node only if TP divides the processes
    per node (torchrun's LOCAL_WORLD_SIZE). Checked at start-up: only the launcher knows it."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local and local % tp_size:
        raise ValueError(
            f"--tensor-model-parallel-size {tp_size} does not divide the {local} processes per node "
            f"(--nproc-per-node): TP groups would span nodes; use a TP size that divides {local}"
        )


def get_rng_tracker_options(cfg: JobConfig) -> dict:
    """Keyword arguments of megatron-core's ``model_parallel_cuda_manual_seed`` for this job."""
    return {"use_cudagraphable_rng": True} if cfg.training.cuda_graph_impl == "local" else {}


# Dropout streams of CP rank r start from --seed + r x this stride (a prime above any TP size, so that
# megatron-core's TP tracker seeds, seed + 2718 + TP rank, never meet another CP rank's).
CP_SEED_STRIDE = 1009


def get_dropout_seed(seed: int, cp_rank: int) -> int:
    """The seed of this rank's dropout streams (the default generator and megatron-core's tracker).
    megatron-core's convention is kept (TP ranks differ in the tracker, DP replicas agree), and CP
    ranks differ: each holds other tokens of the same rows, and with one seed they would draw the same
    hidden-dropout mask for different tokens, correlated where one process draws independent ones.
    CP rank 0 keeps --seed, so a run without CP draws what it drew before. Weights never depend on it
    (``model/init_weights.py`` seeds each parameter from --seed and its name)."""
    return seed + CP_SEED_STRIDE * cp_rank


def ensure_rng_tracker(cfg: JobConfig) -> None:
    """A run built on groups made for another (``build_training_run(ctx=...)``, two runs side by side)
    gets the RNG tracker its flags need: CUDA graphs (``--cuda-graph-impl local``) need megatron-core's
    graph-safe tracker, which the first run's seed call may not have asked for. Re-seeded with the same
    seed, so the first run's streams start over as if it had asked for it."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    options = get_rng_tracker_options(cfg)
    if options and not getattr(get_cuda_rng_tracker(), "use_cudagraphable_rng", False):
        seed = get_dropout_seed(cfg.training.seed, ps.get_context_parallel_rank())
        model_parallel_cuda_manual_seed(seed, **options, force_reset_rng=True)


def build_parallel_context(cfg: JobConfig, device: torch.device) -> ParallelContext:
    """megatron-core's model-parallel groups for this job, and the RNG tracker seeds."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    check_versions()
    apply_cpu_platform(device)
    check_tp_inside_node(cfg.parallel.tensor_model_parallel_size)
    vp = get_virtual_pipeline_size(cfg)
    stage_placement = get_stage_placement(cfg)
    embedding_ranks = {}
    if stage_placement == "v":  # the tied embedding's two copies are both on pipeline rank 0
        embedding_ranks = dict(get_embedding_ranks=get_v_embedding_ranks)
    cp = cfg.parallel.context_parallel_size
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size,
        context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=vp if vp and vp > 1 else None,
        distributed_timeout_minutes=cfg.parallel.distributed_timeout_minutes,
        create_gloo_process_groups=device.type == "cuda",
        **embedding_ranks,
    )
    # Dropout streams: megatron-core's convention (TP ranks differ, DP replicas agree), CP ranks differ.
    # (CUDA graphs need the graph-safe tracker, whose states live in the captured graph's generator)
    seed = get_dropout_seed(cfg.training.seed, ps.get_context_parallel_rank())
    model_parallel_cuda_manual_seed(seed, **get_rng_tracker_options(cfg))
    torch.manual_seed(seed)
    return ParallelContext(
        device=device,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        vp_size=vp if vp and vp > 1 else None,
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
        stage_placement=stage_placement,
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=cp,
        cp_group=ps.get_context_parallel_group() if cp > 1 else None,
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True) if cp > 1 else None,
        replica_group=build_replica_group(cfg, dist.get_world_size()) if cp > 1 else None,
    )


def build_replica_group(cfg: JobConfig, world_size: int) -> Any:
    """This rank's TP x CP x PP group (megatron-core builds TP x PP and TP x CP, not the three):
    the ranks of one DP replica. Collective: every rank creates every group, in the same order."""
    from megatron.core.parallel_state import RankGenerator

    p = cfg.parallel
    tp, cp, pp = p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size
    gen = RankGenerator(tp=tp, ep=1, dp=world_size // (tp * cp * pp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    mine, me = None, dist.get_rank()
    for ranks in gen.get_ranks("tp-cp-pp"):
        group = dist.new_group(ranks)
        if me in ranks:
            mine = group
    return mine


def destroy_parallel_context() -> None:
    """Tear down every process group but the default one, so that a next layout can follow.

    megatron-core's ``destroy_model_parallel()`` only drops its references: each gloo subgroup
    keeps its threads and connections alive. Measured with 8 ranks and repeated TP2 x PP4
    init/destroy cycles: 160 threads per process after a few cycles, over 1,000 and 36-54 s per
    cycle after a few hundred groups. Destroying the subgroups keeps it flat (``compat.py``:
    torch's group registry is read to find them). A garbage collection ends the teardown.
    """
    from megatron.core import parallel_state as ps

    if dist.is_initialized():
        default = dist.distributed_c10d._get_default_group()
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is not default:
                dist.destroy_process_group(group)
    ps.destroy_model_parallel()
    # Finalise the destroyed groups (and the run's other native objects) here rather than at
    # whichever later allocation triggers a collection: inside the next layout's collectives or in
    # a forked DataLoader worker, that finalisation crashed processes with SIGSEGV.
    gc.collect()
