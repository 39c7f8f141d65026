"""Planner variants against `ar` and each other in ONE process: on the embedded pair (8 GSM8K dev
questions, 1 thread, greedy, 256 tokens), every prompt is answered by `ar` and by `lossless` (block and
lookup `auto`) under each variant, the order rotating and flipping from prompt to prompt and round to
round, after an untimed `ar` request that leaves every timed one the same cache state (the first
request after a new prompt pays its prefill's slow first passes: run first always, a variant looked
~2 % slower). Per variant: the median over rounds of the per-prompt median of (variant / `ar` on the
same prompt, seconds apart), each prompt's median and mean over rounds (a copying answer's is bimodal:
its drafts start early or late), its median cycles, and the regret share. Separate processes (scripts/embedded_pair.py run twice) resolve ~1-2 %; this, ~0.5 %.

    python dev/planner_ab.py --variants default,no-climb,no-explore --rounds 30

`--fresh`: every round, each variant answers the 8 prompts in a NEW engine (the model loaded once), as
one `prove-local bench` run does: what a fresh process pays while its planner knows nothing yet. Each
prompt is still answered by `ar` and the variant back to back in that engine (order flipping). The memory
variants (`memory`, `memory-cold`, `memory-lookup`) keep the planner's memory on, each in a cache folder of its
own (a copy of the calibration cache): each new engine of the variant starts from what its last one left.

Variants (VARIANTS below): `default` (the code as it is), `no-climb` (planner.CLIMB off: the slow start
waits for exploration draws), `no-explore` (explore = 0: no exploration draws or probes),
`sample-32` (ar cycles of a clear run sampled 1 in 32 instead of AR_SAMPLE_CLEAR), `no-floor` (lookup
explorations at any expected rate, EXPLORE_FLOOR = 0), `no-lookup` (Settings lookup = 0: MARS blocks
alone), `no-lookup-explore` (both off: what `lossless` costs where it can only run `ar`), `no-lane` (planner.LANE
off: every quiet cycle planned and observed), `no-backoff-lane` (planner.BACKOFF_LANE off: the index's
back-off's cycles planned and observed one by one), `draws-planned` (every exploration draw of a clear run
handed to plan_cycle, as before Planner._explorable), `reset-cap` (after a rejected lookup draft the
slow start's cap falls back to what was accepted + 1, LOOKUP_KEEP = 0, instead of keeping half),
`explore-local` (lookup explorations judged by the request's record alone, EXPLORE_PRIOR off), `backoff-16`/`-32`/`-64`
(the index's back-off up to 16/32/64 cycles instead of LOOKUP_BACKOFF's 4: a copy found later, the index asked
less often), `bare` (lookup and exploring off, and neither
quiet_cycle nor observe called: the floor of what `lossless` costs beside `ar` in this engine).
"""
from __future__ import annotations

import argparse
import collections
import copy
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import prove_local.planner as P  # noqa: E402
from prove_local.bench.data import load_prompts  # noqa: E402
from prove_local.chat import Conversation  # noqa: E402
from prove_local.engine import Engine, Settings  # noqa: E402
from prove_local.llama import Model, kv_options  # noqa: E402
from prove_local.loading import EMBEDDED_PROPOSER  # noqa: E402

DATA = ROOT.parent / "shared" / "datasets" / "gsm8k" / "test_dev.jsonl"
# name -> (module constants of planner.py, Planner attributes[, Settings fields]), set before each of its requests
VARIANTS = {
    "default": ({}, {}),
    "no-climb": ({"CLIMB": False}, {}),
    "no-explore": ({}, {"explore": 0.0}),
    "sample-32": ({"AR_SAMPLE_CLEAR": 32}, {}),
    "no-floor": ({"EXPLORE_FLOOR": 0.0}, {}),
    "no-lane": ({"LANE": False}, {}),
    "no-backoff-lane": ({"BACKOFF_LANE": False}, {}),
    "reset-cap": ({"LOOKUP_KEEP": 0.0}, {}),
    "explore-local": ({"EXPLORE_PRIOR": False}, {}),
    "draws-planned": ({}, {"_explorable": lambda *a: True}),
    "no-lookup": ({}, {}, {"lookup": 0}),
    "no-lookup-explore": ({}, {"explore": 0.0}, {"lookup": 0}),
    "no-lookup-explore-lane": ({"LANE": False}, {"explore": 0.0}, {"lookup": 0}),
    # --fresh only: a new engine whose planner starts from what a warm one learned on other questions
    # (--prior N GSM8K train questions answered first): its statistics, costs and switch record; "+choice"
    # also its current choices and replan state
    "prior": ({}, {}),
    "prior+choice": ({}, {}),
    "prior-stats": ({}, {}),                       # the acceptance statistics alone
    "prior-costs": ({}, {}),                       # the host-time and switch records alone
    # --fresh only: the planner's memory on (calibrate.save_memory, in a cache folder of this run's own
    # with a copy of the calibration): each new engine of this variant starts from what its last one
    # left; every other variant runs with PROVE_LOCAL_MEMORY=0
    "memory": ({}, {}),
    "memory-cold": ({"WARM": False}, {}),          # the memory on, the first plans made by the first request (not at prepare)
    "memory-lookup": ({"MEMORY_LOOKUP": True}, {}),   # the memory on, the lookup drafts' record in it too
    "memory-no-lookup": ({"MEMORY_LOOKUP": False}, {}),   # the memory on, without the lookup drafts' record
    "memory-no-loss-check": ({"LOOKUP_LOSS_CHECK": False}, {}),   # the memory on, lookup explorations judged by the spent budget alone
    "no-loss-check": ({"LOOKUP_LOSS_CHECK": False}, {}),
    "backoff-16": ({"LOOKUP_BACKOFF": 16}, {}),
    "backoff-64": ({"LOOKUP_BACKOFF": 64}, {}),
    "backoff-32": ({"LOOKUP_BACKOFF": 32}, {}),
    "bare": ({}, {"explore": 0.0, "quiet_cycle": lambda *a: True, "observe": lambda *a, **k: False}, {"lookup": 0}),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="default,no-climb")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None, help="also write the per-round ratios as JSON here")
    ap.add_argument("--fresh", action="store_true", help="a new engine per round and variant (as each bench run)")
    ap.add_argument("--prior", type=int, default=16, help="--fresh: train questions the prior variants' warm engine answers")
    a = ap.parse_args()
    names = a.variants.split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; known: {', '.join(VARIANTS)}")
    import os
    import shutil
    import tempfile

    from prove_local.calibrate import cache_path
    cache = Path(tempfile.mkdtemp(prefix="planner-ab-"))
    if cache_path().exists():
        shutil.copy(cache_path(), cache / "calibration.json")
    os.environ["PROVE_LOCAL_CACHE"], os.environ["PROVE_LOCAL_MEMORY"] = str(cache), "0"
    model = Model(str(EMBEDDED_PROPOSER))

    def new_engine() -> Engine:
        e = Engine.load(model, n_ctx=4096, n_threads=1, flash_attn="auto", **kv_options(model.default_kv_type))
        e.prepare(Settings(mode="lossless", block="auto"))
        return e

    engine = new_engine()
    pl = engine.planner
    saved = ({k: getattr(P, k) for v in VARIANTS.values() for k in v[0]},
             {k: getattr(pl, k) for v in VARIANTS.values() for k in v[1]})
    kinds = collections.Counter()
    snapshot = {}
    if any(n.startswith("prior") for n in names):
        train = [Conversation(model).prompt_tokens(p.text) for p in load_prompts(str(DATA.parent / "train.jsonl"), a.prior)]
        for toks in train:
            list(engine.generate(toks, Settings(mode="lossless", max_new=a.max_new, temperature=0.0, block="auto")))
        learned = ("stats", "overhead", "_after_wide", "_after_start", "_ar_seen")
        choice = ("current", "age", "_settled", "_options", "_hopeless", "_fresh")
        snapshot = {"prior": {k: copy.deepcopy(getattr(pl, k)) for k in learned},
                    "prior+choice": {k: copy.deepcopy(getattr(pl, k)) for k in learned + choice},
                    "prior-stats": {"stats": copy.deepcopy(pl.stats)},
                    "prior-costs": {k: copy.deepcopy(getattr(pl, k)) for k in learned if k != "stats"}}
        engine.close()
        engine = new_engine()
    prompts = [Conversation(model).prompt_tokens(p.text) for p in load_prompts(str(DATA), 8)]
    arms = ["ar"] + names
    ratios = {n: [[] for _ in prompts] for n in names}
    cycles = {n: [[] for _ in prompts] for n in names}
    regret = collections.Counter()

    def answer(arm: str, toks: list[int]):
        pl = engine.planner
        for k, v in saved[0].items():
            setattr(P, k, v)
        for k, v in saved[1].items():
            if callable(v):
                pl.__dict__.pop(k, None)          # (a method: the planner's own again)
            else:
                setattr(pl, k, v)
        if arm != "ar":
            for k, v in VARIANTS[arm][0].items():
                setattr(P, k, v)
            for k, v in VARIANTS[arm][1].items():
                setattr(pl, k, v)
        r0, e0 = pl.regret, pl.elapsed
        fields = dict(mode="ar" if arm == "ar" else "lossless", max_new=a.max_new, temperature=0.0, block="auto",
                      lookup=0 if arm == "ar" else "auto")
        if arm != "ar":
            fields.update(VARIANTS[arm][2] if len(VARIANTS[arm]) > 2 else {})
        gen = engine.generate(toks, Settings(**fields))
        out = list(gen)
        regret[arm, "r"] += pl.regret - r0
        regret[arm, "e"] += pl.elapsed - e0
        if arm != "ar":
            for c in out:
                label = c.plan.kind if c.plan.kind == "ar" else ("lookup" if c.plan.lookup else f"block{c.plan.block}")
                kinds[arm, label, "cycles"] += 1
                kinds[arm, label, "tokens"] += len(c.committed)
        return gen.request.n_tokens / gen.request.decode_seconds, len(out), [t for c in out for t in c.committed]

    def one_pass(r: int, i: int, toks: list[int], arms_now: list[str]) -> dict:
        k = (r + i) % len(arms_now)
        order = arms_now[k:] + arms_now[:k]
        if (r + i) % 2:
            order = order[::-1]
        list(engine.generate(toks, Settings(mode="ar", max_new=8, temperature=0.0)))   # (the prefill, untimed)
        return {arm: answer(arm, toks) for arm in order}

    try:
        for r in range(a.rounds + 1 if not a.fresh else 0):
            for i, toks in enumerate(prompts):
                k = (r + i) % len(arms)
                order = arms[k:] + arms[:k]
                if (r + i) % 2:
                    order = order[::-1]
                list(engine.generate(toks, Settings(mode="ar", max_new=8, temperature=0.0)))   # (the prefill, untimed)
                res = {arm: answer(arm, toks) for arm in order}
                if any(res[n][2] != res["ar"][2] for n in names):
                    raise SystemExit(f"prompt {i}: a variant's tokens differ from ar's")
                if r == 0:
                    continue                      # (untimed: the engine warm)
                for n in names:
                    ratios[n][i].append(res[n][0] / res["ar"][0])
                    cycles[n][i].append(res[n][1])
            print(f"round {r}/{a.rounds}", file=sys.stderr, flush=True)
        for r in range(a.rounds if a.fresh else 0):
            for n in (names if r % 2 == 0 else names[::-1]):
                engine.close()
                os.environ["PROVE_LOCAL_MEMORY"] = "1" if n.startswith("memory") else "0"
                if n.startswith("memory"):            # (each memory variant a cache folder of its own)
                    own = cache / n
                    if not own.is_dir():
                        own.mkdir()
                        if (cache / "calibration.json").exists():
                            shutil.copy(cache / "calibration.json", own / "calibration.json")
                    os.environ["PROVE_LOCAL_CACHE"] = str(own)
                else:
                    os.environ["PROVE_LOCAL_CACHE"] = str(cache)
                for k, v in saved[0].items():
                    setattr(P, k, VARIANTS[n][0].get(k, v))      # (the variant's constants at prepare too)
                engine = new_engine()
                for k, v in snapshot.get(n, {}).items():
                    setattr(engine.planner, k, copy.deepcopy(v))
                for i, toks in enumerate(prompts):
                    res = one_pass(r, i, toks, ["ar", n])
                    if res[n][2] != res["ar"][2]:
                        raise SystemExit(f"prompt {i}: {n}'s tokens differ from ar's")
                    ratios[n][i].append(res[n][0] / res["ar"][0])
                    cycles[n][i].append(res[n][1])
                for k, v in saved[0].items():
                    setattr(P, k, VARIANTS[n][0].get(k, v))      # (the last answer may have been ar's)
                engine.close()                  # (its memory written while the variant's setting holds)
                os.environ["PROVE_LOCAL_MEMORY"] = "0"
            print(f"round {r + 1}/{a.rounds}", file=sys.stderr, flush=True)
    finally:
        engine.close()
        shutil.rmtree(cache, ignore_errors=True)
    out = {}
    for n in names:
        per_round = [statistics.median(ratios[n][i][r] for i in range(len(prompts))) for r in range(a.rounds)]
        out[n] = {"per_prompt": statistics.median(per_round),
                  "prompts": [statistics.median(x) for x in ratios[n]],
                  "prompts_mean": [statistics.mean(x) for x in ratios[n]],
                  "cycles": [statistics.median(x) for x in cycles[n]],
                  "regret_share": regret[n, "r"] / max(1e-12, regret[n, "e"]), "rounds": per_round}
        print(f"{n:11s} per prompt {out[n]['per_prompt']:.3f}   prompts "
              + " ".join(f"{x:.3f}" for x in out[n]["prompts"])
              + "   means " + " ".join(f"{x:.3f}" for x in out[n]["prompts_mean"])
              + "   cycles " + " ".join(f"{x:.0f}" for x in out[n]["cycles"])
              + f"   regret {100 * out[n]['regret_share']:.2f} %")
        shares = {lab: (kinds[n, lab, "cycles"], kinds[n, lab, "tokens"]) for (v, lab, f) in kinds if v == n and f == "cycles"}
        out[n]["kinds"] = shares
        print("            " + "  ".join(f"{lab}: {c} cycles {t} tokens" for lab, (c, t) in sorted(shares.items())))
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
