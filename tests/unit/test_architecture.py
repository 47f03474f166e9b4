"""The package's shape: no import cycle among our modules, no function-local import of our own
modules, no library file over 600 lines.

The import graph is read from the source (``ast``), not by importing: every ``import`` and
``from ... import`` of a ``megatron_ext`` module, at module level or inside a function, is an edge.
A function-local import of our own code is how an import cycle hides (the module imports fine,
and the cycle bites whoever imports the other side first), so it is refused as well, unless the
allow-list below says why it must stay.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_ext"
MAX_LINES = 600

# (importing module, imported module) -> why the import stays inside a function.
LOCAL_IMPORTS_ALLOWED: dict[tuple[str, str], str] = {}

# library file (relative to the repository root) -> why it may exceed MAX_LINES.
LONG_FILES_ALLOWED: dict[str, str] = {
    "megatron_ext/compat.py": "the one table of workarounds (its point: one place to start an upgrade); the "
    "context-parallel entries took it past 600 lines. To lift: split the table by concern into a package "
    "whose __init__ joins the parts",
}


def get_module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def list_modules() -> dict[str, pathlib.Path]:
    return {get_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve_import(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The modules of ours that ``node`` imports (``from a.b import c`` is module ``a.b.c`` when that
    is a module, else ``a.b``); relative imports resolved against ``module``."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    out = []
    for name in names:
        while name and name not in known and "." in name:  # `import a.b.c` of a package attribute
            name = name.rsplit(".", 1)[0]
        if name in known:
            out.append(name)
    return out


def build_import_graph() -> tuple[dict[str, set[str]], list[tuple[str, str, str, int]]]:
    """(module -> the modules of ours it imports anywhere, [(module, function, imported, line)] of
    the imports of our modules made inside a function)."""
    modules = list_modules()
    known = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    local: list[tuple[str, str, str, int]] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module].update(t for t in resolve_import(node, module, is_package, known) if t != module)
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    targets = resolve_import(node, module, is_package, known)
                    local += [(module, func.name, t, node.lineno) for t in targets]
    return graph, sorted(set(local))


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def test_find_cycles_finds_a_cycle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_our_modules():
    graph, _ = build_import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles among megatron_ext modules (each line one cycle):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_function_local_import_of_our_modules():
    _, local = build_import_graph()
    found = [(m, f, t, line) for m, f, t, line in local if (m, t) not in LOCAL_IMPORTS_ALLOWED]
    assert not found, (
        "function-local imports of our own modules (import them at module level; a cycle that forces a local "
        "import means a function belongs in a lower module):\n"
        + "\n".join(f"  {m}.{f} (line {line}) imports {t}" for m, f, t, line in found)
    )
    used = {(m, t) for m, _, t, _ in local}
    stale = sorted(set(LOCAL_IMPORTS_ALLOWED) - used)
    assert not stale, f"allow-listed local imports that no longer exist (remove them from the list): {stale}"


def test_no_library_file_over_the_line_limit():
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    over = {p: n for p, n in sorted(lengths.items()) if n > MAX_LINES and p not in LONG_FILES_ALLOWED}
    assert not over, f"library files over {MAX_LINES} lines (split them by concern): {over}"
    stale = sorted(p for p in LONG_FILES_ALLOWED if lengths.get(p, 0) <= MAX_LINES)
    assert not stale, f"allow-listed long files that are no longer long (remove them from the list): {stale}"
