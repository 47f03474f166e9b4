"""Tokenizers usable both by our tools and as megatron-core's dataset ``tokenizer``.

Invariant: ``eod`` is a real id inside ``[0, vocab_size)``, so an EOD token appended by
``tools/preprocess_data.py --append-eod`` always has an embedding row. ``pad`` is the id the
training loop pads with; it is loss-masked wherever it appears.

Two types, with Megatron-LM's ``--tokenizer-type`` names:

- ``NullTokenizer``: the text is space-separated integer ids. ``eod = vocab_size`` (the flag), so
  the model vocabulary is ``vocab_size + 1``, exactly as megatron-core's own NullTokenizer (which
  we delegate to). ``pad = eod``; megatron-core's GPTDataset notices the collision and then masks
  no pad tokens, which is what we want (it never masks real EODs).
- ``SentencePieceTokenizer`` (alias ``GPTSentencePieceTokenizer``): a sentencepiece ``.model``.
  ``eod`` is the model's eos id and ``pad`` its pad id (``tools/train_tokenizer.py`` defines both
  as distinct real tokens); a model without a pad piece pads with eod.

``identity()`` is what checkpoints store, so a resumed run can refuse a different tokenizer.
"""

import hashlib
import os
from collections import OrderedDict
from typing import Optional

from megatron_ext.config import ConfigError

NULL_TYPES = ("NullTokenizer",)
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")
TOKENIZER_TYPES = NULL_TYPES + SENTENCEPIECE_TYPES


def get_file_sha256(path: str) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class NullTokenizer:
    """Ids are the text's space-separated integers; ``eod = vocab_size`` of the flag.

    Delegates to megatron-core's ``NullTokenizer`` so the id conventions cannot drift from it.
    """

    def __init__(self, vocab_size: int):
        from megatron.core.tokenizers.text.libraries.null_tokenizer import (
            NullTokenizer as _McoreNullTokenizer,
        )

        self._impl = _McoreNullTokenizer(vocab_size)
        self.tokenizer_type = "NullTokenizer"

    @property
    def vocab_size(self) -> int:
        """Model vocabulary: the flag's vocab size plus one for EOD."""
        return self._impl.vocab_size

    @property
    def eod(self) -> int:
        return self._impl.eod

    @property
    def pad(self) -> int:
        return self._impl.eod

    @property
    def unique_identifiers(self) -> OrderedDict:
        """JSON-able description hashed into megatron-core's dataset cache names."""
        return OrderedDict(self.identity())

    def tokenize(self, text: str) -> list[int]:
        text = text.strip()
        if not text:
            return []
        try:
            ids = [int(x) for x in text.split()]
        except ValueError as exc:
            raise ConfigError([
                f"--tokenizer-type NullTokenizer expects text of space-separated integer ids, "
                f"got {text[:60]!r}; use --tokenizer-type SentencePieceTokenizer for real text"]) from exc
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ConfigError([
                f"NullTokenizer ids must lie in [0, {self.vocab_size}) (--vocab-size "
                f"{self.vocab_size - 1} plus EOD), got {bad[:5]}; raise --vocab-size"
            ])
        return ids

    def detokenize(self, ids) -> str:
        return self._impl.ids_to_text([int(i) for i in ids])

    def identity(self) -> dict:
        return {"type": self.tokenizer_type, "model_sha256": None, "vocab_size": self.vocab_size}


class SentencePieceTokenizer:
    """A sentencepiece model; ``eod`` is its eos id, ``pad`` its pad id (eod if it has none)."""

    def __init__(self, model_path: str, tokenizer_type: str = "SentencePieceTokenizer"):
        import sentencepiece

        self.model_path = model_path
        self.tokenizer_type = tokenizer_type
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
        except (RuntimeError, OSError) as err:
            raise ConfigError([f"--tokenizer-model {model_path} is not a sentencepiece model that loads "
                               f"({' '.join(str(err).split())[:200]}); pass a .model file written by "
                               f"sentencepiece or tools/train_tokenizer.py"]) from None
        self._sha256 = get_file_sha256(model_path)
        self._eod = self._sp.eos_id()
        if self._eod < 0:
            raise ConfigError([
                f"--tokenizer-model {model_path} defines no eos piece, so EOD would not be a "
                f"real token; retrain it with tools/train_tokenizer.py (it sets --eos_id)"])
        self._pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else self._eod

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def unique_identifiers(self) -> OrderedDict:
        """JSON-able description hashed into megatron-core's dataset cache names."""
        return OrderedDict(self.identity())

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def detokenize(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    def identity(self) -> dict:
        return {
            "type": self.tokenizer_type,
            "model_sha256": self._sha256,
            "vocab_size": self.vocab_size,
        }


def build_tokenizer(
    tokenizer_type: str, tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None
):
    """Build the tokenizer named by ``--tokenizer-type``.

    Raises ``ValueError`` naming the flag and the fix for an unknown type, a missing
    ``--tokenizer-model`` file or a missing/invalid ``--vocab-size``.
    """
    if tokenizer_type in NULL_TYPES:
        if vocab_size is None or int(vocab_size) <= 0:
            raise ConfigError([
                f"--tokenizer-type NullTokenizer needs a positive --vocab-size (got {vocab_size}); "
                f"the model vocabulary is then --vocab-size + 1 (EOD = --vocab-size)"])
        return NullTokenizer(int(vocab_size))
    if tokenizer_type in SENTENCEPIECE_TYPES:
        if not tokenizer_model:
            raise ConfigError([
                f"--tokenizer-type {tokenizer_type} needs --tokenizer-model PATH to a "
                f"sentencepiece .model (e.g. data/default/tokenizer.model, or train one with "
                f"tools/train_tokenizer.py)"])
        if not os.path.isfile(tokenizer_model):
            raise ConfigError([
                f"--tokenizer-model {tokenizer_model} does not exist; pass the path of a "
                f"sentencepiece .model (e.g. data/default/tokenizer.model)"])
        tokenizer = SentencePieceTokenizer(tokenizer_model, tokenizer_type)
        if vocab_size is not None and int(vocab_size) != tokenizer.vocab_size:
            raise ConfigError([
                f"--vocab-size {vocab_size} disagrees with --tokenizer-model {tokenizer_model}, "
                f"which has {tokenizer.vocab_size} pieces; drop --vocab-size for {tokenizer_type}"])
        return tokenizer
    raise ConfigError([
        f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of "
        f"{', '.join(TOKENIZER_TYPES)}"])
