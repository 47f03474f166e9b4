"""Megatron-LM launch scripts' argv as bash hands it over: read as the script meant it where
Megatron-LM reads it so, named where Megatron-LM stops on it too.

Megatron-LM's example scripts keep their flags in bash arrays and expand them unquoted
(``${ARGS[@]}``), so bash splits every element at its spaces and keeps the quotes written inside an
element: the element ``"--split '99,1,0'"`` arrives as ``--split`` and ``'99,1,0'``, quotes
included, and ``--step-batch-size-schedule "0:16 2.4B:320"`` as three words. Megatron-LM reads the
first as meant (its ``parse_and_normalize_split`` takes the numbers with the regular expression
``[.0-9]+``) and stops on the second (argparse: "unrecognized arguments: 2.4B:320"). So do we:
``read_split`` gives the split that Megatron-LM reads where that is the split written, and
``rejoin_word_split_values`` joins a value bash split back into one word and names it as an error
that says how to keep it whole.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_NUMBER = r"(?:\d+\.?\d*|\.\d+)"
_SEPARATOR = r"\s*[,/:;\s]\s*"
# what Megatron-LM's regular expression reads as written: 1 to 3 non-negative numbers
_MEGATRON_SPLIT = re.compile(rf"\s*({_NUMBER})(?:{_SEPARATOR}({_NUMBER}))?(?:{_SEPARATOR}({_NUMBER}))?\s*")
# our own grammar (data/gpt_datasets.parse_split), left as given
_OWN_SPLIT = re.compile(rf"\s*{_NUMBER}(?:\s*[,/]\s*{_NUMBER}){{0,2}}\s*")

# flags whose one value holds spaces, and the shape of each of its words
SPACED_VALUE_FLAGS = {
    "--step-batch-size-schedule": re.compile(r"[0-9.]+[KMBTkmbt]?:[0-9.]+[KMBTkmbt]?,?"),
}


def read_split(text: str) -> str:
    """``--split`` as Megatron-LM's ``parse_and_normalize_split`` reads it, written ``A,B,C``, where
    that reading is the split written: 1 to 3 non-negative numbers apart by commas, slashes, colons,
    semicolons or spaces, the whole optionally in quotes (``'99,1,0'``, as bash passes it on from an
    unquoted array element). Anything else is returned as given, for the split grammar's own error
    (``1e-3`` or ``-1``, which the regular expression would misread as other numbers)."""
    if _OWN_SPLIT.fullmatch(text):
        return text
    inner = text.strip()
    while len(inner) >= 2 and inner[0] == inner[-1] and inner[0] in "'\"":
        inner = inner[1:-1].strip()
    match = _MEGATRON_SPLIT.fullmatch(inner)
    if match is None:
        return text
    return ",".join(number for number in match.groups() if number is not None)


def rejoin_word_split_values(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``argv`` with each value of a ``SPACED_VALUE_FLAGS`` flag that bash split into several words
    joined back into one word, and one problem for each such value (Megatron-LM stops on it too, so
    the script needs the quotes either way)."""
    out: list[str] = []
    problems = []
    i = 0
    while i < len(argv):
        out.append(argv[i])
        word_shape = SPACED_VALUE_FLAGS.get(argv[i])
        i += 1
        if word_shape is None:
            continue
        words = []
        while i < len(argv) and word_shape.fullmatch(argv[i]):
            words.append(argv[i])
            i += 1
        if words:
            out.append(" ".join(words))
        if len(words) > 1:
            flag = out[-2]
            problems.append(
                f"{flag} {' '.join(words)}: bash split it into {len(words)} words: quote it, so that it arrives as "
                f"one; in an array that the script expands unquoted (${{ARGS[@]}}), where quotes cannot keep it "
                f"whole, write it with commas: {flag} {','.join(w.rstrip(',') for w in words)} (Megatron-LM reads "
                f'commas too; it stops on the split value as well: "unrecognized arguments: {" ".join(words[1:])}")'
            )
    return out, problems
