"""Several requests decoded in one llama_decode per step (prove_local/batching.py), on real llama.cpp
contexts with tiny random-weight F32 models and an F32 KV cache: each request's output in a batch is
the same request's output alone, token for token (greedy and seeded sampling), with requests in flight
at different phases (different prompt lengths, one finishing early, one in prefill while the others
decode, modes mixed); every sequence's cache then holds exactly its committed tokens (bitwise the
logits of a fresh context); one request's decode error, cancellation or abandoned consumer never ends
or hangs another; the pool's engines share the contexts."""
from __future__ import annotations

import math
import threading
from dataclasses import replace

import numpy as np
import pytest

from prove_local.batching import PENDING, Shared, SeqView
from prove_local.engine import Engine, Settings, batch_summary
from prove_local.errors import ContextFull, LlamaError
from prove_local.llama import Context, Model
from prove_local.loading import Loaded
from prove_local.planner import Costs, Planner
from prove_local.pool import EnginePool
from tests.reference import next_logits
from tests.tiny import tiny_gguf

F32 = dict(n_ctx=512, n_threads=1, type_k="f32", type_v="f32", n_batch=64)   # a 200-token prompt: 4 chunks
SLOTS = 4
LONG = 60.0          # a step waits this long for a parked engine: batching in these tests is by the barrier


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("batching")
    prop = Model(tiny_gguf(d, seed=0))
    ver = Model(tiny_gguf(d, seed=1, hidden=32, role="verifier"))
    draft = Model(tiny_gguf(d, seed=0, mask=False, role="verifier"))   # the proposer's weights: long accepted drafts
    yield {"target": prop, "verifier": ver, "draft": draft}


@pytest.fixture(scope="module")
def solo(models):
    return Engine.load(models["target"], models["verifier"], models["draft"], **F32)


def shared_engines(models, n=SLOTS, grace=LONG, **opts):
    shared = Shared(models, n, grace=grace, **{**F32, **opts})
    engines = []
    for i in range(n):
        e = Engine.load(models["target"], models["verifier"], models["draft"], contexts=shared.views(i), **F32)
        e.member = shared.members[i]
        engines.append(e)
    return shared, engines


def prompt(models, i: int, n: int) -> list[int]:
    """A prompt of n tokens, different for each i."""
    base = models["target"].tokenize(f"Question {i}: what is {i} + {3 * i}? The quick brown fox {i}. ")
    return (base * (n // len(base) + 1))[:n]


def alone(engine, p, s) -> list[int]:
    return [t for c in engine.generate(p, s) for t in c.committed]


def solo_cycles(engine, job) -> list:
    return list(engine.generate(job[0], job[1]))


def run_together(engines, jobs):
    """jobs[i] = (prompt, Settings, start) on engines[i] in its own thread; `start` None (at once) or
    (j, k): after job j has yielded its k-th cycle. Returns (outputs, cycles, errors) per job."""
    n = len(jobs)
    outs, cycles, errors = [None] * n, [[] for _ in range(n)], [None] * n
    seen = [threading.Event() for _ in range(n)]
    reached = {}
    gate = threading.Barrier(sum(1 for j in jobs if j[2] is None))

    def work(i):
        p, s, start = jobs[i]
        try:
            if start is None:
                gate.wait()
            else:
                reached.setdefault(start, threading.Event()).wait()
            out = []
            for c in engines[i].generate(p, s):
                cycles[i].append(c)
                out += c.committed
                key = (i, len(cycles[i]))
                if key in reached:
                    reached[key].set()
            outs[i] = out
        except BaseException as e:       # noqa: BLE001 - reported by the test
            errors[i] = e
        finally:
            seen[i].set()
            for (j, _), ev in reached.items():      # a job that ends early releases the ones waiting on it
                if j == i:
                    ev.set()

    for j in jobs:
        if j[2] is not None:
            reached[j[2]] = threading.Event()
    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs, cycles, errors


def batched_cycles(cycles) -> int:
    return sum(1 for c in cycles if any(b[0] > 1 for bs in c.batch.values() for b in bs))


def check_caches(models, engines):
    """Every sequence's cache holds exactly its engine's committed tokens: the next-token logits of
    each view equal, bitwise, those of a fresh context fed the same tokens."""
    for e in engines:
        for role, view in e.contexts.items():
            if not e.tokens or view.n_past == 0:
                continue
            with Context(models[role], **F32) as fresh:
                want = next_logits(fresh, e.tokens)
            assert np.array_equal(next_logits(view, e.tokens), want), role


def test_one_step_is_one_llama_decode_with_each_sequence_exact(models):
    """Two sequences' passes of different widths in one step: one llama_decode, and each pass's rows
    bitwise those of a context of its own."""
    shared, _ = shared_engines(models, 2)
    try:
        ctx = shared.contexts["target"]
        a, b = (SeqView(ctx, i, shared.members[i]) for i in (0, 1))
        pa, pb = prompt(models, 1, 7), prompt(models, 2, 3)
        for m in shared.members:
            m.resume()                    # both in their generation: the step waits for both passes
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("a", a.eval(pa, rows=[6, 2, 4])))
        before = ctx.n_decode
        t.start()
        while shared.members[0].state != PENDING:
            t.join(0.01)
        got["b"] = b.eval(pb, rows=[0, 2])
        t.join()
        assert ctx.n_decode == before + 1
        assert a.batches[-1] == b.batches[-1] == (2, 10)
        for m in shared.members:
            m.leave()
        with Context(models["target"], **F32) as fresh:
            assert np.array_equal(got["a"], fresh.eval(pa, rows=[6, 2, 4]))
            fresh.truncate(0)
            assert np.array_equal(got["b"], fresh.eval(pb, rows=[0, 2]))
        a.truncate(3)
        assert (a.n_past, b.n_past) == (3, 3)
        with Context(models["target"], **F32) as fresh:   # b's cache was not touched by a's truncate
            assert np.array_equal(next_logits(b, pb), next_logits(fresh, pb))
    finally:
        shared.close()


def test_each_sequence_has_the_context_size_asked_for(models):
    shared, _ = shared_engines(models, 3, n_batch=512)
    try:
        ctx = shared.contexts["target"]
        views = [SeqView(ctx, i, shared.members[i]) for i in range(3)]
        assert all(v.n_ctx == 512 for v in views)
        views[1].eval(prompt(models, 5, 512), rows=[])
        with pytest.raises(ContextFull, match="512-token context"):
            views[1].eval([5])
        views[0].eval(prompt(models, 6, 300), rows=[])
        views[2].eval(prompt(models, 7, 511), rows=[])
        assert [v.n_past for v in views] == [300, 512, 511]
    finally:
        shared.close()


MIXED = [  # (prompt index, prompt length, settings, start)
    (0, 9, Settings(mode="ar", max_new=48), None),
    (1, 23, Settings(mode="lossless", max_new=64, block=4), None),
    (2, 5, Settings(mode="spec", max_new=12, draft_k=3), None),                 # finishes early
    (3, 200, Settings(mode="lossless", max_new=40, block=8), (0, 6)),          # prefills while the others decode
]


def test_mixed_requests_in_flight_equal_their_solo_runs(models, solo):
    shared, engines = shared_engines(models)
    try:
        jobs = [(prompt(models, i, n), s, start) for i, n, s, start in MIXED]
        want = [alone(solo, p, s) for p, s, _ in jobs]
        outs, cycles, errors = run_together(engines, jobs)
        assert errors == [None] * len(jobs)
        for i, (out, w) in enumerate(zip(outs, want)):
            assert out == w, f"request {i} ({jobs[i][1].mode}) differs from its run alone"
        assert len(outs[2]) == 12 and len(outs[0]) == 48
        assert all(batched_cycles(c) > 0 for c in cycles[:2]), "no cycle was decoded with another request"
        b = batch_summary(cycles[1])
        assert b["sequences_max"] >= 2 and b["decodes"] == sum(sum(c.passes.values()) for c in cycles[1])
        assert batch_summary(solo_cycles(solo, jobs[1])) is None
        assert batched_cycles(cycles[3]) > 0
        for cs in cycles:                 # passes counted per cycle = the rule's declared passes
            for c in cs:
                assert c.passes == {r: sum(math.ceil(x / F32["n_batch"]) for x in w) for r, w in c.widths.items() if w}
                assert {r: len(b) for r, b in c.batch.items()} == c.passes
        check_caches(models, engines)
        # the next request on each engine reuses its sequence's prefix and is still exact
        outs2, _, errors2 = run_together(engines, [(p + o[:3], Settings(mode="lossless", max_new=20, block=4), None)
                                                   for (p, _, _), o in zip(jobs, outs)])
        assert errors2 == [None] * len(jobs)
        for (p, _, _), o, o2 in zip(jobs, outs, outs2):
            assert o2 == alone(solo, p + o[:3], Settings(mode="lossless", max_new=20, block=4))
    finally:
        shared.close()


def test_a_request_alone_decodes_on_its_own_thread_and_batching_resumes_with_company(models, solo):
    """A request with no other generation in the pool decodes its passes on its own thread (no hand-off
    to the batch thread and back), each pass a step of one sequence; once two requests are in flight,
    their passes share steps again. Outputs equal the solo engine's."""
    shared, engines = shared_engines(models, n=2)
    try:
        batcher = shared.batcher
        job = (prompt(models, 0, 40), Settings(mode="lossless", max_new=48, block=4), None)
        assert alone(engines[0], job[0], job[1]) == alone(solo, job[0], job[1])
        assert batcher._thread is None and batcher.steps == batcher.decodes > 0
        # the second request starts once the first has handed over its first cycle: both are then in
        # their generations, whichever thread runs first
        jobs = [job, (prompt(models, 1, 30), Settings(mode="ar", max_new=24), (0, 1))]
        outs, cycles, errors = run_together(engines, jobs)
        assert errors == [None, None] and outs == [alone(solo, p, s) for p, s, _ in jobs]
        assert batcher._thread is not None and all(batched_cycles(c) > 0 for c in cycles)
        check_caches(models, engines)
    finally:
        shared.close()


def test_planned_widths_and_prove_in_a_batch_equal_greedy(models, solo):
    """The planner's widths (block auto, calibrated) and prove with a gate that never passes: exact too."""
    shared, engines = shared_engines(models, 3)
    try:
        jobs = [(prompt(models, 10, 14), Settings(mode="lossless", max_new=40, block="auto"), None),
                (prompt(models, 11, 30), Settings(mode="prove", max_new=40, block=6, theta=1.01), None),
                (prompt(models, 12, 8), Settings(mode="lookup", max_new=40, lookup=3), None)]
        want = [alone(solo, p, Settings(mode="ar", max_new=40)) for p, _, _ in jobs]
        outs, cycles, errors = run_together(engines, jobs)
        assert errors == [None] * 3
        assert outs == want
        assert sum(batched_cycles(c) for c in cycles) > 0
        check_caches(models, engines)
    finally:
        shared.close()


def test_a_batched_planner_prices_widths_against_the_step_it_joins(models, solo, monkeypatch):
    """Engine._load: while another engine generates, the planner gets the other sequences' tokens of
    the recent steps (SeqView.others) as its load; alone, none. The output stays greedy's."""
    loads = []
    real = Planner.set_load

    def record(self, load, sequences=0):
        loads.append((self, dict(load), sequences))
        real(self, load, sequences)

    monkeypatch.setattr(Planner, "set_load", record)
    shared, engines = shared_engines(models, 2)
    try:
        alone(engines[0], prompt(models, 16, 6), Settings(mode="lossless", max_new=2, block="auto"))  # (calibrated)
        loads.clear()
        jobs = [(prompt(models, 13, 12), Settings(mode="lossless", max_new=30, block="auto"), None),
                (prompt(models, 14, 20), Settings(mode="ar", max_new=30), None)]
        want = [alone(solo, p, Settings(mode="ar", max_new=30)) for p, _, _ in jobs]
        outs, cycles, errors = run_together(engines, jobs)
        assert errors == [None, None] and outs == want
        mine = [(ld, k) for pl, ld, k in loads if pl is engines[0].planner]
        # the ar request feeds one token a step (its prefill: 19 in the first): the load seen is 1
        assert mine and any(ld.get("target") == 1 and k == 1 for ld, k in mine), mine
        assert all(ld.get("target", 0) <= 19 and k <= 1 for ld, k in mine)
        assert list(engines[0].contexts["target"].others)       # recorded per stock pass
        # a batched cycle waits for the other request's share of its decodes (Cycle.waited), and what is
        # left of its time beside its own decode share is its host time (the planner's overhead)
        shared_cycles = [c for c in cycles[0] if any(k > 1 for bs in c.batch.values() for k, _ in bs)]
        assert shared_cycles and all(c.waited > 0 for c in shared_cycles)
        assert all(0 <= c.waited <= c.seconds - sum(c.decode_seconds.values()) + 1e-9 for c in cycles[0])
        loads.clear()
        alone(engines[0], prompt(models, 15, 10), Settings(mode="lossless", max_new=8, block="auto"))
        # nobody else generating (given once, when the other request ended: Engine.plan passes a load on
        # only when it was read again)
        assert all(ld == {} and k == 0 for _, ld, k in loads)
        assert engines[0].planner.costs.load == {} and engines[0].planner.costs.step_rest() == (0.0, 0.0)
    finally:
        shared.close()


def test_batched_requests_run_their_planners_lanes_and_stay_exact(models, solo):
    """In a pool, as alone, the quiet ar cycles of a planner that chose ar run in lanes (Planner._grant):
    two lossless requests in flight together (without lookup drafts: a pool's load that moves makes a
    lookup table stale, and its quiet cycles are no clear run until a match may use it), over half of
    their cycles neither planned nor observed (a lane ends at each sampled ar cycle, 1 in 8 here),
    each output its solo run's and each cache its committed tokens."""
    shared, engines = shared_engines(models, 2)
    try:
        calls = []
        for i, e in enumerate(engines):
            steep = {1: 1.0, 2: 3.0, 64: 200.0}          # (nothing wider than one token pays)
            e.planner = pl = Planner(Costs({"target": steep}), explore=0.02, seed=i)
            quiet, observe = pl.quiet_cycle, pl.observe
            pl.quiet_cycle = lambda *a, quiet=quiet, **k: calls.append("q") or quiet(*a, **k)
            pl.observe = lambda *a, observe=observe, **k: calls.append("o") or observe(*a, **k)
        jobs = [(prompt(models, 17, 12), Settings(mode="lossless", max_new=80, block="auto", lookup=0), None),
                (prompt(models, 18, 20), Settings(mode="lossless", max_new=80, block="auto", lookup=0), None)]
        want = [alone(solo, p, Settings(mode="ar", max_new=80)) for p, _, _ in jobs]
        outs, cycles, errors = run_together(engines, jobs)
        assert errors == [None, None] and outs == want
        n = sum(len(c) for c in cycles)
        assert sum(batched_cycles(c) for c in cycles) > n / 4
        assert calls.count("o") < n / 2 and calls.count("q") < n / 2, (calls.count("o"), calls.count("q"), n)
        check_caches(models, engines)
    finally:
        shared.close()


def test_the_load_is_read_again_every_load_every_passes():
    """Engine._load reads the medians of the last LOAD_PASSES stock passes' loads (SeqView.others) once per
    LOAD_EVERY target passes and hands back the same object in between (Engine.plan passes a load on to
    the planner only when it is another object, or to new costs); alone it is ALONE at once."""
    import collections
    from types import SimpleNamespace

    from prove_local.engine import ALONE, LOAD_EVERY, LOAD_PASSES
    view = SimpleNamespace(others=collections.deque(maxlen=16), n_decode=0)
    busy = [True]
    e = Engine({"target": view}, is_eog=lambda t: False, mask_token=None, n_ctx=64)
    e.member = SimpleNamespace(batcher=SimpleNamespace(others_generating=lambda m: busy[0]))

    def step(others, tokens):
        view.others.append((others, tokens))
        view.n_decode += 1
    for _ in range(LOAD_PASSES):
        step(3, 3)
    first = e._load()
    assert first == ({"target": 3}, 3)
    for i in range(1, LOAD_EVERY):                        # a prefill beside: not read until LOAD_EVERY passes
        step(3, 40)
        assert e._load() is first, i
    step(3, 40)                                            # 4 of the last 8 passes at 40 tokens: the upper median
    assert e._load() == ({"target": 40}, 3)
    busy[0] = False
    assert e._load() is ALONE
    busy[0] = True
    assert e._load() == ({"target": 40}, 3)               # (read at once after being alone)


@pytest.mark.parametrize("sampler", ["coupled", "rejection"])
def test_seeded_sampling_in_a_batch_equals_the_same_request_alone(models, solo, sampler):
    shared, engines = shared_engines(models, 3)
    try:
        kw = dict(temperature=0.9, sampler=sampler)
        jobs = [(prompt(models, 20, 11), Settings(mode="ar", max_new=40, seed=1, **kw), None),
                (prompt(models, 21, 17), Settings(mode="lossless", max_new=40, block=4, seed=2, **kw), None),
                (prompt(models, 22, 6), Settings(mode="spec", max_new=30, draft_k=3, seed=3, **kw), (0, 4))]
        want = [alone(solo, p, s) for p, s, _ in jobs]
        outs, cycles, errors = run_together(engines, jobs)
        assert errors == [None] * 3
        assert outs == want
        assert sum(batched_cycles(c) for c in cycles) > 0
    finally:
        shared.close()


def test_a_failing_decode_fails_only_its_request(models, solo):
    """A prompt with a token outside the vocabulary: llama.cpp refuses the whole batch it is in; the
    step retries each pass alone, so only that request fails, and its engine serves the next one."""
    shared, engines = shared_engines(models, 3)
    try:
        bad = prompt(models, 30, 10)
        bad[4] = models["target"].n_vocab + 7
        jobs = [(prompt(models, 31, 12), Settings(mode="ar", max_new=40), None),
                (bad, Settings(mode="lossless", max_new=40, block=4), None),
                (prompt(models, 32, 20), Settings(mode="lossless", max_new=40, block=4), None)]
        outs, _, errors = run_together(engines, jobs)
        assert isinstance(errors[1], LlamaError) and "llama_decode failed" in str(errors[1])
        assert errors[0] is None and errors[2] is None
        assert outs[0] == alone(solo, *jobs[0][:2]) and outs[2] == alone(solo, *jobs[2][:2])
        assert engines[1].contexts["target"].n_past == 0      # nothing of the failed pass stays
        good = prompt(models, 33, 9)
        assert alone(engines[1], good, Settings(mode="lossless", max_new=20, block=4)) == \
            alone(solo, good, Settings(mode="lossless", max_new=20, block=4))
        check_caches(models, engines)
    finally:
        shared.close()


def test_cancelled_and_abandoned_requests_never_stop_the_others(models, solo):
    """Request 0 is closed after 3 cycles; request 1's consumer stops iterating after 2 cycles and
    neither closes nor drops its generation (it is waited for a grace period, not forever); the
    others finish exactly, and both engines then serve exact requests."""
    shared, engines = shared_engines(models, 4, grace=0.005)
    try:
        s = Settings(mode="lossless", max_new=40, block=4)
        held = {}
        done = threading.Event()

        def cancel():
            g = engines[0].generate(prompt(models, 40, 10), s)
            for k, _ in enumerate(g):
                if k == 2:
                    break
            g.close()

        def abandon():
            g = engines[1].generate(prompt(models, 41, 10), s)
            held["g"] = g
            next(g), next(g)
            done.wait()              # holds the open generation until the others are done

        jobs = [(prompt(models, 42, 15), s, None), (prompt(models, 43, 7), Settings(mode="ar", max_new=50), None)]
        side = [threading.Thread(target=cancel, daemon=True), threading.Thread(target=abandon, daemon=True)]
        for t in side:
            t.start()
        outs, _, errors = run_together(engines[2:], jobs)
        done.set()
        for t in side:
            t.join()
        assert errors == [None, None]
        assert outs == [alone(solo, p, st) for p, st, _ in jobs]
        held["g"].close()
        for e in engines[:2]:
            p = prompt(models, 44, 12)
            assert alone(e, p, s) == alone(solo, p, s)
        check_caches(models, engines)
    finally:
        shared.close()


def test_the_pool_shares_contexts_and_each_answer_equals_its_own(models, solo):
    loaded = Loaded(models["target"], models["verifier"], models["draft"], dict(F32))
    pool = EnginePool(loaded, parallel=3)
    try:
        assert pool.shared is not None
        results, errs = {}, []

        def ask(i):
            try:
                with pool.engine() as (slot, engine):
                    assert isinstance(engine.contexts["target"], SeqView)
                    assert engine.contexts["target"].shared is pool.shared.contexts["target"]
                    results[i] = alone(engine, prompt(models, 50 + i, 8 + 3 * i),
                                       Settings(mode="lossless" if i % 2 else "ar", max_new=30, block=4))
            except BaseException as e:   # noqa: BLE001
                errs.append(e)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(5)]   # 5 requests, 3 slots
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errs == []
        for i in range(5):
            assert results[i] == alone(solo, prompt(models, 50 + i, 8 + 3 * i),
                                       Settings(mode="lossless" if i % 2 else "ar", max_new=30, block=4))
        b = pool.stats()["batch"]                  # the decode thread's counters (the server's /metrics)
        assert 0 < b["steps"] <= b["decodes"] and b["tokens"] >= 5 * 30 - 5
        assert 0 < b["decode_seconds"] <= b["step_seconds"]
    finally:
        assert pool.close()
    assert all(c._ctx is None for c in pool.shared.contexts.values())
    unbatched = EnginePool(loaded, parallel=2, batched=False)
    try:
        assert unbatched.shared is None and isinstance(unbatched.first.contexts["target"], Context)
        assert "batch" not in unbatched.stats()
    finally:
        unbatched.close()


@pytest.mark.parametrize("batched", [True, False])
def test_a_batched_pool_keeps_its_busy_sequences_consecutive(models, batched):
    """llama.cpp decodes a step of sequences 0 and 2 as two ubatches (split_equal over consecutive ids):
    a batched pool gives a request the free slot that leaves the busy sequence ids in the fewest runs,
    its cached prompt deciding only among those; with nothing busy, or engines of their own, the cached
    prompt alone decides, and a slot asked for by number is that slot."""
    pool = EnginePool(Loaded(models["target"], None, None, dict(F32)), parallel=4, batched=batched)
    try:
        for i in range(1, 4):
            pool._engines[i] = pool._make(i)
        likes = lambda j: (lambda e: 10 if e is pool._engines[j] else 1)   # noqa: E731  (a cached prompt in slot j)
        with pool._cond:
            assert pool._pick(likes(2)) == 2                  # nothing busy
            pool._busy[0] = True
            assert pool._pick(likes(2)) == (1 if batched else 2)
            assert pool._pick(likes(3)) == (1 if batched else 3)
            pool._busy[2] = True                              # {0, 2}: the hole first
            assert pool._pick(likes(3)) == (1 if batched else 3)
            pool._busy[0], pool._busy[2], pool._busy[3] = False, False, True
            assert pool._pick(likes(0)) == (2 if batched else 0)   # {3}: next to it
            assert pool._pick(0) == 0                         # by number
            pool._busy[0], pool._busy[3] = True, False
            assert pool._pick(0) == 1                         # that slot busy: as any other request
    finally:
        with pool._cond:
            pool._busy[:] = [False] * 4                       # (no request holds them: close waits for none)
        assert pool.close()


def test_flash_attention_is_off_in_shared_contexts_unless_asked_for(models, solo):
    """Flash attention `auto` is off on a CPU, in a context of its own and in a shared one (its CPU
    kernel depends on the pass's shape: llama.flash_attn_setting); `on` is honoured. Batched on F16 KV
    equals the same request alone with flash attention off."""
    f16 = dict(F32, type_k="f16", type_v="f16")
    with Context(models["target"], **f16) as own:
        assert own.flash_attn == "off"
    shared, engines = shared_engines(models, 2, **f16)
    try:
        assert shared.flash_attn == "off"
        jobs = [(prompt(models, 60, 13), Settings(mode="ar", max_new=30), None),
                (prompt(models, 61, 21), Settings(mode="lossless", max_new=30, block=4), None)]
        outs, cycles, errors = run_together(engines, jobs)
        assert errors == [None, None]
        ref = Engine.load(models["target"], models["verifier"], models["draft"], **dict(f16, flash_attn="off"))
        assert outs == [alone(ref, p, s) for p, s, _ in jobs]
    finally:
        shared.close()
    on = Shared({"target": models["target"]}, 2, **dict(f16, flash_attn="on"))
    try:
        assert on.flash_attn == "on"
    finally:
        on.close()


def test_flash_attention_over_a_q8_0_k_cache_is_on_in_shared_contexts_and_exact(tmp_path_factory):
    """A q8_0 K and an F16 V (the CPU default for quantized models): `auto` is on in a shared context
    too (llama.cpp's row-wise kernel is the only one where K or V is quantized), and requests at
    different phases in one batch each equal the same request alone, flash attention on, in a context
    of its own."""
    d = tmp_path_factory.mktemp("batching-q8")
    wide = dict(heads=2, kv_heads=1)                      # 32-wide heads: q8_0 blocks are 32 values
    models = {"target": Model(tiny_gguf(d, seed=0, **wide)),
              "verifier": Model(tiny_gguf(d, seed=1, role="verifier", **wide)),
              "draft": Model(tiny_gguf(d, seed=0, mask=False, role="verifier", **wide))}
    assert models["target"].head_dims == (32, 32) and models["target"].default_kv_type == "f32"
    q8 = dict(F32, type_k="q8_0", type_v="f16")
    shared, engines = shared_engines(models, 3, **q8)
    try:
        assert shared.flash_attn == "on"
        jobs = [(prompt(models, 70, 140), Settings(mode="ar", max_new=30), None),
                (prompt(models, 71, 21), Settings(mode="lossless", max_new=30, block=4), None),
                (prompt(models, 72, 9), Settings(mode="spec", max_new=24, draft_k=3), (0, 5))]
        outs, cycles, errors = run_together(engines, jobs)
        assert errors == [None, None, None]
        assert any(batched_cycles(c) for c in cycles)
        ref = Engine.load(models["target"], models["verifier"], models["draft"], **q8)
        assert ref.contexts["target"].flash_attn == "on"
        assert outs == [alone(ref, p, s) for p, s, _ in jobs]
        for e in engines:                                 # each sequence holds its committed tokens only
            with Context(models["target"], **q8) as fresh:
                assert np.array_equal(next_logits(e.contexts["target"], e.tokens), next_logits(fresh, e.tokens))
    finally:
        shared.close()
        for m in models.values():
            m.close()


def test_gated_adapter_passes_in_a_batch_equal_the_stock_model_alone(tmp_path):
    """A stock model with a gated MARS adapter: adapter-on proposal passes and stock passes of one step
    are separate decodes of the shared context; lossless (fixed and planned widths) and mars beside ar
    each equal the same request alone, and every sequence ends with stock KV only."""
    torch = pytest.importorskip("torch")
    from prove_local.llama import Adapter
    from prove_local.train import adapter as ad

    path = tiny_gguf(tmp_path, seed=3, mask=False)
    lm = ad.StockLM(path)
    lora = ad.Lora(lm, 4, alpha=8, seed=1)
    g = torch.Generator().manual_seed(101)
    with torch.no_grad():
        for k in lora.b:
            lora.b[k].copy_(torch.randn(lora.b[k].shape, generator=g) * 0.05)
    gguf = ad.export(lm, lora, tmp_path / "random.gguf", mask=ad.choose_mask(lm), block=8, dtype="f32")
    with Model(path) as m:
        a = Adapter(m, gguf)
        solo = Engine.load(m, adapter=a, **F32)
        shared = Shared({"target": m}, 4, adapter=a, grace=LONG, **F32)
        engines = []
        for i in range(4):
            e = Engine.load(m, adapter=a, contexts=shared.views(i), **F32)
            e.member = shared.members[i]
            engines.append(e)
        try:
            base = m.tokenize("Question: what is 7 times 8? Answer: ")
            jobs = [(base + base[:3], Settings(mode="lossless", max_new=40, block=4), None),
                    (base[:9], Settings(mode="ar", max_new=40), None),
                    (base * 2, Settings(mode="lossless", max_new=40, block="auto"), None),
                    (base[4:], Settings(mode="mars", max_new=30, block=4, tau=0.5), (1, 3))]
            want = [alone(solo, p, s) for p, s, _ in jobs]
            outs, cycles, errors = run_together(engines, jobs)
            assert errors == [None] * 4
            assert outs == want
            assert batched_cycles(cycles[0]) > 0
            for e in engines:
                v = e.contexts["target"]
                assert v.gated and v.n_stock == v.n_past <= len(e.tokens)     # no adapter KV left behind
            check = {"target": m}
            check_caches(check, engines)
        finally:
            shared.close()


def test_closing_the_shared_contexts_fails_a_waiting_pass_instead_of_hanging_it(models):
    shared, _ = shared_engines(models, 2)
    a = SeqView(shared.contexts["target"], 1, shared.members[1])
    shared.members[0].resume()            # sequence 0 is in its generation's code: the step waits for it
    got = []

    def wait():
        try:
            a.eval(prompt(models, 70, 5))
        except LlamaError as e:
            got.append(e)

    t = threading.Thread(target=wait)
    t.start()
    while shared.members[1].state != PENDING:
        t.join(0.01)
    shared.close()
    t.join()
    assert len(got) == 1 and "closed" in str(got[0])
    with pytest.raises(LlamaError, match="closed"):
        a.eval([5])


class FakeShared:
    """What the batcher needs of a shared context, recording its decodes (no llama.cpp)."""

    def __init__(self, adapter=None):
        self.model, self.adapter, self.n_ctx, self.n_batch, self.n_vocab, self.n_threads = \
            type("M", (), {"path": "fake.gguf"})(), adapter, 64, 16, 3, 1
        self._ctx, self.decode_seconds, self.calls, self.dropped = object(), 0.0, [], []
        self.lent = []               # per decode: (adapter, the `views` it was given)

    def decode_batch(self, passes, adapter=False, views=None):
        self.calls.append([(seq, pos, list(tokens)) for seq, pos, tokens, _ in passes])
        self.lent.append((adapter, None if views is None else list(views)))
        return [np.full((len(rows), self.n_vocab), seq, dtype=np.float32) for seq, _, _, rows in passes]

    def drop(self, seq, p0):
        self.dropped.append((seq, p0))


@pytest.mark.parametrize("grace", [0.0, LONG])
def test_a_parked_engine_is_waited_for_only_its_grace(grace):
    """Engine 0 has handed a cycle to its consumer (parked): a step waits for it `grace` seconds, so with
    a long grace engine 1's pass is decoded only when engine 0 leaves, and with none at once."""
    from prove_local.batching import Batcher

    b, fake = Batcher(grace), FakeShared()
    m0, m1 = b.member(0), b.member(1)
    v1 = SeqView(fake, 1, m1)
    m0.resume()
    m0.park()
    m1.resume()
    out = []
    t = threading.Thread(target=lambda: out.append(v1.eval([7, 8])))
    t.start()
    if grace:
        while m1.state != PENDING:
            t.join(0.01)
        assert fake.calls == [] and out == []        # waiting for the parked engine
        m0.leave()
    t.join()
    assert fake.calls == [[(1, 0, [7, 8])]] and out[0].tolist() == [[1.0, 1.0, 1.0]]
    m1.leave()
    b.close()


def test_rows_are_lent_only_to_a_generating_rules_pass_in_the_last_decode_of_its_context():
    """Batcher._step hands out views into llama.cpp's buffer only where no decode of that context can come
    before the engine reads them: a rule's `eval_view` (not `eval`, whose caller keeps the rows) of an
    engine in a generation (a step waits for it), in the step's last decode of the context (an adapter
    pass and a stock pass of one step are two decodes: the first one's rows are copied)."""
    from prove_local.batching import Batcher

    b, fake = Batcher(), FakeShared(adapter=object())
    members = [b.member(i) for i in range(4)]
    views = [SeqView(fake, i, m) for i, m in enumerate(members)]
    for m in members[:3]:
        m.resume()                                   # engines 0-2 in a generation; engine 3 is not
    passes = [lambda: views[0].eval_view([1], adapter=True),     # the adapter's decode, first: copied
              lambda: views[3].eval_view([4]),                   # not in a generation: copied
              lambda: views[1].eval_view([2]),                   # the stock decode, last: lent
              lambda: views[2].eval([3])]                        # eval: copied
    threads = [threading.Thread(target=f) for f in passes]
    for k, t in enumerate(threads):
        t.start()
        while k < 2 and len(b._waiting) <= k:       # (in this order: the adapter's group is decoded first)
            t.join(0.001)
    for t in threads:
        t.join(LONG)
    assert sorted(fake.lent, key=lambda x: x[0] is not True) == [(True, None), (False, [True, False, False])]
    # a lone engine's pass (Batcher._alone: no step to wait for) is lent too, and a non-generating one not
    for m in members[:3]:
        m.leave()
    fake.lent.clear()
    members[0].resume()
    views[0].eval_view([5])
    members[0].leave()
    views[0].eval_view([6])
    assert fake.lent == [(False, [True]), (False, [False])]
    b.close()


def test_a_lent_row_is_the_buffer_and_a_copy_is_not(models):
    """llama.Context.decode_batch: a pass whose `views` entry is true gets its rows as a view into
    llama.cpp's output buffer (no copy), in batch order; the others, and rows asked for out of order,
    get copies; the values are the same either way."""
    ctx = Context(models["target"], n_seq=2, **F32)
    try:
        p = prompt(models, 3, 6)
        lent, kept = ctx.decode_batch([(0, 0, p, [4, 5]), (1, 0, p, [5, 4])], views=[True, True])
        buffer = ctx._logits_view(4)
        assert np.shares_memory(lent, buffer) and not np.shares_memory(kept, buffer)   # (out of order: a copy)
        assert np.array_equal(lent, kept[::-1])
        a, b2 = ctx.decode_batch([(0, 6, p[:1], [0]), (1, 6, p[:1], [0])], views=[False, True])
        buffer = ctx._logits_view(2)
        assert not np.shares_memory(a, buffer) and np.shares_memory(b2, buffer) and np.array_equal(a, b2)
    finally:
        ctx.close()


@pytest.mark.parametrize("batched", [True, False])
def test_a_saved_prompt_state_spares_the_prefill_and_changes_nothing(models, solo, batched):
    """The pool's prompt cache (batching.PromptCache, llama-server's --cache-ram): an engine that drops
    a long committed sequence for a new request saves it first; another engine then asked for that
    prompt (and its next turn) writes the saved state into its own sequence (batched) or context
    (not) instead of prefilling it, and everything after is as without the cache: the same tokens,
    and a cache whose next-token logits are a fresh context's bit for bit."""
    loaded = Loaded(models["target"], None, None, dict(F32))
    pool = EnginePool(loaded, parallel=2, batched=batched)
    assert (pool.shared is not None) == batched and pool.stats()["prompt_cache"]["entries"] == 0
    a, b = prompt(models, 7, 90), prompt(models, 8, 30)
    s = Settings(mode="lossless", max_new=12, block=4)
    try:
        cache = pool.prompt_cache
        with pool.engine(prefer=0) as (i, e0):
            assert i == 0
            first = alone(e0, a, s)
            answered = list(e0.tokens)
        with pool.engine(prefer=0) as (_, e0):
            assert alone(e0, b, s) == alone(solo, b, s)        # a's 102 tokens saved before they were dropped
        assert (cache.saved, len(cache)) == (1, 1) and cache.bytes > 0
        with pool.engine(prefer=1) as (i, e1):
            assert i == 1 and e1.contexts["target"].n_past == 0
            gen = e1.generate(a, s)
            out = [t for c in gen for t in c.committed]
            assert gen.request.n_cached == len(a) - 1 and gen.prefill[0] == 0    # nothing prefilled
            assert out == first == alone(solo, a, s)
            check_caches(models, [e1])
            # the next turn: the saved state holds the first answer too
            turn = answered + prompt(models, 9, 20)
            gen = e1.generate(turn, s)
            out = [t for c in gen for t in c.committed]
            assert out == alone(solo, turn, s)
            check_caches(models, [e1])
        assert cache.hits == 1 and cache.tokens_restored == len(a) - 1
        # a prompt the cache shares fewer than min_tokens with is prefilled as before
        with pool.engine(prefer=1) as (_, e1):
            gen = e1.generate(prompt(models, 10, 40), s)
            list(gen)
            assert gen.prefill[0] > 30 and cache.hits == 1
        assert cache.saved == 2                     # (e1's two turns, dropped for it)
    finally:
        assert pool.close()


@pytest.mark.parametrize("batched", [True, False])
def test_a_question_answered_on_one_engine_is_copied_on_another(models, solo, batched):
    """The pool's engines share their finished requests (lookup.Recent): the same prompt on the other
    engine drafts the first engine's answer (forced 4-token lookups: 4 copied and 1 of the model's a
    cycle), with the same tokens as alone and a clean cache; a request with `recall` off neither copies
    nor is copied."""
    loaded = Loaded(models["target"], None, None, dict(F32))
    pool = EnginePool(loaded, parallel=2, batched=batched)
    a = prompt(models, 11, 40)
    s = Settings(mode="lookup", max_new=30, lookup=4)
    want = alone(solo, a, replace(s, recall=False))
    try:
        with pool.engine(prefer=0) as (_, e0):
            first = list(e0.generate(a, s))
        with pool.engine(prefer=1) as (_, e1):
            again = list(e1.generate(a, s))
            assert [t for c in again for t in c.committed] == want
            check_caches(models, [e1])
            copied = sum(c.n_accepted for c in again if c.plan.lookup)
            assert copied >= 20 and len(again) <= 30 // 5 + 2, (copied, len(again))
            assert len(again) < len(first)
            closed = [t for c in e1.generate(prompt(models, 12, 40), replace(s, recall=False)) for t in c.committed]
        shared = pool.recent.since(object())               # (what an engine new to the pool would take in)
        assert any(seq[-30:] == tuple(want) for seq in shared)
        assert not any(seq[-30:] == tuple(closed) for seq in shared)
    finally:
        assert pool.close()


def test_recent_shares_other_engines_sequences_once_and_bounded():
    from prove_local.lookup import Recent
    r, e0, e1 = Recent(limit=10), object(), object()
    r.add(e0, [1, 2, 3])
    r.add(e1, [4, 5])
    assert r.since(e0) == [(4, 5)] and r.since(e0) == []           # (its own never; each once)
    assert r.since(e1) == [(1, 2, 3)]
    r.add(e0, range(6, 13))                                          # 12 tokens held: the oldest goes
    assert r.since(e1) == [(6, 7, 8, 9, 10, 11, 12)] and r.since(object()) == [(4, 5), tuple(range(6, 13))]
    r.add(e0, [])
    assert r.since(e1) == []


def test_the_prompt_cache_keeps_what_fits_and_finds_the_longest_prefix():
    from prove_local.batching import PromptCache
    c = PromptCache(capacity=100, min_tokens=2)
    c.save([1, 2, 3, 4], b"x" * 40)
    c.save([1, 2, 9], b"y" * 40)
    assert c.best([1, 2, 3, 4, 5]) == (4, b"x" * 40, 4) and c.best([1, 2, 9, 9]) == (3, b"y" * 40, 3)
    assert c.best([1, 2, 7])[0] == 2 and c.best([5, 6]) is None
    c.save([7, 7, 7], b"z" * 40)                 # 120 bytes > 100: the least recently used goes
    # ([1, 2, 9] was used last, by the tie at [1, 2, 7]: the most recent state wins a tie)
    assert len(c) == 2 and c.bytes == 80 and c.best([1, 2, 3, 4])[0] == 2 and c.best([1, 2, 9])[0] == 3
    c.save([8], b"w" * 101)                      # larger than the whole cache: not kept
    assert len(c) == 2


def test_the_prompt_cache_does_not_copy_what_it_holds_already():
    from prove_local.batching import PromptCache

    class Ctx:                                   # a context holding 20 stock positions
        n_past = n_stock = 20
        copies = 0

        def state(self, limit=None):
            Ctx.copies += 1
            return b"s" * 10

        def truncate(self, n):
            self.n_past = self.n_stock = n
    c = PromptCache(capacity=1000, min_tokens=4)
    c.keep(Ctx(), list(range(20)))
    c.keep(Ctx(), list(range(20)))              # the same tokens: held already
    c.keep(Ctx(), list(range(12)))              # a prefix of them: held already
    assert Ctx.copies == 1 and len(c) == 1
    c.keep(Ctx(), list(range(10)) + [99] * 10)  # different tokens: copied
    assert Ctx.copies == 2 and len(c) == 2


def test_no_prompt_cache_with_zero_mib(models):
    """serve --cache-ram 0: the pool keeps no states, so a prompt another engine dropped is prefilled."""
    loaded = Loaded(models["target"], None, None, dict(F32))
    pool = EnginePool(loaded, parallel=2, prompt_cache_mib=0)
    a, b = prompt(models, 7, 90), prompt(models, 8, 30)
    s = Settings(mode="ar", max_new=6)
    try:
        assert pool.prompt_cache is None and "prompt_cache" not in pool.stats()
        with pool.engine(prefer=0) as (_, e0):
            alone(e0, a, s)
        with pool.engine(prefer=0) as (_, e0):
            alone(e0, b, s)
        with pool.engine(prefer=1) as (i, e1):
            gen = e1.generate(a, s)
            list(gen)
            assert i == 1 and gen.prefill[0] == len(a) - 1
    finally:
        assert pool.close()


@pytest.mark.parametrize("batched", [True, False])
def test_a_pools_later_engines_take_the_first_ones_pass_costs(models, monkeypatch, tmp_path, batched):
    """The first engine calibrates (the server does it before serving); the pool's later engines take
    its curves (a Costs of their own over them) instead of reading the cache, where an incomplete curve
    would be measured again at each one's first request, beside the others' decoding."""
    from prove_local import engine as engine_mod
    monkeypatch.setenv("PROVE_LOCAL_CACHE", str(tmp_path))
    loaded = Loaded(models["target"], models["verifier"], models["draft"], dict(F32))
    pool = EnginePool(loaded, parallel=2, batched=batched)
    try:
        first = pool.first
        assert first.prepare(Settings(mode="lossless", max_new=8, block="auto")) and first.planner.costs is not None

        def measured_again(*a, **k):
            raise AssertionError("a later engine read or measured the calibration itself")
        monkeypatch.setattr(engine_mod, "calibrate", measured_again)
        with pool.engine(prefer=1) as (slot, engine):
            assert slot == 1 and engine is not first
            assert engine.planner.costs is not None and engine.planner.costs is not first.planner.costs
            assert engine._thread_curves == first._thread_curves
            out = alone(engine, prompt(models, 80, 12), Settings(mode="lossless", max_new=16, block="auto"))
        monkeypatch.undo()
        want = Engine.load(models["target"], models["verifier"], models["draft"], **F32)
        assert out == alone(want, prompt(models, 80, 12), Settings(mode="ar", max_new=16))
    finally:
        pool.close()
