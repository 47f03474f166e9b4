"""The workaround table: pinned to the megatron-core it was checked against, every entry resolves,
and every module that reaches into megatron-core or torch internals is registered."""

from __future__ import annotations

import ast
import pathlib
import re
import warnings

import pytest

from megatron_ext import compat

PACKAGE = pathlib.Path(compat.__file__).parent


def test_megatron_core_version_is_the_checked_one():
    installed = compat.get_megatron_core_version()
    assert installed == compat.CHECKED_MEGATRON_CORE_VERSION, (
        f"megatron-core {installed} is installed but the workarounds in megatron_ext/compat.py were "
        f"checked against {compat.CHECKED_MEGATRON_CORE_VERSION}: re-check each entry (what it corrects "
        f"may be fixed upstream, or moved), then update CHECKED_MEGATRON_CORE_VERSION"
    )


@pytest.mark.parametrize("entry", compat.WORKAROUNDS, ids=lambda w: w.name)
def test_every_entry_resolves(entry):
    assert compat.resolve(entry.where) is not None
    for name in entry.upstream:
        try:
            compat.resolve(name)
        except (ImportError, AttributeError) as err:
            pytest.fail(f"{entry.name}: upstream {name} no longer exists ({err}); re-check {entry.where}")


def test_names_are_unique():
    names = [w.name for w in compat.WORKAROUNDS]
    assert len(names) == len(set(names))


def _private_upstream_uses(path: pathlib.Path) -> set[str]:
    """What a module does to megatron-core/torch internals, seen in its syntax: private names it
    imports, attributes it assigns on imported megatron/torch modules, private attributes it
    assigns on other objects (instance patches)."""
    tree = ast.parse(path.read_text())
    upstream_aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            upstream_aliases |= {
                (a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in ("megatron", "torch")
            }
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("megatron", "torch"):
            upstream_aliases |= {a.asname or a.name for a in node.names}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("megatron", "torch"):
            found |= {f"import {node.module}.{a.name}" for a in node.names if a.name.startswith("_")}
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        for t in targets:
            if not isinstance(t, ast.Attribute):
                continue
            root = t.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in upstream_aliases:
                found.add(f"assign {ast.unparse(t)}")
            elif (
                t.attr.startswith("_")
                and not t.attr.startswith("__")
                and not (isinstance(root, ast.Name) and root.id in ("self", "cls"))
            ):
                found.add(f"assign {ast.unparse(t)}")
    return found


def test_every_module_reaching_into_internals_is_registered():
    registered = {w.where.split(":")[0] for w in compat.WORKAROUNDS}
    unregistered = {}
    for path in PACKAGE.rglob("*.py"):
        module = "megatron_ext." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        uses = _private_upstream_uses(path)
        if uses and module not in registered:
            unregistered[module] = sorted(uses)
    assert not unregistered, f"register these in megatron_ext/compat.py: {unregistered}"


def test_every_internal_a_module_reaches_is_named_by_its_entries():
    """Not only the module: each private name it imports or assigns on megatron-core / torch (or
    patches onto an instance) is named in an entry of that module (its upstream names or its text),
    so the table says what each patch touches. Our own marker attributes (``_megatron_ext*``) aside."""
    text: dict[str, str] = {}
    for w in compat.WORKAROUNDS:
        module = w.where.split(":")[0]
        text[module] = text.get(module, "") + " ".join((w.corrects, *w.upstream)) + " "
    unnamed = {}
    for path in PACKAGE.rglob("*.py"):
        module = "megatron_ext." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for use in _private_upstream_uses(path):
            attr = use.split(".")[-1]
            if not attr.startswith("_megatron_ext") and not re.search(rf"\b{re.escape(attr)}\b", text.get(module, "")):
                unnamed.setdefault(module, []).append(use)
    assert not unnamed, f"name these in their entries in megatron_ext/compat.py: {unnamed}"


def test_version_drift_warns_once_and_never_fails(monkeypatch):
    monkeypatch.setattr(compat, "get_megatron_core_version", lambda: "9.9.9")
    monkeypatch.setattr(compat, "get_torch_version", lambda: (2, 99))
    monkeypatch.setattr(compat, "_WARNED", False)
    drift = compat.describe_version_drift()
    assert len(drift) == 2 and "9.9.9" in drift[0] and "2.99" in drift[1] and "2.11-2.13" in drift[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.check_versions()
        compat.check_versions()
    assert len(caught) == 2  # one per drifting package, the first call only
