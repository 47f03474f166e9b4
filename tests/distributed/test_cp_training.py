"""Context parallelism through the training loop: every layout and pipeline schedule trains as one process.

Forked gloo worlds run ``train`` on the tests' tiny Llama-style model (GQA, RoPE from the sliced
positions), fp32, 3 steps with clipping active, packed documents padded to g = 8 (a multiple of 2c
for c = 2 and 4; negotiated lengths, multiples of 16) or unpacked rows. The reference is one process
with the same g. Compared with it, for every layout:

- each iteration's logged loss (the global token mean: the loss rows summed over DP x CP) <= 1e-5;
- every parameter after the 3 steps, gathered over TP, <= 1e-5 (relative): the gradients megatron-core's
  DDP reduces over DP x CP and its token count over DP x CP are one process's; CP peers hold the same
  parameters bitwise;
- the log window's totals (loss sum, valid tokens, real tokens, model FLOPs), summed over DP x CP:
  one process's, so tokens/s (real tokens / s) and TFLOP/s per GPU (FLOPs / s / world) are not c
  times off; and --log-params-norm's value (in bf16 with the distributed optimizer too, whose main
  parameter shards are summed over DP x CP).

Layouts: 4 ranks, CP2 x PP2 under megatron-core's 1F1B (with the distributed optimizer, sharded over
CP, saving its checkpoint at step 3) and interleaved 1F1B (VPP2), and our runtime's ZBH1 and
ZBVZeroBubble, packed; 1F1B on unpacked rows. 8 ranks: CP2 x TP2+SP x PP2, CP2 x DP2 x PP2 with the
distributed optimizer, CP4 x PP2. Resume: the CP2 x PP2 checkpoint (g = 8, optimizer sharded over
CP) loaded at CP1 x PP2 x DP2 and at CP4 x PP2: steps 4 and 5 give one process's losses. Also: CP
peers run the same actions under our runtime; what collectives our features add per step; the
layout line; dropout seeds per CP rank; a rank that raises under CP leaves its peers to the step
watchdog, which names it.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.pipeline.runtime import get_schedule_runtime
from megatron_ext.run import describe_run
from megatron_ext.testing import (
    LLAMA_STYLE,
    MarkovDataset,
    PackedMarkovDataset,
    build_tiny_run,
    count_collectives,
    gather_full_params,
    run_ranks,
    tiny_values,
)
from megatron_ext.training import loop
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.step import unwrap_model

pytestmark = pytest.mark.distributed

G, SEQ, ITERS, RESUMED_ITERS = 8, 64, 3, 5
MODEL = dict(LLAMA_STYLE, group_query_attention=True, num_query_groups=2, ffn_hidden_size=128)
# Adam's eps at 1e-4, not 1e-8: with 1e-8 Adam turns fp32 rounding in a gradient element near zero (another
# summation order) into a step of lr's size, 1.6e-5 of a weight's norm after 3 steps under CP (3e-6 under
# PP2 x DP2 without CP); with 1e-4, 2.4e-7 (one fp32 ulp), and the update is still Adam's (elements >> 1e-4)
BASE = dict(
    MODEL,
    seq_length=SEQ,
    train_iters=ITERS,
    clip_grad=0.3,
    adam_eps=1e-4,
    global_batch_size=8,
    pad_to_multiple_of=16,
    log_interval=1,
)
PACKED = dict(BASE, micro_batch_size=1, packed_sequences=True, document_pad_multiple=G, log_params_norm=True)
ROWS = dict(BASE, micro_batch_size=2, log_params_norm=False)
DATA = {"packed": lambda: PackedMarkovDataset(SEQ, pad_multiple=G), "rows": lambda: MarkovDataset(SEQ, mask_every=1)}
VALID = PackedMarkovDataset(SEQ, seed=9, pad_multiple=G)
EVAL = dict(eval_interval=ITERS, eval_iters=2)  # one evaluation (forward only) after step 3
CP2_PP2 = dict(context_parallel_size=2, pipeline_model_parallel_size=2)
# name: (flags, data)
FOUR_RANKS = {
    "CP2 x PP2 1F1B, distributed optimizer": (dict(PACKED, **CP2_PP2, use_distributed_optimizer=True), "packed"),
    # (its collectives counted: without --log-params-norm's)
    "CP2 x PP2 VPP2": (
        dict(PACKED, **CP2_PP2, num_layers_per_virtual_pipeline_stage=1, log_params_norm=False),
        "packed",
    ),
    # (the spike guard, never armed in 3 steps, records each step's agreed global loss)
    "CP2 x PP2 ZBH1": (
        dict(PACKED, **CP2_PP2, pipeline_schedule="ZBH1", skip_spiky_loss_factor=100.0, skip_spiky_loss_window=5),
        "packed",
    ),
    "CP2 x PP2 ZBVZeroBubble": (dict(PACKED, **CP2_PP2, **EVAL, pipeline_schedule="ZBVZeroBubble"), "packed"),
    "CP2 x PP2 1F1B rows": (dict(ROWS, **CP2_PP2), "rows"),
}
BF16_RUN = (dict(PACKED, **CP2_PP2, use_distributed_optimizer=True, bf16=True), "packed")
# --bf16: --log-params-norm reads the fp32 main parameters, the distributed optimizer's shards over DP x CP
BF16 = "CP2 x PP2 1F1B bf16, distributed optimizer"
SAVED = "CP2 x PP2 1F1B, distributed optimizer"
COUNTED = "CP2 x PP2 VPP2"
EIGHT_RANKS = {
    "CP2 x TP2+SP x PP2": (
        dict(PACKED, **CP2_PP2, tensor_model_parallel_size=2, sequence_parallel=True),
        "packed",
    ),
    "CP2 x DP2 x PP2, distributed optimizer": (dict(PACKED, **CP2_PP2, use_distributed_optimizer=True), "packed"),
    "CP4 x PP2": (dict(PACKED, **EVAL, context_parallel_size=4, pipeline_model_parallel_size=2), "packed"),
}
# resumed from SAVED's checkpoint, at 4 and at 8 ranks
RESUME_CP1 = dict(PACKED, pipeline_model_parallel_size=2, use_distributed_optimizer=True, train_iters=RESUMED_ITERS)
RESUME_CP4 = dict(RESUME_CP1, context_parallel_size=4)


def _train(values: dict, data: str, load: str | None = None, count: bool = False, inf_at: int | None = None) -> dict:
    """``train`` of the run of ``values`` (loading ``load`` first; an inf loss on CP rank 1 at
    iteration ``inf_at``): what each rank saw and logged."""
    run = build_tiny_run(tiny_values(**values), DATA[data](), VALID if "eval_interval" in values else None)
    if inf_at is not None:
        inject_inf_loss(run, inf_at)
    ctx = run.ctx
    lines: list[str] = []
    run.log = lines.append
    totals = []
    log_iteration = loop._log_iteration

    def recording(run_, loss, result, window, reduced, *args):  # the logging rank's reduced window
        totals.append((reduced.tolist(), args[1] if len(args) > 1 else None))
        return log_iteration(run_, loss, result, window, reduced, *args)

    evaluations: list[list[float]] = []
    evaluate_and_log = loop.evaluate_and_log

    def evaluating(run_):
        evaluations.append(evaluate_and_log(run_))
        return evaluations[-1]

    loop._log_iteration, loop.evaluate_and_log = recording, evaluating  # this forked rank only
    actions = record_actions(run)
    if load is not None:
        load_checkpoint(run, load)
    counts = count_collectives(lambda: loop.train(run)) if count else loop.train(run) and None
    loop._log_iteration, loop.evaluate_and_log = log_iteration, evaluate_and_log
    params = gather_full_params(run) if ctx.dp_rank == 0 else {}  # (collective over TP)
    out = {
        "records": [(r["iteration"], r["loss"], r["grad_norm"]) for r in run.records],
        "totals": totals,
        "params": params if ctx.tp_rank == 0 else {},
        "place": (ctx.cp_rank, ctx.pp_rank, ctx.tp_rank, ctx.dp_rank),
        "actions": actions,
        "layout": describe_run(run).splitlines()[0],
        "loaded": [line for line in lines if line.startswith("loaded checkpoint")],
        "counts": counts,
        "seeds": get_dropout_seeds(),
        "spike_losses": list(run.spike_guard.losses) if run.spike_guard is not None else None,
        "nan": (run.state.nan_iterations, run.nan_origin),
        "validation": evaluations if ctx.is_last_stage else [],
    }
    destroy_parallel_context()
    return out


def inject_inf_loss(run, iteration: int) -> None:
    """+inf added to CP rank 1's per-token losses (its share of every micro-batch) at ``iteration``:
    its loss sum is inf, its gradients stay finite (a constant), CP rank 0's loss is finite."""
    if not (run.ctx.is_last_stage and run.ctx.cp_rank == 1):
        return

    def hook(module, inputs, output):  # output: this rank's per-token loss [b, s/c]
        return output + float("inf") if module.training and run.state.iteration + 1 == iteration else output

    unwrap_model(run.model[-1]).register_forward_hook(hook)


def record_actions(run) -> list[str]:
    """The actions our schedule runtime runs on this rank, as it runs them (empty under megatron-core's)."""
    runtime, ran = get_schedule_runtime(run.model), []
    if runtime is not None:
        run_action = runtime._run_action

        def recording(step, config, action):
            ran.append(str(action))
            return run_action(step, config, action)

        runtime._run_action = recording
    return ran


def get_dropout_seeds() -> tuple[int, int]:
    """(the default generator's seed, a hash of megatron-core's model-parallel tracker state)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = get_cuda_rng_tracker().get_states()["model-parallel-rng"]
    return torch.initial_seed(), hash(state.numpy().tobytes())


def _reference(rank: int, world_size: int) -> dict:
    return {
        "packed": _train(dict(PACKED, **EVAL), "packed"),
        "packed, 5 steps": _train(dict(PACKED, train_iters=RESUMED_ITERS), "packed"),
        "rows": _train(ROWS, "rows"),  # (rows: no --log-params-norm)
        "packed, bf16": _train(dict(PACKED, bf16=True), "packed"),
    }


def _four_ranks(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for name, (values, data) in FOUR_RANKS.items():
        if name == SAVED:  # a 5-step run exiting (and saving) after step 3, which the resumed runs finish
            values = dict(values, save=root, train_iters=RESUMED_ITERS, exit_interval=ITERS)
        out[name] = _train(values, data, count=name == COUNTED)
    out["resumed at CP1 x PP2 x DP2"] = _train(RESUME_CP1, "packed", load=root)
    out[BF16] = _train(*BF16_RUN)
    out["inf loss"] = _train(dict(PACKED, **CP2_PP2), "packed", inf_at=2)
    return out


def _eight_ranks(rank: int, world_size: int, root: str) -> dict:
    out = {name: _train(values, data) for name, (values, data) in EIGHT_RANKS.items()}
    out["resumed at CP4 x PP2"] = _train(RESUME_CP4, "packed", load=root)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cp_training") / "ckpt")


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_reference, 1)[0]


@pytest.fixture(scope="module")
def four_ranks(checkpoint):
    return run_ranks(_four_ranks, 4, checkpoint, timeout=600)


@pytest.fixture(scope="module")
def eight_ranks(four_ranks, checkpoint):  # resumes the checkpoint the 4-rank world saved
    return run_ranks(_eight_ranks, 8, checkpoint, timeout=600)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _logged(ranks: list[dict], name: str) -> tuple[list, list]:
    """(records, totals) of a layout: the same on every rank that has them (totals: the logging rank)."""
    records = [r[name]["records"] for r in ranks if r[name]["records"]]
    assert records and all(rec == records[0] for rec in records), name
    (totals,) = [r[name]["totals"] for r in ranks if r[name]["totals"]]
    return records[0], totals


def _params(ranks: list[dict], name: str) -> dict:
    """Every parameter, from CP rank 0 of each stage, after checking that CP peers hold it bitwise."""
    merged, by_place = {}, {r[name]["place"]: r[name]["params"] for r in ranks}
    for (cp, pp, tp, dp), params in by_place.items():
        peer = by_place[(0, pp, tp, dp)]
        assert params.keys() == peer.keys()
        for key, value in params.items():
            assert torch.equal(value, peer[key]), f"{name}: CP rank {cp} of stage {pp} holds another {key}"
        merged.update(params)
    return merged


def check_against_one_process(ranks: list[dict], name: str, flags: dict, ref: dict, tol: float = 1e-5) -> None:
    records, totals = _logged(ranks, name)
    assert all((norm is not None) == flags["log_params_norm"] for _, norm in totals), name
    assert [r[0] for r in records] == [r[0] for r in ref["records"]]
    # the loss, and the grad norm (Adam and clipping hide a gradient off by a factor, e.g. a token count
    # summed over DP but not CP; the norm does not)
    for column, what in ((1, "losses"), (2, "grad norms")):
        got = torch.tensor([r[column] for r in records], dtype=torch.float64)
        want = torch.tensor([r[column] for r in ref["records"]], dtype=torch.float64)
        rel = ((got - want).abs() / want.abs()).max().item()
        assert rel <= tol, f"{name}: {what} differ by {rel:.2e}:\n{got}\n{want}"
    for (window, norm), (ref_window, ref_norm) in zip(totals, ref["totals"], strict=True):
        # valid and real tokens exactly; FLOPs (per micro-batch, of local shares) to float64 rounding
        assert window[1:3] == ref_window[1:3], f"{name}: [valid, real tokens] {window[1:3]} != {ref_window[1:3]}"
        assert window[3] == pytest.approx(ref_window[3], rel=1e-12), f"{name}: FLOPs {window[3]} != {ref_window[3]}"
        assert window[0] == pytest.approx(ref_window[0], rel=tol), name
        assert norm is None or norm == pytest.approx(ref_norm, rel=tol), f"{name}: params norm {norm} != {ref_norm}"
    if "eval_interval" in flags:  # forward only: our runtime (ZBV) and megatron-core's (CP4), over DP x CP
        validation = {tuple(r[name]["validation"][0]) for r in ranks if r[name]["validation"]}
        ((loss,),) = validation
        assert loss == pytest.approx(ref["validation"][0][0], rel=tol), (name, loss, ref["validation"])
    params, ref_params = _params(ranks, name), ref["params"]
    assert params.keys() == ref_params.keys(), name
    worst = max(ref_params, key=lambda k: _relative(params[k], ref_params[k]))
    assert _relative(params[worst], ref_params[worst]) <= tol, (
        f"{name}: {worst} differs by {_relative(params[worst], ref_params[worst]):.2e}"
    )


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_cp2_pp2_under_every_schedule_trains_as_one_process(four_ranks, reference, name):
    flags, data = FOUR_RANKS[name]
    check_against_one_process(four_ranks, name, flags, reference[data])


def test_the_params_norm_sums_the_distributed_optimizers_main_parameter_shards_over_dp_cp(four_ranks, reference):
    """--bf16 --use-distributed-optimizer at CP2 x PP2 (DP 1): the fp32 main parameters are sharded over
    DP x CP (2 shards); summed over DP alone the norm would miss half of them. Against one process in
    bf16 (to bf16 training's agreement: the losses within 1e-2, the norms within 1e-3)."""
    records, totals = _logged(four_ranks, BF16)
    ref_records, ref_totals = reference["packed, bf16"]["records"], reference["packed, bf16"]["totals"]
    for (_, loss, _), (_, ref_loss, _) in zip(records, ref_records, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-2)
    norms, ref_norms = [norm for _, norm in totals], [norm for _, norm in ref_totals]
    assert len(norms) == ITERS and all(n == pytest.approx(r, rel=1e-3) for n, r in zip(norms, ref_norms)), (
        norms,
        ref_norms,
    )


def test_the_guards_agree_under_cp(four_ranks, reference):
    """The spike guard's step loss (one all-reduce of [sum, count] over the world, each CP rank adding its
    share) is the one-process loss on every rank. An inf loss on CP rank 1 alone (its gradients finite)
    poisons its gradients, which DDP's reduce over DP x CP carries to every rank: every rank skips that
    step as non-finite, and the origin names the CP rank."""
    ref = [loss for _, loss, _ in reference["packed"]["records"]]
    for r in four_ranks:
        assert r["CP2 x PP2 ZBH1"]["spike_losses"] == pytest.approx(ref, rel=1e-5)
        count, origin = r["inf loss"]["nan"]
        assert count == 1, r["inf loss"]["nan"]
        assert "iteration 2: the loss was not finite on rank 3 (pipeline stage 1 of 2, tensor rank 0, " in origin
        assert "context-parallel rank 1, data-parallel rank 0, micro-batch 0)" in origin, origin
        assert "context-parallel rank 0" not in origin, origin


@pytest.mark.parametrize("name", list(EIGHT_RANKS))
def test_eight_rank_cp_layouts_train_as_one_process(eight_ranks, reference, name):
    check_against_one_process(eight_ranks, name, EIGHT_RANKS[name][0], reference["packed"])


@pytest.mark.parametrize(
    ("world", "name", "saved_at"),
    [("four_ranks", "resumed at CP1 x PP2 x DP2", "cp': 2"), ("eight_ranks", "resumed at CP4 x PP2", "cp': 2")],
)
def test_a_cp2_checkpoint_resumes_at_cp1_and_cp4_exactly(request, reference, world, name, saved_at):
    """Weights and the distributed optimizer's state (saved gathered over DP x CP) reshard across CP; the
    RNG states, per rank, are skipped (the layout differs); g = 8 is kept. Steps 4 and 5: one process's."""
    ranks = request.getfixturevalue(world)
    records, _ = _logged(ranks, name)
    ref = reference["packed, 5 steps"]["records"][ITERS:]
    assert [r[0] for r in records] == [r[0] for r in ref] == [4, 5]
    for (_, loss, norm), (_, ref_loss, ref_norm) in zip(records, ref):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss) and abs(norm - ref_norm) <= 1e-5 * ref_norm, (records, ref)
    (line,) = {line for r in ranks for line in r[name]["loaded"]}
    assert "at iteration 3 (resharded from" in line and saved_at in line, line


def test_cp_peers_run_the_same_actions_under_our_runtime(four_ranks):
    """ZBH1 and ZBV: the runtime's P2P shape is [s/c, b, h] (the parity above), and each CP rank runs
    exactly the actions of its CP peers on the same pipeline stage (each a pipeline of its own)."""
    for name in ("CP2 x PP2 ZBH1", "CP2 x PP2 ZBVZeroBubble"):
        by_stage: dict[int, list] = {}
        for r in four_ranks:
            by_stage.setdefault(r[name]["place"][1], []).append(r[name]["actions"])
        for stage, runs in by_stage.items():
            assert len(runs) == 2 and runs[0] and runs[0] == runs[1], (name, stage)


def test_collectives_our_features_add_per_step_stay_two_under_cp(four_ranks):
    """CP2 x PP2 x VPP2 packed, 3 logged steps: besides the model's own (the CP attention's gather and
    reduce-scatter, the cross-entropy's) and megatron-core's that our wrappers issue (finalize's token count
    over DP x CP, the grad norm's), our code issues one negotiation all-reduce per step (over TP x CP x PP)
    and, on the last stage, one all-reduce of the logged loss rows over DP x CP: at most 2 a step."""
    model = ("megatron_ext.context_parallel.collectives", "megatron_ext.model.cross_entropy")
    rehomed = ("megatron_ext.training.finalize", "megatron_ext.training.optimizer", "megatron_ext.training.grad_norm")
    for r in four_ranks:
        counts = r[COUNTED]["counts"]
        assert counts[(model[0], "all_gather_single")] > 0, counts  # the counter sees the CP attention
        ours = {k: v for k, v in counts.items() if k[0].startswith("megatron_ext") and k[0] not in model + rehomed}
        last = r[COUNTED]["place"][1] == 1
        expected = {("megatron_ext.data.padding", "all_reduce"): ITERS}
        if last:
            expected[("megatron_ext.training.evaluation", "all_reduce")] = ITERS
        assert ours == expected, ours
        assert sum(ours.values()) / ITERS <= 2


def test_the_layout_line_names_cp_and_dropout_streams_differ_per_cp_rank(four_ranks, eight_ranks):
    """'> layout: world 8 = TP 2 x CP 2 x PP 2 x DP 1'. Dropout: CP ranks get their own streams (the
    default generator and megatron-core's tracker, offset by the CP rank), TP peers keep the default
    generator's (a replicated activation's dropout) and differ in the tracker (megatron-core's)."""
    first = eight_ranks[0]
    assert first["CP2 x TP2+SP x PP2"]["layout"].startswith("> layout: world 8 = TP 2 x CP 2 x PP 2 x DP 1 |")
    assert first["CP4 x PP2"]["layout"].startswith("> layout: world 8 = TP 1 x CP 4 x PP 2 x DP 1 |")
    assert four_ranks[0]["resumed at CP1 x PP2 x DP2"]["layout"].startswith("> layout: world 4 = TP 1 x PP 2 x DP 2 |")
    seeds = {r["CP2 x TP2+SP x PP2"]["place"]: r["CP2 x TP2+SP x PP2"]["seeds"] for r in eight_ranks}
    for (cp, pp, tp, dp), (default, tracker) in seeds.items():
        assert default != seeds[(1 - cp, pp, tp, dp)][0] and tracker != seeds[(1 - cp, pp, tp, dp)][1]
        assert default == seeds[(cp, pp, 1 - tp, dp)][0] and tracker != seeds[(cp, pp, 1 - tp, dp)][1]
    assert seeds[(0, 0, 0, 0)][0] == 1234  # CP rank 0 keeps --seed: a run without CP draws what it drew


# ----------------------------------------------------------------------------- a rank that raises


def _raising_world(rank: int, world_size: int, report_dir: str) -> dict:
    """CP2: rank 1 raises in the forward of iteration 2 (before its CP all-gather) and stays alive, as
    under NCCL, where its peers' collectives would not fail; rank 0 waits in the all-gather until its
    step watchdog reports. Then rank 1 ends, which ends rank 0's all-gather."""
    values = tiny_values(**dict(PACKED, context_parallel_size=2, train_iters=2, step_timeout_minutes=0.05))
    run = build_tiny_run(values, DATA["packed"]())
    run.watchdog.out = open(os.path.join(report_dir, f"stacks{rank}.txt"), "w")
    reports: list[str] = []

    def report(text: str) -> None:  # instead of exit 1 (in the watchdog's thread: rank 0 waits in its step)
        reports.append(text)
        open(os.path.join(report_dir, "reported"), "w").close()

    run.watchdog.on_timeout = report

    def raise_once(module, args):
        if module.training and run.state.iteration == 1:
            raise ValueError("a bad micro-batch on CP rank 1")

    if rank == 1:
        unwrap_model(run.model[0]).register_forward_pre_hook(raise_once)
    start = time.monotonic()
    try:
        loop.train(run)
        error = None
    except Exception as err:  # noqa: BLE001 - what each rank saw is the result
        error = f"{type(err).__name__}: {err}"
    while rank == 1 and time.monotonic() - start < 30 and not os.path.exists(os.path.join(report_dir, "reported")):
        time.sleep(0.05)  # alive until rank 0's watchdog has reported (at most 30 s)
    run.watchdog.close()
    return {"error": error, "reports": reports, "seconds": time.monotonic() - start}


def test_a_rank_that_raises_under_cp_leaves_its_peer_to_the_step_watchdog_which_names_it(tmp_path):
    first, second = run_ranks(_raising_world, 2, str(tmp_path), timeout=180)
    assert second["error"] == "ValueError: a bad micro-batch on CP rank 1" and second["reports"] == []
    (report,) = first["reports"]  # bounded: --step-timeout-minutes 0.05 (3 s)
    assert "in a training step" in report.splitlines()[0] and "--step-timeout-minutes 0.05" in report, report
    stopped = report.split("  STOPPED", 1)[1].splitlines()[1]
    assert stopped.startswith("    rank 1 (pipeline stage 0 of 1, tensor rank 0, context-parallel rank 1, "), report
    assert first["error"] is not None and first["seconds"] < 60, first  # its all-gather ended with rank 1
