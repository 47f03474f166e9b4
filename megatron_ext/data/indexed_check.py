"""A start-up check of megatron-core indexed datasets (``PREFIX.bin`` / ``PREFIX.idx``), O(1) per file.

Invariant: a prefix that passes has an index with megatron-core's header, a known token dtype, the
size its counts imply, and a ``.bin`` exactly as long as the index says (the last sequence's
pointer plus its length); so a truncated or mismatched pair is named at start-up instead of failing
with a numpy error at some later step (or never, inside an unused split). Reads 34 bytes of the
header and two numbers of the index; pure otherwise (no numpy arrays of the whole index).
"""

from __future__ import annotations

import os
import struct

INDEX_HEADER = b"MMIDIDX\x00\x00"  # megatron-core indexed_dataset._INDEX_HEADER
ITEM_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # megatron-core DType code -> bytes
_HEAD = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # header, version, dtype code, sequence and document counts


def check_indexed_dataset(prefix: str) -> list[str]:
    """Problems of one ``--data-path`` prefix, each naming the file and what is wrong."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    fix = "rebuild it with tools/preprocess_data.py (or copy the pair again)"
    try:
        idx_size, bin_size = os.path.getsize(idx), os.path.getsize(bin_)
        with open(idx, "rb") as f:
            head = f.read(_HEAD)
            if len(head) < _HEAD or head[: len(INDEX_HEADER)] != INDEX_HEADER:
                return [f"{idx} is not a megatron-core index (bad or short header): {fix}"]
            version, code, sequences, documents = struct.unpack("<QBQQ", head[len(INDEX_HEADER) :])
            if version != 1 or code not in ITEM_SIZES:
                return [f"{idx}: unknown index version {version} or token dtype code {code}: {fix}"]
            expected_idx = _HEAD + 4 * sequences + 8 * sequences + 8 * documents
            if idx_size < expected_idx:  # (a trailing mode array may follow: never shorter)
                return [
                    f"{idx} has {idx_size} bytes, its counts ({sequences} sequences, {documents} "
                    f"documents) need {expected_idx}: the file is truncated; {fix}"
                ]
            if sequences == 0:
                if bin_size:
                    return [f"{idx} holds no sequence but {bin_} has {bin_size} bytes: {fix}"]
                return [
                    f"{prefix} has no documents (no text became tokens; megatron-core cannot even map an "
                    f"empty .bin): leave it out"
                ]
            f.seek(_HEAD + 4 * (sequences - 1))
            (last_length,) = struct.unpack("<i", f.read(4))
            f.seek(_HEAD + 4 * sequences + 8 * (sequences - 1))
            (last_pointer,) = struct.unpack("<q", f.read(8))
    except OSError as err:
        return [f"{prefix}: cannot read the .bin/.idx pair ({err.strerror}: {err.filename})"]
    expected_bin = last_pointer + last_length * ITEM_SIZES[code]
    if bin_size != expected_bin:
        how = "truncated" if bin_size < expected_bin else "longer than its index describes"
        return [
            f"{bin_} has {bin_size} bytes but {idx} describes {expected_bin}: the .bin is {how} or the "
            f"pair does not belong together; {fix}"
        ]
    return []


# ``PREFIX.tokenizer.json``, beside the pair: the tokenizer tools/preprocess_data.py wrote it with.
# Megatron-LM's format records none, so ids made by one tokenizer train silently under another (in
# range, or with NullTokenizer's EOD = --vocab-size another id); a pair without a record (made by
# Megatron-LM's tool) is not checked.
TOKENIZER_RECORD_SUFFIX = ".tokenizer.json"


def build_tokenizer_record(identity: dict, tokenizer_model: str | None, json_key: str, append_eod: bool) -> dict:
    """What ``PREFIX.tokenizer.json`` holds: the tokenizer's identity (type, sha256 of its files,
    vocabulary size; as checkpoints record it), where its files were, and how the text was read."""
    return {
        "tokenizer": dict(identity),
        "tokenizer_model": tokenizer_model,
        "json_key": json_key,
        "append_eod": append_eod,
        "written_by": "tools/preprocess_data.py",
    }


def _describe_tokenizer(identity: dict, model: str | None = None) -> str:
    text = f"{identity.get('type')} (vocabulary {identity.get('vocab_size')}"
    if identity.get("model_sha256"):
        text += f", files sha256 {str(identity['model_sha256'])[:12]}"
    return text + (f", from {model})" if model else ")")


def same_tokenizer(saved: dict, identity: dict) -> bool:
    """Whether ids made by ``saved`` mean the same under ``identity``: the same tokenizer files and
    vocabulary (a type that reads the same files the same way may differ, e.g. Llama2Tokenizer and
    SentencePieceTokenizer); without files (NullTokenizer), the same type and vocabulary."""
    if saved.get("vocab_size") != identity.get("vocab_size"):
        return False
    if saved.get("model_sha256") or identity.get("model_sha256"):
        return saved.get("model_sha256") == identity.get("model_sha256")
    return saved.get("type") == identity.get("type")


def check_tokenizer_record(prefix: str, identity: dict) -> list[str]:
    """A problem if ``PREFIX.tokenizer.json`` names another tokenizer than ``identity`` (this run's),
    or cannot be read; nothing without a record."""
    import json

    path = prefix + TOKENIZER_RECORD_SUFFIX
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        saved = dict(record["tokenizer"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [
            f"{path} (the tokenizer the pair was made with) cannot be read ({type(err).__name__}: {err}): "
            f"delete it to train unchecked, or preprocess the data again"
        ]
    if same_tokenizer(saved, identity):
        return []
    return [
        f"{prefix} was tokenized with {_describe_tokenizer(saved, record.get('tokenizer_model'))} (recorded in "
        f"{path}), but this run's tokenizer is {_describe_tokenizer(identity)}: its ids would mean other "
        f"tokens; give the tokenizer it was made with (--tokenizer-type/--tokenizer-model/--vocab-size) or "
        f"preprocess it again with this one"
    ]
