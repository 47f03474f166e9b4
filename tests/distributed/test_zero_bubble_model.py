"""The model side of the zero-bubble schedules under the schedule runtime (``pipeline/runtime.py``),
on real GPT chunks: the B/W split of our linears (``model/wgrad_deferral.py``) and the V placement
(``model/v_placement.py``) give megatron-core 1F1B's losses and gradients, bitwise.

One 4-rank world, four layouts, each with megatron-core's 1F1B as the reference: PP 4 (8 layers,
m = 8); PP 2 x DP 2 with the distributed optimizer and --overlap-grad-reduce; TP 2 x PP 2 with
sequence parallelism; PP 2 x DP 2 in bf16 on packed micro-batches with full recompute. ZBVZeroBubble
(tied embeddings, and untied once: the embedding and the output layer on rank 0, the tie and the
token count local to it), ZBH1 and InterleavedZeroBubble run one step through the runtime with every
linear deferring its W. Compared: every parameter's final gradient (after the DP reduce, the
tied-embedding sum and the per-token scaling), each micro-batch's loss on the loss rank, and the W
queue, empty at the step's end. Then, across schedules: after the optimizer's step the checkpoint
saved under ZBV holds exactly 1F1B's tensors, and each loads into the other schedule's run. And
through the training loop: under ZBV pipeline rank 0 records and logs the losses; over 40 clipped
iterations at PP 2 x DP 2 (with and without the distributed optimizer) ZBV's losses, gradient norms
and final weights are 1F1B's bit for bit; in fp16 from a loss scale that overflows at first, ZBV skips
the same steps as 1F1B (the found-inf all-reduce over a V placement) and then gives 1F1B's losses.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_ext.checkpoint.state import load_full_tensors
from megatron_ext.model.init_weights import get_global_name, get_layer_offset
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.pipeline.runtime import get_schedule_runtime
from megatron_ext.pipeline.wgrad_queue import WeightGradQueue
from megatron_ext.testing import (
    MarkovDataset,
    PackedMarkovDataset,
    build_tiny_run,
    gather_full_grads,
    run_ranks,
    tiny_values,
)
from megatron_ext.training.checkpointing import load_checkpoint, save_checkpoint
from megatron_ext.training.loop import train
from megatron_ext.training.optimizer import step_optimizer
from megatron_ext.training.step import build_step_microbatches, run_forward_backward, unwrap_model

pytestmark = pytest.mark.distributed

ZBV_TIED, ZBV_UNTIED = (
    dict(pipeline_schedule="ZBVZeroBubble"),
    dict(pipeline_schedule="ZBVZeroBubble", untie_embeddings_and_output_weights=True),
)
ZBH1, IZB = (
    dict(pipeline_schedule="ZBH1"),
    dict(pipeline_schedule="InterleavedZeroBubble", num_virtual_stages_per_pipeline_rank=2),
)
UNTIED = dict(untie_embeddings_and_output_weights=True)
CHECKPOINT_LAYOUT = "PP 2 x DP 2, distributed optimizer, overlapped grad reduce"
# layout: (flags, {case: flags}, data); each layout's reference is 1F1B ("1F1B", "1F1B untied")
LAYOUTS = {
    "PP 4": (
        dict(pipeline_model_parallel_size=4, num_layers=8, global_batch_size=16),
        {"1F1B": {}, "ZBVZeroBubble tied": ZBV_TIED, "ZBH1": ZBH1, "InterleavedZeroBubble": IZB},
        "unpacked",
    ),
    # clipping at the tiny runs' 1.0: the step's update follows the global gradient norm
    CHECKPOINT_LAYOUT: (
        dict(
            pipeline_model_parallel_size=2,
            num_layers=4,
            global_batch_size=16,
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            ddp_bucket_size=20000,
        ),
        {
            "1F1B": {},
            "1F1B untied": UNTIED,
            "ZBVZeroBubble tied": ZBV_TIED,
            "ZBVZeroBubble untied": ZBV_UNTIED,
            "ZBH1": ZBH1,
            "InterleavedZeroBubble": IZB,
        },
        "unpacked",
    ),
    # the embedding group per TP rank; the activations between stages are sequence shards
    "TP 2 x PP 2, sequence parallel": (
        dict(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            num_layers=4,
            global_batch_size=8,
            sequence_parallel=True,
        ),
        {"1F1B": {}, "ZBVZeroBubble tied": ZBV_TIED},
        "unpacked",
    ),
    # Float16Module's casts at V's last stage (rank 0), packed micro-batches' metadata per stage, W of
    # recomputed layers
    "PP 2 x DP 2, bf16, packed, full recompute": (
        dict(
            pipeline_model_parallel_size=2,
            num_layers=4,
            global_batch_size=8,
            micro_batch_size=1,
            bf16=True,
            packed_sequences=True,
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
        ),
        {"1F1B": {}, "ZBVZeroBubble tied": ZBV_TIED, "ZBH1": ZBH1},
        "packed",
    ),
}
DATA = {"unpacked": lambda: MarkovDataset(32, mask_every=1), "packed": lambda: PackedMarkovDataset(32)}
CASES = [(layout, case) for layout, (_, cases, _) in LAYOUTS.items() for case in cases if not case.startswith("1F1B")]


def _step(values: dict, data: str, save: str | None = None) -> dict:
    """One step's forward and backward as ``train_step`` runs it (megatron-core's schedule for the
    reference; for --pipeline-schedule the runtime run.py attached, the chunks' linears deferring
    into its queue); the final gradients and the loss rank's losses; with ``save``, the optimizer's
    step and a checkpoint there."""
    run = build_tiny_run(tiny_values(**values), DATA[data]())  # run.py: the W queue, deferral and runtime
    ctx, model = run.ctx, run.model
    runtime = get_schedule_runtime(model)
    assert (runtime is None) == ("pipeline_schedule" not in values)
    queue = runtime.queue if runtime is not None else WeightGradQueue()
    mbs, length = build_step_microbatches(run, run.train_ds, 0)
    reports = run_forward_backward(model, mbs, length)
    deferred = sum(getattr(p, "skip_backward_post_hook", False) for c in model for p in c.parameters())
    ours = sum(getattr(m, "traceable_linear", False) for c in model for m in c.modules())  # run.prepare_layers
    out = {
        "grads": gather_full_grads(run),
        "losses": [float(r["lm loss"][0]) for r in reports],
        "loss_rank": ctx.is_last_stage,
        "pending": queue.pending(),
        "deferred": deferred,
        "ours": ours,
    }
    if save is not None:
        assert step_optimizer(run.optimizer, True)[0]
        run.state.iteration = 1
        save_checkpoint(run, save)
        out["params"] = _full_params(run)
    destroy_parallel_context()
    return out


def _full_params(run) -> dict[str, torch.Tensor]:
    """{global name: weight} of this rank's parameters (TP 1: no gather)."""
    out = {}
    for chunk in run.model:
        model = unwrap_model(chunk)
        offset = get_layer_offset(model)
        for local_name, param in model.named_parameters():
            name = get_global_name(local_name, offset)
            if model.share_embeddings_and_output_weights and name == "output_layer.weight":
                name = "embedding.word_embeddings.weight"
            out[name] = param.detach().clone()
    return out


def _train(values: dict) -> dict:
    """Three iterations (unless given) of the training loop: the losses it records, the lines it logs
    here, the skipped (fp16-overflow) iterations, the final loss scale, the (pre-clip) gradient norm of
    each iteration and the final weights."""
    run = build_tiny_run(tiny_values(**{"train_iters": 3, **values}), MarkovDataset(32, mask_every=1))
    lines: list[str] = []
    run.log = lines.append
    train(run)
    destroy_parallel_context()
    return {
        "records": [(r["iteration"], r["loss"]) for r in run.records],
        "norms": [r["grad_norm"] for r in run.records],
        "logged": [line for line in lines if "iteration" in line and "lm loss" in line],
        "skipped": run.state.skipped_iterations,
        "scale": float(run.optimizer.get_loss_scale()),
        "params": _full_params(run),
    }


def _load_into(values: dict, checkpoint: str) -> dict:
    """A fresh run of ``values`` loading ``checkpoint``: the loaded iteration and weights."""
    run = build_tiny_run(tiny_values(**values), MarkovDataset(32))
    out = {"iteration": load_checkpoint(run, checkpoint), "params": _full_params(run)}
    destroy_parallel_context()
    return out


def _world(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for layout, (flags, cases, data) in LAYOUTS.items():
        for case, case_flags in cases.items():
            save = os.path.join(root, case) if layout == CHECKPOINT_LAYOUT and case in CHECKPOINTED else None
            out[(layout, case)] = _step(dict(flags, **case_flags), data, save)
    flags = LAYOUTS[CHECKPOINT_LAYOUT][0]
    for case, case_flags in (("1F1B", {}), ("ZBVZeroBubble", ZBV_TIED)):
        for trained, trained_flags in TRAINED.items():
            out[(trained, case)] = _train(dict(trained_flags, **case_flags))
        out[("fp16", case)] = _train(dict(flags, **FP16, **case_flags))
    # each checkpoint into the other schedule's run
    out["1F1B loads ZBV"] = _load_into(flags, os.path.join(root, "ZBVZeroBubble tied"))
    out["ZBV loads 1F1B"] = _load_into(dict(flags, **ZBV_TIED), os.path.join(root, "1F1B"))
    return out


CHECKPOINTED = ("1F1B", "ZBVZeroBubble tied")
# many steps of the training loop with clipping active (0.3, below every step's norm): the clipped update
# follows the global gradient norm, summed per parameter under pipeline parallelism (training/grad_norm.py)
# so that it does not depend on which stages share a rank; PP 2 x DP 2 with the distributed optimizer
# and small buckets (DP shard boundaries cut parameters, at other places under each placement), and
# PP 2 x DP 2 without it (every rank holds its gradients whole)
TRAIN_ITERS, CLIP = 40, 0.3
TRAINED = {
    "trained": dict(LAYOUTS[CHECKPOINT_LAYOUT][0], clip_grad=CLIP, train_iters=TRAIN_ITERS),
    "trained, no distributed optimizer": dict(
        LAYOUTS[CHECKPOINT_LAYOUT][0],
        clip_grad=CLIP,
        train_iters=TRAIN_ITERS,
        use_distributed_optimizer=False,
        overlap_grad_reduce=False,
    ),
}
# a loss scale that overflows in the first steps (skipped), then steps that apply
FP16 = dict(fp16=True, initial_loss_scale=2.0**16, hysteresis=1, train_iters=5)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("zero_bubble_model"))
    return [root, *run_ranks(_world, 4, root, timeout=900)]


def _merged(results, key) -> tuple[dict, list]:
    grads, losses = {}, []
    for rank_out in results:
        out = rank_out[key]
        losses += out["losses"]
        for name, g in out["grads"].items():
            if name in grads:  # a name on two ranks (TP-gathered, DP-reduced): one value
                assert torch.equal(grads[name], g), (key, name)
            grads[name] = g
    return grads, losses


@pytest.mark.parametrize("layout,schedule", CASES)
def test_zero_bubble_step_gives_1f1bs_gradients_and_losses_bitwise(results, layout, schedule):
    ranks = results[1:]
    reference = (layout, "1F1B untied" if "untied" in schedule else "1F1B")
    ref_grads, ref_losses = _merged(ranks, reference)
    grads, losses = _merged(ranks, (layout, schedule))
    for rank_out in ranks:
        out = rank_out[(layout, schedule)]
        assert out["pending"] == 0 and out["deferred"] > 0
        assert out["ours"] == 0  # the W deferral owns the linears: no lean/traceable linear of model/compile.py
        # the 1F1B reference at TP 1 runs the lean eager linears: compared with megatron-core's (deferred) bitwise
        assert (rank_out[reference]["ours"] > 0) == ("tensor_model_parallel_size" not in LAYOUTS[layout][0])
    flags = LAYOUTS[layout][0]
    pp = flags["pipeline_model_parallel_size"]
    v = schedule.startswith("ZBV")
    loss_ranks = [r for r, out in enumerate(ranks) if out[(layout, schedule)]["loss_rank"]]
    assert loss_ranks == [r for r in range(4) if r // (4 // pp) == (0 if v else pp - 1)]
    num_mb = flags["global_batch_size"] // flags.get("micro_batch_size", 2)  # over DP, once per TP rank
    assert losses == ref_losses and len(losses) == num_mb * flags.get("tensor_model_parallel_size", 1)
    assert grads.keys() == ref_grads.keys()
    assert ("output_layer.weight" in grads) == ("untied" in schedule)
    for name, g in ref_grads.items():
        assert g.abs().sum() > 0, name
        assert torch.equal(g, grads[name]), f"{name}: max diff {(g - grads[name]).abs().max()}"


def test_checkpoints_saved_under_zbv_and_1f1b_are_the_same_and_load_into_the_other(results):
    """After one step and the optimizer's (distributed optimizer): the checkpoint saved under ZBV
    holds exactly 1F1B's tensors (weights, Adam moments), and each loads into the other schedule's
    fresh run giving the stepped weights."""
    root, ranks = results[0], results[1:]
    saved = {case: load_full_tensors(os.path.join(root, case, "iter_0000001")) for case in CHECKPOINTED}
    reference, zbv = (saved[case] for case in CHECKPOINTED)
    keys = sorted(k for k in reference if not k.startswith("optimizer.") or ".exp_avg" in k)
    assert any(".exp_avg_sq." in k for k in keys) and any(k.startswith("decoder.layers.") for k in keys)
    assert zbv.keys() == reference.keys()
    differ = [k for k in keys if not torch.equal(reference[k], zbv[k])]
    assert not differ, differ
    for loaded, stepped in (("1F1B loads ZBV", "1F1B"), ("ZBV loads 1F1B", "ZBVZeroBubble tied")):
        for rank_out in ranks:
            assert rank_out[loaded]["iteration"] == 1
            expected = rank_out[(CHECKPOINT_LAYOUT, stepped)]["params"]
            assert expected.keys() == rank_out[loaded]["params"].keys()
            for name, w in expected.items():
                assert torch.equal(w, rank_out[loaded]["params"][name]), (loaded, name)


def test_the_training_loop_logs_zbvs_losses_on_pipeline_rank_0(results):
    """Through ``train``: under ZBV the loss lives on pipeline rank 0, which records it and whose last
    DP rank logs it (global rank 1 at PP 2 x DP 2; 1F1B: the last rank)."""
    ranks = results[1:]
    for case, recording, logging in (("1F1B", [2, 3], 3), ("ZBVZeroBubble", [0, 1], 1)):
        assert [r for r, out in enumerate(ranks) if out[("trained", case)]["records"]] == recording, case
        assert [r for r, out in enumerate(ranks) if out[("trained", case)]["logged"]] == [logging], case
        assert len(ranks[logging][("trained", case)]["logged"]) == TRAIN_ITERS


@pytest.mark.parametrize("trained", list(TRAINED))
def test_zbv_trains_1f1bs_model_bitwise_over_many_clipped_steps(results, trained):
    """40 iterations of the training loop with clipping active: under ZBV every iteration's loss and
    gradient norm, and every weight at the end, are 1F1B's bit for bit (the norm summed per parameter:
    rank 0 holds layers 0 and 3 under V, 0 and 1 under 1F1B, and megatron-core's per-rank sums differed
    in the last bit, the clipped updates by 7.5e-9 from the first step where they did)."""
    ranks = results[1:]
    reference, zbv = ranks[3][(trained, "1F1B")], ranks[1][(trained, "ZBVZeroBubble")]
    assert [i for i, _ in zbv["records"]] == list(range(1, TRAIN_ITERS + 1))
    assert zbv["records"] == reference["records"]
    assert zbv["norms"] == reference["norms"] and min(reference["norms"]) > CLIP  # every update was clipped
    weights = {}
    for case in ("1F1B", "ZBVZeroBubble"):
        weights[case] = {}
        for rank_out in ranks:  # under V rank 0 holds the first and the last layers
            weights[case].update(rank_out[(trained, case)]["params"])
    assert weights["1F1B"].keys() == weights["ZBVZeroBubble"].keys()
    differ = [k for k, w in weights["1F1B"].items() if not torch.equal(w, weights["ZBVZeroBubble"][k])]
    assert not differ, differ


def test_fp16_under_zbv_skips_the_same_steps_and_gives_1f1bs_losses(results):
    """--fp16 (fp32 main gradients, dynamic loss scale from 2^16, which overflows at first): under ZBV
    the same iterations are skipped as under 1F1B, the loss scale ends the same, and the recorded
    losses are 1F1B's bitwise (megatron-core's grad scaler inside our runtime's backward_step, the
    found-inf all-reduce over the model-parallel group whatever the placement)."""
    ranks = results[1:]
    reference, zbv = ranks[3][("fp16", "1F1B")], ranks[1][("fp16", "ZBVZeroBubble")]
    assert 1 <= reference["skipped"] < 5, reference  # some steps skipped, some applied
    for r in range(4):
        assert ranks[r][("fp16", "ZBVZeroBubble")]["skipped"] == ranks[r][("fp16", "1F1B")]["skipped"]
        assert ranks[r][("fp16", "ZBVZeroBubble")]["scale"] == ranks[r][("fp16", "1F1B")]["scale"]
    assert [i for i, _ in zbv["records"]] == [i for i, _ in reference["records"]] == [1, 2, 3, 4, 5]
    assert zbv["records"] == reference["records"]
