"""A rehearsal of a whole job on one CPU machine (``pretrain_gpt.py --rehearse``): what a launch of
WORLD_SIZE ranks decides before its first step, computed for that world size in one process, with
no process group, no GPU and no memory for the weights.

    WORLD_SIZE=512 python pretrain_gpt.py --config configs/llama3-70b.yaml --rehearse

1. The flags and the layout: ``validation.validate`` for that world size, the tokenizer built and
   checked against the data as at start-up (the real run's own checks, not a copy of them).
2. The process-group map: megatron-core's pure-Python ``RankGenerator`` in the order
   ``initialize_model_parallel`` uses by default (ours passes none), so the TP, PP, DP and
   embedding groups are those a real launch creates; a rank's node is ``rank // ranks per node``
   as torchrun numbers them. Invariant checked: every TP group sits inside one node (its
   all-reduces run at every layer).
3. The model: each distinct (pipeline stage, virtual stage) chunk built once on the ``meta``
   device (``model/param_count.py``): parameters per rank, which pipeline ranks hold the embedding
   and the output layer, uneven splits.
4. Memory per rank: parameter, gradient-buffer and optimizer-state bytes from the exact counts
   (``get_state_bytes``), and the layout planner's prediction of the rest (``planning/predict.py``:
   activations at the schedule's peak from the calibrated model, temporaries outside autograd, the
   stated margin): what ``tools/plan_layout.py`` prints for this layout.
5. The samples each DP rank reads in the first step of a fresh run, from the run's own
   assignment (``data.microbatch.get_microbatch_indices``); their contents are not read.

Ranks per node: ``LOCAL_WORLD_SIZE`` (torchrun's, from ``--nproc-per-node``), else
``NPROC_PER_NODE`` (``launch/torchrun.sh``'s), else 8 (the GPUs of an HGX node, as
``launch/slurm.sbatch``), at most the world size. Any failing check is one ConfigError naming the
flag or variable and the fix (exit status 2, like every configuration error).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable, Mapping

from megatron_ext.config import ConfigError, JobConfig
from megatron_ext.data.microbatch import get_microbatch_indices
from megatron_ext.data.tokenizers import build_tokenizer, get_tokenizer_args
from megatron_ext.derived import (
    get_batch_schedule,
    get_data_parallel_size,
    get_padded_vocab_size,
    get_replica_size,
    get_schedule_name,
    get_stage_placement,
    get_virtual_pipeline_size,
    precision_name,
)
from megatron_ext.model.param_count import ParameterCount, count_parameters
from megatron_ext.model.v_placement import get_v_embedding_ranks
from megatron_ext.planning.fit import describe_memory_overrun
from megatron_ext.planning.memory import RankMemory, StateBytes, get_state_bytes
from megatron_ext.planning.planner import check_job
from megatron_ext.planning.predict import predict_memory
from megatron_ext.planning.step_time import Cluster
from megatron_ext.validation import check_data_tokenizer

DEFAULT_RANKS_PER_NODE = 8
GIB = 1024**3


# ----------------------------------------------------------------------------- the process-group map


@dataclasses.dataclass(frozen=True)
class GroupMap:
    """Which global ranks share each process group, and each rank's coordinates and node.

    ``tp_rank[r]``, ``pp_rank[r]``, ``dp_rank[r]``, ``cp_rank[r]``: rank r's place in its TP, PP, DP
    and CP group."""

    world_size: int
    ranks_per_node: int
    tp_groups: tuple[tuple[int, ...], ...]
    pp_groups: tuple[tuple[int, ...], ...]
    dp_groups: tuple[tuple[int, ...], ...]
    cp_groups: tuple[tuple[int, ...], ...]  # the ranks splitting one micro-batch's sequence
    dp_cp_groups: tuple[tuple[int, ...], ...]  # DP x CP: the gradient reduce and the optimizer's shards
    embedding_groups: tuple[tuple[int, ...], ...]  # megatron-core's word-embedding groups (tie and grad sync)
    tp_rank: tuple[int, ...]
    pp_rank: tuple[int, ...]
    dp_rank: tuple[int, ...]
    cp_rank: tuple[int, ...]

    def get_node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def get_nodes_per_group(self, groups: tuple[tuple[int, ...], ...]) -> int:
        """The most nodes one of ``groups`` spans."""
        return max(len({self.get_node(r) for r in g}) for g in groups)

    def get_ranks_of_pp_rank(self, pp_rank: int) -> list[int]:
        return [r for r in range(self.world_size) if self.pp_rank[r] == pp_rank]


def get_megatron_order() -> str:
    """The group order ``initialize_model_parallel`` uses when given none, as parallel.py calls it."""
    from megatron.core.parallel_state import initialize_model_parallel

    return inspect.signature(initialize_model_parallel).parameters["order"].default


def _index_in_groups(groups: list[list[int]], world_size: int) -> tuple[int, ...]:
    place = [-1] * world_size
    for group in groups:
        for i, r in enumerate(group):
            assert place[r] == -1, f"rank {r} is in two groups of one kind"
            place[r] = i
    assert min(place) >= 0, "a rank is in no group"
    return tuple(place)


def build_group_map(tp: int, pp: int, dp: int, ranks_per_node: int, placement: str = "loop", cp: int = 1) -> GroupMap:
    """The groups megatron-core forms for TP x CP x PP x DP (no process group is created)."""
    from megatron.core.parallel_state import RankGenerator, default_embedding_ranks

    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=get_megatron_order())
    world = tp * cp * pp * dp
    tp_groups, pp_groups, dp_groups = gen.get_ranks("tp"), gen.get_ranks("pp"), gen.get_ranks("dp")
    cp_groups = gen.get_ranks("cp")
    embedding_ranks = get_v_embedding_ranks if placement == "v" else default_embedding_ranks  # as parallel.py
    return GroupMap(
        world_size=world,
        ranks_per_node=ranks_per_node,
        tp_groups=tuple(map(tuple, tp_groups)),
        pp_groups=tuple(map(tuple, pp_groups)),
        dp_groups=tuple(map(tuple, dp_groups)),
        cp_groups=tuple(map(tuple, cp_groups)),
        dp_cp_groups=tuple(map(tuple, gen.get_ranks("dp-cp"))),
        embedding_groups=tuple(tuple(embedding_ranks(g)) for g in pp_groups),
        tp_rank=_index_in_groups(tp_groups, world),
        pp_rank=_index_in_groups(pp_groups, world),
        dp_rank=_index_in_groups(dp_groups, world),
        cp_rank=_index_in_groups(cp_groups, world),
    )


def get_ranks_per_node(env: Mapping[str, str], world_size: int) -> tuple[int, str]:
    """(ranks per node, where the figure came from); see the module docstring."""
    for name in ("LOCAL_WORLD_SIZE", "NPROC_PER_NODE"):
        value = env.get(name)
        if value:
            if not value.isdigit() or int(value) <= 0:
                raise ConfigError([f"{name}={value!r} must be a positive number of processes per node"])
            return int(value), f"{name}={value}"
    assumed = min(DEFAULT_RANKS_PER_NODE, max(world_size, 1))
    return assumed, f"LOCAL_WORLD_SIZE unset: {assumed} per node assumed"


def check_nodes(world_size: int, ranks_per_node: int, source: str, tp: int) -> list[str]:
    """The world fills whole nodes, and TP's consecutive ranks stay inside one."""
    if world_size % ranks_per_node:
        return [
            f"WORLD_SIZE {world_size} is not a multiple of the {ranks_per_node} ranks per node ({source}): "
            f"torchrun starts the same number on every node; set LOCAL_WORLD_SIZE to the processes per node"
        ]
    if ranks_per_node % tp:
        return [
            f"--tensor-model-parallel-size {tp} does not divide the {ranks_per_node} ranks per node ({source}): "
            f"TP groups (consecutive ranks) would span nodes, and TP all-reduces at every layer over the "
            f"network; use a TP size that divides {ranks_per_node} (pipeline stages span nodes instead)"
        ]
    return []


def check_group_map(gm: GroupMap) -> list[str]:
    """Every TP group inside one node (after ``check_nodes``, a check of megatron-core's order)."""
    spanning = [g for g in gm.tp_groups if len({gm.get_node(r) for r in g}) > 1]
    return [
        f"TP group {list(g)} spans nodes {sorted({gm.get_node(r) for r in g})} under megatron-core's "
        f"order {get_megatron_order()!r}: use a --tensor-model-parallel-size that divides the ranks per node"
        for g in spanning[:1]
    ]


# ----------------------------------------------------------------------------- the rehearsal


@dataclasses.dataclass(frozen=True)
class Rehearsal:
    """What a launch of ``world_size`` ranks would build before its first step."""

    world_size: int
    ranks_per_node: int
    ranks_per_node_source: str
    groups: GroupMap
    vocab_size: int  # the tokenizer's ids
    padded_vocab_size: int
    params: ParameterCount
    embedding_pp_rank: int  # the pipeline rank holding the word embedding (stage 0)
    output_pp_rank: int  # ... and the output layer (the last stage)
    state_bytes: tuple[StateBytes, ...]  # per pipeline rank: what each of its ranks holds
    predicted: tuple[RankMemory, ...]  # per pipeline rank: the planner's memory model (planning/predict.py)
    first_step_samples: tuple[tuple[tuple[int, ...], ...], ...]  # [dp rank][micro-batch] -> global sample indices
    seconds: float


def get_first_step_samples(cfg: JobConfig, world_size: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Each DP rank's micro-batches (global sample indices) in the first step of a fresh run."""
    dp, b = get_data_parallel_size(cfg, world_size), cfg.training.micro_batch_size
    gbs = get_batch_schedule(cfg, world_size).get_global_batch_size(0)  # a ramp-up's first batch
    return tuple(tuple(tuple(mb) for mb in get_microbatch_indices(0, gbs, b, r, dp)) for r in range(dp))


def check_samples(samples: tuple[tuple[tuple[int, ...], ...], ...], global_batch_size: int) -> list[str]:
    """The DP ranks read the global batch [0, G) exactly once between them."""
    read = sorted(i for rank in samples for mb in rank for i in mb)
    if read != list(range(global_batch_size)):
        return [
            f"the first step's samples over the DP ranks are not the global batch 0..{global_batch_size - 1} "
            f"once each (--global-batch-size, --micro-batch-size)"
        ]
    return []


def check_flags(cfg: JobConfig, world_size: int, ranks_per_node: int, source: str) -> None:
    """The start-up checks at ``world_size`` and the nodes; ConfigError listing every problem."""
    p = cfg.parallel
    problems = list(check_job(cfg, world_size, cuda=p.device != "cpu"))  # on GPUs unless --device cpu
    if world_size % get_replica_size(cfg) == 0:  # else validate said it
        problems += check_nodes(world_size, ranks_per_node, source, p.tensor_model_parallel_size)
    if p.gpu_memory_gib is not None and p.gpu_memory_gib <= 0:
        problems.append(f"--gpu-memory-gib {p.gpu_memory_gib:g}: give the GPUs' memory in GiB (e.g. 80), > 0")
    if problems:
        raise ConfigError(problems)


def get_unrehearsed_notes(cfg: JobConfig) -> list[str]:
    """The rehearsal's own flags on a run that does not rehearse: one warning each, not an error, so
    that the rehearsed command line launches the job as it is (docs/planning.md: the real job's flags
    plus --rehearse; a launch has nothing to check them against)."""
    p = cfg.parallel
    if p.gpu_memory_gib is None or p.rehearse:
        return []
    return [
        f"--gpu-memory-gib {p.gpu_memory_gib:g} is ignored without --rehearse: a launch does not check its "
        f"predicted memory; run this command line with --rehearse (and WORLD_SIZE) to check that the layout "
        f"fits {p.gpu_memory_gib:g} GiB"
    ]


def rehearse(cfg: JobConfig, world_size: int, env: Mapping[str, str]) -> Rehearsal:
    """Check and compute everything of the module docstring; ConfigError listing what fails."""
    start = time.perf_counter()
    ranks_per_node, source = get_ranks_per_node(env, world_size)
    check_flags(cfg, world_size, ranks_per_node, source)
    p, d = cfg.parallel, cfg.data
    tokenizer = build_tokenizer(**get_tokenizer_args(d))
    check_data_tokenizer(d, tokenizer.identity())

    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    dp = get_data_parallel_size(cfg, world_size)
    groups = build_group_map(tp, pp, dp, ranks_per_node, get_stage_placement(cfg), cp)
    params = count_parameters(cfg, tokenizer.vocab_size)  # (the same at every CP size)
    last_stage = len(params.chunks) - 1
    samples = get_first_step_samples(cfg, world_size)
    problems = check_group_map(groups) + check_samples(
        samples, get_batch_schedule(cfg, world_size).get_global_batch_size(0)
    )
    if problems:
        raise ConfigError(problems)
    predicted = predict_memory(cfg, world_size, tokenizer.vocab_size)
    if p.gpu_memory_gib is not None:
        cluster = Cluster(world_size, ranks_per_node, p.gpu_memory_gib)
        overrun = describe_memory_overrun(cfg, cluster, tokenizer.vocab_size, predicted)
        if overrun:
            raise ConfigError([overrun])
    return Rehearsal(
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        ranks_per_node_source=source,
        groups=groups,
        vocab_size=tokenizer.vocab_size,
        padded_vocab_size=get_padded_vocab_size(tokenizer.vocab_size, cfg),
        params=params,
        embedding_pp_rank=next(c.pp_rank for c in params.chunks if c.stage == 0),
        output_pp_rank=next(c.pp_rank for c in params.chunks if c.stage == last_stage),
        # the distributed optimizer shards over DP x CP (CP ranks hold the same parameters)
        state_bytes=tuple(get_state_bytes(cfg, n, dp * cp) for n in params.per_pp_rank()),
        predicted=tuple(predicted),
        first_step_samples=samples,
        seconds=time.perf_counter() - start,
    )


# ----------------------------------------------------------------------------- the summary


def _span(ranks: tuple[int, ...] | list[int]) -> str:
    """[0, 64, 128, ..., 448] as '0..448 step 64' when evenly spaced ('0..3' for a step of 1)."""
    if len(ranks) > 2 and len({b - a for a, b in zip(ranks, ranks[1:])}) == 1:
        step = ranks[1] - ranks[0]
        return f"{ranks[0]}..{ranks[-1]}" + (f" step {step}" if step != 1 else "")
    return ", ".join(map(str, ranks))


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / 1024**2:.1f} MiB"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 'es' if noun.endswith('h') else 's'}"


def _describe_groups(kind: str, groups: tuple[tuple[int, ...], ...], gm: GroupMap) -> str:
    first, last = groups[0], groups[-1]
    nodes = sorted({gm.get_node(r) for r in first})
    return (
        f"  {kind}: {_count(len(groups), 'group')} of {len(first)}, e.g. ranks {_span(first)} "
        f"(node{'s' if len(nodes) > 1 else ''} {_span(nodes)}){f' ... {_span(last)}' if len(groups) > 1 else ''}"
    )


def describe_cp_nodes(gm: GroupMap) -> str:
    """Where the CP groups sit: one node each, or how many they span (allowed, and said: the K/V
    all-gather and reduce-scatter of every layer then cross the network)."""
    nodes, size = gm.get_nodes_per_group(gm.cp_groups), len(gm.cp_groups[0])
    if nodes == 1:
        return "each inside one node"
    tp = len(gm.tp_groups[0])
    return (
        f"each spans {nodes} nodes: its K/V all-gather and reduce-scatter cross the network at every layer "
        f"(allowed; TP x CP = {tp * size} within the {gm.ranks_per_node} ranks of a node keeps them inside one)"
    )


def describe_group_lines(gm: GroupMap) -> list[str]:
    """The process-group lines of the summary (CP's only with CP)."""
    lines = [_describe_groups("TP", gm.tp_groups, gm)]
    if len(gm.cp_groups[0]) > 1:
        lines.append(_describe_groups("CP", gm.cp_groups, gm) + "; " + describe_cp_nodes(gm))
    lines += [_describe_groups("PP", gm.pp_groups, gm), _describe_groups("DP", gm.dp_groups, gm)]
    if len(gm.cp_groups[0]) > 1:
        lines.append(_describe_groups("DP x CP", gm.dp_cp_groups, gm) + " (gradient reduce, optimizer shards)")
    lines.append(f"  embedding groups: {len(gm.embedding_groups)}, e.g. ranks {_span(gm.embedding_groups[0])}")
    return lines


def describe_rehearsal(cfg: JobConfig, r: Rehearsal) -> str:
    """The summary ``--rehearse`` prints."""
    gm, p = r.groups, cfg.parallel
    tp, pp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, len(gm.dp_groups[0])
    cp = p.context_parallel_size
    vpp = get_virtual_pipeline_size(cfg)
    schedule = get_schedule_name(cfg) or ("Interleaved1F1B" if vpp else "1F1B" if pp > 1 else "no pipeline")
    lines = [
        f"rehearsal: {r.world_size} ranks on {_count(r.world_size // r.ranks_per_node, 'node')} of {r.ranks_per_node} "
        f"({r.ranks_per_node_source}): TP {tp}{f' x CP {cp}' if cp > 1 else ''} x PP {pp}"
        f"{f' x VPP {vpp}' if vpp else ''} x DP {dp}, {schedule}"
        f"{', sequence parallel' if p.sequence_parallel else ''}"
        f"{', distributed optimizer' if p.use_distributed_optimizer else ''}",
        f"process groups (megatron-core's RankGenerator, order {get_megatron_order()}; node = rank // "
        f"{r.ranks_per_node}; every TP group inside one node):",
        *describe_group_lines(gm),
    ]
    counts = r.params
    distinct = len({(c.num_layers, c.stage == 0, c.stage == len(counts.chunks) - 1) for c in counts.chunks})
    layers = sorted({c.num_layers for c in counts.chunks})
    lines.append(
        f"model: {counts.total:,} parameters (vocabulary {r.vocab_size:,} padded to {r.padded_vocab_size:,}), "
        f"{_count(len(counts.chunks), 'chunk')} of {'/'.join(map(str, layers))} layers"
        f"{' (uneven split)' if len(layers) > 1 else ''}, {distinct} distinct, each built once on meta; "
        f"embedding on pipeline rank {r.embedding_pp_rank}, output layer on pipeline rank {r.output_pp_rank}"
    )
    precision = precision_name(cfg.training.bf16, cfg.training.fp16)
    lines.append(
        f"per rank ({precision} weights, gradient buffers, {cfg.training.optimizer} state"
        f"{(' sharded over DP x CP' if cp > 1 else ' sharded over DP') if p.use_distributed_optimizer else ''}, "
        f"exact; then the planner's prediction of "
        f"the whole GPU: activations at the schedule's peak, temporaries, margin):"
    )
    for pp_rank, state in enumerate(r.state_bytes):
        chunks = [c for c in counts.chunks if c.pp_rank == pp_rank]
        ranks = gm.get_ranks_of_pp_rank(pp_rank)
        roles = (" embedding" if pp_rank == r.embedding_pp_rank else "") + (
            " output" if pp_rank == r.output_pp_rank else ""
        )
        lines.append(
            f"  pp {pp_rank:>2} (ranks {ranks[0]}..{ranks[-1]}, {len(ranks)}): stages "
            f"{','.join(str(c.stage) for c in chunks)} of {'+'.join(str(c.num_layers) for c in chunks)} layers{roles}"
            f" | {counts.per_pp_rank()[pp_rank]:,} parameters | {_size(state.total)} = weights "
            f"{_size(state.parameters)} + grads {_size(state.gradients)} + optimizer {_size(state.optimizer)}"
        )
        if r.predicted:
            mem = r.predicted[pp_rank]
            lines.append(
                f"        predicted {mem.total / GIB:.1f} GiB = state {mem.state.total / GIB:.1f} + activations "
                f"{mem.activations / GIB:.1f} + temporaries {mem.temporaries / GIB:.1f} + margin {mem.margin / GIB:.1f}"
            )
    samples = r.first_step_samples
    m = len(samples[0])
    lines.append(
        f"first step: global batch {sum(len(mb) for s in samples for mb in s)}, {_count(m, 'micro-batch')}"
        f" of {len(samples[0][0])} per DP rank (each once):"
    )
    for dp_rank in sorted({0, len(samples) - 1}):
        flat = [i for mb in samples[dp_rank] for i in mb]
        lines.append(f"  DP rank {dp_rank}: samples {_span(flat)}")
    lines.append(f"rehearsal passed in {r.seconds:.1f} s")
    return "\n".join(lines)


def get_world_size(env: Mapping[str, str]) -> int:
    """The rehearsed world: ``WORLD_SIZE`` as torchrun would set it (required: a rehearsal of one
    process is rarely what was meant)."""
    value = env.get("WORLD_SIZE", "")
    if not value.isdigit() or int(value) <= 0:
        raise ConfigError(
            [
                f"--rehearse rehearses a launch of WORLD_SIZE ranks: set WORLD_SIZE to the job's number of "
                f"processes (e.g. WORLD_SIZE=64 python pretrain_gpt.py ... --rehearse), got {value!r}"
            ]
        )
    return int(value)


def rehearse_job(
    cfg: JobConfig, notes: list[str], env: Mapping[str, str], log: Callable[[str], None] = print
) -> Rehearsal:
    """``pretrain_gpt.py --rehearse``: rehearse the launch ``env`` describes (WORLD_SIZE,
    LOCAL_WORLD_SIZE) and print the summary (and the flag notices)."""
    result = rehearse(cfg, get_world_size(env), env)
    for note in notes:
        log(f"WARNING: {note}")
    log(describe_rehearsal(cfg, result))
    return result
