"""Measure the activation bytes autograd saves per layer and token with the real megatron-core
layers at small sizes on the CPU, fit the memory model's coefficients, and write the table.

    python -m tools.calibrate_memory [--out megatron_ext/planning/calibration.json]

For each family (GPT-2 style with dropout 0.1 as GPT-3, the same without dropout, Llama style:
RMSNorm, SwiGLU, GQA, RoPE, no biases), precision (fp32, bf16) and recompute (none, selective
core attention, full uniform 1 layer), one micro-batch's forward and loss (our ``forward_step``,
as a training step runs it) of a 2-layer model at several shapes (hidden, heads, query groups, MLP
width, sequence, micro-batch, vocabulary) on 1 rank, and at TP 2 with and without sequence
parallelism on 2 forked gloo ranks, under ``SavedBytesMeter`` (exact bytes, one count per storage,
parameters excluded), attributed to the embedding, the layers (with the decoder's own checkpoint
saves under full recompute) and the head (final norm, output layer, loss). Per-token bytes are
exactly linear in the features of ``planning/memory.py`` (``layer_features``, ``head_features``);
least squares over the features the family's layers can save (``LAYER_FEATURES_BY_FAMILY``; the
shapes vary query groups per rank across megatron-core's query-copy cases, a shape that does not
separate the features is an error) gives each bucket's coefficients, and the table keeps the largest
relative residual of the fit beside them. Takes about a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron_ext.cpu_platform import quiet_known_warnings  # noqa: E402

quiet_known_warnings()

import numpy as np  # noqa: E402

from megatron_ext.cli_args import ToolParser, fail, input_file, output_file  # noqa: E402
from megatron_ext.parallel import destroy_parallel_context  # noqa: E402
from megatron_ext.planning.memory import (  # noqa: E402
    CALIBRATION_PATH,
    EMBEDDING_FEATURES,
    HEAD_FEATURES,
    LAYER_FEATURES,
    LAYER_FEATURES_BY_FAMILY,
    Shape,
    embedding_features,
    head_features,
    layer_features,
)
from megatron_ext.planning.meter import SavedBytesMeter  # noqa: E402
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values  # noqa: E402
from megatron_ext.training.step import build_step_microbatches, forward_step, unwrap_model  # noqa: E402

FAMILIES = {
    "gpt": dict(hidden_dropout=0.1, attention_dropout=0.1),
    "gpt-nodropout": {},
    "llama": dict(
        normalization="RMSNorm",
        swiglu=True,
        group_query_attention=True,
        position_embedding_type="rope",
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=True,
    ),
}
PRECISIONS = {"fp32": {}, "bf16": dict(bf16=True)}
RECOMPUTE = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}
# (hidden, heads, query groups, MLP width, sequence, micro-batch, vocabulary ids); TP 1
SHAPES_TP1 = [
    (64, 4, 2, 192, 32, 1, 127),
    (128, 4, 2, 192, 32, 1, 127),
    (64, 8, 4, 192, 32, 1, 127),
    (64, 4, 1, 192, 32, 1, 127),
    (64, 4, 2, 320, 32, 1, 127),
    (64, 4, 2, 192, 64, 1, 127),
    (64, 4, 2, 192, 32, 2, 255),
    (64, 4, 4, 192, 32, 1, 127),  # Llama without GQA (a group per head: no repeat of K and V)
]
# each with SP off and on: one query group per rank (megatron-core's query reshape a view), two (a copy)
SHAPES_TP2 = [(64, 4, 2, 192, 32, 1, 127), (128, 8, 4, 320, 64, 1, 255)]


def get_flags(family: str, shape: tuple, tp: int, sp: bool) -> dict:
    h, heads, groups, ffn, s, b, vocab = shape
    flags = dict(
        num_layers=2,
        hidden_size=h,
        num_attention_heads=heads,
        ffn_hidden_size=ffn,
        seq_length=s,
        micro_batch_size=b,
        global_batch_size=b,
        vocab_size=vocab,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        **FAMILIES[family],
    )
    if family == "llama":
        flags["num_query_groups"] = groups
    return flags


def measure(values: dict) -> dict[str, int]:
    """Bytes one micro-batch's forward and loss leave for the backward, by part."""
    run = build_tiny_run(tiny_values(**values), MarkovDataset(values["seq_length"]))
    mbs, _ = build_step_microbatches(run, run.train_ds, 0)
    chunk = run.model[0]
    gpt = unwrap_model(chunk)
    meter = SavedBytesMeter(chunk.parameters())
    handles = meter.attribute(gpt.embedding, "embedding") + meter.attribute(gpt.decoder, "layers")
    for layer in gpt.decoder.layers:
        handles += meter.attribute(layer, "layers")
    handles += meter.attribute(gpt.decoder.final_layernorm, "head")
    with meter.track():
        output, loss_func = forward_step(iter(mbs), chunk)
        loss = loss_func(output)  # kept: what is live now is what waits for the backward
    parts = dict(meter.by_label)
    del loss, output
    for h in handles:
        h.remove()
    destroy_parallel_context()
    return {
        "embedding": parts.get("embedding", 0),
        "layer": parts.get("layers", 0) // values["num_layers"],
        "head": parts.get("head", 0) + parts.get("", 0),
    }


def _measure_all(rank: int, world_size: int, jobs: list) -> list:
    return [(key, measure(values)) for key, values in jobs]


def collect() -> list[dict]:
    """Every measurement: bucket, shape, TP, SP and bytes per part of one micro-batch."""
    jobs = {1: [], 2: []}
    for family in FAMILIES:
        for precision, pflags in PRECISIONS.items():
            for recompute, rflags in RECOMPUTE.items():
                for tp, shapes in ((1, SHAPES_TP1), (2, SHAPES_TP2)):
                    for shape in shapes:
                        for sp in (False, True) if tp > 1 else (False,):
                            key = dict(
                                family=family, precision=precision, recompute=recompute, shape=shape, tp=tp, sp=sp
                            )
                            jobs[tp].append((key, {**get_flags(family, shape, tp, sp), **pflags, **rflags}))
    rows = []
    for tp, todo in jobs.items():
        results = run_ranks(_measure_all, tp, todo)
        rows += [{**key, **nbytes} for key, nbytes in results[0]]
    return rows


def get_shape(row: dict) -> Shape:
    h, heads, groups, ffn, s, b, vocab = row["shape"]
    return Shape(
        hidden=h,
        heads=heads,
        query_groups=groups if row["family"] == "llama" else heads,
        ffn=ffn,
        seq_length=s,
        micro_batch=b,
        padded_vocab=-(-(vocab + 1) // 32) * 32,  # NullTokenizer's ids + EOD, padded to tiny_values' 32
        tp=row["tp"],
        sequence_parallel=row["sp"],
        swiglu=row["family"] == "llama",
    )


def fit(rows: list[dict]) -> dict:
    """Per bucket: coefficients (bytes per feature unit and token) and the largest relative residual."""
    table = {}
    buckets = sorted({(r["family"], r["precision"], r["recompute"]) for r in rows})
    for bucket in buckets:
        mine = [r for r in rows if (r["family"], r["precision"], r["recompute"]) == bucket]
        entry = {}
        for part, features, names, used in (
            ("layer", layer_features, LAYER_FEATURES, LAYER_FEATURES_BY_FAMILY[bucket[0]]),
            ("embedding", embedding_features, EMBEDDING_FEATURES, EMBEDDING_FEATURES),
            ("head", head_features, HEAD_FEATURES, HEAD_FEATURES),
        ):
            shapes = [get_shape(r) for r in mine]
            columns = [names.index(n) for n in used]
            x = np.array([features(s) for s in shapes], dtype=float)[:, columns]
            tokens = np.array([s.seq_length * s.micro_batch for s in shapes], dtype=float)
            y = np.array([r[part] for r in mine], dtype=float) / tokens
            coef, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
            if rank < len(used):  # the shapes do not separate the features: the coefficients would be arbitrary
                raise ValueError(f"{'/'.join(bucket)} {part}: {len(used)} features, rank {rank} over the shapes")
            coef = np.round(coef, 3)
            pred = x @ coef
            err = float(np.max(np.abs(pred - y) / np.maximum(y, 1e-9))) if y.any() else 0.0
            entry[part] = dict(zip(used, map(float, coef)))
            entry[f"{part}_max_rel_error"] = round(err, 5)
        table["/".join(bucket)] = entry
    return table


def fit_saved_rows(path: str) -> tuple[list[dict], dict]:
    """(the measurements ``--rows`` wrote to ``path``, their fit); a file that is not such
    measurements (damaged, another file) is one error line, exit 2."""
    try:
        with open(path, encoding="utf-8") as f:
            rows = [{**r, "shape": tuple(r["shape"])} for r in json.load(f)]
        return rows, fit(rows)
    except (ValueError, KeyError, TypeError, IndexError) as err:
        fail(f"--from-rows {path} is not what --rows writes ({type(err).__name__}: {err}): measure again with --rows")


def main(argv: list[str] | None = None) -> int:
    p = ToolParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=output_file, default=CALIBRATION_PATH, help="where to write the table (JSON)")
    p.add_argument("--rows", type=output_file, default=None, help="also write the raw measurements here (JSON)")
    p.add_argument(
        "--from-rows", type=input_file, default=None, help="fit measurements written by --rows instead of measuring"
    )
    args = p.parse_args(argv)
    start = time.perf_counter()
    if args.from_rows:
        rows, table = fit_saved_rows(args.from_rows)
    else:
        rows = collect()
        table = fit(rows)
    doc = {
        "command": "python -m tools.calibrate_memory",
        "what": "bytes per token saved for backward, per layer / embedding / head, on one TP rank",
        "measurements": len(rows),
        "buckets": table,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    if args.rows:
        with open(args.rows, "w") as f:
            json.dump(rows, f)
    worst = max(v for e in table.values() for k, v in e.items() if k.endswith("max_rel_error"))
    print(
        f"{len(rows)} measurements, {len(table)} buckets, worst fit residual {worst:.2%}, {time.perf_counter() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
