"""What batching requests does to lossless, on paper: the planner's choice and the throughput it
expects at 1 / 2 / 4 / ... concurrent requests, from pass-cost curves and per-slot acceptance. No
model runs and nothing is timed: the numbers come from planner.batch_projection, the rule the engine
plans with, over each curve.

    python scripts/batch_projection.py --out docs/bench/batch-projection \\
        [--curve LABEL=CURVE.json ...] [--rates 1,0.59,...] [--concurrency 1,2,4,8,16,32]

Curves: the built-in ones (`flat`: the paper's cost model, every pass costs a one-token pass;
`rtx3090-7b-q4_0-32k`: a published llama.cpp measurement, see CURVES) and any `--curve
LABEL=FILE`, FILE either `prove-local calibrate MODEL.gguf --json` output (the chosen thread count's
curve of its first model) or a JSON object {tokens: seconds}. Acceptance (`--rates`): per slot,
conditional on the slots before it (slot 1 of a MARS proposal is the model's own token: 1); the
default is the embedded proposer's, measured (docs/planner.md, "What the acceptance allows").

Writes OUT/results.json, OUT/summary.md and OUT/batch_projection.png (the lossless gain over an
all-`ar` step against concurrency, per curve: the planner's choice, and the best width if every
request in a step ran it at once). Needs matplotlib for the plot only.
"""
from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from prove_local.files import write_atomic  # noqa: E402
from prove_local.planner import Costs, batch_projection  # noqa: E402

# The embedded (self-distilled) proposer's acceptance of slots 1-9 given the slots before them, 10,972
# positions of its own GSM8K answers (docs/planner.md); slots 10-16 unmeasured, taken as slot 9's.
EMBEDDED_RATES = [1.0, 0.59, 0.64, 0.67, 0.67, 0.66, 0.66, 0.66, 0.71] + [0.71] * 7

# Published: llama.cpp PR #17891 ("CUDA: fix unpadded strides in MMA FA kernel"), llama-bench on an RTX
# 3090, LLaMA 7B Q4_0, `pp512@d32768` (512 tokens after a 32,768-token context) per microbatch size,
# the base commit's column: tokens/s 40.05, 76.19, 146.70, 250.73, 504.32, 905.59, 1475.74, 1567.34 at
# microbatch 1 ... 128, so t(n) = n / (tokens/s). A deep context: attention is much of t(1) there.
CURVES = {
    "flat": {1: 1.0, 4096: 1.0},
    "rtx3090-7b-q4_0-32k": {n: n / tps for n, tps in
                            [(1, 40.05), (2, 76.19), (4, 146.70), (8, 250.73), (16, 504.32), (32, 905.59),
                             (64, 1475.74), (128, 1567.34)]},
}
SOURCES = {
    "flat": "the paper's cost model: every pass costs a one-token pass",
    "rtx3090-7b-q4_0-32k": "llama.cpp PR #17891, RTX 3090, LLaMA 7B Q4_0 at a 32k-token depth (published)",
}


def parse_ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of integers") from None
    if not out or any(c < 1 for c in out):
        raise argparse.ArgumentTypeError(f"{text!r}: values must be >= 1")
    return out


def parse_rates(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers") from None
    if not out or any(not 0.0 <= r <= 1.0 for r in out):
        raise argparse.ArgumentTypeError(f"{text!r}: rates must lie in [0, 1]")
    return out


def load_curve(spec: str) -> tuple[str, dict[int, float], str]:
    """LABEL=FILE -> (label, {n: seconds}, source), FILE a `calibrate --json` output or {n: seconds}."""
    label, sep, path = spec.partition("=")
    if not sep or not label or not path:
        raise SystemExit(f"--curve {spec!r}: expected LABEL=FILE.json")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--curve {spec!r}: {path}: {e}") from None
    if isinstance(data, dict) and data and all(isinstance(v, dict) and "curves" in v for v in data.values()):
        model, entry = next(iter(data.items()))          # prove-local calibrate --json
        data, source = entry["curves"][str(entry["threads"])], f"{Path(model).name}, {entry['threads']} thread(s), calibrated"
    else:
        source = path
    try:
        curve = {int(n): float(t) for n, t in data.items()}
    except (AttributeError, TypeError, ValueError):
        raise SystemExit(f"--curve {spec!r}: {path}: expected {{tokens: seconds}} or `prove-local calibrate --json` output") from None
    if 1 not in curve or any(n < 1 or not t > 0 for n, t in curve.items()):
        raise SystemExit(f"--curve {spec!r}: {path}: needs t(1) and positive seconds at widths >= 1")
    return label, curve, source


def summary(res: dict) -> str:
    lines = ["# Batching and lossless, on paper", "",
             f"`{res['command']}`", "",
             "No model runs here: `planner.batch_projection` over each curve. Acceptance per slot (given the "
             f"slots before it): {', '.join(str(r) for r in res['rates'])}. Per concurrency c: the all-`ar` step's "
             "throughput over one request's (`ar` batch gain); the batch-aware planner's choice for one `lossless` "
             "request beside c - 1 `ar` requests and the step gain it expects; the best width if all c requests "
             "proposed at once, every pass one ubatch of c times its tokens, and that width's gain over the "
             "all-`ar` step. The planner rates its options as if the other requests ran `ar` (it does not "
             "know their plans), so a proposal beside them is a ubatch of its own that holds up their step; the "
             "in-phase column is what a scheduler that had every request of a step propose the same width at "
             "the same time would keep.", ""]
    for name, c in res["curves"].items():
        lines += [f"## {name}", "", f"{c['source']}; t(n)/t(1) at 2, 4, 8, 16: "
                  + ", ".join(f"{c['curve_ratio'][str(n)]:.2f}" for n in (2, 4, 8, 16)), "",
                  "| concurrency | `ar` batch gain | planner's choice | its step gain | best width in phase | its gain |",
                  "|---:|---:|---|---:|---:|---:|"]
        for r in c["rows"]:
            b = r["best_in_phase"]
            lines.append(f"| {r['concurrency']} | {r['ar_batch_gain']:.2f}x | {r['choice']} | {r['step_gain']:.2f}x "
                         f"| {'ar' if b['width'] == 1 else 'B=' + str(b['width'])} | {b['gain']:.2f}x |")
        lines.append("")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: no matplotlib: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, c) in enumerate(res["curves"].items()):
        cs = [r["concurrency"] for r in c["rows"]]
        color = f"C{i}"
        ax.plot(cs, [r["step_gain"] for r in c["rows"]], "o-", color=color, label=f"{name}: planner beside ar")
        ax.plot(cs, [r["best_in_phase"]["gain"] for r in c["rows"]], "s--", color=color, label=f"{name}: best width in phase")
    ax.set_xscale("log", base=2)
    cs = sorted({r["concurrency"] for c in res["curves"].values() for r in c["rows"]})
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.minorticks_off()
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("lossless step throughput / all-ar step")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.legend(fontsize=7)
    ax.set_title("lossless under batching, on paper")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--curve", action="append", default=[], metavar="LABEL=FILE",
                    help="a curve to add: `prove-local calibrate --json` output or {tokens: seconds}; repeatable")
    ap.add_argument("--no-builtin", action="store_true", help="only the --curve curves")
    ap.add_argument("--rates", type=parse_rates, default=EMBEDDED_RATES,
                    help="per-slot acceptance, slot 1 first (default: the embedded proposer's, measured)")
    ap.add_argument("--concurrency", type=parse_ints, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--block-max", type=int, default=16, help="the widest proposal (default 16)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if not 1 <= a.block_max <= 64:
        ap.error("--block-max must lie in 1..64")
    curves = {} if a.no_builtin else {k: (v, SOURCES[k]) for k, v in CURVES.items()}
    for spec in a.curve:
        label, curve, source = load_curve(spec)
        curves[label] = (curve, source)
    if not curves:
        ap.error("no curve: give --curve LABEL=FILE or leave out --no-builtin")
    a.out.mkdir(parents=True, exist_ok=True)
    res = {"command": "python scripts/batch_projection.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rates": a.rates, "curves": {}}
    for name, (curve, source) in curves.items():
        solo = Costs({"target": curve})
        rows = batch_projection(curve, a.rates, a.concurrency, a.block_max)
        res["curves"][name] = {"source": source, "curve": {str(n): t for n, t in sorted(curve.items())},
                               "curve_ratio": {str(n): solo.solo("target", n) / solo.solo("target", 1) for n in (2, 4, 8, 16)},
                               "rows": rows}
        for r in rows:
            b = r["best_in_phase"]
            print(f"{name:>22} c={r['concurrency']:<3} ar x{r['ar_batch_gain']:<7.2f} planner {r['choice']:<9} "
                  f"x{r['step_gain']:.2f}   in phase {'ar' if b['width'] == 1 else 'B=' + str(b['width'])} x{b['gain']:.2f}")
    write_atomic(a.out / "results.json", json.dumps(res, indent=1) + "\n")
    write_atomic(a.out / "summary.md", summary(res) + "\n")
    plot(res, a.out / "batch_projection.png")
    print(f"wrote {a.out}/results.json, summary.md, batch_projection.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
