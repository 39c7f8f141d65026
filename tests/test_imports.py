"""The import graph of prove_local, read with `ast` from every `import` anywhere in a module (at its
top, and in function bodies, which run later): no cycle among the package's modules, imports of the
package's own modules at module level except the few deliberately deferred ones listed below with
their reason, the optional extras kept out of the command line's start, no front end importing the
command line, and each top module importing in a fresh interpreter."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "prove_local"

# In-function imports of the package's own modules that are deliberate: (importer, imported) -> why.
# Only optional heavy extras (gradio, fastapi/uvicorn, torch, matplotlib) justify one; anything else
# belongs at the top of its module, and a cycle is broken by moving the shared piece to the right layer.
DEFERRED = {
    ("prove_local.server.cli", "prove_local.server.app"):
        "the FastAPI app imports fastapi at its top (the `server` extra): loaded only when `serve` runs",
    ("prove_local.entry", "prove_local.cli"):
        "the console script imports the command line inside its Ctrl-C handler: an interrupt during the start-up imports is one line",
    ("prove_local.ui.app", "prove_local.ui.page"):
        "the page imports gradio at its top (the `ui` extra): loaded only when `ui` runs",
}
# The optional extras: `prove-local` must start (and every other command run) without them.
EXTRAS = ("gradio", "fastapi", "starlette", "uvicorn", "pydantic", "torch", "matplotlib")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def import_nodes(path: Path) -> list[tuple[ast.stmt, bool]]:
    """Every Import / ImportFrom of the file, and whether it sits in a function body (deferred)."""
    found = []

    def walk(node, deferred):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, deferred))
            walk(child, deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    walk(ast.parse(path.read_text(), str(path)), False)
    return found


def targets(node, importer: str, is_package: bool) -> set[str]:
    """The prove_local modules one import statement loads (`from .x import y`: .x, or .x.y if a module)."""
    package = importer if is_package else importer.rpartition(".")[0]
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[:len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names]
    found = set()
    for t in names:
        while t and t not in MODULES:       # `import prove_local.convert.cli` -> the module itself
            t = t.rpartition(".")[0] if "." in t else ""
        if t and t != importer:
            found.add(t)
    return found


def imports(path: Path, *, deferred: bool | None = None) -> set[str]:
    """prove_local modules that `path` imports: anywhere (None), only in function bodies (True) or
    only at module level (False)."""
    name = module_name(path)
    out = set()
    for node, in_function in import_nodes(path):
        if deferred is None or in_function == deferred:
            out |= targets(node, name, path.name == "__init__.py")
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import cycle, or None. A module imports its package's __init__ first, and an __init__ that
    imports its own submodules is not a cycle: a loop made only of such parent/child steps is fine."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if n.startswith(m + "."):
                continue
            if state.get(n) == "open":
                cycle = stack[stack.index(n):] + [n]
                if not all(b.startswith(a + ".") or a.startswith(b + ".") for a, b in zip(cycle, cycle[1:])):
                    return cycle
            elif n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None
    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle_counting_function_level_imports():
    graph = {m: imports(p) for m, p in MODULES.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one_through_a_function_body(tmp_path):
    """A function-level import closing a loop is found (the old test read module level only)."""
    graph = {"prove_local.a": {"prove_local.b"}, "prove_local.b": {"prove_local.c"},
             "prove_local.c": {"prove_local.a"}, "prove_local.d": {"prove_local.d.e"}, "prove_local.d.e": {"prove_local.d"}}
    assert find_cycle(graph) == ["prove_local.a", "prove_local.b", "prove_local.c", "prove_local.a"]
    assert find_cycle({k: v for k, v in graph.items() if k.startswith("prove_local.d")}) is None
    f = tmp_path / "m.py"
    f.write_text("import os\n\ndef f():\n    from .loading import KV_TYPES\n    return KV_TYPES\n")
    assert [(type(n).__name__, d) for n, d in import_nodes(f)] == [("Import", False), ("ImportFrom", True)]


def test_own_modules_are_imported_at_module_level_unless_listed():
    deferred = {(m, t) for m, p in MODULES.items() for t in imports(p, deferred=True)}
    unlisted = sorted(deferred - DEFERRED.keys())
    assert not unlisted, ("in-function imports of prove_local's own modules (move them to the module's top; "
                          "list one in DEFERRED only for an optional extra): " + ", ".join(map(" -> ".join, unlisted)))
    stale = sorted(DEFERRED.keys() - deferred)
    assert not stale, f"DEFERRED lists imports that are gone: {stale}"


def test_the_command_line_starts_without_the_optional_extras():
    code = (f"import sys, prove_local.cli; print(','.join(m for m in {EXTRAS!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "", f"`prove-local` imports extras at start: {r.stdout.strip()}"


@pytest.mark.parametrize("front", ["prove_local.bench", "prove_local.ui", "prove_local.convert", "prove_local.pull",
                                   "prove_local.server", "prove_local.loading", "prove_local.pool",
                                   "prove_local.errors"])
def test_front_ends_never_import_the_command_line(front):
    users = [m for m, p in MODULES.items() if (m == front or m.startswith(front + "."))
             and "prove_local.cli" in imports(p)]
    assert users == []


def test_each_top_module_imports_fresh():
    """Each in a new interpreter, first: an import cycle would fail here as a partially initialized module."""
    tops = ["prove_local.cli", "prove_local.bench", "prove_local.ui.app", "prove_local.ui.runtime",
            "prove_local.convert.cli", "prove_local.pull", "prove_local.loading", "prove_local.engine",
            "prove_local.calibrate", "prove_local.bench.results", "prove_local.chat", "prove_local.server",
            "prove_local.server.app"]
    for m in tops:
        r = subprocess.run([sys.executable, "-c", f"import {m}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (m, r.stderr[-2000:])
