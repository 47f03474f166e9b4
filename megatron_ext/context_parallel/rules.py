"""The rules the flags must satisfy under context parallelism, each a problem string naming the
flags, the values and the fix (pure; ``validation.validate`` runs them with every other rule).

- lengths: every row or document a CP rank splits is cut into 2c equal chunks (head-tail), and with
  sequence parallelism each CP shard is then cut over TP: --seq-length and --pad-to-multiple-of
  must be multiples of 2c (c x lcm(2, TP) with --sequence-parallel);
- packed documents are padded to a multiple of g = --document-pad-multiple (default 2c), and g must
  be a multiple of 2c: g is a data setting of its own, so the packs do not change with c;
- what is not built under CP is refused by name (see ``NOT_UNDER_CP``), and fp32 on CUDA (the CUDA
  path is flash varlen, half precision only).

Hidden dropout is allowed: each CP rank draws its own masks (``parallel.get_dropout_seed`` offsets
the dropout seed by the CP rank), as one process draws independent masks for every token; like any
dropout it is not bitwise one process's.
"""

from __future__ import annotations

from megatron_ext.config import JobConfig
from megatron_ext.derived import (
    get_cp_comm_types,
    get_cp_length_multiple,
    get_document_pad_multiple,
    get_sequence_padding,
)


def describe_nearest_multiples(value: int, multiple: int) -> str:
    """'N or M': the multiples of ``multiple`` nearest ``value`` (only the upper one below it)."""
    lower = value // multiple * multiple
    upper = lower + multiple
    return f"{lower} or {upper}" if lower > 0 else f"{upper}"


def check_cp_comm_type(cfg: JobConfig) -> list[str]:
    """--cp-comm-type: all_gather (allgather), one value or one per layer."""
    p, m = cfg.parallel, cfg.model
    out = []
    bad = [v for v, ours in zip(p.cp_comm_type, get_cp_comm_types(p)) if ours is None]
    if bad:
        out.append(
            f"--cp-comm-type {' '.join(dict.fromkeys(bad))}: only all_gather is supported (keys and values "
            f"all-gathered over the CP group, queries local; 'allgather' is accepted too); Megatron-LM's p2p "
            f"(ring), a2a (Ulysses) and a2a+p2p are not: use --cp-comm-type all_gather"
        )
    if len(p.cp_comm_type) not in (1, m.num_layers):
        out.append(
            f"--cp-comm-type takes one value or one per layer (--num-layers {m.num_layers}), got "
            f"{len(p.cp_comm_type)}: give one value"
        )
    return out


def check_document_pad_multiple(cfg: JobConfig) -> list[str]:
    """--document-pad-multiple g: positive, for packed documents, a multiple of 2c under CP, and a
    divisor of --seq-length (a document of --seq-length tokens stays one pack; for the default g = 2c
    ``check_cp_lengths`` says so)."""
    d, m, c = cfg.data, cfg.model, cfg.parallel.context_parallel_size
    g = d.document_pad_multiple
    if g is not None and g <= 0:
        return [f"--document-pad-multiple must be >= 1, got {g}"]
    if g is not None and g > 1 and not d.packed_sequences:
        return [
            f"--document-pad-multiple {g} pads packed documents: it needs --packed-sequences (other rows are "
            f"split head-tail per row, padded by --pad-to-multiple-of)"
        ]
    if not d.packed_sequences or c <= 0:
        return []
    g = get_document_pad_multiple(d, c)
    out = []
    if c > 1 and g % (2 * c):
        out.append(
            f"--document-pad-multiple {g} is not a multiple of 2 x --context-parallel-size {c} = {2 * c}: each "
            f"CP rank takes two chunks of every document; use {describe_nearest_multiples(g, 2 * c)}"
        )
    if m.seq_length > 0 and m.seq_length % g and (d.document_pad_multiple is not None or c == 1):
        out.append(
            f"--seq-length {m.seq_length} is not a multiple of --document-pad-multiple {g}: a document padded to "
            f"the multiple must still fit a pack; use --seq-length {describe_nearest_multiples(m.seq_length, g)}"
        )
    return out


def check_cp_lengths(cfg: JobConfig) -> list[str]:
    """--seq-length and --pad-to-multiple-of against 2c (c x lcm(2, TP) with sequence parallelism)."""
    p, m, d = cfg.parallel, cfg.model, cfg.data
    c, multiple = p.context_parallel_size, get_cp_length_multiple(cfg)
    if c <= 1 or p.tensor_model_parallel_size <= 0:
        return []
    why = (
        f"2 x --context-parallel-size {c}"
        if not p.sequence_parallel
        else f"--context-parallel-size {c} x lcm(2, --tensor-model-parallel-size {p.tensor_model_parallel_size})"
        f" with --sequence-parallel"
    )
    out = []
    if m.seq_length > 0 and m.seq_length % multiple:
        out.append(
            f"--seq-length {m.seq_length} is not a multiple of {why} = {multiple}: every row is cut into equal "
            f"chunks per CP rank; use --seq-length {describe_nearest_multiples(m.seq_length, multiple)}"
        )
    k = d.pad_to_multiple_of
    if get_sequence_padding(d) != "static" and k > 0 and k % multiple:
        out.append(
            f"--pad-to-multiple-of {k} is not a multiple of {why} = {multiple}: a padded step must split into "
            f"equal chunks per CP rank; use --pad-to-multiple-of {describe_nearest_multiples(k, multiple)}"
        )
    return out


# (what is given, why it is refused under CP, the fix); each a predicate on the config
NOT_UNDER_CP = (
    (
        lambda cfg: not cfg.training.calculate_per_token_loss,
        "--no-calculate-per-token-loss",
        "the loss under CP is the token sum over DP x CP; per-micro-batch means are not built: drop it",
    ),
    (
        lambda cfg: cfg.training.torch_compile,
        "--torch-compile",
        "the CP attention's gather and per-piece kernels are not compiled yet: drop --torch-compile",
    ),
    (
        lambda cfg: cfg.training.cuda_graph_impl == "local",
        "--cuda-graph-impl local",
        "captured layers would replay one CP layout: use --cuda-graph-impl none",
    ),
    (
        lambda cfg: cfg.model.transformer_impl == "transformer_engine",
        "--transformer-impl transformer_engine",
        "CP runs on our attention of the local spec (auto picks it under CP): use --transformer-impl local or auto",
    ),
    (
        lambda cfg: cfg.model.attention_dropout > 0,
        "--attention-dropout > 0",
        "CP peers would draw the same dropout masks for different queries: use --attention-dropout 0",
    ),
    (
        lambda cfg: get_sequence_padding(cfg.data) == "variable",
        "--sequence-padding variable",
        "megatron-core's shape handshake is not combined with CP: use negotiated (the default) or static",
    ),
)


def check_not_under_cp(cfg: JobConfig) -> list[str]:
    c = cfg.parallel.context_parallel_size
    if c <= 1:
        return []
    return [
        f"{given} is not supported with --context-parallel-size {c}: {why}"
        for refuses, given, why in NOT_UNDER_CP
        if refuses(cfg)
    ]


def check_cp_precision(cfg: JobConfig, cuda: bool) -> list[str]:
    """On CUDA the CP attention is one flash varlen call per layer (``context_parallel/attention.py``),
    which takes bf16 or fp16 only: an fp32 run is refused here rather than at its first layer."""
    c, t = cfg.parallel.context_parallel_size, cfg.training
    if c <= 1 or not cuda or t.bf16 or t.fp16:
        return []
    return [
        f"--context-parallel-size {c} on CUDA needs --bf16 (or --fp16): the CP attention runs flash's varlen "
        f"kernel, which has no fp32 form (fp32 under CP runs on the CPU only)"
    ]


def check_context_parallel(cfg: JobConfig, cuda: bool = False) -> list[str]:
    """Every CP rule (the world's divisibility by TP x CP x PP is ``layout_rules.check_layout``'s)."""
    return (
        check_cp_comm_type(cfg)
        + check_document_pad_multiple(cfg)
        + check_cp_lengths(cfg)
        + check_not_under_cp(cfg)
        + check_cp_precision(cfg, cuda)
    )
