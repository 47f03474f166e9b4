"""Generate text from any of our checkpoints, for spot checks: greedy, or sampled (temperature, top-k, top-p).

    python tools/generate.py --load CKPT --prompt "Once upon a time" --max-new-tokens 32 [--greedy]
    python tools/generate.py --load CKPT --prompt-ids 1,2,3 --top-p 0.9 --temperature 0.8 --seed 0 --device cuda

Any saved layout: our checkpoints (megatron-core ``torch_dist``) key every tensor by its global
name, layers stacked on dimension 0, so one process reads them whole (every item checked against
the checksums its save recorded, as ``--ckpt-verify`` does) and copies them into the model the
checkpoint's own flags build at TP = PP = 1, on the local (torch) layer spec, any model family (GPT-2
or Llama style). The model computes in fp32 (bf16 weights are upcast). The prompt is tokenized with
the tokenizer the run recorded (its flags in the checkpoint), or given as token ids.

No KV cache: each new token runs the model over the whole sequence (quadratic in its length), which
is what a spot check of a few hundred tokens needs and keeps the tool on the training model's
forward. The padded vocabulary's extra rows are never sampled.

Sampling (``sample_next_token``): logits / temperature; top-k keeps the k largest; top-p keeps the
smallest set of most likely tokens whose probability reaches p (the token that crosses p
included); then one draw from the renormalised distribution with a seeded generator, so a seed
gives the same tokens on every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import socket
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.cpu_platform import quiet_known_warnings  # noqa: E402

quiet_known_warnings()  # before megatron-core's imports, which warn about TE/Apex on a CPU machine

from megatron_ext.checkpoint.directory import resolve_load_path  # noqa: E402
from megatron_ext.checkpoint.listing import describe_unmarked_iterations  # noqa: E402
from megatron_ext.checkpoint.reader import NAMED_ERRORS, open_checkpoint  # noqa: E402
from megatron_ext.checkpoint.state import load_full_tensors  # noqa: E402
from megatron_ext.cli_args import ToolParser, integer, real  # noqa: E402
from megatron_ext.config import ModelConfig, build_job_config  # noqa: E402
from megatron_ext.data.tokenizers import build_tokenizer  # noqa: E402

# checkpoint keys of layer-stacked tensors (megatron-core stores the norms fused into the following
# linear, as Transformer Engine names them) -> the local spec's parameter names
FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
TOKENIZER_KEYS = (
    "tokenizer_type",
    "tokenizer_model",
    "vocab_size",
    "vocab_file",
    "merge_file",
    "tiktoken_pattern",
    "tiktoken_num_special_tokens",
    "tiktoken_special_tokens",
)


# ----------------------------------------------------------------------------- sampling (pure)


def get_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Boolean mask over ``probs`` ([V], summing to 1): the smallest set of most likely tokens whose
    probability reaches ``top_p`` (the token that crosses it included; the most likely always)."""
    order = torch.argsort(probs, descending=True, stable=True)
    before = torch.cumsum(probs[order], 0) - probs[order]  # probability of the tokens ranked above
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[order[before < top_p]] = True
    mask[order[0]] = True
    return mask


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> int:
    """The next token from ``logits`` ([V], fp32): the argmax when ``temperature`` is 0, else one
    draw after temperature, top-k (0: off) and top-p (1: off)."""
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        probs = torch.where(get_nucleus(probs, top_p), probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def generate(
    model: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    vocab_size: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_id: int | None = None,
) -> list[int]:
    """``prompt`` continued by up to ``max_new_tokens`` tokens (stopping after ``stop_id``), each from
    the model's logits over the whole sequence so far (no KV cache); only ids below ``vocab_size``
    (the tokenizer's, not the padded vocabulary) are chosen."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            tokens = torch.tensor([ids], device=device)
            positions = torch.arange(len(ids), device=device)[None]
            logits = model(input_ids=tokens, position_ids=positions, attention_mask=None)  # [1, s, V_padded]
            token = sample_next_token(logits[0, -1, :vocab_size].float(), temperature, top_p, top_k, generator)
            ids.append(token)
            if token == stop_id:
                break
    return ids


# ----------------------------------------------------------------------------- the model


def to_parameter_names(full: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (layers stacked on dim 0, norms under their fused names) -> the local
    spec's single-process parameter names."""
    out = {}
    for key, tensor in full.items():
        if not key.startswith("decoder.layers."):
            out[key] = tensor
            continue
        suffix = key[len("decoder.layers.") :]
        suffix = FUSED_NORMS.get(suffix, suffix)
        for i in range(num_layers):
            out[f"decoder.layers.{i}.{suffix}"] = tensor[i]
    return out


def build_generation_config(args: dict[str, Any], padded_vocab: int) -> Any:
    """The checkpoint's model flags (``args``, flat) at TP = PP = 1 on the local spec, fp32."""
    model_keys = {f.name for f in dataclasses.fields(ModelConfig)}
    values = {k: v for k, v in args.items() if k in model_keys}
    values.update(
        transformer_impl="local",
        recompute_granularity=None,
        recompute_method=None,
        recompute_num_layers=None,
        recompute_activations=False,
        recompute_modules=[],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mock_data=True,
        tokenizer_type="NullTokenizer",
        vocab_size=padded_vocab - 1,  # the model's vocabulary is the checkpoint's padded one
    )
    return build_job_config(values)


def _join_one_process_world() -> bool:
    """A 1-rank gloo world unless one exists (tests fork one); True when this call made it."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ValueError("tools/generate.py runs in one process: launch it with python, not torchrun")
        return False
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(minutes=10)
    )
    return True


def open_saved_checkpoint(load: str, log: Callable[[str], None] = print) -> tuple[int, str, dict[str, Any]]:
    """(iteration, directory, common record: args, tokenizer, padded_vocab_size) of the newest
    complete checkpoint under ``load`` (or one iter_XXXXXXX), its coordinator files checked; the
    tensors are not read. ValueError naming what is wrong."""
    found, warning = resolve_load_path(load)
    if warning:
        log(f"WARNING: {warning}")
    if found is None:
        what = (
            "does not exist"
            if not os.path.exists(load)
            else f"holds no complete checkpoint{describe_unmarked_iterations(load)}"
        )
        raise ValueError(
            f"--load {load} {what}: give a directory that pretrain_gpt.py --save wrote, or one of its iter_XXXXXXX"
        )
    iteration, ckpt_dir = found
    try:
        common = open_checkpoint(ckpt_dir, warn=lambda message: log(f"WARNING: {message}"))[1]
    except NAMED_ERRORS as err:
        raise ValueError(f"--load {load}: {err}: give another checkpoint (e.g. an earlier iter_XXXXXXX)") from None
    return iteration, ckpt_dir, common


def load_model(
    load: str,
    device: torch.device,
    log: Callable[[str], None] = print,
    opened: tuple[int, str, dict[str, Any]] | None = None,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """(our model in eval mode on ``device``, the checkpoint's common record: args, tokenizer,
    padded_vocab_size) from the newest complete checkpoint under ``load`` (or one iter_XXXXXXX;
    ``opened``: what ``open_saved_checkpoint`` returned for it); needs a 1-rank world
    (``_join_one_process_world``). ValueError naming what is wrong."""
    from megatron_ext.derived import resolve_config
    from megatron_ext.model.gpt import build_model_chunks
    from megatron_ext.parallel import build_parallel_context

    iteration, ckpt_dir, common = opened or open_saved_checkpoint(load, log)
    try:
        full = load_full_tensors(ckpt_dir, exclude=("optimizer.",))
    except NAMED_ERRORS as err:
        raise ValueError(f"--load {load}: {err}") from None
    args, padded = common["args"], common["padded_vocab_size"]
    cfg = build_generation_config(args, padded)
    ctx = build_parallel_context(cfg, device)
    (model,) = build_model_chunks(cfg, resolve_config(cfg, 1, padded), ctx.placement, device)
    saved = to_parameter_names(full, args["num_layers"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in saved:
                raise ValueError(f"--load {load}: {ckpt_dir} holds no {name} for the model its flags build")
            if saved[name].numel() != param.numel():
                raise ValueError(
                    f"--load {load}: {name} is {tuple(saved[name].shape)}, the model's {tuple(param.shape)}"
                )
            # a SwiGLU fc1 is stored [2, ffn, h]: reshaped, it is [gate; up] as the parameter holds it
            param.copy_(saved[name].reshape(param.shape))
    log(f"loaded {ckpt_dir} (iteration {iteration}): {args['num_layers']} layers, {padded} padded vocabulary")
    return model.eval(), common


def build_saved_tokenizer(common: dict[str, Any]) -> Any:
    """The tokenizer the run recorded in its flags."""
    args = common["args"]
    return build_tokenizer(**{k: args[k] for k in TOKENIZER_KEYS if args.get(k) is not None})


# ----------------------------------------------------------------------------- main


def prompt_ids(text: str) -> list[int]:
    """An argparse ``type``: comma-separated token ids, each a whole number >= 0."""
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give token ids as whole numbers, comma-separated (1,2,3)"
        ) from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{text}: token ids are >= 0: give the ids the checkpoint's tokenizer makes")
    return ids


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, help="a save directory (its newest checkpoint) or an iter_XXXXXXX")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, tokenized with the run's tokenizer")
    prompt.add_argument("--prompt-ids", type=prompt_ids, help="token ids, comma-separated")
    parser.add_argument("--max-new-tokens", type=integer(1, what="tokens to generate"), default=32)
    parser.add_argument("--greedy", action="store_true", help="the most likely token each time (temperature 0)")
    parser.add_argument("--temperature", type=real(0, what="0: greedy, 1: the model's distribution"), default=1.0)
    parser.add_argument(
        "--top-p",
        type=real(0, 1, what="the probability mass kept", low_open=True),
        default=1.0,
        help="nucleus sampling: 1 keeps every token",
    )
    parser.add_argument("--top-k", type=integer(0, what="tokens kept; 0: all"), default=0, help="0 keeps every token")
    parser.add_argument("--seed", type=integer(0, what="the sampler's seed"), default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu)")
    return args


def get_position_limit(args: dict[str, Any]) -> tuple[int | None, str]:
    """The longest sequence the checkpoint's model may run, and what sets it: a learned position
    table's rows (beyond them the lookup fails), else the length it was trained at (RoPE runs past it
    on positions it never saw: nonsense, silently); a converted model's Hugging Face context."""
    if args.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        if args.get("max_position_embeddings"):
            return args["max_position_embeddings"], "--max-position-embeddings (its learned position table)"
        return args.get("seq_length"), "--seq-length (its learned position table)"
    if args.get("seq_length"):
        return args["seq_length"], "--seq-length (the length it was trained at)"
    return args.get("max_position_embeddings"), "max_position_embeddings (its Hugging Face config)"


def check_prompt(prompt: list[int], max_new_tokens: int, common: dict[str, Any], given: str) -> None:
    """ValueError unless every id of ``prompt`` is in the checkpoint's vocabulary and the prompt with
    ``max_new_tokens`` fits the model's positions (``given``: the flag the prompt came from)."""
    vocab = (common.get("tokenizer") or {}).get("vocab_size") or common["padded_vocab_size"]
    if not prompt:
        raise ValueError(f"{given}: the prompt has no tokens: give some text or ids")
    outside = sorted({t for t in prompt if not 0 <= t < vocab})
    if outside:
        raise ValueError(
            f"{given}: ids {', '.join(map(str, outside[:5]))}{' ...' if len(outside) > 5 else ''} are outside the "
            f"checkpoint's vocabulary of {vocab} (0..{vocab - 1}): give ids its tokenizer makes"
        )
    limit, what = get_position_limit(common["args"])
    if limit is not None and len(prompt) + max_new_tokens > limit:
        room = limit - len(prompt)
        fix = f"give --max-new-tokens {room} or less" if room > 0 else f"give a prompt of at most {limit - 1} tokens"
        raise ValueError(
            f"{given}: the prompt's {len(prompt)} tokens and --max-new-tokens {max_new_tokens} make "
            f"{len(prompt) + max_new_tokens} positions, beyond the model's {limit}, {what}: {fix}"
        )


def log_to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
    own = _join_one_process_world()
    try:
        opened = open_saved_checkpoint(args.load, log=log_to_stderr)
        common = opened[2]
        tokenizer = build_saved_tokenizer(common) if args.prompt is not None else None
        prompt = tokenizer.tokenize(args.prompt) if tokenizer else args.prompt_ids
        check_prompt(prompt, args.max_new_tokens, common, "--prompt" if tokenizer else "--prompt-ids")
        model, common = load_model(args.load, torch.device(args.device), log=log_to_stderr, opened=opened)
        vocab = (common.get("tokenizer") or {}).get("vocab_size") or common["padded_vocab_size"]
        temperature = 0.0 if args.greedy else args.temperature
        ids = generate(model, prompt, args.max_new_tokens, vocab, temperature, args.top_p, args.top_k, args.seed)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if own:
            import torch.distributed as dist

            dist.destroy_process_group()
    print("ids:", ",".join(map(str, ids)))
    if tokenizer is not None:
        print(tokenizer.detokenize(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
