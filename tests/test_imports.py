"""The import graph: no cycle among prove_local's modules at import time, the command line does not load
its front ends (bench, ui, convert, pull) until a command runs, and no front end imports the command line."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "prove_local"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def imports(path: Path, top_level_only: bool) -> set[str]:
    """prove_local modules that `path` imports (at module level only, or anywhere)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:       # `import prove_local.convert.cli` -> the module itself
                t = t.rpartition(".")[0] if "." in t else ""
            if t and t != name:
                found.add(t)
    return found


def test_no_import_cycle_at_module_level():
    graph = {m: imports(p, top_level_only=True) for m, p in MODULES.items()}
    # a module imports its package's __init__ first; an __init__ importing its own submodules is not a cycle
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
                    pytest.fail("import cycle: " + " -> ".join(cycle))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_cli_loads_its_front_ends_only_when_a_command_runs():
    top = imports(MODULES["prove_local.cli"], top_level_only=True)
    fronts = ("prove_local.bench", "prove_local.ui", "prove_local.convert", "prove_local.pull")
    assert not [m for m in top if m.startswith(fronts)], top


@pytest.mark.parametrize("front", ["prove_local.bench", "prove_local.ui", "prove_local.convert", "prove_local.pull",
                                   "prove_local.loading", "prove_local.pool", "prove_local.errors"])
def test_front_ends_never_import_the_command_line(front):
    users = [m for m, p in MODULES.items() if (m == front or m.startswith(front + "."))
             and "prove_local.cli" in imports(p, top_level_only=False)]
    assert users == []


def test_each_top_module_imports_fresh():
    """Each in a new interpreter, first: an import cycle would fail here as a partially initialized module."""
    tops = ["prove_local.cli", "prove_local.bench", "prove_local.ui.app", "prove_local.ui.runtime",
            "prove_local.convert.cli", "prove_local.pull", "prove_local.loading", "prove_local.engine",
            "prove_local.bench.results", "prove_local.chat"]
    for m in tops:
        r = subprocess.run([sys.executable, "-c", f"import {m}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (m, r.stderr[-2000:])
