"""Build the embedded default corpus from English text that ships with CPython (no download).

Sources, in this order (so the output is deterministic for a given Python build):
1. ``pydoc_data.topics.topics``: the language reference sections ``help()`` shows (~80
   documents of 0.1-40 kB).
2. Docstrings of the standard library: every public module and submodule reachable from
   ``sys.stdlib_module_names`` (sorted), then its public classes, functions and methods (sorted by
   qualified name). Private (``_x``) and test modules are skipped, and so are modules that act on
   import (``antigravity`` opens a browser, ``this`` prints) or need a display (``tkinter``).

One document per topic or docstring, one JSON object ``{"text": ...}`` per line. Documents
shorter than ``--min-chars`` are dropped (one-line docstrings such as "Return self==value." carry
little text and repeat); exact duplicates keep their first occurrence. Writing stops before the
document that would cross ``--max-bytes`` of UTF-8 text.
"""

import contextlib
import hashlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import sys
import warnings
from collections.abc import Iterator, Sequence

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron_ext.cli_args import ToolParser, integer, output_file  # noqa: E402

# Modules with side effects on import, GUI needs, or nothing but tests / private machinery.
SKIP_MODULES = frozenset(
    {
        "antigravity",
        "this",
        "idlelib",
        "tkinter",
        "turtle",
        "turtledemo",
        "test",
        "lib2to3",
        "ensurepip",
        "venv",
        "pydoc_data",
        "__hello__",
        "__phello__",
    }
)


_ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+")


def is_public_module_name(name: str) -> bool:
    """False for private, test and skip-listed modules (any dotted component counts)."""
    parts = name.split(".")
    if parts[0] in SKIP_MODULES:
        return False
    return not any(p.startswith("_") or p in ("test", "tests", "idle_test") for p in parts)


def safe_import(name: str):
    """Import a module with its output and warnings swallowed; None if it fails."""
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - any import-time failure (incl. SystemExit) skips it
        return None


def iter_package_modules(top: str) -> Iterator:
    """``top`` and, for a package, its public submodules sorted by name (unimportable skipped)."""
    module = safe_import(top)
    if module is None:
        return
    yield module
    if not hasattr(module, "__path__"):
        return
    with contextlib.redirect_stderr(io.StringIO()):  # walk_packages imports subpackages
        names = sorted(info.name for info in pkgutil.walk_packages(module.__path__, top + ".", onerror=lambda _: None))
    for name in names:
        if is_public_module_name(name):
            submodule = safe_import(name)
            if submodule is not None:
                yield submodule


def iter_stdlib_modules() -> Iterator:
    """Public stdlib modules and their public submodules, sorted by name."""
    for top in sorted(sys.stdlib_module_names):
        if is_public_module_name(top):
            yield from iter_package_modules(top)


def get_own_doc(obj) -> str | None:
    """The object's own docstring, dedented (not one inherited from a base class)."""
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return None
    # pybind11 signatures embed default-argument reprs such as "<X object at 0x7f..>", which
    # differ from run to run; drop the address so the corpus is reproducible.
    return _ADDRESS_RE.sub("", inspect.cleandoc(doc))


def iter_module_docstrings(module) -> Iterator[str]:
    """The module's docstring, then its own public classes/functions and their methods."""
    doc = get_own_doc(module)
    if doc:
        yield doc
    members = []
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isroutine(obj):
            members.append((name, obj))
    for _name, obj in sorted(members, key=lambda item: item[0]):
        doc = get_own_doc(obj)
        if doc:
            yield doc
        if inspect.isclass(obj):
            for attr_name in sorted(vars(obj)):
                attr = vars(obj)[attr_name]
                if attr_name.startswith("_") and attr_name != "__init__":
                    continue
                is_descriptor = isinstance(attr, (property, staticmethod, classmethod))
                if inspect.isroutine(attr) or is_descriptor:
                    doc = get_own_doc(attr)
                    if doc:
                        yield doc


def iter_corpus_texts(packages: Sequence[str] = ()) -> Iterator[str]:
    """All candidate documents in deterministic order (before filtering and dedup)."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key].strip()
    for module in iter_stdlib_modules():
        yield from iter_module_docstrings(module)
    for package in packages:
        for module in iter_package_modules(package):
            yield from iter_module_docstrings(module)


DEFAULT_PACKAGES = ("numpy", "torch")


def build_default_corpus(
    output: str,
    max_bytes: int = 4_000_000,
    min_chars: int = 200,
    packages: Sequence[str] = DEFAULT_PACKAGES,
    log_every: int = 1000,
) -> dict:
    """Write the corpus JSONL to ``output`` (atomically); returns {"documents", "bytes"}."""
    seen: set[bytes] = set()
    num_docs, num_bytes = 0, 0
    tmp_path = output + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(tmp_path, "w", encoding="utf-8") as f, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation noise from importing every module
        for text in iter_corpus_texts(packages):
            if len(text) < min_chars:
                continue
            digest = hashlib.sha1(text.encode("utf-8")).digest()
            if digest in seen:
                continue
            size = len(text.encode("utf-8"))
            if num_bytes + size > max_bytes:
                break
            seen.add(digest)
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            num_docs += 1
            num_bytes += size
            if log_every and num_docs % log_every == 0:
                print(f"  {num_docs} documents, {num_bytes / 1e6:.2f} MB", flush=True)
    os.replace(tmp_path, output)
    print(f"wrote {output}: {num_docs} documents, {num_bytes / 1e6:.2f} MB of text", flush=True)
    return {"documents": num_docs, "bytes": num_bytes}


def main(argv=None) -> None:
    parser = ToolParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=output_file, required=True, help="JSONL file to write")
    parser.add_argument(
        "--max-bytes",
        type=integer(1, what="bytes of text"),
        default=4_000_000,
        help="stop before exceeding this many bytes of UTF-8 text",
    )
    parser.add_argument(
        "--min-chars",
        type=integer(0, what="characters"),
        default=200,
        help="drop documents shorter than this many characters",
    )
    parser.add_argument(
        "--packages",
        default=",".join(DEFAULT_PACKAGES),
        help="comma-separated installed packages whose docstrings follow the stdlib's ('' for none)",
    )
    args = parser.parse_args(argv)
    packages = [p for p in args.packages.split(",") if p]
    build_default_corpus(args.output, max_bytes=args.max_bytes, min_chars=args.min_chars, packages=packages)


if __name__ == "__main__":
    main()
