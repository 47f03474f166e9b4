"""Zero-bubble schedules on the real GPT chunks: exact as 1F1B and as one process.

1. Through ``pretrain_gpt.main`` (the entry point, on an indexed dataset of Markov documents made by
   ``tools/preprocess_data.py``), per-iteration training losses and the validation loss (forward-only
   through our runtime) equal one process's: ZBH1 and ZBVZeroBubble at PP 4 (tolerance 1e-6) and at
   PP 2 x DP 2, InterleavedZeroBubble at PP 2 x VPP 2 x DP 2 (1e-5), packed and unpacked; and each of
   the three at TP 2 x PP 2 x DP 2 with sequence parallelism, full recompute, the distributed
   optimizer, --overlap-grad-reduce and --overlap-param-gather (1e-5; six iterations, so every
   step after the first runs on parameters the overlapped gather brought). The runtime raises when a
   step ends with a W left in the queue, so a finished run also says the queue was empty at every
   step's end.
2. After one step, every parameter's gradient under ZBH1 at PP 4 and InterleavedZeroBubble at PP 2 x
   VPP 2 x DP 2 equals megatron-core's 1F1B / interleaved 1F1B on the same layout, packed and unpacked.
3. The deferral-on matrix, TP 2 x PP 2 x DP 2 with sequence parallelism, full recompute, the
   distributed optimizer, --overlap-grad-reduce and --overlap-param-gather: after one step every
   parameter's gradient equals megatron-core's own schedule's (1F1B, interleaved 1F1B) on the same
   layout, and no DDP bucket starts its reduce before the last W of its chunk (counted).

Worlds: one process (the reference), 4 ranks, 8 ranks; each runs all its cases in one fork
(``pretrain_gpt.main``'s final ``destroy_process_group`` is skipped so that the next case reuses it).
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import pytest
import torch

from megatron_ext.testing import MarkovDataset, run_ranks

pytestmark = pytest.mark.distributed

VOCAB = 100  # NullTokenizer: ids 0..99, EOD 100
BASE = [
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    str(VOCAB),
    "--device",
    "cpu",
    "--seq-length",
    "64",
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--train-iters",
    "6",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-3",
    "--lr-decay-style",
    "constant",
    "--clip-grad",
    "1.0",
    "--split",
    "90,10,0",
    "--log-interval",
    "1",
    "--eval-interval",
    "6",
    "--eval-iters",
    "1",
    "--seed",
    "1234",
    "--make-vocab-size-divisible-by",
    "32",
]
PACKINGS = {
    "unpacked": [],
    "packed": ["--packed-sequences"],
    "unpacked, 8 layers": ["--num-layers", "8"],
}  # the V at PP 4 needs 2 x 4 chunks
FOUR_RANK = {  # name: (flags, tolerance[, packings: both unless given])
    "ZBH1 PP4": (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "ZBH1"], 1e-6),
    "ZBVZeroBubble PP4": (
        ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "ZBVZeroBubble"],
        1e-6,
        ("unpacked, 8 layers",),
    ),
    "ZBH1 PP2xDP2": (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbh1"], 1e-5),
    "InterleavedZeroBubble PP2xVPP2xDP2": (
        [
            "--pipeline-model-parallel-size",
            "2",
            "--pipeline-schedule",
            "InterleavedZeroBubble",
            "--num-virtual-stages-per-pipeline-rank",
            "2",
        ],
        1e-5,
    ),
    "ZBVZeroBubble PP2xDP2": (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "ZBVZeroBubble"], 1e-5),
}
FOUR_RANK_CASES = [
    (name, packing)
    for name, case in FOUR_RANK.items()
    for packing in (case[2] if len(case) > 2 else ("unpacked", "packed"))
]
MATRIX_FLAGS = [
    "--tensor-model-parallel-size",
    "2",
    "--pipeline-model-parallel-size",
    "2",
    "--sequence-parallel",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
]
EIGHT_RANK = {  # name: (flags, packing), each on top of MATRIX_FLAGS; tolerance 1e-5
    "ZBH1": (["--pipeline-schedule", "ZBH1"], "unpacked"),
    "InterleavedZeroBubble": (
        ["--pipeline-schedule", "InterleavedZeroBubble", "--num-virtual-stages-per-pipeline-rank", "2"],
        "packed",
    ),
    "ZBVZeroBubble": (["--pipeline-schedule", "ZBVZeroBubble"], "packed"),
}


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    """An indexed dataset of 400 Markov documents of 5-150 tokens (so packing packs several)."""
    from tools.preprocess_data import preprocess_data

    root = tmp_path_factory.mktemp("zb_data")
    chain, rng = MarkovDataset(160, seed=3), np.random.default_rng(7)
    path = os.path.join(root, "docs.jsonl")
    with open(path, "w") as f:
        for i in range(400):
            n = int(np.clip(rng.lognormal(np.log(40), 0.8), 5, 150))
            tokens = chain[i]["tokens"][:n] % VOCAB
            f.write(json.dumps({"text": " ".join(map(str, tokens))}) + "\n")
    preprocess_data(
        path, os.path.join(root, "docs"), "NullTokenizer", vocab_size=VOCAB, append_eod=True, progress=False
    )
    return os.path.join(root, "docs_text_document")


def _main_runs(rank: int, world_size: int, runs: list[list[str]], grad_cases: tuple = ()) -> list[dict]:
    """``pretrain_gpt.main`` per argv: the logged losses and validation losses of this rank; then, for
    each of ``grad_cases`` ((our flags, megatron-core's flags, packed)), one step's full gradients
    under both schedules."""
    import pretrain_gpt
    from megatron_ext.parallel import destroy_parallel_context
    from megatron_ext.pipeline.runtime import get_schedule_runtime
    from megatron_ext.training import evaluation

    evals: list[float] = []
    schedules: list[str | None] = []
    orig_evaluate = evaluation.evaluate

    def evaluate(run, *args):
        loss = orig_evaluate(run, *args)
        if run.ctx.is_last_stage:
            evals.append(loss)
        runtime = get_schedule_runtime(run.model)
        schedules.append(runtime.name if runtime else None)
        return loss

    out = []
    evaluation.evaluate, destroy = evaluate, torch.distributed.destroy_process_group
    torch.distributed.destroy_process_group = lambda *a, **k: None  # the next run reuses this world
    try:
        for argv in runs:
            evals.clear()
            schedules.clear()
            with contextlib.redirect_stdout(open(os.devnull, "w")):
                losses = pretrain_gpt.main(argv)
            out.append({"losses": losses, "evals": list(evals), "schedule": schedules[0]})
            destroy_parallel_context()
    finally:
        evaluation.evaluate, torch.distributed.destroy_process_group = orig_evaluate, destroy
    for ours, theirs, packed in grad_cases:
        grads = []
        for flags in (ours, theirs):
            grads.append(_one_step_grads({**GRAD_BASE, **flags}, record=False, packed=packed)[0])
            destroy_parallel_context()
        out.append({"grads": grads})
    return out


def _logged(per_rank: list[list[dict]], i: int) -> tuple[list[float], list[float]]:
    """The case's losses and validation losses, from the ranks that hold the loss (all equal)."""
    found = [r[i] for r in per_rank if r[i]["losses"]]
    assert found and all(f == found[0] for f in found)
    return found[0]["losses"], found[0]["evals"], found[0]["schedule"]


GRAD_BASE = dict(global_batch_size=8, micro_batch_size=1, num_layers=4)
GRAD_CASES = {  # name: (ours, megatron-core's schedule on the same layout); each packed and unpacked
    "ZBH1 PP4": (dict(pipeline_model_parallel_size=4, pipeline_schedule="ZBH1"), dict(pipeline_model_parallel_size=4)),
    "InterleavedZeroBubble PP2xVPP2xDP2": (
        dict(
            pipeline_model_parallel_size=2,
            num_virtual_stages_per_pipeline_rank=2,
            pipeline_schedule="InterleavedZeroBubble",
        ),
        dict(pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2),
    ),
}


@pytest.fixture(scope="module")
def one_process(data_prefix) -> dict:
    """{packing: (losses, validation losses)} of one process."""
    base = BASE + ["--data-path", data_prefix]
    (reference,) = run_ranks(_main_runs, 1, [base + flags for flags in PACKINGS.values()], timeout=600)
    assert all(r["schedule"] is None for r in reference)
    return {packing: (reference[i]["losses"], reference[i]["evals"]) for i, packing in enumerate(PACKINGS)}


@pytest.fixture(scope="module")
def main_results(data_prefix, one_process):
    base = BASE + ["--data-path", data_prefix]
    cases = FOUR_RANK_CASES
    runs = [base + FOUR_RANK[name][0] + PACKINGS[packing] for name, packing in cases]
    grad_cases = [(name, packed) for name in GRAD_CASES for packed in (False, True)]
    per_rank = run_ranks(_main_runs, 4, runs, tuple((*GRAD_CASES[n], p) for n, p in grad_cases), timeout=900)
    grads = {}
    for i, case in enumerate(grad_cases, start=len(cases)):
        merged = ({}, {})
        for rank_out in per_rank:
            for mine, theirs in zip(merged, rank_out[i]["grads"]):
                mine.update(theirs)
        grads[case] = merged
    return one_process, {case: _logged(per_rank, i) for i, case in enumerate(cases)}, grads


@pytest.mark.parametrize("name,packing", FOUR_RANK_CASES)
def test_losses_through_pretrain_gpt_equal_one_process(main_results, name, packing):
    ref, results, _ = main_results
    (ref_losses, ref_evals), (losses, evals, schedule) = ref[packing], results[(name, packing)]
    assert schedule == name.split()[0]  # our runtime ran it (megatron-core's schedules would pass too)
    tol = FOUR_RANK[name][1]
    assert len(ref_losses) == 6 and ref_losses[-1] < ref_losses[0], ref_losses  # the model learns
    assert losses == pytest.approx(ref_losses, rel=tol, abs=tol), (name, packing)
    assert len(ref_evals) == 1 and evals == pytest.approx(ref_evals, rel=tol, abs=tol), (name, packing)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_gradients_after_one_step_equal_megatron_core_s_schedule(main_results, name, packed):
    ours, theirs = main_results[2][(name, packed)]
    assert ours.keys() == theirs.keys() and ours
    for param, g in theirs.items():
        assert g.abs().sum() > 0, param
        torch.testing.assert_close(ours[param], g, rtol=1e-6, atol=1e-9, msg=f"{name}: {param}")


# ---- the deferral-on matrix, TP 2 x PP 2 x DP 2 ----

MATRIX = dict(
    tensor_model_parallel_size=2,
    pipeline_model_parallel_size=2,
    sequence_parallel=True,
    recompute_granularity="full",
    recompute_method="uniform",
    recompute_num_layers=1,
    use_distributed_optimizer=True,
    overlap_grad_reduce=True,
    overlap_param_gather=True,
    num_layers=8,
    global_batch_size=8,
    micro_batch_size=1,
)
MATRIX_CASES = {  # ours: (our flags, megatron-core's schedule on the same layout)
    "ZBH1": (dict(pipeline_schedule="ZBH1"), {}),
    "InterleavedZeroBubble": (
        dict(pipeline_schedule="InterleavedZeroBubble", num_virtual_stages_per_pipeline_rank=2),
        dict(num_virtual_stages_per_pipeline_rank=2),
    ),
    "ZBVZeroBubble": (dict(pipeline_schedule="ZBVZeroBubble"), dict(num_virtual_stages_per_pipeline_rank=2)),
}


def _one_step_grads(values: dict, record: bool, packed: bool = False) -> tuple[dict, list]:
    """Full gradients after one step (finalized), and, with ``record``, the order in which a second
    step ran its W's, started DDP bucket groups' reduces and finalized (DDP only dispatches reduces
    from the second step on: the first one learns which gradients a bucket waits for)."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    from megatron_ext.pipeline import runtime as rt
    from megatron_ext.testing import PackedMarkovDataset, build_tiny_run, gather_full_grads, tiny_values
    from megatron_ext.training.step import build_step_microbatches, run_forward_backward

    dataset = PackedMarkovDataset(32) if packed else MarkovDataset(32, mask_every=1)
    run = build_tiny_run(tiny_values(**values, packed_sequences=packed), dataset)
    mbs, length = build_step_microbatches(run, run.train_ds, 0)
    run_forward_backward(run.model, mbs, length)
    grads = gather_full_grads(run)
    events: list = []
    if record:
        # a group holding a deferred weight may reduce after that weight's last W only; one holding none
        # (norms, biases, embeddings: their hooks fire in B) after the chunk's last backward action
        groups = {
            id(g): (c, any(getattr(p, "skip_backward_post_hook", False) for p in g.params))
            for c, chunk in enumerate(run.model)
            for g in chunk.bucket_groups
        }
        orig_w, orig_sync = rt.weight_step, _ParamAndGradBucketGroup.start_grad_sync
        orig_action = rt.ScheduleRuntime._run_action
        config = run.model[0].config
        finalize = config.finalize_model_grads_func

        def weight_step(queue, key):
            events.append(("W", key))
            return orig_w(queue, key)

        def start_grad_sync(self, *args, **kwargs):
            events.append(("reduce", groups.get(id(self))))
            return orig_sync(self, *args, **kwargs)

        def run_action(self, step, config, action):
            if action.kind != "F":
                events.append(("action", (step.order.chunk_of(action.stage), action.mb)))
            return orig_action(self, step, config, action)

        rt.weight_step, _ParamAndGradBucketGroup.start_grad_sync = weight_step, start_grad_sync
        rt.ScheduleRuntime._run_action = run_action
        config.finalize_model_grads_func = lambda *a, **k: (events.append(("finalize", None)), finalize(*a, **k))
        try:
            mbs, length = build_step_microbatches(run, run.train_ds, run.global_batch_size)
            run_forward_backward(run.model, mbs, length)
        finally:
            rt.weight_step, _ParamAndGradBucketGroup.start_grad_sync = orig_w, orig_sync
            rt.ScheduleRuntime._run_action = orig_action
            config.finalize_model_grads_func = finalize
    return (grads if run.ctx.tp_rank == 0 and run.ctx.dp_rank == 0 else {}), events


def _matrix(rank: int, world_size: int, runs: list[list[str]]) -> dict:
    from megatron_ext.parallel import destroy_parallel_context

    out = {"main": _main_runs(rank, world_size, runs)}
    for name, (ours, theirs) in MATRIX_CASES.items():
        for label, flags in (("ours", ours), ("megatron-core", theirs)):
            out[(name, label)] = _one_step_grads({**MATRIX, **flags}, record=label == "ours")
            destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def matrix_results(data_prefix):
    base = BASE + ["--data-path", data_prefix] + MATRIX_FLAGS
    runs = [base + flags + PACKINGS[packing] for flags, packing in EIGHT_RANK.values()]
    return run_ranks(_matrix, 8, runs, timeout=900)


@pytest.mark.parametrize("name", list(EIGHT_RANK))
def test_losses_at_tp2_pp2_dp2_sp_recompute_overlapped_equal_one_process(one_process, matrix_results, name):
    """TP 2 x PP 2 x DP 2, sequence parallel, full recompute, distributed optimizer with both overlap
    flags, through pretrain_gpt.main: the losses (every step from the second on runs on parameters
    --overlap-param-gather gathered inside the step) and the validation loss equal one process's."""
    packing = EIGHT_RANK[name][1]
    ref_losses, ref_evals = one_process[packing]
    losses, evals, schedule = _logged([r["main"] for r in matrix_results], list(EIGHT_RANK).index(name))
    assert schedule == name
    assert len(losses) == 6 and losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5), (name, losses, ref_losses)
    assert len(evals) == 1 and evals == pytest.approx(ref_evals, rel=1e-5, abs=1e-5), name


@pytest.mark.parametrize("name", list(MATRIX_CASES))
def test_deferral_matrix_gradients_equal_megatron_core_s_schedule(matrix_results, name):
    merged = {}
    for label in ("ours", "megatron-core"):
        grads = {}
        for rank_out in matrix_results:
            grads.update(rank_out[(name, label)][0])
        merged[label] = grads
    assert merged["ours"].keys() == merged["megatron-core"].keys() and merged["ours"]
    for param, g in merged["megatron-core"].items():
        assert g.abs().sum() > 0, param
        torch.testing.assert_close(merged["ours"][param], g, rtol=1e-5, atol=1e-8, msg=f"{name}: {param}")


@pytest.mark.parametrize("name", list(MATRIX_CASES))
def test_no_bucket_reduce_starts_before_its_last_w(matrix_results, name):
    """Buckets with deferred weights: not before the W of the chunk's last micro-batch; others (their
    gradients complete in B): not before the chunk's last micro-batch's backward; and some bucket with
    deferred weights starts its reduce inside the schedule (before finalize: the overlap works)."""
    m = 4  # global batch 8 / (micro-batch 1 x DP 2)
    overlapped = 0
    for rank_out in matrix_results:
        events = rank_out[(name, "ours")][1]
        reduces = [i for i, e in enumerate(events) if e[0] == "reduce"]
        assert reduces, (name, events)
        overlapped += sum(i < events.index(("finalize", None)) and events[i][1][1] for i in reduces)
        for i in reduces:
            chunk, deferred = events[i][1]
            # the W of the chunk's last micro-batch; without deferred weights, its first backward action
            ready = ("W", (chunk, m - 1)) if deferred else ("action", (chunk, m - 1))
            assert events.index(ready) < i, (name, events)
    assert overlapped, f"{name}: no bucket of deferred weights started its reduce inside the schedule"
