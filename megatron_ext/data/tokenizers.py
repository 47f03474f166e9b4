"""Tokenizers usable both by our tools and as megatron-core's dataset ``tokenizer``.

Invariant: ``eod`` is a real id inside ``[0, vocab_size)``, so an EOD token appended by
``tools/preprocess_data.py --append-eod`` always has an embedding row. ``pad`` is the id the
training loop pads with; it is loss-masked wherever it appears.

The types, with Megatron-LM's ``--tokenizer-type`` names:

- ``NullTokenizer``: the text is space-separated integer ids. ``eod = vocab_size`` (the flag), so
  the model vocabulary is ``vocab_size + 1``, exactly as megatron-core's own NullTokenizer (which
  we delegate to). ``pad = eod``; megatron-core's GPTDataset notices the collision and then masks
  no pad tokens, which is what we want (it never masks real EODs).
- ``SentencePieceTokenizer`` (alias ``GPTSentencePieceTokenizer``): a sentencepiece ``.model``.
  ``eod`` is the model's eos id and ``pad`` its pad id (``tools/train_tokenizer.py`` defines both
  as distinct real tokens); a model without a pad piece pads with eod.

- ``HuggingFaceTokenizer``: a local Hugging Face tokenizer directory (Llama-3, Qwen, GPT-2, ...),
  through megatron-core's ``HuggingFaceTokenizer`` library (its ids: ``text_to_ids``, no special
  tokens added, as Megatron-LM's preprocessing writes them). ``eod`` is the tokenizer's eos token
  (an error when it has none), ``pad`` its pad token or eod. Nothing is downloaded: the path must
  exist (hub ids are refused) and the load runs with the hub offline. A bare ``tokenizer.json`` is
  refused (it names no eos token): pass its directory with ``tokenizer_config.json``.
- ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``--vocab-file`` (vocab.json) and
  ``--merge-file`` (merges.txt), built with the ``tokenizers`` library (megatron-core 0.16.1's
  path for this type ignores the merge file and fetches "gpt2" from the hub); ``eod`` =
  ``<|endoftext|>``, which the vocabulary must hold; ``pad`` = eod.
- ``TikTokenizer``: Megatron's tiktoken vocabulary (a ``.json`` list of ``{rank, token_bytes,
  token_str}``) through megatron-core's ``TikTokenTokenizer`` (needs the ``tiktoken`` package):
  ``--tiktoken-num-special-tokens`` ids (default 1000) come first, then the ranks; ``--vocab-size`` is
  the whole vocabulary (default 2**17). ``eod`` is ``</s>`` (id 2 with the default special tokens),
  ``pad`` is ``<pad>`` (id 4).
- ``Llama2Tokenizer``: Megatron-LM core_v0.16.1's, a sentencepiece model (Llama-2's
  ``tokenizer.model``): the vocabulary is its piece count, ``eod`` its eos, ``pad`` = eod (its
  legacy class defines no pad; Llama-2's model has none). ``tokenize`` is sentencepiece's
  ``encode``, as megatron-core's tokenizer (Megatron-LM's default system, its ``preprocess_data.py``
  included) reads this type; its legacy class (``--legacy-tokenizer``) puts BOS first, which
  ``tools/preprocess_data.py --legacy-tokenizer`` reproduces (``bos``).
- Megatron-LM main's ``Llama3Tokenizer`` is refused with the type to use instead.

The flag checks and the type names: ``tokenizer_flags.py``. How these differ from Megatron-LM's
(the specials its legacy SentencePieceTokenizer adds): docs/running.md, "Coming from Megatron-LM".

``identity()`` is what checkpoints store, so a resumed run can refuse a different tokenizer.
"""

import contextlib
import hashlib
import os
from collections import OrderedDict
from typing import Any

from megatron_ext.config import ConfigError
from megatron_ext.data.tokenizer_flags import (
    HF_TYPES,
    LLAMA2_TYPES,
    NULL_TYPES,
    SENTENCEPIECE_TYPES,
    TIKTOKEN_TYPES,
    check_tokenizer_flags,
)

# megatron-core's TikTokenTokenizer defaults (its module's constants, repeated for the checks)
TIKTOKEN_DEFAULT_VOCAB_SIZE = 2**17
TIKTOKEN_REQUIRED_SPECIAL = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
# files of a tokenizer directory that define its ids (hashed into the identity; never weights)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "vocab.txt",
)
GPT2_EOD = "<|endoftext|>"


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
            raise ConfigError(
                [
                    f"--tokenizer-type NullTokenizer expects text of space-separated integer ids, "
                    f"got {text[:60]!r}; use --tokenizer-type SentencePieceTokenizer for real text"
                ]
            ) from exc
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ConfigError(
                [
                    f"NullTokenizer ids must lie in [0, {self.vocab_size}) (--vocab-size "
                    f"{self.vocab_size - 1} plus EOD), got {bad[:5]}; raise --vocab-size"
                ]
            )
        return ids

    def detokenize(self, ids) -> str:
        return self._impl.ids_to_text([int(i) for i in ids])

    def identity(self) -> dict:
        return {"type": self.tokenizer_type, "model_sha256": None, "vocab_size": self.vocab_size}


class _TokenizerFiles:
    """What the file-backed tokenizers share: EOD and pad ids, and an identity (type, a hash of
    the tokenizer files, vocabulary size) that a checkpoint records and a resume compares."""

    tokenizer_type: str
    _eod: int
    _pad: int
    _sha256: str

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def unique_identifiers(self) -> OrderedDict:
        """JSON-able description hashed into megatron-core's dataset cache names."""
        return OrderedDict(self.identity())

    def identity(self) -> dict:
        return {"type": self.tokenizer_type, "model_sha256": self._sha256, "vocab_size": self.vocab_size}


class _DecodedWhole(_TokenizerFiles):
    """A megatron-core tokenizer (``self._impl``) whose library decodes a list of ids at once: the
    bytes of all ids together (megatron-core's ``ids_to_text`` for tiktoken decodes each token
    alone, which garbles a character whose bytes span two tokens)."""

    _impl: Any

    @property
    def vocab_size(self) -> int:
        return int(self._impl.vocab_size)

    @property
    def bos(self) -> int | None:
        """The library's BOS id (None when the tokenizer defines none); our data never holds it."""
        bos = self._impl.bos_id
        return None if bos is None else int(bos)

    def tokenize(self, text: str) -> list[int]:
        return [int(i) for i in self._impl.text_to_ids(text)]

    def detokenize(self, ids) -> str:
        return self._impl.tokenizer.decode([int(i) for i in ids])


class SentencePieceTokenizer(_TokenizerFiles):
    """A sentencepiece model; ``eod`` is its eos id, ``pad`` its pad id (eod if it has none)."""

    def __init__(self, model_path: str, tokenizer_type: str = "SentencePieceTokenizer"):
        import sentencepiece

        self.model_path = model_path
        self.tokenizer_type = tokenizer_type
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
        except (RuntimeError, OSError) as err:
            raise ConfigError(
                [
                    f"--tokenizer-model {model_path} is not a sentencepiece model that loads "
                    f"({' '.join(str(err).split())[:200]}); pass a .model file written by "
                    f"sentencepiece or tools/train_tokenizer.py"
                ]
            ) from None
        self._sha256 = get_file_sha256(model_path)
        self._eod = self._sp.eos_id()
        if self._eod < 0:
            raise ConfigError(
                [
                    f"--tokenizer-model {model_path} defines no eos piece, so EOD would not be a "
                    f"real token; retrain it with tools/train_tokenizer.py (it sets --eos_id)"
                ]
            )
        self._pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else self._eod

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def detokenize(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron-LM core_v0.16.1's ``Llama2Tokenizer``: a sentencepiece model whose vocabulary is its
    piece count, ``eod`` its eos and ``pad`` = eod. ``tokenize`` is sentencepiece's ``encode`` (no
    BOS), as megatron-core's tokenizer reads the type; ``bos`` is what Megatron-LM's legacy class
    puts first (``tools/preprocess_data.py --legacy-tokenizer``)."""

    def __init__(self, model_path: str):
        super().__init__(model_path, "Llama2Tokenizer")
        self._pad = self._eod  # Megatron-LM's class has no pad id (its .pad raises); Llama-2's model has none


def get_files_sha256(paths: list[str]) -> str:
    """One sha256 over files' names and bytes, in the given order."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(os.path.basename(path).encode() + b"\0" + get_file_sha256(path).encode())
    return digest.hexdigest()


@contextlib.contextmanager
def _hub_offline():
    """Hugging Face loads with the hub switched off: a local path never becomes a download."""
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class HuggingFaceTokenizer(_DecodedWhole):
    """A local Hugging Face tokenizer directory through megatron-core's library."""

    def __init__(self, path: str):
        try:
            from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer as _Impl
        except ImportError as err:
            raise ConfigError(
                [
                    f"--tokenizer-type HuggingFaceTokenizer needs the transformers package ({err}); "
                    f"pip install transformers"
                ]
            ) from None
        self.tokenizer_type, self.model_path = "HuggingFaceTokenizer", path
        try:
            with _hub_offline():
                self._impl = _Impl(path)
        except (ValueError, OSError) as err:
            raise ConfigError(
                [
                    f"--tokenizer-model {path}: not a Hugging Face tokenizer directory that loads "
                    f"offline ({' '.join(str(err).split())[:300]})"
                ]
            ) from None
        if self._impl.eod is None:
            raise ConfigError(
                [
                    f"--tokenizer-model {path}: the tokenizer defines no eos token, so documents could "
                    f'not be ended with EOD; set "eos_token" in its tokenizer_config.json'
                ]
            )
        self._eod = int(self._impl.eod)
        pad = self._impl.tokenizer.pad_token_id
        self._pad = int(pad) if pad is not None else self._eod
        self._files = sorted(os.path.join(path, f) for f in os.listdir(path) if f in TOKENIZER_FILES)
        self._sha256 = get_files_sha256(self._files)


class GPT2BPETokenizer(_TokenizerFiles):
    """GPT-2's byte-level BPE from vocab.json and merges.txt (the ``tokenizers`` library)."""

    def __init__(self, vocab_file: str, merge_file: str):
        try:
            from tokenizers import ByteLevelBPETokenizer
        except ImportError as err:
            raise ConfigError(
                [f"--tokenizer-type GPT2BPETokenizer needs the tokenizers package ({err}); pip install tokenizers"]
            ) from None
        self.tokenizer_type = "GPT2BPETokenizer"
        try:
            self._impl = ByteLevelBPETokenizer(vocab_file, merge_file, add_prefix_space=False)
        except Exception as err:  # noqa: BLE001 - the Rust library raises its own exception type
            raise ConfigError(
                [
                    f"--vocab-file {vocab_file} / --merge-file {merge_file}: not a GPT-2 BPE vocabulary "
                    f"and merge list ({' '.join(str(err).split())[:200]})"
                ]
            ) from None
        eod = self._impl.token_to_id(GPT2_EOD)
        if eod is None:
            raise ConfigError([f"--vocab-file {vocab_file} has no {GPT2_EOD} token, GPT-2's EOD"])
        self._eod = self._pad = int(eod)  # GPT-2 has no pad token: pad with EOD (labels ignored)
        self._sha256 = get_files_sha256([vocab_file, merge_file])

    @property
    def vocab_size(self) -> int:
        return int(self._impl.get_vocab_size())

    def tokenize(self, text: str) -> list[int]:
        return list(self._impl.encode(text).ids)

    def detokenize(self, ids) -> str:
        return self._impl.decode([int(i) for i in ids])


class TikTokenizer(_DecodedWhole):
    """Megatron's tiktoken vocabulary (.json) through megatron-core's ``TikTokenTokenizer``.

    Ids: the special tokens first (``num_special_tokens`` of them: the named ones, then
    ``<SPECIAL_i>`` fillers), then the vocabulary's ranks shifted by ``num_special_tokens``, up to
    ``vocab_size``. ``eod`` is ``</s>``, ``pad`` is ``<pad>``.
    """

    def __init__(
        self,
        path: str,
        vocab_size: int | None = None,
        pattern: str | None = None,
        num_special_tokens: int = 1000,
        special_tokens: list[str] | None = None,
    ):
        try:
            import tiktoken  # noqa: F401 - megatron-core's module swallows the ImportError
            from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer as _Impl
        except ImportError as err:
            raise ConfigError(
                [f"--tokenizer-type TikTokenizer needs the tiktoken package ({err}); pip install tiktoken"]
            ) from None
        self.tokenizer_type, self.model_path = "TikTokenizer", path
        vocab_size = int(vocab_size or TIKTOKEN_DEFAULT_VOCAB_SIZE)
        problems = _check_tiktoken_vocabulary(path, vocab_size, num_special_tokens, special_tokens)
        if problems:
            raise ConfigError(problems)
        kwargs = dict(num_special_tokens=num_special_tokens, vocab_size=vocab_size, pattern=pattern or "v2")
        if special_tokens:
            kwargs["special_tokens"] = list(special_tokens)
        self._impl = _Impl(path, **kwargs)
        self._eod, self._pad = int(self._impl.eos_id), int(self._impl.pad_id)
        # the ids depend on the file and on the options: all of them go into the identity
        digest = hashlib.sha256(get_file_sha256(path).encode())
        digest.update(repr((kwargs["pattern"], num_special_tokens, self._impl.special_tokens[:16])).encode())
        self._sha256 = digest.hexdigest()


def _check_tiktoken_vocabulary(
    path: str, vocab_size: int, num_special_tokens: int, special_tokens: list[str] | None
) -> list[str]:
    """What megatron-core's TikTokenTokenizer would assert on, as errors naming the flags."""
    import json

    names = list(special_tokens) if special_tokens else list(TIKTOKEN_REQUIRED_SPECIAL)
    out = []
    missing = [t for t in TIKTOKEN_REQUIRED_SPECIAL if t not in names]
    if missing or len(set(names)) != len(names):
        out.append(
            f"--tiktoken-special-tokens must name each token once and include {' '.join(TIKTOKEN_REQUIRED_SPECIAL)}"
            f" (missing: {' '.join(missing) or 'none'})"
        )
    if not len(names) <= num_special_tokens < vocab_size:
        out.append(
            f"--tiktoken-num-special-tokens {num_special_tokens} must be at least the {len(names)} special tokens "
            f"and below --vocab-size {vocab_size}"
        )
        return out
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
        ok = isinstance(vocab, list) and all(
            isinstance(x, dict) and x.keys() == {"rank", "token_bytes", "token_str"} and x["rank"] == i
            for i, x in enumerate(vocab)
        )
    except (OSError, ValueError) as err:
        vocab, ok = [], False
        out.append(f"--tokenizer-model {path}: not a readable JSON file ({' '.join(str(err).split())[:200]})")
    if not ok and not out:
        out.append(
            f"--tokenizer-model {path}: not Megatron's tiktoken vocabulary (a JSON list of "
            f'{{"rank": i, "token_bytes": base64, "token_str": ...}} in rank order)'
        )
    elif ok and len(vocab) < vocab_size - num_special_tokens:
        out.append(
            f"--vocab-size {vocab_size} needs {vocab_size - num_special_tokens} ranks after the "
            f"{num_special_tokens} special ids (--tiktoken-num-special-tokens), but --tokenizer-model {path} "
            f"has {len(vocab)}: give --vocab-size {len(vocab) + num_special_tokens} or less"
        )
    return out


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = 1000,
    tiktoken_special_tokens: list[str] | None = None,
):
    """Build the tokenizer named by ``--tokenizer-type``.

    Raises ConfigError naming the flag and the fix for an unknown type, a missing
    ``--tokenizer-model`` file or a missing/invalid ``--vocab-size``.
    """
    problems = check_tokenizer_flags(tokenizer_type, tokenizer_model, vocab_size, vocab_file, merge_file)
    if problems:
        raise ConfigError(problems)
    if tokenizer_type in NULL_TYPES:
        return NullTokenizer(int(vocab_size))
    if tokenizer_type in TIKTOKEN_TYPES:  # --vocab-size is this tokenizer's own size
        return TikTokenizer(
            tokenizer_model, vocab_size, tiktoken_pattern, tiktoken_num_special_tokens, tiktoken_special_tokens
        )
    if tokenizer_type in SENTENCEPIECE_TYPES:
        tokenizer = SentencePieceTokenizer(tokenizer_model, tokenizer_type)
    elif tokenizer_type in LLAMA2_TYPES:
        tokenizer = Llama2Tokenizer(tokenizer_model)
    elif tokenizer_type in HF_TYPES:
        tokenizer = HuggingFaceTokenizer(tokenizer_model)
    else:
        tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    if vocab_size is not None and int(vocab_size) != tokenizer.vocab_size:
        source = f"--tokenizer-model {tokenizer_model}" if tokenizer_model else f"--vocab-file {vocab_file}"
        raise ConfigError(
            [
                f"--vocab-size {vocab_size} disagrees with {source}, which has {tokenizer.vocab_size} "
                f"ids; drop --vocab-size for {tokenizer_type} (the model pads the vocabulary itself)"
            ]
        )
    return tokenizer


def get_tokenizer_args(data) -> dict:
    """build_tokenizer's arguments from the data config (``cfg.data``): every tokenizer flag."""
    return dict(
        tokenizer_type=data.tokenizer_type,
        tokenizer_model=data.tokenizer_model,
        vocab_size=data.vocab_size,
        vocab_file=data.vocab_file,
        merge_file=data.merge_file,
        tiktoken_pattern=data.tiktoken_pattern,
        tiktoken_num_special_tokens=data.tiktoken_num_special_tokens,
        tiktoken_special_tokens=list(data.tiktoken_special_tokens) or None,
    )
