"""A Hugging Face tokenizer directory that gives exactly our SentencePiece tokenizer's ids.

Invariant: for an exported model, ``AutoTokenizer.from_pretrained(export_dir)(text)["input_ids"]``
equals ``SentencePieceTokenizer.tokenize(text)`` (sentencepiece's ``encode``: no BOS, no EOS, the
special tokens' strings in the text are plain text), with or without ``add_special_tokens``.

transformers' own conversion of a ``tokenizer.model`` does not give that for our models (checked
with transformers 5.x on ``data/default/tokenizer.model``: 8 of 18 probe strings differ): its
Metaspace pre-tokenizer adds no dummy ``▁`` to text that starts with a space, it splits the
user-defined ``\\n`` piece out of the text before the dummy prefix is added, and it matches
``<s>``/``</s>``/``<pad>`` in text as special tokens. So we write the ``tokenizer.json`` ourselves:

- normalizer: ``Prepend("▁")`` (when the model adds a dummy prefix) then ``Replace(" ", "▁")``,
  sentencepiece's own ``add_dummy_prefix`` and whitespace escaping, on the whole text;
- model: BPE over the model's pieces (ids are the piece ids), one merge per pair of mergeable
  pieces whose concatenation is a mergeable piece, ranked by that piece's score (sentencepiece
  merges the best-scoring pair, the leftmost on a tie, as the BPE model does); user-defined
  pieces take part in no merge (sentencepiece never merges them); byte fallback as the model;
- no post-processor, and ``split_special_tokens`` so special tokens' strings are plain text;
- decoder: ``▁`` to space, bytes fused, the dummy prefix's space stripped.

The ``.model`` file is copied beside it as ``tokenizer.model``. A model this cannot reproduce
exactly (a Unigram model, a normalization other than ``identity``, collapsed whitespace, a
multi-character user-defined piece, unused pieces, whitespace as suffix) is named with the reason
by ``get_unsupported_reasons`` and gets the note instead.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

SPIECE = "▁"  # sentencepiece's escaped space
# ModelProto.SentencePiece.Type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
BPE_MODEL_TYPE = 2  # TrainerSpec.ModelType.BPE


def load_model_proto(model_path: str) -> Any:
    """The sentencepiece ``ModelProto`` of a ``.model`` file (sentencepiece's protobuf module)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_path, "rb") as f:
        proto.ParseFromString(f.read())
    return proto


def get_unsupported_reasons(proto: Any) -> list[str]:
    """Why a Hugging Face ``tokenizer.json`` could not give this model's ids exactly (none: it can)."""
    reasons = []
    if proto.trainer_spec.model_type != BPE_MODEL_TYPE:
        reasons.append(
            "it is not a BPE model (Hugging Face's Unigram model matches control and byte pieces such as "
            "'<s>' or '<0x41>' in the text, which sentencepiece never does)"
        )
    norm = proto.normalizer_spec
    if norm.precompiled_charsmap or norm.name not in ("identity", ""):
        reasons.append(f"its normalization {norm.name!r} is not 'identity' (not reproduced exactly)")
    if norm.remove_extra_whitespaces:
        reasons.append("it collapses runs of whitespace (remove_extra_whitespaces), which tokenizers does not mirror")
    if not norm.escape_whitespaces or proto.trainer_spec.treat_whitespace_as_suffix:
        reasons.append("it does not escape whitespace as a prefix ▁ (escape_whitespaces/treat_whitespace_as_suffix)")
    long_symbols = [p.piece for p in proto.pieces if p.type == USER_DEFINED and len(p.piece) > 1]
    if long_symbols:
        reasons.append(
            f"it has multi-character user-defined pieces ({', '.join(map(repr, long_symbols[:3]))}), which "
            f"sentencepiece matches before merging and a BPE tokenizer.json cannot"
        )
    if any(p.type == UNUSED for p in proto.pieces):
        reasons.append("it has unused pieces, which sentencepiece re-segments")
    return reasons


def get_bpe_merges(proto: Any) -> list[tuple[str, str]]:
    """Every (left, right) pair of mergeable pieces whose concatenation is a mergeable piece, best
    merged piece first (higher score, then lower id), as sentencepiece's BPE encoder ranks them."""
    mergeable = {p.piece: (i, p.score) for i, p in enumerate(proto.pieces) if p.type == NORMAL}
    merges = []
    for piece, (pid, score) in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                merges.append((-score, pid, mergeable[left][0], mergeable[right][0], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def build_tokenizer_json(proto: Any) -> str:
    """The ``tokenizer.json`` (a string) of a sentencepiece BPE model that passed
    ``get_unsupported_reasons``; needs the ``tokenizers`` package."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    unk = next((p.piece for p in proto.pieces if p.type == UNKNOWN), None)
    byte_fallback = proto.trainer_spec.byte_fallback
    # without byte fallback sentencepiece emits one unk for a run of unknown characters: fuse_unk
    model = BPE(vocab=vocab, merges=get_bpe_merges(proto), unk_token=unk, byte_fallback=byte_fallback, fuse_unk=True)
    tokenizer = Tokenizer(model)
    add_prefix = proto.normalizer_spec.add_dummy_prefix
    steps = [normalizers.Prepend(SPIECE)] if add_prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPIECE)])
    # sentencepiece decodes unk as " ⁇ " (its unk_surface)
    steps = [decoders.Replace(unk, proto.trainer_spec.unk_surface)] if unk else []
    steps += [decoders.Replace(SPIECE, " ")] + ([decoders.ByteFallback()] if byte_fallback else []) + [decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer.to_str()


def build_tokenizer_config(proto: Any, eod: int, pad: int) -> dict[str, Any]:
    """``tokenizer_config.json``: special tokens named (eos = our EOD, pad = our pad), none added
    to the text, and their strings in text left as text (``split_special_tokens``)."""
    pieces = proto.pieces
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "eos_token": pieces[eod].piece,
        "pad_token": pieces[pad].piece,
    }
    bos = proto.trainer_spec.bos_id
    if 0 <= bos < len(pieces):
        config["bos_token"] = pieces[bos].piece
    unk = proto.trainer_spec.unk_id
    if 0 <= unk < len(pieces):
        config["unk_token"] = pieces[unk].piece
    return config


def write_sentencepiece_tokenizer(model_path: str, out_dir: str, eod: int, pad: int) -> list[str]:
    """Write ``tokenizer.model``, ``tokenizer.json``, ``tokenizer_config.json`` and
    ``special_tokens_map.json`` into ``out_dir``; returns their names. The caller has checked
    ``get_unsupported_reasons`` is empty."""
    proto = load_model_proto(model_path)
    tokenizer_json = build_tokenizer_json(proto)  # first: an ImportError leaves no file behind
    shutil.copyfile(model_path, os.path.join(out_dir, "tokenizer.model"))
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json)
    config = build_tokenizer_config(proto, eod, pad)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    special = {k: v for k, v in config.items() if k.endswith("_token")}
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(special, f, indent=2, ensure_ascii=False)
    return ["tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
