"""The V placement in megatron-core (model/v_placement.py), against the loop placement of the same
pipeline (2 chunks per rank), without a schedule.

One 4-rank world, two layouts (PP 4; PP 2 x DP 2 with the distributed optimizer), tied and untied
embeddings, each built under the loop placement (interleaved) and under V (``--pipeline-schedule
ZBVZeroBubble``):
- every stage has the same checkpoint entries (keys, global offsets, replica ids) and the same
  initial values under both placements, and the embedding and the output layer sit on the first and
  last stage (rank 0 under V);
- ``finalize_model_grads`` of the placement, fed the same hand-made gradients per stage and a token
  count on the loss rank only, gives the same final gradients (DP reduce, tied embedding, per-token
  scaling): under V the tie is local to rank 0 and the count comes from rank 0;
- one whole step: under V a small hand-written runtime (every micro-batch's forward through the
  2p stages with blocking P2P along the V, then each backward split into B, captured, and W, run
  later from the queue, each chunk's last micro-batch outside ``no_sync``; the loss and the token
  count on rank 0) gives bitwise the losses and the final gradients (tied embedding, output layer,
  every layer) of megatron-core's interleaved 1F1B under the loop placement. The schedules
  themselves are ``pipeline/``'s; this runtime only has to be obviously right.
"""

from __future__ import annotations

import contextlib
import hashlib

import pytest
import torch
import torch.distributed as dist

from megatron_ext.checkpoint.state import build_model_sharded_state_dict
from megatron_ext.model.wgrad_deferral import apply_weight_grad_deferral
from megatron_ext.pipeline.placement import get_stage_location
from megatron_ext.pipeline.wgrad_queue import WeightGradQueue
from megatron_ext.model.init_weights import get_global_name, get_layer_offset
from megatron_ext.parallel import destroy_parallel_context
from megatron_ext.testing import MarkovDataset, build_tiny_run, gather_full_grads, run_ranks, tiny_values
from megatron_ext.training.step import build_step_microbatches, forward_step, run_forward_backward, unwrap_model

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "PP 4": dict(pipeline_model_parallel_size=4, num_layers=8),
    "PP 2 x DP 2, distributed optimizer": dict(pipeline_model_parallel_size=2, num_layers=4,
                                               use_distributed_optimizer=True),
}
PLACEMENTS = {"loop": {}, "v": dict(pipeline_schedule="ZBVZeroBubble")}
TIES = {"tied": {}, "untied": dict(untie_embeddings_and_output_weights=True)}


def _stage_entries(run) -> dict[int, dict]:
    """{stage: {(key, global offset, replica id): value}} of this rank's chunks' checkpoint entries."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    state = build_model_sharded_state_dict(run.model)
    for i in range(len(run.model)):
        stage = run.ctx.placement.get_stage(i)
        entries = {}
        for t in state[f"model{i}"].values():
            if isinstance(t, ShardedTensor):
                entries[(t.key, tuple(t.global_offset), tuple(t.replica_id))] = t.data.detach().clone()
        model = unwrap_model(run.model[i])
        out[stage] = {"entries": entries, "pre": model.pre_process, "post": model.post_process,
                      "rank": run.ctx.pp_rank}
    return out


def _fake_grad(name: str, dp_rank: int, shape) -> torch.Tensor:
    seed = int(hashlib.sha256(f"{name}:{dp_rank}".encode()).hexdigest()[:12], 16)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _finalized_grads(run) -> tuple[dict, list]:
    """Hand-made main_grads (a function of the parameter's stage-independent name and the DP rank),
    a token count on the loss rank, the placement's finalize; the full final gradients."""
    for chunk in run.model:
        chunk.zero_grad_buffer()
        model = unwrap_model(chunk)
        offset = get_layer_offset(model)
        for local_name, param in model.named_parameters():
            param.main_grad.copy_(_fake_grad(get_global_name(local_name, offset), run.ctx.dp_rank, param.shape))
    num_tokens = torch.tensor(37 + 5 * run.ctx.dp_rank if run.ctx.is_last_stage else 0, dtype=torch.int)
    run.model[0].config.finalize_model_grads_func(run.model, num_tokens)
    copies = []  # every copy of the tied embedding's gradient on this rank
    for chunk in run.model:
        model = unwrap_model(chunk)
        if model.share_embeddings_and_output_weights and model.shared_embedding_or_output_weight() is not None:
            copies.append(model.shared_embedding_or_output_weight().main_grad.clone())
    return gather_full_grads(run), copies


def _world(rank: int, world_size: int) -> dict:
    out = {}
    for layout, flags in LAYOUTS.items():
        for tie, tie_flags in TIES.items():
            for placement, placement_flags in PLACEMENTS.items():
                values = tiny_values(num_virtual_stages_per_pipeline_rank=2, **flags, **tie_flags, **placement_flags)
                run = build_tiny_run(values, MarkovDataset(32))
                stages = _stage_entries(run)  # the initial weights (finalize changes only gradients)
                grads, copies = _finalized_grads(run)
                out[(layout, tie, placement)] = {
                    "stages": stages, "grads": grads, "copies": copies,
                    "loss_rank": run.ctx.is_last_stage, "dp_rank": run.ctx.dp_rank,
                    "placement": run.ctx.stage_placement,
                }
                destroy_parallel_context()
                out[("step", layout, tie, placement)] = _one_step(values)
                destroy_parallel_context()
    return out


def _one_step(values: dict) -> dict:
    """One step's losses and final gradients: megatron-core's schedule (loop) or ``run_v_step``."""
    queue = WeightGradQueue()
    if values.get("pipeline_schedule"):
        import megatron_ext.run as run_module

        build_chunks = run_module.build_model_chunks

        def build_deferred(*args, **kwargs):  # the deferral goes on before DDP wraps the chunks
            chunks = build_chunks(*args, **kwargs)
            apply_weight_grad_deferral(chunks, queue)
            return chunks

        run_module.build_model_chunks = build_deferred
        try:
            run = build_tiny_run(values, MarkovDataset(32, mask_every=1))
        finally:
            run_module.build_model_chunks = build_chunks
    else:
        run = build_tiny_run(values, MarkovDataset(32, mask_every=1))
    mbs, length = build_step_microbatches(run, run.train_ds, 0)
    if run.ctx.stage_placement == "v":
        losses = run_v_step(run, mbs, length, queue)
    else:
        losses = [float(r["lm loss"][0]) for r in run_forward_backward(run.model, mbs, length)]
    deferred = sum(getattr(p, "skip_backward_post_hook", False) for c in run.model for p in c.parameters())
    return {"grads": gather_full_grads(run), "losses": losses if run.ctx.is_last_stage else None,
            "pending": queue.pending(), "deferred": deferred}


def run_v_step(run, microbatches, seq_length: int, queue: WeightGradQueue) -> list[float]:
    """All forwards (stage 0 .. 2p-1), then all backwards (B captured, per stage in reverse), then
    every W in micro-batch order; then the placement's finalize with rank 0's token count. Every
    rank walks the same global sequence of (micro-batch, stage), so blocking P2P pairs up."""
    ctx, model = run.ctx, run.model
    pp, ranks = ctx.pp_size, dist.get_process_group_ranks(ctx.pp_group)
    last = 2 * pp - 1
    config = model[0].config
    for chunk in model:
        chunk.zero_grad_buffer()
    saved, losses = {}, []
    num_tokens = torch.tensor(0, dtype=torch.int)
    for i, mb in enumerate(microbatches):
        for s in range(2 * pp):
            rank, chunk = get_stage_location(s, pp, 2, "v")
            if s > 0:
                _hand_over(saved, (i, s - 1), (i, s), ranks, pp, seq_length, mb, ctx, config)
            if rank != ctx.pp_rank:
                continue
            if s > 0:
                unwrap_model(model[chunk]).set_input_tensor(saved[(i, s, "in")])
            output, loss_func = forward_step(iter([mb]), model[chunk])
            if s == last:
                loss, count, report = loss_func(output)
                losses.append(float(report["lm loss"][0]))
                num_tokens += count
                output = config.grad_scale_func(loss)
            saved[(i, s, "out")] = output
    for i in range(len(microbatches)):
        for s in reversed(range(2 * pp)):
            rank, chunk = get_stage_location(s, pp, 2, "v")
            if s < last:
                _hand_back(saved, (i, s + 1), (i, s), ranks, pp, ctx)
            if rank != ctx.pp_rank:
                continue
            sync = model[chunk].no_sync() if i < len(microbatches) - 1 else contextlib.nullcontext()
            with sync, queue.capture((chunk, i)):
                grad = saved.pop((i, s, "grad"), None)
                torch.autograd.backward(saved.pop((i, s, "out")), grad_tensors=grad)
    for i in range(len(microbatches)):
        for chunk in range(2):
            sync = model[chunk].no_sync() if i < len(microbatches) - 1 else contextlib.nullcontext()
            with sync:
                queue.run((chunk, i))
    config.finalize_model_grads_func(model, num_tokens)
    return losses


def _hand_over(saved, src, dst, ranks, pp, seq_length, mb, ctx, config):
    """Stage src's output becomes stage dst's input: a local hand-over on one rank, else P2P."""
    (i, s_src), (_, s_dst) = src, dst
    r_src, r_dst = get_stage_location(s_src, pp, 2, "v")[0], get_stage_location(s_dst, pp, 2, "v")[0]
    if ctx.pp_rank == r_src == r_dst:
        saved[(i, s_dst, "in")] = saved[(i, s_src, "out")].detach().requires_grad_()
    elif ctx.pp_rank == r_src:
        dist.send(saved[(i, s_src, "out")].detach().contiguous(), ranks[r_dst])
    elif ctx.pp_rank == r_dst:
        buf = torch.empty(seq_length, mb.tokens.shape[0], config.hidden_size, dtype=config.pipeline_dtype)
        dist.recv(buf, ranks[r_src])
        saved[(i, s_dst, "in")] = buf.requires_grad_()


def _hand_back(saved, src, dst, ranks, pp, ctx):
    """Stage src's input gradient becomes the output gradient of stage dst (after src's B)."""
    (i, s_src), (_, s_dst) = src, dst
    r_src, r_dst = get_stage_location(s_src, pp, 2, "v")[0], get_stage_location(s_dst, pp, 2, "v")[0]
    if ctx.pp_rank == r_src == r_dst:
        saved[(i, s_dst, "grad")] = saved.pop((i, s_src, "in")).grad
    elif ctx.pp_rank == r_src:
        dist.send(saved.pop((i, s_src, "in")).grad.contiguous(), ranks[r_dst])
    elif ctx.pp_rank == r_dst:
        out = saved[(i, s_dst, "out")]
        buf = torch.empty_like(out)
        dist.recv(buf, ranks[r_src])
        saved[(i, s_dst, "grad")] = buf


@pytest.fixture(scope="module")
def results():
    return run_ranks(_world, 4, timeout=600)


def _merged_stages(results, key):
    stages = {}
    for rank_out in results:
        r = rank_out[key]
        if r["dp_rank"] == 0:
            stages.update(r["stages"])
    return stages


CASES = [(layout, tie) for layout in LAYOUTS for tie in TIES]


@pytest.mark.parametrize("layout,tie", CASES)
def test_each_stage_has_the_same_checkpoint_entries_and_initial_values(results, layout, tie):
    loop, v = _merged_stages(results, (layout, tie, "loop")), _merged_stages(results, (layout, tie, "v"))
    num_stages = 2 * LAYOUTS[layout]["pipeline_model_parallel_size"]
    assert sorted(loop) == sorted(v) == list(range(num_stages))
    assert results[0][(layout, tie, "v")]["placement"] == "v"
    for stage in range(num_stages):
        a, b = loop[stage], v[stage]
        assert (a["pre"], a["post"]) == (b["pre"], b["post"]) == (stage == 0, stage == num_stages - 1)
        assert a["entries"].keys() == b["entries"].keys(), stage
        for k, value in a["entries"].items():
            assert torch.equal(value, b["entries"][k]), (stage, k)
    # the embedding and the loss: rank 0 and rank p-1 under loop, both rank 0 under V
    assert (v[0]["rank"], v[num_stages - 1]["rank"]) == (0, 0)
    assert (loop[0]["rank"], loop[num_stages - 1]["rank"]) == (0, num_stages // 2 - 1)
    layer_keys = {k[0] for s in v.values() for k in s["entries"] if "decoder.layers" in k[0]}
    assert layer_keys, "megatron-core keys layers by one stacked key and a global offset"


@pytest.mark.parametrize("layout,tie", CASES)
def test_finalize_under_v_equals_the_loop_placement(results, layout, tie):
    dp = 4 // LAYOUTS[layout]["pipeline_model_parallel_size"]
    for placement in PLACEMENTS:  # one loss rank per DP replica: rank p-1 under loop, rank 0 under V
        loss_ranks = [r for r, out in enumerate(results) if out[(layout, tie, placement)]["loss_rank"]]
        assert loss_ranks == (list(range(dp)) if placement == "v" else list(range(4 - dp, 4))), placement
    merged = {}
    for placement in PLACEMENTS:
        grads = {}
        for rank_out in results:
            for name, g in rank_out[(layout, tie, placement)]["grads"].items():
                if name in grads:
                    assert torch.equal(grads[name], g), (placement, name)
                grads[name] = g
        merged[placement] = grads
    assert merged["loop"].keys() == merged["v"].keys()
    assert ("output_layer.weight" in merged["v"]) == (tie == "untied")
    for name, g in merged["loop"].items():
        assert torch.equal(g, merged["v"][name]), name
    # under V, rank 0 holds both copies of the tied embedding, equal after the local tie
    if tie == "tied":
        for rank_out in results:
            r = rank_out[(layout, tie, "v")]
            if r["loss_rank"]:
                first, last = r["copies"]
                assert torch.equal(first, last)


@pytest.mark.parametrize("layout,tie", CASES)
def test_a_v_step_gives_1f1bs_losses_and_gradients_bitwise(results, layout, tie):
    merged = {}
    for placement in PLACEMENTS:
        grads, losses = {}, []
        for rank_out in results:
            out = rank_out[("step", layout, tie, placement)]
            assert out["pending"] == 0 and (out["deferred"] > 0) == (placement == "v")
            losses += out["losses"] or []
            for name, g in out["grads"].items():
                if name in grads:
                    assert torch.equal(grads[name], g), (placement, name)
                grads[name] = g
        merged[placement] = (grads, losses)
    (loop_grads, loop_losses), (v_grads, v_losses) = merged["loop"], merged["v"]
    assert loop_losses == v_losses and len(v_losses) == 4
    assert loop_grads.keys() == v_grads.keys()
    for name, g in loop_grads.items():
        assert g.abs().sum() > 0, name
        assert torch.equal(g, v_grads[name]), f"{name}: max diff {(g - v_grads[name]).abs().max()}"
