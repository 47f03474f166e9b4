"""What ``generate.py`` records from Megatron-LM's memory at the save, for the loader's tests to match.

- ``logits``: [2, 16, padded vocabulary] fp32, Megatron-LM's model (eval, no grad) on a fixed input
  through megatron-core's forward-only schedule, gathered over TP on the last stage;
- ``moments``: {(pipeline rank, TP rank, parameter name): statistics of exp_avg and exp_avg_sq}
  over the TP-local parameter, assembled from every data-parallel rank's optimizer shard (``stats``);
- ``next_batch``: the tokens and labels of the next global batch Megatron-LM's data iterator yields
  ([global batch, seq] in sample order: sample ``consumed + k * mbs * dp + r * mbs + j`` is micro-batch
  k of data-parallel rank r, row j, as its MegatronPretrainingSampler deals them);
- ``next_step``: its own iteration 2, run after the save on that batch: the loss and grad norm it logs;
- ``iteration``, ``consumed_train_samples``, ``padded_vocab_size``.
"""

from __future__ import annotations

import torch

FIXED_INPUT_SEED = 7


def get_fixed_input(vocab: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, position ids), both [2, 16]: the input whose logits are recorded."""
    g = torch.Generator().manual_seed(FIXED_INPUT_SEED)
    tokens = torch.randint(0, vocab, (2, 16), generator=g)
    return tokens, torch.arange(16).unsqueeze(0).expand(2, -1).contiguous()


def stats(x: torch.Tensor) -> list[float]:
    """[numel, sum, sum of squares, index-weighted mean, first three values] of ``x`` flattened, in
    float64: equal statistics of two tensors mean equal tensors, up to rounding (a shifted tensor
    changes the index-weighted mean)."""
    x = x.detach().double().flatten()
    index = torch.arange(x.numel(), dtype=torch.float64)
    head = x[:3].tolist() + [0.0] * (3 - min(3, x.numel()))
    return [float(x.numel()), x.sum().item(), (x * x).sum().item(), (x * index).sum().item() / x.numel(), *head]


def record_logits(model) -> torch.Tensor | None:
    """Megatron-LM's logits of the fixed input, on global rank 0 (None elsewhere)."""
    from megatron.core import mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens, position_ids = get_fixed_input()

    def forward_step(data_iterator, chunk):
        output = chunk(tokens, position_ids, None)
        return output, lambda out: (out.sum() * 0, {"logits": out.detach().clone()})

    for chunk in model:
        chunk.eval()
    with torch.no_grad():
        store = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=None,
            model=model,
            num_microbatches=1,
            seq_length=16,
            micro_batch_size=2,
            forward_only=True,
        )
    for chunk in model:
        chunk.train()
    local = store[0]["logits"] if store else None  # [2, 16, vocab / TP] on the last stage
    mine = (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank(), local)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    if torch.distributed.get_rank() != 0:
        return None
    last = max(pp for pp, _, _ in gathered)
    unique = {tp: t for pp, tp, t in gathered if pp == last and t is not None}  # DP replicas: the same shard
    return torch.cat([unique[tp] for tp in sorted(unique)], dim=-1)


def _local_moment_pieces(optimizer, model) -> list[tuple]:
    """This rank's (chunk, name, start, end, exp_avg, exp_avg_sq) pieces, start/end in the flattened
    TP-local parameter."""
    pieces = []
    names = {p: (i, n) for i, chunk in enumerate(model) for n, p in chunk.module.named_parameters()}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "model_param_gbuf_map"):  # the distributed optimizer: a range of each parameter
            for param, (chunk, name) in names.items():
                if param not in opt.model_param_gbuf_map:
                    continue
                span = opt._get_model_param_range_map(param)["param"]
                state = opt._get_main_param_and_optimizer_states(param)
                pieces.append((chunk, name, span.start, span.end, state["exp_avg"], state["exp_avg_sq"]))
        else:  # FP32Optimizer: torch's Adam over the model's own parameters
            for group in opt.optimizer.param_groups:
                for param in group["params"]:
                    state = opt.optimizer.state[param]
                    chunk, name = names[param]
                    n = param.numel()
                    pieces.append((chunk, name, 0, n, state["exp_avg"].flatten(), state["exp_avg_sq"].flatten()))
    return [(c, n, s, e, a.detach().cpu().clone(), b.detach().cpu().clone()) for c, n, s, e, a, b in pieces]


def record_moments(optimizer, model) -> dict | None:
    """{(pp rank, tp rank, chunk, name): {"exp_avg": stats, "exp_avg_sq": stats}} on global rank 0."""
    from megatron.core import mpu

    numel = {(i, n): p.numel() for i, chunk in enumerate(model) for n, p in chunk.module.named_parameters()}
    mine = (
        mpu.get_pipeline_model_parallel_rank(),
        mpu.get_tensor_model_parallel_rank(),
        numel,
        _local_moment_pieces(optimizer, model),
    )
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    if torch.distributed.get_rank() != 0:
        return None
    full: dict[tuple, dict[str, torch.Tensor]] = {}
    for pp, tp, sizes, pieces in gathered:
        for chunk, name, start, end, exp_avg, exp_avg_sq in pieces:
            key = (pp, tp, chunk, name)
            slot = full.setdefault(
                key, {k: torch.full((sizes[(chunk, name)],), float("nan")) for k in ("exp_avg", "exp_avg_sq")}
            )
            slot["exp_avg"][start:end] = exp_avg
            slot["exp_avg_sq"][start:end] = exp_avg_sq
    for key, slot in full.items():
        assert not any(t.isnan().any() for t in slot.values()), f"{key}: a piece of its state is missing"
    return {key: {k: stats(t) for k, t in slot.items()} for key, slot in full.items()}


def record_next_batch(args, train_iter) -> tuple[dict | None, list[dict]]:
    """(the next global batch of Megatron-LM's train iterator in sample order, on global rank 0; the
    micro-batches this rank read, which ``record_next_step`` trains on)."""
    from megatron.core import mpu
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    mine, read = [], []
    first_stage = mpu.get_pipeline_model_parallel_rank() == 0
    if train_iter is not None and first_stage and mpu.get_tensor_model_parallel_rank() == 0:
        for k in range(get_num_microbatches()):
            batch = next(train_iter)
            read.append(batch)
            mine.append((mpu.get_data_parallel_rank(), k, batch["tokens"].clone(), batch["labels"].clone()))
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    if torch.distributed.get_rank() != 0:
        return None, read
    dp, mbs = mpu.get_data_parallel_world_size(), args.micro_batch_size
    rows = {}
    for pieces in gathered:
        for r, k, tokens, labels in pieces:
            for j in range(mbs):
                rows[k * mbs * dp + r * mbs + j] = (tokens[j], labels[j])
    order = sorted(rows)
    assert order == list(range(args.global_batch_size)), order
    batch = {
        "first_sample": args.consumed_train_samples,
        "tokens": torch.stack([rows[i][0] for i in order]),
        "labels": torch.stack([rows[i][1] for i in order]),
    }
    return batch, read


def record_next_step(step, read: list[dict], train_iter) -> dict | None:
    """Megatron-LM's own iteration 2, after the save: ``step(data_iterator)`` is its ``train_step``;
    the first pipeline stage trains on the micro-batches ``record_next_batch`` read from its iterator,
    the last on its own iterator's next ones (the same samples). {"lm loss", "grad norm", "lr"} on
    global rank 0."""
    from megatron.core import mpu
    from megatron.core.rerun_state_machine import RerunDataIterator

    first_stage = mpu.get_pipeline_model_parallel_rank() == 0
    data = RerunDataIterator(iter(read)) if first_stage and read else train_iter
    loss, skipped, *_, grad_norm, _, _ = step(data)
    mine = {"lm loss": float(loss["lm loss"]), "grad norm": float(grad_norm)} if loss else None
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (mine, skipped))
    losses = [m for m, _ in gathered if m is not None]
    return {**losses[-1], "skipped": any(s for _, s in gathered)} if torch.distributed.get_rank() == 0 else None


def build_reference(case, args, model, optimizer, train_iter) -> tuple[dict, list[dict]]:
    """Everything above but the next step, collective over the world; the dict is complete on global
    rank 0. Also the micro-batches this rank read (``record_next_step``'s)."""
    next_batch, read = record_next_batch(args, train_iter)
    reference = {
        "logits": record_logits(model),
        "moments": None if case.optimizer == "none" else record_moments(optimizer, model),
        "next_batch": next_batch,
        "iteration": 1,
        "consumed_train_samples": args.consumed_train_samples,
        "padded_vocab_size": args.padded_vocab_size,
    }
    return reference, read
