"""Pretrain a GPT model with megatron-core: TP x PP x VPP x DP, on GPUs or on the CPU (gloo).

    torchrun --nproc-per-node 8 pretrain_gpt.py --config configs/default.yaml

Flags follow Megatron-LM's names (``--help`` lists them); a ``--config`` YAML/TOML file gives the
same keys, and flags override it.
"""

from __future__ import annotations

import os
import sys

from megatron_ext.platform import quiet_known_warnings, select_device

quiet_known_warnings()  # before megatron-core's imports, which warn about TE/Apex on CPU

import torch  # noqa: E402

from megatron_ext.arguments import parse_args  # noqa: E402
from megatron_ext.checkpointing import CheckpointMeta, build_exit_decider, setup_checkpointing  # noqa: E402
from megatron_ext.config import (  # noqa: E402
    ConfigError, JobConfig, get_global_batch_size, get_padded_vocab_size, uses_variable_lengths, validate,
)
from megatron_ext.datasets import build_gpt_datasets, parse_split  # noqa: E402
from megatron_ext.packed_dataset import build_packed_datasets  # noqa: E402
from megatron_ext.logger import MetricWriter  # noqa: E402
from megatron_ext.model import build_model_chunks, wrap_with_ddp  # noqa: E402
from megatron_ext.optim import build_optimizer, build_scheduler  # noqa: E402
from megatron_ext.parallel import build_parallel_context, init_distributed  # noqa: E402
from megatron_ext.pp_timeline import build_pp_timeline  # noqa: E402
from megatron_ext.tokenizer import build_tokenizer  # noqa: E402
from megatron_ext.training import TrainingRun, configure_model_hooks, train  # noqa: E402


def build_data(cfg: JobConfig, tokenizer, global_batch_size: int):
    t = cfg.training
    num_evals = t.train_iters // t.eval_interval if t.eval_interval else 0
    num_samples = [
        t.train_iters * global_batch_size,
        max(num_evals * t.eval_iters * global_batch_size, 1),
        1,
    ]
    d = cfg.data
    if uses_variable_lengths(cfg):
        strategy = d.packing_strategy if d.packed_sequences else "one_per_row"
        train_ds, valid_ds, _ = build_packed_datasets(
            d.data_path[-1], parse_split(d.split), cfg.model.seq_length, strategy, t.seed,
            num_samples, d.data_cache_path,
        )
        if int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1:
            index = train_ds.index
            print(
                f"> {strategy} samples: {index.num_bins} of <= {cfg.model.seq_length} tokens from "
                f"{len(index.piece_len)} document pieces | packing efficiency (real tokens / slots "
                f"at --seq-length): {index.efficiency(cfg.model.seq_length):.3f}", flush=True,
            )
        return train_ds, valid_ds
    train_ds, valid_ds, _ = build_gpt_datasets(
        tokenizer, cfg.model.seq_length, num_samples, data_path=d.data_path, split=d.split,
        mock_data=d.mock_data, random_seed=t.seed, path_to_cache=d.data_cache_path,
        create_attention_mask=False,
    )
    return train_ds, valid_ds


def main(argv: list[str] | None = None) -> list[float]:
    cfg = parse_args(argv)
    device = select_device()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world_size, cuda=device.type == "cuda")
    exit_decider = build_exit_decider(cfg)  # SIGTERM during start-up is recorded too
    tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model, cfg.data.vocab_size)

    init_distributed(device, cfg.parallel.distributed_timeout_minutes)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ctx = build_parallel_context(cfg, device)
    gbs = get_global_batch_size(cfg, world_size)
    vocab = get_padded_vocab_size(tokenizer.vocab_size, cfg)
    model = wrap_with_ddp(cfg, build_model_chunks(cfg, ctx.placement, vocab, device))
    optimizer = build_optimizer(cfg, model, device)
    scheduler = build_scheduler(cfg, optimizer, gbs)
    configure_model_hooks(model, optimizer)
    train_ds, valid_ds = build_data(cfg, tokenizer, gbs)

    if ctx.is_logging_rank:
        _print_summary(cfg, ctx, vocab, model)
    run = TrainingRun(
        cfg=cfg, ctx=ctx, model=model, optimizer=optimizer, scheduler=scheduler,
        train_ds=train_ds, valid_ds=valid_ds, global_batch_size=gbs,
        writer=MetricWriter(cfg, enabled=ctx.is_logging_rank), pad_id=tokenizer.pad,
    )
    if cfg.logging.pp_timeline:
        run.schedule_context = build_pp_timeline(cfg.logging.pp_timeline, ctx).trace_step
    meta = CheckpointMeta(tokenizer=tokenizer.identity(), padded_vocab_size=vocab)
    setup_checkpointing(run, meta, exit_decider)
    history = train(run)
    run.writer.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    write_exit_marker()
    return history


def write_exit_marker() -> None:
    """Tell launch/torchrun.sh this rank finished cleanly (torchrun's own code cannot say so
    after a SIGTERM)."""
    marker_dir = os.environ.get("MEGATRON_EXT_EXIT_MARKER_DIR")
    if marker_dir and os.path.isdir(marker_dir):
        open(os.path.join(marker_dir, f"rank{os.environ.get('RANK', '0')}.ok"), "w").close()


def _print_summary(cfg: JobConfig, ctx, vocab: int, model) -> None:
    p = cfg.parallel
    local = sum(prm.numel() for chunk in model for prm in chunk.parameters())
    print(
        f"> layout: world {ctx.world_size} = TP {ctx.tp_size} x PP {ctx.pp_size} x DP {ctx.dp_size}"
        f" | virtual stages per pipeline rank {ctx.vp_size or 1}"
        f" | distributed optimizer {p.use_distributed_optimizer} | device {ctx.device}"
        f" | padded vocab {vocab} | parameters on the logging rank {local:,}",
        flush=True,
    )


if __name__ == "__main__":
    try:
        main()
    except ConfigError as err:
        if os.environ.get("RANK", "0") == "0":  # every rank finds the same problems
            print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
