"""What to change when a job's predicted peak is above its GPUs' memory (``pretrain_gpt.py --rehearse
--gpu-memory-gib N``): the largest term of the fullest GPU, the cheapest change that keeps the job's
layout, and the planner's best layout for the same GPUs.

The job's layout is TP, CP, PP, VPP, the schedule and the pipeline split (so DP): a change that
keeps it may turn on recompute (selective, then full: 1 layer, uniform), lower the micro-batch size
(the same global batch in more micro-batches), turn on sequence parallelism (TP > 1) or the
distributed optimizer (DP x CP > 1), alone or together. The cheapest is the one with the least
predicted step time among those that fit (``planner.price_job``: full recompute costs a forward, a
smaller micro-batch a longer pipeline), then the least memory, then the fewest flags. All figures
are the planner's models (``memory.py``, ``step_time.py``): the local layer spec's activations,
calibrated on CPU runs, never compared with a GPU's ``max_memory_allocated`` yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings

from megatron_ext.config import JobConfig
from megatron_ext.derived import get_data_parallel_size
from megatron_ext.planning.memory import GIB, RankMemory, get_recompute_kind
from megatron_ext.planning.planner import RECOMPUTE, Candidate, check_job, get_head_layers, plan, price_job
from megatron_ext.planning.step_time import Cluster

RECOMPUTE_FLAGS = {
    "selective": ("--recompute-granularity", "selective"),
    "full": ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"),
}
STRONGER_RECOMPUTE = {"none": ("none", "selective", "full"), "selective": ("selective", "full"), "full": ("full",)}


@contextlib.contextmanager
def quiet_recompute_advice():
    """Without megatron-core's advice, on every TransformerConfig the planner's parameter counts build
    with selective recompute, that Transformer Engine's fused attention needs no core_attn recompute
    (we run the local spec): it would come before the error it is a part of."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*no need to set 'core_attn' to recompute.*")
        yield


@dataclasses.dataclass(frozen=True)
class Change:
    """Flags to add to a job (and to remove from its config), with the predicted result."""

    flags: tuple[str, ...]
    remove: tuple[str, ...]
    memory: float  # bytes on the fullest GPU
    seconds: float  # predicted step time


def get_terms(rank: RankMemory) -> dict[str, float]:
    """One GPU's predicted bytes by term, as the rehearsal prints them."""
    s = rank.state
    return {
        "weights": s.parameters,
        "gradient buffers": s.gradients,
        "optimizer state": s.optimizer,
        "activations": rank.activations,
        "temporaries": rank.temporaries,
        "margin": rank.margin,
    }


def get_variants(cfg: JobConfig, world_size: int) -> list[tuple[tuple[str, ...], tuple[str, ...], JobConfig]]:
    """(flags added, config settings to remove, the job) of every change keeping the layout (module
    docstring), the job itself excluded."""
    p, m, t = cfg.parallel, cfg.model, cfg.training
    kind = get_recompute_kind(cfg)
    sizes = [b for b in range(t.micro_batch_size, 0, -1) if t.micro_batch_size % b == 0]
    sp = [False, True] if p.tensor_model_parallel_size > 1 and not p.sequence_parallel else [False]
    shards = get_data_parallel_size(cfg, world_size) * p.context_parallel_size
    dist = [False, True] if shards > 1 and not p.use_distributed_optimizer else [False]
    out = []
    for recompute, mbs, add_sp, add_dist in itertools.product(STRONGER_RECOMPUTE[kind], sizes, sp, dist):
        if (recompute, mbs, add_sp, add_dist) == (kind, t.micro_batch_size, False, False):
            continue
        flags, remove = [], []
        model = m
        if recompute != kind:
            flags += RECOMPUTE_FLAGS[recompute]
            remove += ["--recompute-activations"] if m.recompute_activations else []
            model = dataclasses.replace(m, recompute_activations=False, recompute_modules=[], **RECOMPUTE[recompute])
        if mbs != t.micro_batch_size:
            flags += ["--micro-batch-size", str(mbs)]
        flags += (["--sequence-parallel"] if add_sp else []) + (["--use-distributed-optimizer"] if add_dist else [])
        parallel = dataclasses.replace(
            p,
            sequence_parallel=p.sequence_parallel or add_sp,
            use_distributed_optimizer=p.use_distributed_optimizer or add_dist,
        )
        job = dataclasses.replace(
            cfg, model=model, parallel=parallel, training=dataclasses.replace(t, micro_batch_size=mbs)
        )
        out.append((tuple(flags), tuple(remove), job))
    return out


def find_cheapest_change(cfg: JobConfig, cluster: Cluster, vocab_size: int) -> Change | None:
    """The cheapest change keeping the layout that fits ``cluster``'s memory (module docstring); None
    when none does."""
    head = get_head_layers(cfg, vocab_size, cfg.parallel.tensor_model_parallel_size)
    fits = []
    for flags, remove, job in get_variants(cfg, cluster.gpus):
        if check_job(job, cluster.gpus):
            continue
        with quiet_recompute_advice():
            _, ranks, time = price_job(job, cluster, vocab_size, head)
        worst = max(r.total for r in ranks)
        if worst <= cluster.gpu_memory_gib * GIB:
            fits.append(Change(flags, remove, worst, time.total))
    return min(fits, key=lambda c: (round(c.seconds, 6), c.memory, len(c.flags)), default=None)


def find_best_layout(cfg: JobConfig, cluster: Cluster, vocab_size: int) -> Candidate | None:
    """The planner's first layout that fits (``planner.plan``), or None."""
    with quiet_recompute_advice():
        return next((c for c in plan(cfg, cluster, vocab_size, {}) if not c.problems), None)


def describe_memory_overrun(
    cfg: JobConfig, cluster: Cluster, vocab_size: int, predicted: list[RankMemory]
) -> str | None:
    """The error of a job whose fullest GPU is predicted above ``cluster.gpu_memory_gib`` (None when it
    fits): that GPU's terms and the largest, the cheapest change keeping the layout, the planner's best
    layout for the same GPUs."""
    budget = cluster.gpu_memory_gib
    worst = max(range(len(predicted)), key=lambda r: predicted[r].total)
    rank = predicted[worst]
    if rank.total <= budget * GIB:
        return None
    terms = get_terms(rank)
    largest = max(terms, key=terms.get)
    head = get_head_layers(cfg, vocab_size, cfg.parallel.tensor_model_parallel_size)
    seconds = price_job(cfg, cluster, vocab_size, head)[2].total
    lines = [
        f"--gpu-memory-gib {budget:g}: pipeline rank {worst} is predicted to need {rank.total / GIB:.1f} GiB = "
        + " + ".join(f"{k} {v / GIB:.1f}" for k, v in terms.items())
        + f"; the largest term is {largest} ({terms[largest] / GIB:.1f} GiB). (The planner's memory model: the "
        f"local layer spec's activations calibrated on CPU runs, not yet checked on a GPU; docs/planning.md.)"
    ]
    change = find_cheapest_change(cfg, cluster, vocab_size)
    if change is None:
        lines.append(
            "    no change of recompute, micro-batch size, sequence parallelism or the distributed optimizer fits "
            "this layout: change the layout (below)"
        )
    else:
        removal = f", and remove {' '.join(change.remove)} from the config" if change.remove else ""
        lines.append(
            f"    the cheapest change keeping this layout: add {' '.join(change.flags)}{removal} (predicted "
            f"{change.memory / GIB:.1f} GiB, step {change.seconds:.2f} s against {seconds:.2f} s as given)"
        )
    best = find_best_layout(cfg, cluster, vocab_size)
    if best is None:
        lines.append(
            f"    no layout the planner enumerates fits {budget:g} GiB on {cluster.gpus} GPUs: more GPUs, or a "
            f"shorter --seq-length"
        )
    else:
        lines.append(
            f"    the planner's best layout for {cluster.gpus} GPUs of {budget:g} GiB: {best.layout.describe()} "
            f"(predicted {best.memory.total / GIB:.1f} GiB, step {best.time.total:.2f} s): "
            f"{' '.join(best.layout.flags())} (tools/plan_layout.py --gpus {cluster.gpus} lists more)"
        )
    return "\n".join(lines)
