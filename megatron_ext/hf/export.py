"""--save-hf: a Hugging Face Llama/Qwen2/Qwen3 directory of the model a run trains, written by the run.

Never the whole model on one rank: the ranks of data-parallel replica 0 write it. Each pipeline
stage all-gathers its own parameters over its TP group one tensor at a time, and its TP ranks share
the writing: transformer layer (or embedding, final norm, output layer) k of the stage goes to TP
rank k mod TP, which keeps only its share, maps it to HF's names (``hf/mapping.py``) and writes
``model-ppPPP-tpTTT.safetensors``. Peak memory per rank is the stage's share plus one whole tensor.

Publishing, as the checkpoints' (``checkpoint/directory.py``): the shards go to
``<save>/hf/.tmp_iter_XXXXXXX``; one all-gather of (error, {HF name: file}) tells the publishing
rank (the logging rank) whether every shard was written; it then writes
``model.safetensors.index.json``, ``config.json`` and the tokenizer's files (copied, or for a
SentencePiece model an exact equivalent, ``hf/tokenizer.py``; else a note), fsyncs every file
(each writer fsynced its shard) and the directory, and renames the directory to
``<save>/hf/iter_XXXXXXX`` (``publish_directory``, which ``tools/convert_checkpoint.py megatron-to-hf``
publishes with too). A reader never sees a partial export, nor one torn by a power loss.

An export of an iteration already exported (a resumed run) renames the earlier one to
``iter_XXXXXXX.old`` before its own rename and deletes it after: a crash between the two renames
leaves the earlier export under ``.old`` alone. The publishing rank recovers it at the next export
and before --keep-last prunes (``recover_interrupted_publish``): an ``.old`` with no complete
``iter_XXXXXXX`` is renamed back (one log line), one beside a complete export is deleted.

An export a killed run owed (started and never published, or due at its last checkpoint) is redone
by the next start that resumes from that checkpoint in --save (``find_owed_export``: the loaded
weights are the checkpoint's, so the export is the one the killed run would have written), and an
abandoned export of another iteration is named with the command that redoes it.

An export that fails to write (disk full, permissions) is a warning naming the directory and the
command that redoes it from the checkpoint, not an error: the export runs after the iteration's
torch_dist checkpoint was saved (or, under ``--async-save``, started), that checkpoint is what a resume needs and it is untouched, and
stopping a long run for a derived copy would cost more than redoing the copy offline
(``tools/convert_checkpoint.py megatron-to-hf``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.checkpoint.directory import fsync_path
from megatron_ext.config import CheckpointConfig, DataConfig, JobConfig
from megatron_ext.data.tokenizers import (
    HF_TYPES,
    SENTENCEPIECE_TYPES,
    SentencePieceTokenizer,
    build_tokenizer,
    get_tokenizer_args,
)
from megatron_ext.derived import get_ffn_hidden_size
from megatron_ext.hf.config import build_hf_config
from megatron_ext.hf.mapping import megatron_to_hf_tensors
from megatron_ext.hf.tokenizer import get_unsupported_reasons, load_model_proto, write_sentencepiece_tokenizer
from megatron_ext.model.init_weights import get_global_name, get_layer_offset
from megatron_ext.model.wrapping import unwrap_model
from megatron_ext.parallel import ParallelContext

HF_SUBDIR = "hf"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_NOTE = "TOKENIZER.txt"
# what a Hugging Face tokenizer directory holds (transformers' names)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)
# Transformer Engine fuses the norms into the following linear: our local-spec names for them
FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def get_hf_export_dir(save: str, iteration: int) -> str:
    return os.path.join(save, HF_SUBDIR, f"iter_{iteration:07d}")


def is_complete_export(path: str) -> bool:
    """A published export: its config and its index (``--save-hf``'s shards) or its one
    ``model.safetensors`` (the converter's) are written before the rename that publishes it."""
    present = {n for n in ("config.json", INDEX_FILE, SINGLE_FILE) if os.path.isfile(os.path.join(path, n))}
    return "config.json" in present and bool(present & {INDEX_FILE, SINGLE_FILE})


def recover_interrupted_publish(hf_root: str, log: Callable[[str], None]) -> list[str]:
    """Undo a crash between ``publish_directory``'s two renames (the publishing rank, before it lists
    or writes exports): an ``iter_XXXXXXX.old`` with no complete ``iter_XXXXXXX`` beside it is renamed
    back, else it is deleted. A failure is a warning (the caller's export or pruning goes on).
    Returns the recovered directories."""
    if not os.path.isdir(hf_root):
        return []
    recovered = []
    for name in sorted(os.listdir(hf_root)):
        match = re.fullmatch(r"(iter_\d{7})\.old", name)
        if match and recover_replaced_export(os.path.join(hf_root, match.group(1)), log):
            recovered.append(os.path.join(hf_root, match.group(1)))
    return recovered


def recover_replaced_export(final: str, log: Callable[[str], None], old: str | None = None) -> bool:
    """``old`` (default ``final + ".old"``: an earlier export ``publish_directory`` was replacing
    when it stopped) renamed back to ``final`` when ``final`` is not a complete export, else deleted;
    a partial ``old`` is deleted. Returns whether it was renamed back (one log line); a failure is a
    warning."""
    old = old or final + ".old"
    if not os.path.isdir(old):
        return False
    try:
        if is_complete_export(final) or not is_complete_export(old):
            shutil.rmtree(old)
            return False
        if os.path.lexists(final):  # a partial directory under the name (a delete cut short)
            shutil.rmtree(final)
        os.rename(old, final)
    except OSError as err:
        log(f"WARNING: could not recover the interrupted Hugging Face export {old}: {err}")
        return False
    log(f"recovered the Hugging Face export {final} from {old} (an export to the same directory was interrupted)")
    return True


def publish_directory(tmp: str, final: str, old: str | None = None, synced: frozenset[str] = frozenset()) -> None:
    """Make ``tmp`` (a complete export) ``final`` in one rename, replacing an earlier ``final``: its
    files (but those named in ``synced``, fsynced by their writers: not reopened, one open per rank's
    shard on a shared file system) and entries fsynced first (a power loss after the rename cannot
    leave a torn file under the final name), the earlier export renamed to ``old`` (default
    ``final + ".old"``) before and deleted after, so a crash in between leaves it whole there
    (``recover_replaced_export`` brings it back). Raises OSError; ``final`` is then the earlier
    export, or it is under ``old``."""
    for name in os.listdir(tmp):
        path = os.path.join(tmp, name)
        if name not in synced and os.path.isfile(path):
            fsync_path(path)
    fsync_path(tmp)
    old = old or final + ".old"
    if os.path.lexists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_path(os.path.dirname(os.path.abspath(final)))
    shutil.rmtree(old, ignore_errors=True)


def should_export_hf(c: CheckpointConfig, iteration: int, last: bool) -> bool:
    """At a save: the run's last one (--train-iters reached or an agreed exit), or every
    --save-hf-interval iterations."""
    if not c.save_hf:
        return False
    return last or bool(c.save_hf_interval) and iteration % c.save_hf_interval == 0


def find_owed_export(c: CheckpointConfig, iteration: int, train_iters: int) -> str | None:
    """Why the export of checkpoint ``iteration`` of --save (the one a run resumed from) is owed, or
    None: it is not published (``<save>/hf/iter_XXXXXXX`` is no complete export) and either an export
    of it was started (its ``.tmp_iter_XXXXXXX`` is left: the run was killed during it) or --save-hf
    was due there (``should_export_hf``; killed between the save and the export). Call it after
    ``recover_interrupted_publish``, on one rank (the export it asks for is collective)."""
    if not c.save_hf or is_complete_export(get_hf_export_dir(c.save, iteration)):
        return None
    if os.path.isdir(os.path.join(c.save, HF_SUBDIR, f".tmp_iter_{iteration:07d}")):
        return "an export of it was started and never published (the run stopped during it)"
    if should_export_hf(c, iteration, last=iteration >= train_iters):
        return "--save-hf was due there and no export was published (the run stopped before it)"
    return None


def describe_abandoned_exports(save: str, but: int | None = None) -> list[str]:
    """A warning for each export started under ``<save>/hf`` and never published (a leftover
    ``.tmp_iter_XXXXXXX``) other than iteration ``but``'s, with the command that redoes it."""
    root = os.path.join(save, HF_SUBDIR)
    found = sorted(
        int(m.group(1))
        for m in map(re.compile(r"\.tmp_iter_(\d{7})$").match, os.listdir(root) if os.path.isdir(root) else [])
        if m
    )
    return [
        f"WARNING: the Hugging Face export of iteration {it} was never published ({get_hf_export_dir(save, it)} is "
        f"missing; an interrupted run left {os.path.join(root, f'.tmp_iter_{it:07d}')}): redo it with python "
        f"tools/convert_checkpoint.py megatron-to-hf --load {os.path.join(save, f'iter_{it:07d}')} --hf-dir DIR"
        for it in found
        if it != but and not is_complete_export(get_hf_export_dir(save, it))
    ]


def join_tp_shards(shards: list[torch.Tensor], partition_dim: int, gated: bool) -> torch.Tensor:
    """The whole tensor from its TP shards (inverse of ``init_weights.slice_for_tp``): a gated
    MLP's ``linear_fc1`` shard is [gate shard; up shard], so halves are joined separately."""
    if not gated:
        return torch.cat(shards, dim=partition_dim)
    halves = [s.chunk(2, dim=partition_dim) for s in shards]
    return torch.cat([torch.cat([h[j] for h in halves], dim=partition_dim) for j in (0, 1)], dim=partition_dim)


def get_unit(name: str) -> str:
    """What one TP rank writes whole: a transformer layer (``decoder.layers.<i>``) or a tensor."""
    return ".".join(name.split(".")[:3]) if name.startswith("decoder.layers.") else name


def _list_stage_params(chunks: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Parameter]]:
    """(our single-process name, parameter) of every parameter of this stage's chunks, in the same
    order on every TP rank of the stage; a tied output layer (a copy of the embedding) left out."""
    out = []
    for chunk in map(unwrap_model, chunks):
        offset = get_layer_offset(chunk)
        tied = getattr(chunk, "share_embeddings_and_output_weights", False)
        for local_name, param in chunk.named_parameters():
            name = get_global_name(local_name, offset)
            if tied and name == "output_layer.weight":
                continue
            for fused, plain in FUSED_NORMS.items():
                if name.endswith(fused):
                    name = name[: -len(fused)] + plain
            out.append((name, param))
    return out


def gather_stage_share(chunks: list[torch.nn.Module], ctx: ParallelContext, gated: bool) -> dict[str, torch.Tensor]:
    """{our name: whole tensor on the CPU} of the units of this stage that this TP rank writes
    (collective over the TP group: one all-gather per TP-split tensor)."""
    params = _list_stage_params(chunks)
    units = list(dict.fromkeys(get_unit(name) for name, _ in params))
    mine = {u for k, u in enumerate(units) if k % ctx.tp_size == ctx.tp_rank}
    share = {}
    for name, param in params:
        tensor = param.detach()
        if ctx.tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(tensor) for _ in range(ctx.tp_size)]
            dist.all_gather(shards, tensor.contiguous(), group=ctx.tp_group)
            tensor = join_tp_shards(shards, param.partition_dim, gated and "linear_fc1" in name)
        if get_unit(name) in mine:
            share[name] = tensor.cpu().clone()
    return share


def build_index(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """``model.safetensors.index.json`` from every writer's {file, weight_map, bytes}."""
    weight_map = {}
    for shard in shards:
        weight_map.update(shard["weight_map"])
    total = sum(shard["bytes"] for shard in shards)
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def write_tokenizer_files(d: DataConfig, out_dir: str, unusable: str | None = None) -> str:
    """Copy the tokenizer files of ``d`` (the run's tokenizer flags) when it is a local Hugging Face
    directory, write the files of an exact Hugging Face equivalent of its SentencePiece model
    (``hf/tokenizer.py``), or write a note saying what tokenizer the token ids are of and why no
    files (``unusable``, a sentence, when the caller found the files at those paths are not the
    model's tokenizer: then no file is copied or converted); returns what was done, for the log."""
    if d.tokenizer_type in HF_TYPES and d.tokenizer_model and os.path.isdir(d.tokenizer_model) and not unusable:
        copied = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(d.tokenizer_model, n))]
        for name in copied:
            shutil.copyfile(os.path.join(d.tokenizer_model, name), os.path.join(out_dir, name))
        if copied:
            return f"tokenizer files {', '.join(copied)} copied from {d.tokenizer_model}"
    why = f" ({unusable})" if unusable else ""
    if d.tokenizer_type in SENTENCEPIECE_TYPES and not unusable:
        written, why = _maybe_write_sentencepiece(d.tokenizer_model, d.tokenizer_type, out_dir)
        if written:
            return f"tokenizer files {', '.join(written)} written for {d.tokenizer_model} (the same ids)"
    return _write_tokenizer_note(d, out_dir, _describe_reader(d), why)


def _describe_reader(d: DataConfig) -> str:
    """How a user of the export gets the ids of the tokenizer ``d`` names, for the note."""
    if d.tokenizer_type in HF_TYPES and d.tokenizer_model:
        return f"AutoTokenizer.from_pretrained({d.tokenizer_model!r})"
    if d.tokenizer_type in SENTENCEPIECE_TYPES:
        return f"sentencepiece.SentencePieceProcessor(model_file={d.tokenizer_model!r}).encode(text) (no BOS/EOS)"
    return "a tokenizer producing the same ids"


def _write_tokenizer_note(d: DataConfig, out_dir: str, how: str, why: str) -> str:
    note = (
        f"No Hugging Face tokenizer files were written: this model was trained with --tokenizer-type "
        f"{d.tokenizer_type} (--tokenizer-model {d.tokenizer_model}). Its token ids are that tokenizer's; "
        f"use {how}.{why}\n"
    )
    with open(os.path.join(out_dir, TOKENIZER_NOTE), "w") as f:
        f.write(note)
    return f"no tokenizer files ({TOKENIZER_NOTE} says which tokenizer the ids are of)"


def _maybe_write_sentencepiece(model_path: str | None, tokenizer_type: str, out_dir: str) -> tuple[list[str], str]:
    """The files written for a SentencePiece run's model, or none and the note's sentence saying why."""
    if not model_path or not os.path.isfile(model_path):
        return [], f" (The file {model_path} was not found when the export was written.)"
    try:
        proto = load_model_proto(model_path)
        reasons = get_unsupported_reasons(proto)
        if reasons:
            return [], f" (A Hugging Face tokenizer would not give exactly these ids: {'; '.join(reasons)}.)"
        tokenizer = SentencePieceTokenizer(model_path, tokenizer_type)
        return write_sentencepiece_tokenizer(model_path, out_dir, tokenizer.eod, tokenizer.pad), ""
    except ImportError as err:  # protobuf (sentencepiece's model format) or tokenizers missing
        return [], f" (No tokenizer.json: {err}; pip install tokenizers protobuf, then export again.)"


def get_special_token_ids(d: DataConfig) -> dict[str, int | None]:
    """``get_tokenizer_special_ids`` of the tokenizer ``d`` (the run's tokenizer flags) names; {} when
    it cannot be built here (a file gone since training: the note says which tokenizer)."""
    try:
        tokenizer = build_tokenizer(**get_tokenizer_args(d))
    except Exception:  # noqa: BLE001 - a file gone since training: the export goes on without the ids
        return {}
    return get_tokenizer_special_ids(tokenizer)


def get_tokenizer_special_ids(tokenizer: Any) -> dict[str, int | None]:
    """``config.json``'s ``eos_token_id`` (our EOD, which ends each document), ``pad_token_id`` (our
    pad, where it is a token of its own: transformers' Llama makes ``pad_token_id`` its embedding's
    ``padding_idx``, whose row fine-tuning then never updates, so a pad that is the EOD is left out)
    and ``bos_token_id``. Without them transformers assumes Llama's eos 2 and bos 1: ``generate``
    would not stop at a GPT-2 vocabulary's EOD, and with no prompt it would start from token 1
    (GPT-2's '"'). Our data never holds a BOS (tokenize adds none), but a SentencePiece model,
    a Hugging Face tokenizer or tiktoken's specials define one, which the exported tokenizer
    names too: that id. NullTokenizer and GPT2BPETokenizer have none: ``None`` (null), so an
    unprompted ``generate`` is an error naming bos_token_id rather than text after a wrong token."""
    eod, pad = int(tokenizer.eod), int(tokenizer.pad)
    bos = getattr(tokenizer, "bos", None)  # sentencepiece says -1 for none, Hugging Face None
    bos = int(bos) if bos is not None and int(bos) >= 0 else None
    return {"eos_token_id": eod, "bos_token_id": bos, **({"pad_token_id": pad} if pad != eod else {})}


def export_hf_model(
    chunks: list[torch.nn.Module],
    ctx: ParallelContext,
    cfg: JobConfig,
    tokenizer_identity: dict[str, Any],
    padded_vocab_size: int,
    iteration: int,
    log: Callable[[str], None] = print,
) -> str | None:
    """Write the model ``chunks`` (this rank's, in megatron-core's wrappers) as an HF directory
    ``<save>/hf/iter_XXXXXXX``; collective over the world. Returns the directory on the publishing
    rank when it was published, else None (a failure is logged there as a warning)."""
    started = time.perf_counter()
    args = cfg.to_flat_dict()
    vocab = tokenizer_identity.get("vocab_size") or padded_vocab_size
    hf = build_hf_config(args, vocab, get_ffn_hidden_size(cfg.model))
    if ctx.is_logging_rank:  # the publishing rank writes config.json
        hf.update(get_special_token_ids(cfg.data))
    save = cfg.checkpoint.save
    final = get_hf_export_dir(save, iteration)
    tmp = os.path.join(save, HF_SUBDIR, f".tmp_iter_{iteration:07d}")
    error = None
    if ctx.is_logging_rank:
        recover_interrupted_publish(os.path.join(save, HF_SUBDIR), log)
        try:
            for stale in glob.glob(os.path.join(save, HF_SUBDIR, ".tmp_iter_*")):  # crashed exports' leftovers
                shutil.rmtree(stale, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as err:
            error = f"{tmp}: {err}"
    dist.barrier()
    shard = {"weight_map": {}, "bytes": 0}
    if ctx.dp_rank == 0:
        share = gather_stage_share(chunks, ctx, gated=cfg.model.swiglu)
        tensors = megatron_to_hf_tensors(share, hf, zero_centered_gamma=cfg.model.apply_layernorm_1p)
        if tensors and error is None:
            error = _write_shard(tensors, tmp, f"model-pp{ctx.pp_rank:03d}-tp{ctx.tp_rank:03d}.safetensors", shard)
    reports = [None] * ctx.world_size
    dist.all_gather_object(reports, (error, shard))
    if not ctx.is_logging_rank:
        return None
    errors = [e for e, _ in reports if e]
    if not errors:
        errors = _publish(hf, cfg, [s for _, s in reports], tmp, final, log, started)
    if errors:
        shutil.rmtree(tmp, ignore_errors=True)
        log(
            f"WARNING: the Hugging Face export of iteration {iteration} to {final} failed ({'; '.join(errors)}); "
            f"the checkpoint of iteration {iteration} is unaffected: redo the export with "
            f"python tools/convert_checkpoint.py megatron-to-hf --load {save} --hf-dir DIR"
        )
        return None
    return final


def _write_shard(tensors: dict[str, torch.Tensor], tmp: str, name: str, shard: dict[str, Any]) -> str | None:
    """Write one safetensors shard; fills ``shard`` ({weight_map, bytes}), returns an error or None."""
    from safetensors import SafetensorError  # an optional dependency, checked by validation
    from safetensors.torch import save_file

    try:
        save_file(tensors, os.path.join(tmp, name), metadata={"format": "pt"})
        fsync_path(os.path.join(tmp, name))  # durable before the publishing rank's rename
    except (OSError, SafetensorError) as err:  # disk full, permissions: safetensors raises its own error
        return f"{os.path.join(tmp, name)}: {err}"
    shard["weight_map"] = {k: name for k in tensors}
    shard["bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    return None


def _publish(
    hf: dict[str, Any],
    cfg: JobConfig,
    shards: list[dict[str, Any]],
    tmp: str,
    final: str,
    log: Callable[[str], None],
    started: float,
) -> list[str]:
    """Index, config and tokenizer into ``tmp``, then ``tmp`` renamed to ``final`` (an earlier
    export of the same iteration replaced); returns the errors (none when published). The log line
    gives the seconds since ``started`` (``time.perf_counter()`` at the export's start)."""
    index = build_index(shards)
    try:
        with open(os.path.join(tmp, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
        tokenizer = write_tokenizer_files(cfg.data, tmp)
        for name in os.listdir(tmp):  # safetensors creates its files 0600: readable as config.json is
            os.chmod(os.path.join(tmp, name), 0o644)
        publish_directory(tmp, final, synced=frozenset(index["weight_map"].values()))  # the writers fsynced the shards
    except OSError as err:
        return [str(err)]
    files = sorted(set(index["weight_map"].values()))
    log(
        f"exported a Hugging Face {hf['architectures'][0]} to {final} in {time.perf_counter() - started:.2f} s: {len(index['weight_map'])} tensors in "
        f"{len(files)} safetensors shards, {index['metadata']['total_size'] / 2**20:.1f} MiB; {tokenizer}"
    )
    return []
