"""`prove-local bench --parallel P` at several P: what batching requests buys on this machine, and
whether each mode keeps up with `ar` in a batch.

    python scripts/parallel_sweep.py --parallel 1,2,4,8 --modes ar,lossless --limit 16 --max-new 64 \\
        --threads 2 --out OUT [-- other bench arguments]

Runs `prove-local bench` once per P, one after another, on the same prompts (default: 16 GSM8K dev
questions from ../shared/datasets, SmolLM2-135M-Instruct Q4_1 with its MARS adapter), each into
OUT/pP/ (its results.json, summary.md, generations.jsonl). Collects per P and run: the throughput of
the run's groups of P requests decoded together (results.json `batched`; at P = 1 the one request's
tokens/s), its ratio to `ar` in the same bench (the comparison that is fair: same process, runs
interleaved per group), tokens per batched step, and for the exact modes whether every output
equals `ar`'s. Writes OUT/results.json, OUT/summary.md and OUT/parallel_sweep.png (tokens/s and
the ratio to ar against P; needs matplotlib). Throughput across P comes from separate processes
minutes apart: on a noisy machine compare the ratios, and the throughputs only roughly.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "datasets" / "gsm8k" / "test_dev.jsonl"


def parse_ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of integers") from None
    if not out or any(p < 1 for p in out):
        raise argparse.ArgumentTypeError(f"{text!r}: values must be >= 1")
    return out


def bench_command(args, p: int, out: Path, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "prove_local.cli", "bench", "--modes", args.modes, "--data", str(args.data),
           "--limit", str(args.limit), "--max-new", str(args.max_new), "--parallel", str(p), "--no-pass-cost",
           "--no-plots", "-q", "--out", str(out)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.proposer:
        cmd += ["--proposer", args.proposer]
        if args.adapter:
            cmd += ["--adapter", args.adapter]
    else:                                     # the default model: SmolLM2 and its adapter (loading.default_pair)
        from prove_local.loading import default_pair
        model, adapter = default_pair()
        cmd += ["--proposer", str(model)] + (["--adapter", str(adapter)] if adapter else [])
    return cmd + extra


def row(res: dict) -> dict:
    """Per run at this P: throughput, its ratio to ar, tokens per step, = ar output."""
    batched = (res.get("batched") or {}).get("runs") or {}
    out = {}
    for name, m in res["modes"].items():
        b = batched.get(name)
        out[name] = {"tokens_per_second": b["tokens_per_second"] if b else m["tokens_per_second"],
                     "vs_ar": b["vs_ar"] if b else m["speedup_vs_ar"]["totals"],
                     "tokens_per_step": b["tokens_per_step"] if b else None,
                     "tokens_per_cycle": m["tokens_per_cycle"], "exact_match_vs_ar": m["exact_match_vs_ar"],
                     "requests": b["requests"] if b else m["n_prompts"]}
    return out


def plot(sweep: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("parallel_sweep: matplotlib is not installed: no plot", file=sys.stderr)
        return False
    ps = sorted(sweep, key=int)
    runs = list(dict.fromkeys(r for p in ps for r in sweep[p]))
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for r in runs:
        xs = [int(p) for p in ps if r in sweep[p]]
        a.plot(xs, [sweep[str(p)][r]["tokens_per_second"] for p in xs], marker="o", label=r)
        b.plot(xs, [sweep[str(p)][r]["vs_ar"] for p in xs], marker="o", label=r)
    a.set(xlabel="requests decoded together (--parallel)", ylabel="tokens/s (all requests)", xscale="log", title="throughput")
    b.set(xlabel="requests decoded together (--parallel)", ylabel="× ar (same bench)", xscale="log", title="against ar")
    b.axhline(1.0, color="grey", lw=0.8)
    for ax in (a, b):
        ax.set_xticks([int(p) for p in ps], [str(p) for p in ps])
        ax.minorticks_off()
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parallel", type=parse_ints, default=[1, 2, 4, 8], help="values of --parallel (default 1,2,4,8)")
    ap.add_argument("--modes", default="ar,lossless")
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--proposer", help="proposer GGUF (default: SmolLM2-135M-Instruct and its adapter)")
    ap.add_argument("--adapter")
    ap.add_argument("--out", required=True)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sweep, commands = {}, {}
    for i, p in enumerate(args.parallel):
        cmd = bench_command(args, p, out / f"p{p}", extra)
        print(f"[{i + 1}/{len(args.parallel)}] --parallel {p}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        r = subprocess.run(cmd, cwd=ROOT)
        if r.returncode != 0:
            print(f"parallel_sweep: bench --parallel {p} exited {r.returncode}; stopping", file=sys.stderr)
            break
        res = json.loads((out / f"p{p}" / "results.json").read_text())
        sweep[str(p)] = row(res)
        commands[str(p)] = res["command"]
        print(f"  {time.perf_counter() - t0:.0f} s: " + ", ".join(
            f"{n} {v['tokens_per_second']:.1f} tokens/s ({v['vs_ar']:.2f}x ar)" for n, v in sweep[str(p)].items()),
            file=sys.stderr, flush=True)
    if not sweep:
        return 1
    (out / "results.json").write_text(json.dumps({"sweep": sweep, "commands": commands}, indent=1) + "\n")
    runs = list(dict.fromkeys(r for v in sweep.values() for r in v))
    lines = ["# bench --parallel sweep", "", f"`python scripts/parallel_sweep.py {' '.join(sys.argv[1:])}`", "",
             "| parallel | " + " | ".join(f"`{r}` tokens/s | × ar | tokens/step" for r in runs) + " |",
             "| ---: |" + " ---: | ---: | ---: |" * len(runs)]
    for p, v in sweep.items():
        cells = []
        for r in runs:
            x = v.get(r)
            cells += ["–"] * 3 if x is None else [f"{x['tokens_per_second']:.1f}", f"{x['vs_ar']:.2f}×",
                                                    "–" if x["tokens_per_step"] is None else f"{x['tokens_per_step']:.2f}"]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    exact = {r: [p for p, v in sweep.items() if r in v and v[r]["exact_match_vs_ar"] not in (None, 1.0)] for r in runs}
    bad = {r: ps for r, ps in exact.items() if ps}
    lines += ["", "Every exact run's outputs equal `ar`'s at every P." if not bad else
              f"Outputs differing from `ar`: {bad}", ""]
    if plot(sweep, out / "parallel_sweep.png"):
        lines += ["![throughput and ratio to ar against --parallel](parallel_sweep.png)", ""]
    (out / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
