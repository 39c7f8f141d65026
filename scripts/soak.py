"""Soak test: one process, many cycles across every mode on the embedded pair, watching memory and
exactness.

    python scripts/soak.py --cycles 10000 --out soak.json

Requests rotate through ar, lossless, prove, mars and spec (the embedded verifier is the draft for
spec) on GSM8K questions from the package's training data, with fixed widths or the planner's
(`auto`), and one request in four sampled at temperature 0.7. Conversations go on for a few turns
(the engine reuses the KV cache of the earlier turns) and are reset at random or when the context is
full; some generations are closed early after a random number of cycles (what a Stop button or
Ctrl-C does). Every `--check-every`-th request of an exact mode (ar, lossless, spec, lookup) is compared
with a fresh decode of the same prompt on a separate, emptied llama.cpp context, by hand, one token
per llama_decode call (no engine): greedy, or for a sampled request the coupled sample of each
position with the request's seed: a full answer must be equal, an early-closed one a prefix. Resident
memory (VmRSS from /proc/self/status) is sampled every `--rss-every` cycles, after a warm-up that
runs every mode once on a 512-token-wide prompt. Any exception or
mismatch counts as an error. The summary is written atomically to --out as JSON.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=10_000, help="cycles to run in all (default 10000)")
    p.add_argument("--out", default="soak.json", help="JSON summary (written atomically; default soak.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new", type=int, default=64, help="max new tokens per request (default 64)")
    p.add_argument("--check-every", type=int, default=10,
                   help="compare with a fresh decode by hand (greedy, or coupled samples of the seed) every N requests of each exact mode (default 10)")
    p.add_argument("--rss-every", type=int, default=200, help="VmRSS sample every N cycles (default 200)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


if __name__ == "__main__":
    build_parser().parse_args()   # --help and bad arguments end here, before llama.cpp is loaded


import numpy as np  # noqa: E402

from prove_local.chat import Conversation  # noqa: E402
from prove_local.engine import Engine, Settings  # noqa: E402
from prove_local.sampling import Sampler  # noqa: E402
from prove_local.errors import ContextFull  # noqa: E402
from prove_local.files import write_atomic  # noqa: E402
from prove_local.llama import Context, Model  # noqa: E402
from prove_local.loading import EMBEDDED_PROPOSER, EMBEDDED_VERIFIER  # noqa: E402
from prove_local.modes import MODES  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "prove_local" / "train" / "data" / "gsm8k_train.jsonl"
FOLLOW_UPS = ["Explain the last step again.", "Are you sure? Check it.", "What if the numbers were doubled?"]


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def fresh_greedy(ctx: Context, prompt: list[int], max_new: int, sampler=None) -> list[int]:
    """Greedy decoding by hand on the reference context, emptied first: the independent reference of
    the exact modes (no engine, no decoding rule). One reference context serves every check, so the
    RSS series is not the allocator's churn of a new context per check. With a coupled sampler
    (sampling.CoupledSampler), each token is its coupled sample at its position instead: what the
    exact modes must commit for that seed."""
    model = ctx.model
    ctx.truncate(0)
    logits = ctx.eval(prompt)[0]
    out: list[int] = []
    while len(out) < max_new and len(prompt) + len(out) < ctx.n_ctx:
        if sampler is None:
            tok = int(np.argmax(logits))
        else:
            prefix = prompt + out
            tok = sampler.draw(sampler.dists(logits[None], prefix)[0], len(prefix))
        out.append(tok)
        if model.is_eog(tok) or len(prompt) + len(out) >= ctx.n_ctx:
            break
        logits = ctx.eval([tok])[0]
    return out


def summarize_rss(loaded: int, series: list[tuple[int, int]]) -> dict:
    """VmRSS after loading, after the warm-up (the series' first sample), its max and last, and the
    growth after the warm-up, in MiB."""
    values = [kib for _, kib in series]
    return {"loaded_mib": round(loaded / 1024, 1), "after_warmup_mib": round(values[0] / 1024, 1),
            "max_mib": round(max(values) / 1024, 1), "last_mib": round(values[-1] / 1024, 1),
            "growth_after_warmup_mib": round((values[-1] - values[0]) / 1024, 1), "samples": len(values)}


def warm_up(engine: Engine, reference: Context, prop: Model, questions: list[str], max_new: int) -> None:
    """One request per mode (and one reference decode) on a prompt that fills a context's batch (512
    tokens): allocations grow to the widest pass seen, so memory measured after this is closer to
    the steady state than to the high-water mark of pass widths still to come."""
    n = min(600, engine.n_ctx - max_new - 16)
    long = prop.tokenize(" ".join(questions), add_special=True)[:n]
    for mode in MODES:
        for _ in engine.generate(long, Settings(mode=mode, max_new=max_new, block=16, draft_k=4)):
            pass
    fresh_greedy(reference, long, max_new)


def soak(cycles: int, *, seed: int = 0, max_new: int = 64, check_every: int = 10, rss_every: int = 200,
         close_early: float = 0.15, follow_up: float = 0.5, threads: int = 1, n_ctx: int = 1024,
         progress: bool = True) -> dict:
    from tqdm import tqdm

    rng = random.Random(seed)
    questions = [json.loads(line)["question"] for line in DATA.read_text().splitlines()[:500]]
    prop, ver = Model(EMBEDDED_PROPOSER), Model(EMBEDDED_VERIFIER)
    options = dict(n_ctx=n_ctx, n_threads=threads, type_k="f32", type_v="f32")    # F32: exact modes equal ar
    engine = Engine.load(prop, ver, ver, **options)
    reference = Context(prop, **options)
    modes = list(MODES)
    stats = {m: {"requests": 0, "sampled": 0, "cycles": 0, "tokens": 0} for m in modes}
    counts = {"requests": 0, "cycles": 0, "early_closes": 0, "follow_up_turns": 0, "context_full_resets": 0,
              "checks": 0, "mismatches": 0, "errors": 0}
    errors: list[str] = []
    loaded = rss_kib()
    warm_up(engine, reference, prop, questions[:40], max_new)
    rss: list[tuple[int, int]] = [(0, rss_kib())]
    conv = Conversation(prop)
    bar = tqdm(total=cycles, desc="soak", unit="cycle", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    t0 = time.perf_counter()
    next_rss = rss_every
    while counts["cycles"] < cycles:
        mode = modes[counts["requests"] % len(modes)]
        if conv.messages and rng.random() < follow_up:
            user = rng.choice(FOLLOW_UPS)
            counts["follow_up_turns"] += 1
        else:
            conv = Conversation(prop)
            user = rng.choice(questions)
        # widths fixed or the planner's ("auto"); one request in four sampled at T = 0.7 (the coupled
        # sampler: checked against ar sampling by hand with the same seed, token for token)
        temperature = 0.7 if rng.random() < 0.25 else 0.0
        settings = Settings(mode=mode, max_new=max_new, block=rng.choice([4, 8, 16, "auto"]), theta=0.05, tau=0.9,
                            draft_k=rng.choice([2, 4, "auto"]), temperature=temperature,
                            seed=rng.randrange(1 << 30))
        stop_after = rng.randint(1, 6) if rng.random() < close_early else None
        counts["requests"] += 1
        stats[mode]["requests"] += 1
        stats[mode]["sampled"] += temperature > 0
        prompt = conv.prompt_tokens(user)
        out: list[int] = []
        n = 0
        try:
            gen = engine.generate(prompt, settings)
            try:
                for cycle in gen:
                    out += cycle.committed
                    n += 1
                    if stop_after is not None and n >= stop_after:
                        counts["early_closes"] += 1
                        break
            finally:
                gen.close()
        except ContextFull:
            counts["context_full_resets"] += 1
            conv = Conversation(prop)
            continue
        except Exception as e:   # noqa: BLE001 - the soak counts every failure
            counts["errors"] += 1
            errors.append(f"request {counts['requests']} ({mode}): {type(e).__name__}: {e}")
            conv = Conversation(prop)
            continue
        finally:
            counts["cycles"] += n
            stats[mode]["cycles"] += n
            stats[mode]["tokens"] += len(out)
            bar.update(n)
        if MODES[mode].exact and stats[mode]["requests"] % check_every == 1 % check_every:
            counts["checks"] += 1
            want = fresh_greedy(reference, prompt, max_new, Sampler.for_settings(settings, settings.seed))
            ok = out == want[:len(out)] if stop_after is not None else out == want
            if not ok:
                counts["mismatches"] += 1
                counts["errors"] += 1
                errors.append(f"request {counts['requests']} ({mode}, T {temperature:g}): differs from a fresh "
                              "decode by hand")
        conv.add_reply(prop.detokenize([t for t in out if not prop.is_eog(t)]))
        if len(conv.messages) > 6:
            conv = Conversation(prop)
        if counts["cycles"] >= next_rss:
            rss.append((counts["cycles"], rss_kib()))
            next_rss += rss_every
    rss.append((counts["cycles"], rss_kib()))
    bar.close()
    reference.close()
    return {
        "settings": {"cycles": cycles, "seed": seed, "max_new": max_new, "check_every": check_every,
                     "rss_every": rss_every, "close_early": close_early, "follow_up": follow_up, "threads": threads,
                     "n_ctx": n_ctx, "models": [str(EMBEDDED_PROPOSER.name), str(EMBEDDED_VERIFIER.name)],
                     "draft": "the embedded verifier"},
        "seconds": round(time.perf_counter() - t0, 1),
        **counts,
        "modes": stats,
        "rss_kib": rss,
        "rss": summarize_rss(loaded, rss),
        "error_messages": errors[:50],
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    res = soak(args.cycles, seed=args.seed, max_new=args.max_new, check_every=args.check_every,
               rss_every=args.rss_every, threads=args.threads, progress=not args.quiet)
    write_atomic(Path(args.out), json.dumps(res, indent=1) + "\n")
    r = res["rss"]
    print(f"soak: {res['cycles']} cycles, {res['requests']} requests ({res['early_closes']} closed early, "
          f"{res['follow_up_turns']} follow-up turns), {res['checks']} checks against a fresh decode by hand, "
          f"{res['errors']} errors; VmRSS {r['loaded_mib']} MiB loaded, {r['after_warmup_mib']} after warm-up, "
          f"max {r['max_mib']}, last {r['last_mib']} ({res['seconds']} s) -> {args.out}", file=sys.stderr)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
