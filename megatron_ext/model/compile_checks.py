"""What --torch-compile and --cuda-graph-impl refuse, checked with the other flags before any work
(``validation.validate``); pure: nothing is imported from torch or megatron-core here.

CUDA graphs follow Megatron-LM 0.16's rules for ``--cuda-graph-impl local``: only the whole-layer
scope or ``full_iteration`` (the per-module scopes need Transformer Engine's graphs), and
``full_iteration`` only without the NaN check (its host-side check cannot run inside a captured step);
full recompute re-runs layers outside any graph, so only ``full_iteration`` could capture it. Here
``full_iteration`` is refused as not wired yet (megatron-core's ``FullCudaGraphWrapper`` copies dict
batches, ours are ``Microbatch`` objects), so every fix an error offers names a setting that runs now.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from megatron_ext.derived import get_max_microbatch_length, get_sequence_padding, uses_variable_lengths
from megatron_ext.pipeline.names import splits_backward

LOCAL_SCOPES = ("full", "full_iteration")
COMPILABLE_RECOMPUTE_MODULES = ("core_attn",)
MAX_QUIET_LENGTHS = 8  # padded lengths a compiled or graphed run may see before start-up warns


def check_compile_and_graphs(cfg: Any, cuda: bool) -> list[str]:
    """Every problem of --torch-compile and the --cuda-graph-* flags, each naming the flag and the fix."""
    return _check_torch_compile(cfg) + _check_cuda_graphs(cfg, cuda)


def _check_torch_compile(cfg: Any) -> list[str]:
    if not cfg.training.torch_compile:
        if cfg.training.torch_compile_cpp_wrapper:
            return [
                "--torch-compile-cpp-wrapper without --torch-compile: it sets how compiled graphs run; add --torch-compile or drop it"
            ]
        return []
    out = []
    schedule = cfg.parallel.pipeline_schedule
    if schedule and splits_backward(schedule):
        out.append(
            f"--torch-compile with --pipeline-schedule {schedule}: a zero-bubble schedule defers each "
            f"linear's weight gradient into a Python queue from inside its backward, which a compiled layer's "
            f"backward cannot do; drop --torch-compile or use 1F1B / Interleaved1F1B"
        )
    m = cfg.model
    granularity = m.recompute_granularity or ("selective" if m.recompute_activations else None)
    modules = [x for x in (m.recompute_modules or []) if x not in COMPILABLE_RECOMPUTE_MODULES]
    if cfg.training.cuda_graph_impl != "none":
        out.append(
            f"--torch-compile with --cuda-graph-impl {cfg.training.cuda_graph_impl}: megatron-core's graph "
            f"capture around a compiled layer is untested here; use one of them"
        )
    if granularity == "selective" and modules:
        out.append(
            f"--torch-compile with --recompute-modules {' '.join(modules)}: megatron-core recomputes those "
            f"through its own checkpoint functions, which do not compile whole; use --recompute-modules "
            f"core_attn or --recompute-granularity full"
        )
    return out


def _check_cuda_graphs(cfg: Any, cuda: bool) -> list[str]:
    t = cfg.training
    impl, scope = t.cuda_graph_impl, t.cuda_graph_scope
    out = []
    if not (isinstance(t.cuda_graph_warmup_steps, int) and t.cuda_graph_warmup_steps >= 0):
        out.append(f"--cuda-graph-warmup-steps must be an integer >= 0, got {t.cuda_graph_warmup_steps!r}")
    if impl == "none":
        return out
    if not cuda:
        return out + [f"--cuda-graph-impl {impl} needs CUDA (this run is on the CPU): leave it out on the CPU"]
    if impl == "transformer_engine":
        if importlib.util.find_spec("transformer_engine") is None:
            out.append(
                "--cuda-graph-impl transformer_engine: transformer_engine is not installed; use --cuda-graph-impl local"
            )
        return out
    if scope not in LOCAL_SCOPES:
        out.append(
            f"--cuda-graph-impl local with --cuda-graph-scope {scope}: only the whole layer (full) or "
            f"full_iteration without Transformer Engine; use --cuda-graph-scope full"
        )
    if scope == "full_iteration" and t.check_for_nan_in_loss_and_grad:
        out.append(
            "--cuda-graph-scope full_iteration with the NaN check on: the check reads the loss on the host "
            "inside the captured step; add --no-check-for-nan-in-loss-and-grad or use --cuda-graph-scope full"
        )
    elif scope == "full_iteration":
        out.append(
            "--cuda-graph-scope full_iteration is not wired here yet: megatron-core's FullCudaGraphWrapper "
            "copies its data iterators' dict batches into static buffers, and ours yield Microbatch objects; "
            "use --cuda-graph-scope full (each whole layer)"
        )
    lengths = "--packed-sequences" if cfg.data.packed_sequences else "--one-document-per-row"
    if uses_variable_lengths(cfg.data) and get_sequence_padding(cfg.data) != "static":
        out.append(
            f"--cuda-graph-impl local with {lengths} and --sequence-padding {get_sequence_padding(cfg.data)}: "
            f"megatron-core replays each layer's graphs with the shapes it captured, and negotiated or "
            f"variable lengths change them; add --sequence-padding static"
        )
    documents = t.cuda_graph_max_documents
    if documents is not None and not (isinstance(documents, int) and documents >= 1):
        out.append(f"--cuda-graph-max-documents must be an integer >= 1, got {documents!r}")
    if cfg.model.recompute_granularity == "full" and scope != "full_iteration":
        out.append(
            "--cuda-graph-impl local with --recompute-granularity full: a recomputed layer runs outside its "
            "graph (only --cuda-graph-scope full_iteration could capture it, and that is not wired here yet); "
            "use --recompute-granularity selective or drop it, or run without --cuda-graph-impl"
        )
    return out


def count_padded_lengths(max_length: int, multiple: int, bucket: str) -> int:
    """How many padded lengths negotiated/variable padding can give (``data/padding.get_step_length``'s
    rounding over every length up to ``max_length``): ceil(max / multiple) with ``multiple``, about
    log2 of that plus one with ``power-of-two``."""
    lengths = set()
    for blocks in range(1, -(-max_length // multiple) + 1):
        if bucket == "power-of-two":
            blocks = 1 << (blocks - 1).bit_length()
        lengths.add(min(max_length, blocks * multiple))
    return len(lengths)


def get_shape_notes(cfg: Any) -> list[str]:
    """One start-up warning when --torch-compile or --cuda-graph-impl meets variable lengths padded with
    ``--pad-length-bucket multiple``: each padded length is a recompile (or a capture), up to seq/64 of
    them with the defaults, which nothing else would say; ``power-of-two`` keeps them to a handful."""
    t, d = cfg.training, cfg.data
    flags = [
        flag
        for flag, on in (("--torch-compile", t.torch_compile), ("--cuda-graph-impl", t.cuda_graph_impl != "none"))
        if on
    ]
    multiple = d.pad_to_multiple_of
    if not flags or not uses_variable_lengths(d) or get_sequence_padding(d) == "static":
        return []
    if d.pad_length_bucket != "multiple" or not (isinstance(multiple, int) and multiple >= 1):
        return []
    longest = get_max_microbatch_length(cfg)
    num_lengths = count_padded_lengths(longest, multiple, "multiple")
    if num_lengths <= MAX_QUIET_LENGTHS:
        return []
    return [
        f"{' and '.join(flags)} with --pad-length-bucket multiple: micro-batches come in up to {num_lengths} "
        f"padded lengths (multiples of --pad-to-multiple-of {multiple} up to {longest} tokens), each a "
        f"recompile; add --pad-length-bucket power-of-two "
        f"({count_padded_lengths(longest, multiple, 'power-of-two')} lengths, at up to 2x the padding)"
    ]
