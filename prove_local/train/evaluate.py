"""Torch-side proxy of lossless ProVe decoding on dev questions (no llama.cpp needed).

For each question: greedy AR continuation g (up to <|im_end|> or --max-new tokens); then the
lossless cycle is simulated exactly as the runtime does it: one proposal pass over
[context, last committed token, <|mask|> x (B-1)] gives B slot predictions; the leading run m
that equals g is committed plus one model token (the correction, or the bonus after a full match).
Reports mean committed tokens per cycle, the per-slot match-rate curve, and the share of
generated tokens inside repeated 8-grams (loop check).

    python -m prove_local.train.evaluate runs/embedded/hf/proposer --dev $GSM8K_DEV --n 40

(`$GSM8K_DEV`: GSM8K test questions as jsonl, as in the README's headline figures.)
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .mars import chat_segments, load_jsonl
from .model import load_hf


@torch.no_grad()
def greedy(model, ids: list[int], stop: int, max_new: int) -> list[int]:
    out: list[int] = []
    for _ in range(max_new):
        nxt = int(model(torch.tensor([ids + out]))[0, -1].argmax())
        out.append(nxt)
        if nxt == stop:
            break
    return out


@torch.no_grad()
def lossless_cycles(model, prompt: list[int], g: list[int], mask_id: int, block: int):
    """Simulated lossless cycles over the greedy path g: (committed per cycle, per-slot matches)."""
    committed, slot_hits, slot_n = [], [0] * block, [0] * block
    i = 0
    while i < len(g):
        ctx = prompt + g[:i]
        x = torch.tensor([ctx + [mask_id] * (block - 1)])
        rows = model(x)[0, len(ctx) - 1:]            # last real token + (block-1) masks
        prop = rows.argmax(-1).tolist()               # slot 1..block
        m = 0
        while m < block and i + m < len(g) and prop[m] == g[i + m]:
            m += 1
        for s in range(block):
            if i + s < len(g):
                slot_n[s] += 1
                slot_hits[s] += int(prop[s] == g[i + s])
        c = min(m + 1, len(g) - i)                    # matched run + correction / bonus token
        committed.append(c)
        i += c
    return committed, slot_hits, slot_n


def loop_share(tokens: list[int], n: int = 8) -> float:
    """Share of tokens covered by an n-gram that already occurred earlier in the same text."""
    seen, covered = set(), [False] * len(tokens)
    for k in range(len(tokens) - n + 1):
        gram = tuple(tokens[k:k + n])
        if gram in seen:
            for j in range(k, k + n):
                covered[j] = True
        seen.add(gram)
    return sum(covered) / max(len(tokens), 1)


def evaluate(model_dir, dev_path, n=40, block=16, max_new=256, threads=2) -> dict:
    from tokenizers import Tokenizer

    torch.set_num_threads(threads)
    model = load_hf(model_dir).eval()
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    mask_id, stop = tok.token_to_id("<|mask|>"), tok.token_to_id("<|im_end|>")
    rows = load_jsonl(dev_path)[:n]
    all_c, hits, cnt, loops, ntok, correct = [], [0] * block, [0] * block, [], 0, 0
    t0 = time.time()
    for r in rows:
        prompt = tok.encode(chat_segments(r["question"], "")[0]).ids
        g = greedy(model, prompt, stop, max_new)
        c, h, s = lossless_cycles(model, prompt, g, mask_id, block)
        all_c += c
        hits = [a + b for a, b in zip(hits, h)]
        cnt = [a + b for a, b in zip(cnt, s)]
        loops.append(loop_share(g) * len(g))
        ntok += len(g)
        text = tok.decode(g)
        gold = r["answer"].split("####")[-1].strip()
        got = text.split("####")[-1].replace("<|im_end|>", "").strip() if "####" in text else None
        correct += int(got == gold)
    return {
        "model": str(model_dir), "questions": len(rows), "block": block,
        "mean_committed_per_cycle": round(sum(all_c) / max(len(all_c), 1), 3),
        "cycles": len(all_c), "generated_tokens": ntok,
        "slot_match_rate": [round(a / b, 4) if b else None for a, b in zip(hits, cnt)],
        "loop_share_8gram": round(sum(loops) / max(ntok, 1), 4),
        "gsm8k_exact_match": round(correct / max(len(rows), 1), 4),
        "seconds": round(time.time() - t0, 1),
    }


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m prove_local.train.evaluate")
    p.add_argument("model_dir")
    p.add_argument("--dev", default=str(Path(__file__).resolve().parents[3] / "shared/datasets/gsm8k/test_dev.jsonl"))
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="write the JSON here too")
    a = p.parse_args(argv)
    r = evaluate(a.model_dir, a.dev, a.n, a.block, a.max_new, a.threads)
    print(json.dumps(r, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
