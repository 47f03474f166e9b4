"""Convert Hugging Face Llama-architecture checkpoints (Llama 2/3/3.1/3.2/3.3, Qwen2/2.5, Qwen3) to ours and back.

    python tools/convert_checkpoint.py hf-to-megatron --hf-dir HF --save CKPT \\
        [--tensor-model-parallel-size 2] [--make-vocab-size-divisible-by 128]
    python tools/convert_checkpoint.py megatron-to-hf --load CKPT --hf-dir OUT [--overwrite] \\
        [--tokenizer-model PATH] [--tokenizer-type TYPE]

megatron-to-hf writes what ``--save-hf`` writes (``megatron_ext/hf/export.py``): the weights,
config.json with the tokenizer's eos/pad/bos ids, and the tokenizer's files (a Hugging Face
directory copied, a SentencePiece model's exact equivalent) or ``TOKENIZER.txt`` saying which
tokenizer the ids are of. The tokenizer is the checkpoint's recorded one; ``--tokenizer-model``
(and ``--tokenizer-type``) stand for it where its recorded path is not on this machine, and must
give the same tokenizer (its identity, as a resume checks) or nothing is written. The export is
written into a hidden sibling of OUT, fsynced and renamed into place: OUT must be new or empty,
or, with ``--overwrite``, an earlier export (only an export's files), which stays until the new
one is complete (a run killed between the two renames leaves it as ``.OUT.replaced-export``,
renamed back by the next run).

Our checkpoints (megatron-core ``torch_dist``) key every tensor by its global name and layer
number, so one converted checkpoint loads under any TP x PP x VPP x DP: the conversion runs in
one process. The padded vocabulary (a multiple of ``--make-vocab-size-divisible-by``, the same at
every TP size, unlike Megatron-LM's) is recorded in the checkpoint; a run loads it at any TP that
divides the multiple. The converted
checkpoint holds weights only (a run that loads it starts a fresh optimizer at iteration 0) and
prints the flags a run needs to match it.

The mapping itself is ``megatron_ext/hf/`` (``config.py``, ``mapping.py``), shared with the
training-time export (``--save-hf``); its names stay importable from here.

Tensor layouts (megatron-core, checked against 0.16.1):
- ``linear_qkv.weight`` is grouped per key/value head: for each of the G query groups,
  [its H/G query heads; its key head; its value head], each head ``head_dim`` rows (``--kv-channels``);
- ``linear_fc1.weight`` of the SwiGLU MLP is [gate; up] (megatron-core applies silu to the first
  half); ``linear_fc2`` is ``down_proj``;
- RoPE: megatron-core's default (``rotary_interleaved=False``) rotates halves, as Hugging Face's
  ``rotate_half`` does, so q/k rows are copied without permutation; theta is ``--rotary-base``.
  Llama-3.1-style scaling (``rope_type: llama3``) maps to ``--use-rope-scaling
  --rope-scaling-factor F``: megatron-core fixes the low/high frequency factors (1, 4) and the
  original context (8192), so other values are refused;
- Qwen2/2.5: q/k/v biases (implied by ``model_type``) map to ``--add-qkv-bias``, grouped like the
  weight rows; sliding-window attention is refused (Qwen2 and Qwen3);
- Qwen3: its per-head ``q_norm``/``k_norm`` map to ``--qk-layernorm`` (``q_layernorm``/``k_layernorm``),
  its ``head_dim`` to ``--kv-channels`` where it is not hidden / heads; it has no q/k/v biases;
- ``--apply-layernorm-1p`` (zero-centred gamma): our norms scale by ``1 + weight``, Hugging Face's
  by ``weight``: the export adds 1 to every norm weight, and ``hf-to-megatron --apply-layernorm-1p``
  subtracts it (the checkpoint then records the flag, which its runs must give).
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import importlib.util
import json
import os
import shutil
import sys
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.cpu_platform import quiet_known_warnings  # noqa: E402

quiet_known_warnings()  # before megatron-core's imports (below, through ours), which warn about TE/Apex

from megatron_ext.checkpoint.compatibility import check_same_tokenizer, saved_ffn_hidden_size  # noqa: E402
from megatron_ext.cli_args import ToolParser, input_dir, integer, output_dir  # noqa: E402
from megatron_ext.config import DataConfig, ModelConfig  # noqa: E402
from megatron_ext.data.tokenizers import build_tokenizer, get_tokenizer_args  # noqa: E402
from megatron_ext.hf.config import (  # noqa: E402
    LLAMA3_ROPE,
    REQUIRED_KEYS,
    SUPPORTED_MODEL_TYPES,
    check_supported,
    get_padded_vocab,
    get_rope_scaling_factor,
    get_rope_theta,
    hf_config_to_values,
)
from megatron_ext.hf.config import build_hf_config as build_hf_config_of  # noqa: E402
from megatron_ext.hf.export import (  # noqa: E402
    INDEX_FILE,
    SINGLE_FILE,
    TOKENIZER_NOTE,
    get_tokenizer_special_ids,
    publish_directory,
    recover_replaced_export,
    write_tokenizer_files,
)
from megatron_ext.hf.export import TOKENIZER_FILES as EXPORT_TOKENIZER_FILES  # noqa: E402
from megatron_ext.hf.mapping import (  # noqa: E402
    HF_NORMS,
    OUR_NORMS,
    check_hf_tensors,
    hf_to_megatron_tensors,
    megatron_to_hf_tensors,
    shift_norm_weights,
    unstack_layers,
)

# the converter's names, which other tools import from here (the mapping itself is megatron_ext.hf)
__all__ = [
    "HF_NORMS",
    "LLAMA3_ROPE",
    "OUR_NORMS",
    "PLACEHOLDER_SETTINGS",
    "REQUIRED_KEYS",
    "SUPPORTED_MODEL_TYPES",
    "build_hf_config",
    "check_empty_save_dir",
    "check_hf_output_dir",
    "check_supported",
    "convert_hf_to_megatron",
    "convert_megatron_lm_to_megatron",
    "convert_megatron_to_hf",
    "get_padded_vocab",
    "get_rope_scaling_factor",
    "get_rope_theta",
    "hf_config_to_values",
    "hf_to_megatron_tensors",
    "main",
    "megatron_to_hf_tensors",
    "shift_norm_weights",
    "unstack_layers",
]

# Training settings of the converter's one-process model, not the HF model's: recorded, every run
# that loads the converted checkpoint warned that it was "trained with --seq-length 16" (state.py's
# WARNED_SETTINGS); the model settings a run must match stay recorded
# megatron-to-hf's flags standing for the checkpoint's recorded tokenizer (DataConfig's names)
TOKENIZER_FLAGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
PLACEHOLDER_SETTINGS = ("seq_length", "seed", "hidden_dropout", "attention_dropout", "packed_sequences")
# the model settings of a Megatron-LM checkpoint that its conversion records (our ModelConfig's fields)
MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))


# ----------------------------------------------------------------------------- process world


def _with_single_process_model(values: dict[str, Any], padded_vocab: int, fn: Callable) -> Any:
    """Build our model in a 1-rank world (TP = PP = 1) and call ``fn(model_chunk, cfg)``.
    Uses the current process group when there is one of size 1 (tests fork one)."""
    import torch.distributed as dist

    from megatron_ext.config import build_job_config
    from megatron_ext.derived import resolve_config
    from megatron_ext.model.gpt import build_model_chunks
    from megatron_ext.parallel import build_parallel_context, destroy_parallel_context

    own_group = not dist.is_initialized()
    if own_group:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(minutes=10)
        )
    if dist.get_world_size() != 1:
        raise ValueError("the converter runs in one process: launch it with python, not torchrun")
    cfg = build_job_config(
        {
            **values,
            "mock_data": True,
            "tokenizer_type": "NullTokenizer",
            "vocab_size": padded_vocab - 1,
            "seq_length": 16,
        }
    )
    device = torch.device("cpu")
    ctx = build_parallel_context(cfg, device)
    try:
        (chunk,) = build_model_chunks(cfg, resolve_config(cfg, 1, padded_vocab), ctx.placement, device)
        return fn(chunk, cfg)
    finally:
        destroy_parallel_context()
        if own_group:
            dist.destroy_process_group()


def _read_hf(hf_dir: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(
            f"--hf-dir {hf_dir}: no config.json: give a Hugging Face model directory (config.json, *.safetensors)"
        )
    try:
        with open(config_path) as f:
            hf = json.load(f)
    except ValueError as err:
        raise ValueError(f"--hf-dir {hf_dir}: config.json is not valid JSON ({err})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"--hf-dir {hf_dir}: config.json holds {type(hf).__name__}, not an object")
    check_supported(hf)
    files = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"--hf-dir {hf_dir}: no *.safetensors files (PyTorch .bin is not supported)")
    state = {}
    for name in files:
        state.update(_read_safetensors(os.path.join(hf_dir, name)))
    check_hf_tensors(state, hf, f"--hf-dir {hf_dir}")  # a tensor missing or cut: named now, not a KeyError later
    return hf, {k: v.float() for k, v in state.items()}


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors; ValueError naming the file when it is not one (garbage,
    truncated: safetensors raises its own SafetensorError, which says neither which file nor what
    to do) or cannot be read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError) as err:
        raise ValueError(
            f"--hf-dir: {path} is not a readable safetensors file ({err}); it may be truncated "
            f"or damaged: download or export it again"
        ) from None


def convert_hf_to_megatron(
    hf_dir: str,
    save: str,
    tp: int = 1,
    divisible_by: int = 128,
    log: Callable[[str], None] = print,
    apply_layernorm_1p: bool = False,
) -> str:
    """HF Llama directory -> ``save/iter_0000000`` (weights, args, the HF config); with
    ``apply_layernorm_1p`` a checkpoint of zero-centred norm weights (HF's minus 1)."""
    from megatron_ext.checkpoint.directory import FORMAT_VERSION, write_checkpoint
    from megatron_ext.checkpoint.state import build_model_sharded_state_dict

    check_empty_save_dir(save)
    hf, hf_state = _read_hf(hf_dir)
    log(f"read {len(hf_state)} tensors from {hf_dir} ({hf['num_hidden_layers']} layers)")
    values = {**hf_config_to_values(hf, divisible_by), "apply_layernorm_1p": apply_layernorm_1p}
    padded = get_padded_vocab(hf["vocab_size"], divisible_by, tp)
    ours = hf_to_megatron_tensors(hf_state, hf, padded, zero_centered_gamma=apply_layernorm_1p)

    def save_chunk(chunk, cfg) -> str:
        params = dict(chunk.named_parameters())
        missing = sorted(set(params) - set(ours))
        if missing:
            raise ValueError(f"no HF tensor for our parameters {missing}")
        with torch.no_grad():
            for name, param in sorted(params.items()):
                if tuple(param.shape) != tuple(ours[name].shape):
                    raise ValueError(f"{name}: HF gives {tuple(ours[name].shape)}, ours is {tuple(param.shape)}")
                param.copy_(ours[name])
        log(f"copied {len(params)} parameters; writing {save}")

        class _Wrapped:  # build_model_sharded_state_dict expects DDP-wrapped chunks
            module = chunk

        state = build_model_sharded_state_dict([_Wrapped])
        args = {k: v for k, v in cfg.to_flat_dict().items() if k not in PLACEHOLDER_SETTINGS}
        state.update(
            args=args, tokenizer=None, padded_vocab_size=padded, hf_config=hf, checkpoint_version=FORMAT_VERSION
        )
        return write_checkpoint(state, save, 0)

    out = _with_single_process_model(values, padded, save_chunk)
    flags = " ".join(
        f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k.replace('_', '-')}"
        for k, v in values.items()
        if v not in (None, False)
    )
    log(f"wrote {out}\nload it with: --load {save} {flags}")
    return out


def convert_megatron_lm_to_megatron(load: str, save: str, log: Callable[[str], None] = print) -> str:
    """Megatron-LM's checkpoint that ``--load load`` names (its tracker's, or one ``iter_XXXXXXX`` /
    ``release`` directory) -> our ``save/iter_0000000``: its weights (read by megatron-core into our
    model built in one process), its settings as our flags, its tokenizer identity where its args
    determine it, and its padded vocabulary (Megatron-LM's: --make-vocab-size-divisible-by x its TP),
    which a run loading the result keeps. Weights only: a run continuing Megatron-LM's optimizer and
    position loads its directory with --load instead."""
    from megatron.core import dist_checkpointing

    from megatron_ext.checkpoint.directory import FORMAT_VERSION, write_checkpoint
    from megatron_ext.checkpoint.megatron_lm import MEGATRON_LM_PADDING, get_common_safe_globals, select_load
    from megatron_ext.checkpoint.megatron_lm_args import get_megatron_lm_tokenizer_identity
    from megatron_ext.checkpoint.reader import NAMED_ERRORS, VerifyingTorchDistLoadStrategy
    from megatron_ext.checkpoint.state import build_model_sharded_state_dict
    from megatron_ext.checkpoint.unpickler import allowing

    check_empty_save_dir(save)
    selection = select_load(load)
    if selection is None:
        raise ValueError(f"--load {load}: no Megatron-LM checkpoint (an iter_XXXXXXX or release directory)")
    mlm_args, values, ckpt = read_megatron_lm_model(selection)
    padded = int(mlm_args.padded_vocab_size)
    model = {k: v for k, v in values.items() if k in MODEL_FIELDS}
    log(f"reading Megatron-LM's {ckpt.path} (iteration {ckpt.iteration}; unverified: it records no checksums)")

    def save_chunk(chunk, cfg) -> str:
        metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        try:
            with allowing(get_common_safe_globals()):
                # nested: the load returns common.pt's items beside it (Megatron-LM's args, optimizer)
                request = {"model": chunk.sharded_state_dict(prefix="", metadata=metadata)}
                loaded = dist_checkpointing.load(request, ckpt.path, VerifyingTorchDistLoadStrategy())["model"]
        except NAMED_ERRORS as err:
            raise ValueError(f"--load {load}: {err}; nothing was written to {save}") from None
        chunk.load_state_dict(loaded, strict=True)

        class _Wrapped:  # build_model_sharded_state_dict expects DDP-wrapped chunks
            module = chunk

        state = build_model_sharded_state_dict([_Wrapped])
        args = {k: v for k, v in cfg.to_flat_dict().items() if k not in PLACEHOLDER_SETTINGS}
        identity = get_megatron_lm_tokenizer_identity(mlm_args)
        state.update(args=args, tokenizer=identity, padded_vocab_size=padded, checkpoint_version=FORMAT_VERSION)
        state.update(padded_vocab_from=MEGATRON_LM_PADDING, converted_from=os.path.abspath(ckpt.path))
        return write_checkpoint(state, save, 0)

    # the model's rows are the checkpoint's: padded by 1 here, whatever Megatron-LM's multiple was
    out = _with_single_process_model({**model, "make_vocab_size_divisible_by": 1}, padded, save_chunk)
    flags = " ".join(
        f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k.replace('_', '-')}"
        for k, v in {**model, **{k: values.get(k) for k in TOKENIZER_FLAGS + ("vocab_size",)}}.items()
        if v not in (None, False) and k != "make_vocab_size_divisible_by"
    )
    log(f"wrote {out} (weights only: a run loading it starts at iteration 0)\nload it with: --load {save} {flags}")
    return out


def check_empty_save_dir(save: str) -> None:
    """The converted checkpoint is iteration 0: written beside a run's checkpoints, ``--load`` would
    still take the run's newest one. Refuse a ``--save`` that holds checkpoints."""
    from megatron_ext.checkpoint.directory import TRACKER_FILE

    if os.path.exists(save) and not os.path.isdir(save):
        raise ValueError(f"--save {save} is a file, not a directory")
    held = (
        sorted(n for n in os.listdir(save) if n.startswith("iter_") or n == TRACKER_FILE) if os.path.isdir(save) else []
    )
    if held:
        raise ValueError(
            f"--save {save} already holds checkpoints ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): "
            f"give a new or empty directory"
        )


def check_hf_output_dir(hf_dir: str, overwrite: bool = False) -> None:
    """Never lose a model or a user's files: ``--hf-dir`` must be new or empty, or, with
    ``overwrite``, hold nothing but what an export writes (it is then replaced as a whole, the
    earlier export kept until the new one is complete: ``publish_directory``)."""
    if os.path.islink(hf_dir):
        raise ValueError(f"--hf-dir {hf_dir} is a symbolic link: give the directory it points to")
    if os.path.exists(hf_dir) and not os.path.isdir(hf_dir):
        raise ValueError(f"--hf-dir {hf_dir} is a file, not a directory")
    entries = sorted(os.listdir(hf_dir)) if os.path.isdir(hf_dir) else []
    if not entries:
        return
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    if not overwrite:
        held = [n for n in entries if n == "config.json" or n.endswith(".safetensors")]
        what = f"a model ({', '.join(held)})" if held else f"files ({shown})"
        raise ValueError(
            f"--hf-dir {hf_dir} already holds {what}: give a new or empty directory, or --overwrite to replace "
            f"an earlier export there"
        )
    foreign = [n for n in entries if not is_export_file(n)]
    if foreign:
        raise ValueError(
            f"--hf-dir {hf_dir} holds files an export does not write ({', '.join(foreign[:4])}"
            f"{', ...' if len(foreign) > 4 else ''}): --overwrite replaces the directory as a whole; move them "
            f"away or give another directory"
        )


def is_export_file(name: str) -> bool:
    """Whether an export (this converter's or ``--save-hf``'s) writes a file of this name."""
    return (
        name in ("config.json", INDEX_FILE, TOKENIZER_NOTE)
        or name in EXPORT_TOKENIZER_FILES
        or name.endswith(".safetensors")
    )


def convert_megatron_to_hf(
    load: str,
    hf_dir: str,
    log: Callable[[str], None] = print,
    overwrite: bool = False,
    tokenizer_flags: dict[str, str] | None = None,
) -> str:
    """Our newest complete checkpoint under ``load`` (or ``load`` itself, one ``iter_XXXXXXX``
    directory) -> HF safetensors, config.json (with the tokenizer's special ids) and the tokenizer's
    files (or a note) in ``hf_dir``, published as ``--save-hf`` publishes: written into a sibling
    temporary directory, fsynced, renamed into place (an earlier export, with ``overwrite``, kept
    until then). ``tokenizer_flags`` ({"tokenizer_model": ..., "tokenizer_type": ...}, DataConfig
    names) stand for the checkpoint's recorded ones (a tokenizer not at its recorded path here); they
    must give the tokenizer the checkpoint records. Every file and item read is checked against the
    checksums its save recorded (as ``--ckpt-verify`` checks a load). A damaged file, a mismatched
    tokenizer or a refused ``hf_dir`` is a ValueError naming it, and nothing is written."""
    from megatron_ext.checkpoint.megatron_lm import select_load
    from megatron_ext.checkpoint.reader import NAMED_ERRORS

    final = os.path.abspath(hf_dir)  # no trailing separator: the siblings are named after it
    recover_replaced_export(final, log, get_replaced_path(final))  # an earlier run killed between its renames
    check_hf_output_dir(hf_dir, overwrite)
    foreign = select_load(load)  # Megatron-LM's own checkpoint: its tracker's (or one iter_ / release directory)
    try:  # every file and item read is checked (against the checksums its save recorded, where it has them)
        if foreign is not None:
            args, hf, tokenizer, full = _read_megatron_lm_for_hf(foreign, tokenizer_flags or {}, log)
        else:
            args, hf, tokenizer, full = _read_ours_for_hf(load, tokenizer_flags or {}, log)
    except NAMED_ERRORS as err:
        raise ValueError(f"--load {load}: {err}; nothing was written to {hf_dir}") from None
    ours = unstack_layers(full, args["num_layers"])
    tensors = megatron_to_hf_tensors(ours, hf, zero_centered_gamma=bool(args.get("apply_layernorm_1p")))
    said = _write_and_publish(tensors, hf, tokenizer, final, log)
    log(f"wrote {len(tensors)} tensors to {hf_dir}; {said}")
    return hf_dir


@dataclasses.dataclass
class ExportTokenizer:
    """What the converter writes for the checkpoint's tokenizer."""

    data: DataConfig | None  # the tokenizer flags whose files are written; None: NO_TOKENIZER_NOTE
    special_ids: dict[str, int | None]  # into config.json (none: the recorded HF config's stay)
    unusable: str | None = None  # why the files at those paths are not the model's: a note instead


# the note for a checkpoint that records no tokenizer (hf-to-megatron's)
NO_TOKENIZER_NOTE = (
    "No Hugging Face tokenizer files were written: this checkpoint records no tokenizer (it was converted "
    "from a Hugging Face model by tools/convert_checkpoint.py hf-to-megatron). Its token ids are that "
    "model's tokenizer's: copy its tokenizer files here, or convert again with --tokenizer-type and "
    "--tokenizer-model.\n"
)


def get_recorded_data_config(args: dict[str, Any]) -> DataConfig:
    """The data flags (the tokenizer's among them) a checkpoint's flat run flags record."""
    names = {f.name for f in dataclasses.fields(DataConfig)}
    return dataclasses.replace(DataConfig(), **{k: v for k, v in args.items() if k in names})


def resolve_export_tokenizer(
    common: dict[str, Any], flags: dict[str, str], hf: dict[str, Any], log: Callable[[str], None]
) -> ExportTokenizer:
    """The tokenizer to export from the checkpoint's record (``common``: its ``tokenizer`` identity
    and flat ``args``), its paths replaced by ``flags`` where given. Given flags that do not build,
    or build another tokenizer than the recorded identity (``check_same_tokenizer``, as a resume
    checks), are a ValueError; recorded paths that are gone or changed here are a warning and the
    note."""
    saved = common.get("tokenizer") or None
    if saved is None:
        return _resolve_unrecorded_tokenizer(flags, hf, log)
    data = dataclasses.replace(get_recorded_data_config(common["args"]), **flags)
    given = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items())
    try:
        built = build_tokenizer(**get_tokenizer_args(data))
    except Exception as err:  # noqa: BLE001 - ConfigError, or a tokenizer library's own error
        if flags:
            raise ValueError(f"{given}: {' '.join(str(err).split())}") from None
        log(
            f"WARNING: the checkpoint's tokenizer ({data.tokenizer_type} {data.tokenizer_model}) cannot be "
            f"loaded here ({' '.join(str(err).split())[:200]}): writing {TOKENIZER_NOTE} instead of its "
            f"files; pass --tokenizer-model (the same tokenizer, where it is on this machine) to export them"
        )
        exists = data.tokenizer_model and os.path.exists(data.tokenizer_model)
        return ExportTokenizer(data, {}, f"it could not be loaded: {err}" if exists else None)
    problems = check_same_tokenizer(saved, built.identity(), whose=f"{given or 'its recorded paths'} give")
    if problems and flags:
        raise ValueError(f"{problems[0]}: pass the tokenizer the checkpoint was trained with (or none: a note)")
    if problems:
        log(f"WARNING: {problems[0]}: writing {TOKENIZER_NOTE} instead of its files")
        return ExportTokenizer(data, {}, "the files at that path are no longer the ones it was trained with")
    return ExportTokenizer(data, get_tokenizer_special_ids(built))


def _resolve_unrecorded_tokenizer(
    flags: dict[str, str], hf: dict[str, Any], log: Callable[[str], None]
) -> ExportTokenizer:
    """A checkpoint converted from Hugging Face records no tokenizer (its run flags name the
    converter's placeholder NullTokenizer): the note, or the tokenizer ``flags`` name in full,
    whose vocabulary must fit the model; the recorded HF config's special ids stay."""
    if not flags:
        return ExportTokenizer(None, {})
    if "tokenizer_type" not in flags:
        raise ValueError(
            "--tokenizer-model: the checkpoint records no tokenizer (converted from a Hugging Face model) to "
            "take the type from: give --tokenizer-type too (e.g. HuggingFaceTokenizer)"
        )
    data = dataclasses.replace(DataConfig(), **flags)
    given = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items())
    try:
        built = build_tokenizer(**get_tokenizer_args(data))
    except Exception as err:  # noqa: BLE001 - ConfigError, or a tokenizer library's own error
        raise ValueError(f"{given}: {' '.join(str(err).split())}") from None
    if built.vocab_size > hf["vocab_size"]:
        raise ValueError(
            f"{given}: its {built.vocab_size} ids do not fit the model's vocabulary of {hf['vocab_size']}: "
            f"pass the tokenizer of the Hugging Face model the checkpoint was converted from"
        )
    log(f"WARNING: the checkpoint records no tokenizer to check {given} against: its files are exported as given")
    return ExportTokenizer(data, {})


def _read_ours_for_hf(load: str, flags: dict[str, str], log: Callable) -> tuple[dict, dict, Any, dict]:
    """(flat run flags, HF config, tokenizer to export, full weights) of our checkpoint ``--load load``."""
    from megatron_ext.checkpoint.directory import resolve_load_path
    from megatron_ext.checkpoint.reader import open_checkpoint
    from megatron_ext.checkpoint.state import load_full_tensors

    found, warning = resolve_load_path(load)  # a save directory or one iter_XXXXXXX, as --load takes
    if warning:
        log(f"WARNING: {warning}")
    if found is None:
        raise ValueError(
            f"--load {load}: no complete checkpoint: give a directory pretrain_gpt.py --save wrote, or its iter_XXXXXXX"
        )
    iteration, ckpt_dir = found
    common = open_checkpoint(ckpt_dir, warn=lambda message: log(f"WARNING: {message}"))[1]
    args = common["args"]
    hf = common.get("hf_config") or build_hf_config(args, common)
    check_supported(hf)
    tokenizer = resolve_export_tokenizer(common, flags, hf, log)
    log(f"reading {ckpt_dir} (iteration {iteration})")
    # the weights only: a run's optimizer state (fp32 main parameters and two Adam moments, 6x the
    # bytes of a bf16 model) would be read into memory and dropped
    full = load_full_tensors(ckpt_dir, exclude=("optimizer.",))
    return args, {**hf, **tokenizer.special_ids}, tokenizer, full


def read_megatron_lm_model(selection: Any) -> tuple[Any, dict[str, Any], Any]:
    """(Megatron-LM's args, our flat values of its settings, its checkpoint) of the checkpoint
    ``selection`` names; ValueError naming what is not read here (its format, a model setting we do
    not build)."""
    from megatron_ext.checkpoint.megatron_lm import check_format, read_megatron_lm_common
    from megatron_ext.checkpoint.megatron_lm_args import map_megatron_lm_args

    ckpt = selection.checkpoint
    problems = check_format(ckpt.path, None)
    common = {} if problems else read_megatron_lm_common(ckpt.path)
    problems = problems or check_format(ckpt.path, common)
    values, refused = map_megatron_lm_args(common["args"]) if not problems else ({}, [])
    if problems or refused:
        raise ValueError(f"{ckpt.path} (Megatron-LM's): {'; '.join(problems + refused)}")
    return common["args"], values, ckpt


def _read_megatron_lm_for_hf(selection: Any, flags: dict[str, str], log: Callable) -> tuple[dict, dict, Any, dict]:
    """(our flat values of its settings, HF config, tokenizer to export, full weights) of a Megatron-LM
    checkpoint: the HF vocabulary is its tokenizer's (the padding rows are dropped) where the tokenizer
    loads here, else all its padded rows (and a note)."""
    from megatron_ext.checkpoint.megatron_lm import read_megatron_lm_weights

    mlm_args, values, ckpt = read_megatron_lm_model(selection)
    for note in selection.notes:
        log(note)
    tokenizer, vocab = resolve_megatron_lm_export_tokenizer(mlm_args, values, flags, log)
    hf = build_hf_config_of(values, vocab, mlm_args.ffn_hidden_size)
    check_supported(hf)
    log(f"reading Megatron-LM's {ckpt.path} (iteration {ckpt.iteration}; unverified: it records no checksums)")
    return values, {**hf, **tokenizer.special_ids}, tokenizer, read_megatron_lm_weights(ckpt.path)


def resolve_megatron_lm_export_tokenizer(
    mlm_args: Any, values: dict[str, Any], flags: dict[str, str], log: Callable
) -> tuple[ExportTokenizer, int]:
    """(the tokenizer to export, the HF vocabulary) of a Megatron-LM checkpoint, which records its
    tokenizer's type and paths, not its files: ``flags`` replace the paths; a tokenizer of another type
    or vocabulary is a ValueError; one that cannot be loaded here gives the note and every padded row."""
    from megatron_ext.checkpoint.megatron_lm_args import describe_tokenizer_difference

    data = dataclasses.replace(get_recorded_data_config(values), **flags)
    given = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items()) or "its recorded paths"
    padded = int(mlm_args.padded_vocab_size)
    try:
        built = build_tokenizer(**get_tokenizer_args(data))
    except Exception as err:  # noqa: BLE001 - ConfigError, or a tokenizer library's own error
        if flags:
            raise ValueError(f"{given}: {' '.join(str(err).split())}") from None
        log(
            f"WARNING: Megatron-LM's tokenizer ({data.tokenizer_type} {data.tokenizer_model or data.vocab_file}) "
            f"cannot be loaded here: writing {TOKENIZER_NOTE} and keeping all {padded} vocabulary rows; pass "
            f"--tokenizer-model (its files on this machine) to export them"
        )
        return ExportTokenizer(data, {}, f"it could not be loaded: {' '.join(str(err).split())[:200]}"), padded
    problem, note = describe_tokenizer_difference(mlm_args, built.identity())
    if problem or built.vocab_size > padded:
        raise ValueError(problem or f"{given} give {built.vocab_size} ids, the model has {padded} rows")
    if note:
        log(f"WARNING: {note}")
    return ExportTokenizer(data, get_tokenizer_special_ids(built)), built.vocab_size


def get_replaced_path(final: str) -> str:
    """Where an earlier export under ``final`` waits while the new one is renamed in: a hidden
    sibling named for us (not ``final.old``, which may be a user's own copy)."""
    parent, base = os.path.split(final)
    return os.path.join(parent, f".{base}.replaced-export")


def _write_and_publish(
    tensors: dict[str, torch.Tensor], hf: dict[str, Any], tokenizer: ExportTokenizer, final: str, log: Callable
) -> str:
    """Write the export into a temporary sibling of ``final`` and publish it there
    (``publish_directory``); returns what was done for the tokenizer, for the log. On any failure
    the temporary directory is deleted and an earlier export under ``final`` stays (or comes back
    from ``get_replaced_path``); a write that fails (disk full, permissions) is a ValueError saying
    so. A process killed here leaves them for the next run (``recover_replaced_export``, and the
    stale temporary directories deleted)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    parent, base = os.path.split(final)
    for stale in glob.glob(os.path.join(parent, f".{glob.escape(base)}.tmp-*")):  # killed runs' leftovers
        shutil.rmtree(stale, ignore_errors=True)
    tmp = os.path.join(parent, f".{base}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(tmp)
    except OSError as err:
        raise ValueError(
            f"--hf-dir {final}: cannot create {tmp} ({err}): the export is written beside --hf-dir and renamed "
            f"in, so the directory holding it must be writable"
        ) from None
    try:
        save_file(tensors, os.path.join(tmp, SINGLE_FILE), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
        if tokenizer.data is None:
            with open(os.path.join(tmp, TOKENIZER_NOTE), "w") as f:
                f.write(NO_TOKENIZER_NOTE)
            said = f"no tokenizer files ({TOKENIZER_NOTE} says why)"
        else:
            said = write_tokenizer_files(tokenizer.data, tmp, tokenizer.unusable)
        umask = os.umask(0)
        os.umask(umask)
        for name in os.listdir(tmp):  # safetensors creates its files 0600: readable as config.json is
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        publish_directory(tmp, final, get_replaced_path(final))
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        recover_replaced_export(final, log, get_replaced_path(final))  # failed between the renames
        if isinstance(err, (OSError, SafetensorError)):
            raise ValueError(
                f"--hf-dir {final}: writing the export failed ({err}); nothing was published (an earlier export "
                f"there is unchanged)"
            ) from None
        raise
    return said


def build_hf_config(args: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    """An HF LlamaConfig dict for a checkpoint trained here (no HF config recorded): ``hf.config``'s,
    with the checkpoint's tokenizer vocabulary and the MLP width its model had (--ffn-hidden-size,
    or its default when it was saved)."""
    vocab = (common.get("tokenizer") or {}).get("vocab_size") or common["padded_vocab_size"]
    return build_hf_config_of(args, vocab, saved_ffn_hidden_size({**common, "args": args}))


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-megatron", help="HF Llama / Qwen2 / Qwen3 (safetensors + config.json) -> our checkpoint")
    a.add_argument("--hf-dir", type=input_dir, required=True)
    a.add_argument("--save", type=output_dir, required=True)
    a.add_argument(
        "--tensor-model-parallel-size",
        type=integer(1, what="the TP size of the runs that will load it"),
        default=1,
        help="TP size of the runs that will load it (only checked: it must divide the multiple)",
    )
    a.add_argument("--make-vocab-size-divisible-by", type=integer(1, what="e.g. 128"), default=128)
    a.add_argument(
        "--apply-layernorm-1p",
        action="store_true",
        help="write zero-centred norm weights (HF's minus 1), for runs with --apply-layernorm-1p",
    )
    b = sub.add_parser(
        "megatron-to-hf",
        help="our checkpoint -> HF Llama / Qwen2 / Qwen3 (safetensors + config.json); "
        "every file read is checked against the checksums its save recorded, a damaged one refused",
    )
    b.add_argument("--load", required=True)
    b.add_argument("--hf-dir", type=output_dir, required=True)
    b.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export in --hf-dir (kept until the new one is complete; a directory holding "
        "other files is refused)",
    )
    c = sub.add_parser(
        "megatron-lm-to-megatron",
        help="Megatron-LM's own checkpoint (core_v0.13+ torch_dist, --transformer-impl local) -> ours, weights "
        "only (pretrain_gpt.py --load reads it whole: optimizer, position)",
    )
    c.add_argument("--load", required=True, help="Megatron-LM's --save directory, or one iter_XXXXXXX / release")
    c.add_argument("--save", type=output_dir, required=True)
    for name in TOKENIZER_FLAGS:
        b.add_argument(
            "--" + name.replace("_", "-"),
            default=None,
            help="the checkpoint's tokenizer where its recorded path is not on this machine (it must be the "
            "same tokenizer: checked against the checkpoint's record)",
        )
    args = parser.parse_args(argv)
    # torch DCP's note when it reads without a process group, which is what this tool means to do
    warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
    if importlib.util.find_spec("safetensors") is None:  # checked before any work, not after the read
        print(
            "error: tools/convert_checkpoint.py reads and writes Hugging Face safetensors, which is not "
            "installed: pip install -e '.[convert]' (or pip install safetensors)",
            file=sys.stderr,
        )
        return 2
    try:
        if args.direction == "hf-to-megatron":
            convert_hf_to_megatron(
                args.hf_dir,
                args.save,
                args.tensor_model_parallel_size,
                args.make_vocab_size_divisible_by,
                apply_layernorm_1p=args.apply_layernorm_1p,
            )
        elif args.direction == "megatron-lm-to-megatron":
            convert_megatron_lm_to_megatron(args.load, args.save)
        else:
            flags = {name: getattr(args, name) for name in TOKENIZER_FLAGS if getattr(args, name)}
            convert_megatron_to_hf(args.load, args.hf_dir, overwrite=args.overwrite, tokenizer_flags=flags)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
