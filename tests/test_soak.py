"""scripts/soak.py with tiny counts: every mode runs, exact modes are checked, and the JSON is whole."""
import json
import subprocess
import sys
from pathlib import Path

from prove_local.modes import MODES

ROOT = Path(__file__).resolve().parents[1]


def test_soak_script_small(tmp_path):
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--cycles", "300", "--check-every", "1",
                        "--rss-every", "50", "--max-new", "24", "--out", str(out), "-q"],
                       capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["cycles"] >= 300 and res["errors"] == 0 and res["error_messages"] == []
    assert set(res["modes"]) == {"ar", "lossless", "prove", "mars", "spec", "lookup"}
    assert all(m["requests"] >= 1 and m["cycles"] >= 1 for m in res["modes"].values())
    # every request of an exact mode was compared with a fresh decode by hand: greedy, or the coupled
    # samples of the request's seed (a sampled exact mode gives ar's text for its seed, at any width)
    exact = [m for m in res["modes"] if MODES[m].exact]          # ar, lossless, spec, lookup
    assert res["checks"] == sum(res["modes"][m]["requests"] for m in exact)
    assert sum(m["sampled"] for m in res["modes"].values()) >= 1
    assert len(res["rss_kib"]) >= 3 and res["rss"]["max_mib"] > 0
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]     # written atomically
    assert "0 errors" in r.stderr
