"""What does the lookup history (`Settings.recall`) cost a served pool on text that never repeats?

    python dev/recall_pool.py --clients 8 --rounds 8

The served setting in one process (no HTTP): `serve`'s own state (ServerState.load: SmolLM2-135M
Q4_1, `--parallel 4`, 2 threads, the CLI defaults), C client threads each answering R distinct GSM8K
train questions (64 tokens, greedy, `lossless`, as the server's jobs do: Answer over pool.engine()),
the arms (recall on, on with the history in every n-gram map as before, off) in rotating order,
the same questions for each arm of a round. Per arm: tokens/s, time inside
llama_decode, the rest of the batched steps and the time between them, and the time spent in the
lookup index's methods (restart, the maps' catch-up, match, offer, supported), summed over the
engines' threads. serve-batching-v41-distinct8 measured the history at 0.974 (0.945-0.998)x itself
without it at 8 clients over HTTP; this asks where that goes.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prove_local import batching, lookup  # noqa: E402
from prove_local.answer import Answer  # noqa: E402
from prove_local.cli import Parser  # noqa: E402
from prove_local.loading import smollm2_path  # noqa: E402
from prove_local.server import add_parser as add_serve  # noqa: E402
from prove_local.chat import chat_tokens  # noqa: E402
from prove_local.server.state import State  # noqa: E402

DATA = ROOT.parent / "shared" / "datasets" / "gsm8k" / "train.jsonl"
kinds: collections.Counter = collections.Counter()      # plan kind -> cycles
spent: collections.Counter = collections.Counter()      # method -> seconds (all threads)
calls: collections.Counter = collections.Counter()


def timed(cls, name):
    orig = getattr(cls, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            spent[name] += time.perf_counter() - t0
            calls[name] += 1
    setattr(cls, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mode", default="lossless", help="the requests' mode (ar: a profile of the plain path)")
    ap.add_argument("--history", type=int, default=None, help="lookup.HISTORY_TOKENS for the run")
    ap.add_argument("--no-instrument", action="store_true", help="no timers around the index's methods")
    ap.add_argument("--arms", default="on,all-maps,off",
                    help="on: recall; all-maps: recall, the history in every n-gram map; off: no recall")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.history is not None:
        lookup.HISTORY_TOKENS = a.history
    questions = [json.loads(x)["question"] for x in DATA.read_text().splitlines() if x.strip()]
    per_run = a.clients * a.requests
    qlock = threading.Lock()
    nxt = iter(())

    if not a.no_instrument:
        for name in ("restart", "_index", "match", "offer", "supported", "sync", "_occurs"):
            timed(lookup.NgramIndex, name)
    steps = []                                       # (start, end, decode seconds, tokens)
    orig_step = batching.Batcher._step

    def step(self, st):
        ctx = st[0].view.shared
        d0, t0 = ctx.decode_seconds, time.perf_counter()
        orig_step(self, st)
        steps.append((t0, time.perf_counter(), ctx.decode_seconds - d0, sum(len(q.tokens) for q in st)))
    batching.Batcher._step = step

    p = Parser(prog="prove-local")
    sub = p.add_subparsers(dest="command")
    add_serve(sub)
    args = p.parse_args(["serve", str(smollm2_path()), "--parallel", "4", "--threads", "2"])
    state = State()
    state.load(args)
    pool, model = state.pool, state.pool.loaded.target

    def ask(recall: bool) -> int:
        with qlock:
            text = next(nxt)
        prompt = chat_tokens(model, model.chat_template, [{"role": "user", "content": text}])
        s = replace(state.defaults, mode=a.mode, max_new=a.max_tokens, temperature=0.0, recall=recall,
                    p_tilde=False)
        with pool.engine() as (_, engine):
            with Answer(engine, model, prompt, s) as ans:
                for c in ans:
                    kinds[c.cycle.plan.kind] += 1
                return len(ans.tokens)

    all_maps = lookup.NgramIndex._history_n

    def run(recall: bool, questions_of_round: list[str], arm: str) -> dict:
        nonlocal nxt
        nxt = iter(questions_of_round)
        # arm "all-maps": the history in every n's map (before the n_max-only history)
        lookup.NgramIndex._history_n = (lambda self: self.n_min) if arm == "all-maps" else all_maps
        spent.clear()
        calls.clear()
        kinds.clear()
        steps.clear()
        out = [0] * a.clients

        def client(c):
            for _ in range(a.requests):
                out[c] += ask(recall)
        ths = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
        t0 = time.perf_counter()
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        wall = time.perf_counter() - t0
        decode = sum(s[2] for s in steps)
        inside = sum(s[1] - s[0] for s in steps)
        return {"recall": recall, "arm": arm, "tokens": sum(out), "wall": wall, "tps": sum(out) / wall, "decode": decode,
                "step_rest": inside - decode, "between": wall - inside, "steps": len(steps),
                "passed": sum(s[3] for s in steps), "kinds": dict(kinds),
                "lookup": dict(spent), "calls": dict(calls)}

    arms = [x for x in a.arms.split(",")]
    # every request a question never asked (a repeat would be copied, or its prefix cached), the arms'
    # alike in length: questions sorted by prompt length, each round's block dealt out to the arms in turn
    length = {q: len(chat_tokens(model, model.chat_template, [{"role": "user", "content": q}])) for q in questions}
    ranked = sorted(questions[per_run:], key=lambda q: (length[q], q))
    step = max(1, len(ranked) // (a.rounds * per_run * len(arms)))
    run(True, questions[:per_run], "on")             # warm-up (not counted)
    rows = []
    for r in range(a.rounds):
        block = ranked[r * per_run * len(arms) * step:(r + 1) * per_run * len(arms) * step:step]
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for arm in (order if r % 2 == 0 else order[::-1]):
            qs = block[arms.index(arm)::len(arms)]
            row = run(arm != "off", qs, arm)
            row["prompt_tokens"] = sum(length[q] for q in qs)
            row["round"] = r
            rows.append(row)
            print(f"round {r} {arm:8s}: {row['tps']:.1f} tokens/s, decode "
                  f"{row['decode']:.2f} s, step rest {row['step_rest']:.2f} s, between {row['between']:.2f} s, "
                  f"prompts {row['prompt_tokens']}, passed {row['passed']} for {row['tokens']}, {row['kinds']}, "
                  f"lookup {sum(row['lookup'].values()) * 1e3:.0f} ms "
                  + " ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(row['lookup'].items())), flush=True)
    by = {arm: [x for x in rows if x["arm"] == arm] for arm in arms}
    for arm in arms:
        if arm == "off":
            continue
        if "off" not in by:
            continue
        ratios = sorted(x["tps"] / y["tps"] for x, y in zip(by[arm], by["off"]))
        print(f"{arm} / off, paired median over {len(ratios)} rounds: {statistics.median(ratios):.3f} "
              f"({', '.join(f'{r:.3f}' for r in ratios)})")
        for key in ("decode", "step_rest", "between"):
            print(f"  {key}: {arm} {statistics.median(x[key] for x in by[arm]):.3f} s, "
                  f"off {statistics.median(x[key] for x in by['off']):.3f} s")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    state.close()


if __name__ == "__main__":
    main()
