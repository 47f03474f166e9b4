"""Overlapped communication changes the timing, never the training.

A 4-rank world, PP2 x DP2 with VPP2 (so megatron-core's interleaved schedule drives the hooks of
two model chunks), the distributed optimizer, fp32, 6 iterations with an evaluation every 2 and a
save at iteration 3. Each variant's training losses, validation losses and final parameters equal
the run without overlap:

- ``--overlap-grad-reduce``: the reduce-scatter starts from the backward hooks;
- ``--overlap-param-gather``: the parameter all-gather after each optimizer step is deferred to
  the next forward (dispatched at the schedule's start, or per bucket with
  ``--no-align-param-gather``). The parameters lag the optimizer until then, so a save in between
  must gather them first (training/step.py: ``params_synced``): without that the checkpoint is one
  update stale and the resume check below fails (an evaluation's forward hooks gather them anyway);
- ``--ddp-bucket-size`` small enough to cut every chunk's parameters into several buckets.

Without evaluation or save, each step issues one reduce-scatter and one all-gather per bucket,
overlapped or not (megatron-core's collectives counted where it calls them).

Resuming the overlapped run from its iteration-3 checkpoint, with overlap on, reproduces its
losses from iteration 4 exactly.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, run_ranks, tiny_values
from megatron_ext.training.checkpointing import load_checkpoint
from megatron_ext.training.loop import train

pytestmark = pytest.mark.distributed

BASE = dict(
    pipeline_model_parallel_size=2,
    num_layers_per_virtual_pipeline_stage=1,
    use_distributed_optimizer=True,
    global_batch_size=8,
    micro_batch_size=1,
    train_iters=6,
    eval_interval=2,
    eval_iters=1,
)
OVERLAP = dict(overlap_grad_reduce=True, overlap_param_gather=True)
VARIANTS = {
    "plain": {},
    "--overlap-grad-reduce": dict(overlap_grad_reduce=True),
    "--overlap-param-gather": OVERLAP,
    "--no-align-param-gather": dict(OVERLAP, align_param_gather=False),
    "small buckets": dict(OVERLAP, ddp_bucket_size=4000),
}


def _datasets():
    return MarkovDataset(32, mask_every=1), MarkovDataset(32, seed=7)


def _capture_validation(run) -> list[float]:
    lines: list[float] = []

    def log(line: str) -> None:
        if "validation" in line and "lm loss value:" in line:
            lines.append(float(line.split("lm loss value:")[1].split("|")[0]))

    run.log = log
    return lines


def _count_collectives(flags: dict) -> dict:
    """Reduce-scatters and all-gathers of the DDP buffers over 4 steps without evaluation or save
    (the end of training gathers once more under overlap, in place of the skipped first step)."""
    import megatron.core.distributed.param_and_grad_buffer as pgb

    counts = {"reduce_scatter": 0, "all_gather": 0}
    saved = pgb.dist_reduce_scatter_func, pgb.dist_all_gather_func

    def counting(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    pgb.dist_reduce_scatter_func = counting("reduce_scatter", saved[0])
    pgb.dist_all_gather_func = counting("all_gather", saved[1])
    try:
        run = build_tiny_run(tiny_values(**dict(BASE, train_iters=4, eval_interval=0), **flags), *_datasets())
        train(run)
        counts["buckets"] = sum(len(b.buckets) for c in run.model for b in c.buffers)
    finally:
        pgb.dist_reduce_scatter_func, pgb.dist_all_gather_func = saved
        destroy_parallel_context()
    return counts


def _world(rank: int, world_size: int, root: str) -> dict:
    out = {"counts": {name: _count_collectives(VARIANTS[name]) for name in ("plain", "small buckets")}}
    for name, flags in VARIANTS.items():
        save = dict(save=f"{root}/{name}", save_interval=3) if name == "--overlap-param-gather" else {}
        run = build_tiny_run(tiny_values(**BASE, **flags, **save), *_datasets())
        val = _capture_validation(run)
        train(run)
        params = {n: p.detach().clone() for i, c in enumerate(run.model) for n, p in c.named_parameters()}
        out[name] = {
            "losses": [r["loss"] for r in run.records],
            "val": val,
            "params": params,
            "buckets": [len(b.buckets) for c in run.model for b in c.buffers],
            "pp_rank": run.ctx.pp_rank,
        }
        destroy_parallel_context()
    run = build_tiny_run(tiny_values(**BASE, **OVERLAP, load=f"{root}/--overlap-param-gather"), *_datasets())
    val = _capture_validation(run)
    load_checkpoint(run, f"{root}/--overlap-param-gather", step=3)
    train(run)
    out["resumed"] = {"losses": [r["loss"] for r in run.records], "val": val}
    destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_world, 4, str(tmp_path_factory.mktemp("overlap")), timeout=600)


def _last_stage(results) -> dict:
    return results[-1]  # rank 3: last pipeline stage (records and validation lines live there)


def test_the_reference_run_trained_and_evaluated(results):
    ref = _last_stage(results)["plain"]
    assert len(ref["losses"]) == 6 and len(ref["val"]) == 3
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "plain"])
def test_overlap_gives_the_losses_of_no_overlap(results, name):
    got, ref = _last_stage(results)[name], _last_stage(results)["plain"]
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    # evaluated on the parameters of the optimizer's last step, not the step before
    assert got["val"] == pytest.approx(ref["val"], rel=1e-6)


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "plain"])
def test_overlap_ends_with_the_parameters_of_no_overlap(results, name):
    for rank in results:
        got, ref = rank[name]["params"], rank["plain"]["params"]
        assert got.keys() == ref.keys()
        for k in ref:
            a, b = got[k], ref[k]
            if k.endswith("linear_qkv.bias"):
                # A key bias shifts every score of a query row alike, so softmax makes its gradient
                # 0: what reaches it is rounding noise, which Adam scales to full-size steps. Any
                # change of summation order (bucket sizes, the fused weight-gradient GEMM) moves
                # it by a few e-6, so only the query and value biases are compared.
                a, b = _without_key_bias(a), _without_key_bias(b)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def _without_key_bias(bias: torch.Tensor) -> torch.Tensor:
    """megatron-core's fused QKV bias is [q, k, v] per query group (here each group holds one
    head); drop the k part."""
    values = tiny_values()
    head_dim = values["hidden_size"] // values["num_attention_heads"]
    per_group = bias.reshape(-1, 3, head_dim)
    return per_group[:, [0, 2]].reshape(-1)


def test_small_buckets_cut_the_parameters_into_several_buckets(results):
    # As in Megatron-LM, only the first chunk of the first pipeline stage is bucketed (the other
    # chunks' reduces are off the critical path); without --overlap-grad-reduce megatron-core keeps
    # one bucket per buffer (two on the chunk with the tied embedding, which gets its own).
    for rank in results:
        plain, small = rank["plain"]["buckets"], rank["small buckets"]["buckets"]
        assert len(plain) == len(small)
        if rank["plain"]["pp_rank"] == 0:
            assert small[0] >= plain[0] + 2 and small[1:] == plain[1:], (plain, small)
        else:
            assert small == plain


@pytest.mark.parametrize("name", ["plain", "small buckets"])
def test_one_reduce_scatter_and_one_all_gather_per_bucket_and_step(results, name):
    for rank in results:
        counts = rank["counts"][name]
        assert counts["reduce_scatter"] == 4 * counts["buckets"], counts
        assert counts["all_gather"] == 4 * counts["buckets"], counts


def test_resume_of_an_overlapped_run_is_exact(results):
    out = _last_stage(results)
    # the checkpoint of iteration 3 holds the parameters after step 3's update (gathered before saving)
    assert out["resumed"]["losses"] == out["--overlap-param-gather"]["losses"][3:]
    assert out["resumed"]["val"] == out["--overlap-param-gather"]["val"][1:]


def _final_evaluation(rank: int, world_size: int) -> dict:
    from megatron_ext.data.builder import get_num_samples

    run = build_tiny_run(
        tiny_values(global_batch_size=4, micro_batch_size=2, train_iters=5, eval_interval=2, eval_iters=1), *_datasets()
    )
    lines: list[str] = []
    run.log = lines.append
    train(run)
    destroy_parallel_context()
    return {
        "validated at": [int(x.split("iteration")[1].split()[0]) for x in lines if "validation" in x],
        "valid samples": get_num_samples(run.cfg.training, 4)[1],
    }


def test_training_ends_with_a_validation_when_its_length_is_not_a_multiple_of_the_interval():
    out = run_ranks(_final_evaluation, 1)[0]
    assert out["validated at"] == [2, 4, 5], out  # Megatron-LM evaluates at the end of training too
    assert out["valid samples"] == 3 * 4  # the third evaluation reads batches of its own
