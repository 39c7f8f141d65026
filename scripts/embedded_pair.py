"""The default settings against `ar` on the embedded pair, with a confidence interval: `lossless` (block and
lookup drafts `auto`, the defaults) and `ar` on the same prompts in one process and one engine, alternating
per prompt (the order flips from one prompt and round to the next, so that the host's drift hits both
alike), for --rounds rounds after one untimed round. Per round: the median over prompts of the paired
ratio, `lossless`'s tokens/s over `ar`'s on the same prompt seconds apart (the same tokens: lossless = ar,
checked), and the ratio of the round's totals. Over rounds: the median and a distribution-free 95 %
interval (scripts/serve_bench.py's median_ci). A single `prove-local bench --limit 8` run is ~0.4 s a mode
on this CPU and moves by ±8 % from run to run; this is the same measure, repeated.

    python scripts/embedded_pair.py --rounds 12 --out bench-out/embedded-pair

Also per mode: host time per cycle (outside llama_decode), tokens per cycle, lookup and MARS drafts.
Tokens/s as everywhere (engine.tokens_per_second: the decode time, prefill excluded). Writes
OUT/results.json, OUT/summary.md and OUT/ratios.png (the per-round ratios).
"""
from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "datasets" / "gsm8k" / "test_dev.jsonl"
MODES = ("ar", "lossless")


def lookup_arg(text: str):
    """--lookup: auto, or a draft length >= 0 (0: off)."""
    if text == "auto":
        return text
    try:
        k = int(text)
    except ValueError:
        k = -1
    if k < 0:
        raise argparse.ArgumentTypeError(f"expected auto or an integer >= 0, not {text!r}")
    return k


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--proposer", default=None, help="proposer GGUF (default: the embedded mars-gsm8k-proposer.gguf)")
    ap.add_argument("--data", default=str(DATA), help="prompt file, as for `prove-local bench --data` (default: GSM8K dev)")
    ap.add_argument("--limit", type=int, default=8, help="prompts (default 8: the issue's setting)")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: the issue's setting)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=12, help="timed rounds (default 12)")
    ap.add_argument("--lookup", type=lookup_arg, default="auto",
                    help="lossless's lookup drafts: auto (the default), 0 (off) or K")
    ap.add_argument("--out", required=True)
    return ap


if __name__ == "__main__":
    ARGS = build_parser().parse_args()   # --help and bad arguments end here, before llama.cpp is loaded

import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import median_ci  # noqa: E402

from prove_local.answer import summary  # noqa: E402
from prove_local.bench.data import load_prompts  # noqa: E402
from prove_local.chat import Conversation  # noqa: E402
from prove_local.engine import Engine, Settings  # noqa: E402
from prove_local.files import write_atomic  # noqa: E402
from prove_local.llama import Model, kv_options  # noqa: E402
from prove_local.loading import EMBEDDED_PROPOSER  # noqa: E402


def answer(engine: Engine, tokens: list[int], mode: str, max_new: int, lookup="auto") -> dict:
    """One greedy answer: its tokens, tokens/s, cycles, host seconds and drafts (answer.summary)."""
    gen = engine.generate(tokens, Settings(mode=mode, max_new=max_new, temperature=0.0, block="auto", lookup=lookup))
    cycles = list(gen)
    s = summary(cycles, gen.request)
    return {"tokens": [t for c in cycles for t in c.committed], "tps": s["tokens_per_second"],
            "seconds": s["seconds"], "cycles": s["n_cycles"], "host": s["host_seconds"], "drafts": s["drafts"]}


def play_round(engine: Engine, prompts: list[list[int]], r: int, max_new: int, lookup="auto") -> list[dict]:
    """Every prompt in both modes, alternating (the order flips with prompt and round)."""
    out = []
    for i, toks in enumerate(prompts):
        order = MODES if (r + i) % 2 == 0 else MODES[::-1]
        out.append({m: answer(engine, toks, m, max_new, lookup if m == "lossless" else 0) for m in order})
    return out


def round_stats(results: list[dict]) -> dict:
    """A round's paired ratio (median over prompts), its totals' ratio, and per mode the sums."""
    per = [p["lossless"]["tps"] / p["ar"]["tps"] for p in results]
    sums = {m: {k: sum(p[m][k] for p in results) for k in ("seconds", "cycles", "host")} | {
        "tokens": sum(len(p[m]["tokens"]) for p in results)} for m in MODES}
    return {"median": statistics.median(per), "totals": sums["ar"]["seconds"] / sums["lossless"]["seconds"], "modes": sums,
            "ratios": per, "tokens_per_cycle": [len(p["lossless"]["tokens"]) / p["lossless"]["cycles"] for p in results]}


def main(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lookup = args.lookup
    model = Model(args.proposer or str(EMBEDDED_PROPOSER))
    engine = Engine.load(model, n_ctx=args.ctx, n_threads=args.threads, flash_attn="auto",
                         **kv_options(model.default_kv_type))
    try:
        return measure(args, out, model, engine, lookup)
    finally:
        engine.close()


def measure(args, out: Path, model: Model, engine: Engine, lookup) -> int:
    prompts = [Conversation(model).prompt_tokens(p.text) for p in load_prompts(args.data, args.limit)]
    engine.prepare(Settings(mode="lossless", block="auto"))          # (the calibration, before any timing)
    play_round(engine, prompts, 1, args.max_new, lookup)                      # untimed: the engine warm, both modes
    rounds, drafts = [], {"lookup": [0, 0], "mask": [0, 0]}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        res = play_round(engine, prompts, r, args.max_new, lookup)
        for i, p in enumerate(res):
            if p["lossless"]["tokens"] != p["ar"]["tokens"]:
                raise SystemExit(f"embedded_pair: prompt {i}: lossless differs from ar (round {r})")
            for src, (n, ok) in p["lossless"]["drafts"].items():     # (modes.Drafts: drafted, accepted)
                if src in drafts:
                    drafts[src][0] += n
                    drafts[src][1] += ok
        rounds.append(round_stats(res))
        st = rounds[-1]
        print(f"round {r + 1}/{args.rounds}: lossless / ar {st['median']:.3f} per prompt, {st['totals']:.3f} "
              f"in total ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    med = [x["median"] for x in rounds]
    tot = [x["totals"] for x in rounds]
    lo, hi, cov = median_ci(med)
    tlo, thi, tcov = median_ci(tot)
    # per prompt over the rounds: which prompts gain (lookup drafts that pay) and which lose (the planner's own time)
    prompts_out = [{"ratio": statistics.median(x["ratios"][i] for x in rounds),
                    "tokens_per_cycle": statistics.median(x["tokens_per_cycle"][i] for x in rounds)}
                   for i in range(len(prompts))]
    per_mode = {}
    for m in MODES:
        s = {k: sum(x["modes"][m][k] for x in rounds) for k in ("seconds", "cycles", "host", "tokens")}
        per_mode[m] = {"tokens_per_second": s["tokens"] / s["seconds"], "tokens_per_cycle": s["tokens"] / s["cycles"],
                       "host_us_per_cycle": 1e6 * s["host"] / s["cycles"]}
    result = {"command": "python " + " ".join(sys.argv), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "proposer": str(model.path), "prompts": len(prompts), "threads": args.threads, "max_new": args.max_new,
              "lookup": lookup,
              "rounds": rounds, "per_prompt": {"median": statistics.median(med), "low": lo, "high": hi, "coverage": cov},
              "totals": {"median": statistics.median(tot), "low": tlo, "high": thi, "coverage": tcov},
              "modes": per_mode, "lossless_drafts": {k: {"drafted": a, "accepted": b} for k, (a, b) in drafts.items()},
              "prompts_detail": prompts_out}
    write_atomic(out / "results.json", json.dumps(result, indent=1))
    lines = [f"# lossless (defaults) / ar, embedded pair: {len(prompts)} prompts, {args.rounds} rounds, "
             f"{args.threads} thread(s)", "", f"`{result['command']}`", "",
             "| | median | 95 % interval (coverage) |", "|---|---|---|",
             f"| per prompt (median of the paired ratios) | **{statistics.median(med):.3f}** | {lo:.3f}–{hi:.3f} ({cov:.3f}) |",
             f"| totals | {statistics.median(tot):.3f} | {tlo:.3f}–{thi:.3f} ({tcov:.3f}) |", "",
             "| mode | tokens/s | tokens per cycle | host µs per cycle |", "|---|---|---|---|"]
    lines += [f"| {m} | {v['tokens_per_second']:.0f} | {v['tokens_per_cycle']:.3f} | {v['host_us_per_cycle']:.1f} |"
              for m, v in per_mode.items()]
    lines += ["", "lossless drafts (drafted / accepted, all rounds): " + ", ".join(
        f"{k} {a} / {b}" for k, (a, b) in drafts.items())]
    lines += ["", "| prompt | lossless / ar (median over rounds) | lossless tokens per cycle |", "|---|---|---|"]
    lines += [f"| {i + 1} | {d['ratio']:.3f} | {d['tokens_per_cycle']:.3f} |" for i, d in enumerate(prompts_out)]
    write_atomic(out / "summary.md", "\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(range(1, len(med) + 1), med, "o-", label="per prompt (median)")
        ax.plot(range(1, len(tot) + 1), tot, "s--", label="totals")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("round")
        ax.set_ylabel("lossless / ar tokens/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ratios.png", dpi=120)
        plt.close(fig)
    except ImportError:
        print("embedded_pair: matplotlib is missing (the `bench` extra): no plot", file=sys.stderr)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
