"""Every tool kept in scripts/ answers --help, quickly and without loading llama.cpp or an optional
extra: its arguments are parsed before its heavy imports, so a broken import path or a script that
was renamed away shows here, in seconds. Experiments live in dev/ and are not run (dev/README.md)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"

# Modules a --help must not import: llama.cpp itself and the heavy or optional packages. Each is
# set to None in sys.modules, so importing it raises ImportError and the script fails.
POISONED = ("llama_cpp", "gguf", "torch", "gradio", "matplotlib", "playwright", "fastapi", "uvicorn",
            "openai", "scipy", "prove_local.llama", "prove_local.engine")
# Scripts not run here, and why.
NOT_RUN = {
    "test.sh": "the test command itself: it installs packages before running pytest (.ci/run runs it)",
}
RUNNER = """
import runpy, sys
for name in {poisoned!r}:
    sys.modules[name] = None
sys.argv = [{path!r}, "--help"]
runpy.run_path({path!r}, run_name="__main__")
"""


def kept_scripts() -> list[str]:
    return sorted(p.name for p in SCRIPTS.iterdir() if p.is_file() and p.suffix in (".py", ".sh"))


def test_every_file_in_scripts_is_a_tested_tool():
    names = kept_scripts()
    assert {"soak.py", "gpu_check.sh", "inflate.py", "lookup_bench.py"} <= set(names)
    stray = [p.name for p in SCRIPTS.iterdir() if p.is_file() and p.suffix not in (".py", ".sh")]
    assert stray == [], f"scripts/ holds tools only (experiments go to dev/): {stray}"
    assert set(NOT_RUN) <= set(names)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [n for n in kept_scripts() if n not in NOT_RUN])
def test_help(name):
    path = str(SCRIPTS / name)
    if name.endswith(".py"):
        cmd = [sys.executable, "-c", RUNNER.format(poisoned=POISONED, path=path)]
    else:
        cmd = ["bash", path, "--help"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, f"{name} --help: exit {r.returncode}\n{r.stderr[-2000:]}"
    out = r.stdout.lower()
    assert ("usage" in out) if name.endswith(".py") else len(r.stdout.strip()) > 40, r.stdout
