"""The decoding rules and the engine's driver on fake contexts with scripted distributions."""
import numpy as np
import pytest

from prove_local import modes, rules
from prove_local.engine import Engine, ModeError, Settings
from prove_local.sampling import GREEDY_ARGMAX
from tests.fakes import (EOS, MASK, PROMPT, V, FakeContext, ar_model, greedy, make_engine, onehot, proposer, run,
                         successor, verifier)


def test_ar_cycle_commits_one_greedy_token():
    ctx = FakeContext(ar_model(), V)
    c = rules.ar_cycle(ctx, PROMPT)
    assert c.committed == [6] and c.n_accepted == 1 and c.passes == {"target": 1}
    assert ctx.cache == PROMPT  # the committed token stays pending


def test_greedy_ar_without_p_tilde_is_the_same_token():
    """GREEDY_ARGMAX (Settings.p_tilde off: run, serve: nobody reads an ar token's p̃) skips the
    softmax, not the choice: the same argmax on rows with ties and near-ties, the first of tied maxima as with p̃; p̃ is NaN."""
    rng = np.random.default_rng(0)
    for k in range(50):
        dist = rng.dirichlet(np.full(V, 0.3))
        if k % 5 == 0:                                  # a tie at the maximum: the first index wins
            dist[rng.integers(V)] = dist[int(np.argmax(dist))]
        with_p = rules.ar_cycle(FakeContext(lambda prefix: dist, V), PROMPT)
        without = rules.ar_cycle(FakeContext(lambda prefix: dist, V), PROMPT, sampler=GREEDY_ARGMAX)
        assert without.committed == with_p.committed == [int(np.argmax(np.log(dist).astype(np.float32)))]
        assert np.isnan(without.p[0]) and with_p.p[0] == pytest.approx(dist.max() / dist.sum(), rel=1e-5)


def test_the_argmax_only_verify_step_accepts_what_the_greedy_one_does():
    """sampling.GREEDY_ARGMAX (Settings.p_tilde off: run, serve) reads each verified row for its argmax
    alone: the same accepted run and the same next token as GREEDY on rows with ties and near-ties
    (random, and drafts that follow the argmax for a while), with the target's q of each draft NaN
    instead of its probability."""
    from prove_local.sampling import GREEDY, GREEDY_ARGMAX
    rng = np.random.default_rng(1)
    for k in range(200):
        rows = rng.normal(size=(6, V)).astype(np.float32)
        if k % 4 == 0:                                   # a tie at a row's maximum: the first index wins
            r = int(rng.integers(6))
            rows[r, int(rng.integers(V))] = rows[r].max()
        drafted = [int(x) for x in rows[:5].argmax(axis=1)]
        cut = int(rng.integers(6))
        if cut < 5:
            drafted[cut] = int((drafted[cut] + 1 + rng.integers(V - 1)) % V)     # a rejection at `cut`
        n, nxt, q, acc, res = GREEDY.sample_and_accept_n(rows, drafted, PROMPT)
        n2, nxt2, q2, acc2, res2 = GREEDY_ARGMAX.sample_and_accept_n(rows, drafted, PROMPT)
        assert (n2, nxt2, acc2, res2) == (n, nxt, acc, res) and n == min(cut, 5)
        assert len(q2) == len(q) == 5 and all(np.isnan(x) for x in q2) and not any(np.isnan(x) for x in q)


@pytest.mark.parametrize("mode", ["lossless", "spec", "lookup"])
def test_without_p_tilde_the_exact_modes_commit_the_same_tokens_and_leave_q_unread(mode):
    """Settings.p_tilde off gives the exact modes' verify steps GREEDY_ARGMAX (modes._sampler): the
    same cycles and tokens as with it on, Cycle.q NaN where it was the target's probability of a
    verified draft."""
    def engine():
        return make_engine(proposer(wrong={3}), draft=FakeContext(ar_model(), V))

    prompt = [1, 2, 3, 4, 5, 1, 2, 3]                    # (lookup: a repeat to draft from)
    kw = dict(mode=mode, max_new=12, block=4, draft_k=3, lookup=3 if mode == "lookup" else 0)
    on, toks_on = run(engine(), prompt, **kw)
    off, toks_off = run(engine(), prompt, p_tilde=False, **kw)
    assert toks_off == toks_on and [c.n_accepted for c in off] == [c.n_accepted for c in on]
    verified = [c for c in on if c.q]
    assert verified and all(not np.isnan(x) for c in verified for x in c.q)
    first = 1 if mode == "lossless" else 0               # (lossless: q[0] is slot 1's own p̃, accepted as it is)
    assert all(np.isnan(x) for c in off if c.q for x in c.q[first:])
    assert [c.q[:first] for c in off if c.q] == [c.q[:first] for c in on if c.q]


def test_lossless_full_block_plus_bonus():
    ctx = FakeContext(proposer(), V)
    c = rules.lossless_cycle(ctx, PROMPT, block=4, mask=MASK)
    assert c.proposed == [6, 7, 8, 9]
    assert c.committed == [6, 7, 8, 9, 10]          # 4 accepted + bonus
    assert c.n_accepted == 4 and c.passes == {"target": 2}
    assert ctx.cache == PROMPT + [6, 7, 8, 9]        # bonus pending, no mask left
    assert ctx.evals == [PROMPT + [MASK] * 3, [6, 7, 8, 9]]


def test_lossless_mismatch_commits_correction():
    ctx = FakeContext(proposer(wrong={3}), V)
    c = rules.lossless_cycle(ctx, PROMPT, block=5, mask=MASK)
    assert c.proposed == [6, 7, 25, 9, 10]
    assert c.committed == [6, 7, 8] and c.n_accepted == 2
    assert ctx.cache == PROMPT + [6, 7]


def test_lossless_slot2_wrong_still_commits_two():
    ctx = FakeContext(proposer(wrong={2}), V)
    c = rules.lossless_cycle(ctx, PROMPT, block=4, mask=MASK)
    assert c.committed == [6, 7] and c.n_accepted == 1


def test_prove_first_slot_fails_gate_commits_one():
    ctx_p, ctx_v = FakeContext(proposer(conf={1: 0.2}), V), FakeContext(verifier(), V)
    c = rules.prove_cycle(ctx_p, ctx_v, PROMPT, block=4, mask=MASK, theta=0.5)
    assert c.p[0] == pytest.approx(0.2) and c.p[0] * c.q[0] < 0.5
    assert c.committed == [6] and c.n_accepted == 1
    assert ctx_p.cache == PROMPT and ctx_v.cache == PROMPT   # 6 is pending in both


def test_prove_theta_zero_commits_whole_block():
    ctx_p, ctx_v = FakeContext(proposer(wrong={2}), V), FakeContext(verifier(), V)
    c = rules.prove_cycle(ctx_p, ctx_v, PROMPT, block=4, mask=MASK, theta=0.0)
    assert c.committed == [6, 25, 8, 9] and c.passes == {"target": 1, "verifier": 1}
    assert ctx_v.evals == [PROMPT + [6, 25, 8]]     # d_B is never fed
    assert ctx_v.cache == PROMPT + [6, 25, 8]


def test_prove_theta_above_one_is_one_token():
    ctx_p, ctx_v = FakeContext(proposer(), V), FakeContext(verifier(), V)
    c = rules.prove_cycle(ctx_p, ctx_v, PROMPT, block=4, mask=MASK, theta=1.01)
    assert c.committed == [6]


def test_prove_gate_stops_at_low_verifier_probability():
    # the verifier doubts the token after PROMPT + [6, 7] (prefix length 5): slot 3
    ctx_p, ctx_v = FakeContext(proposer(), V), FakeContext(verifier(low_at={5}), V)
    c = rules.prove_cycle(ctx_p, ctx_v, PROMPT, block=6, mask=MASK, theta=0.05)
    np.testing.assert_allclose(c.q[:4], [0.8, 0.8, 0.01, 0.8], rtol=1e-5)
    assert c.committed == [6, 7] and c.n_accepted == 2
    assert ctx_v.cache == PROMPT + [6]


@pytest.mark.parametrize("tau,expect", [(0.89, 4), (0.91, 1), (0.0, 4), (0.96, 0 + 1)])
def test_mars_tau_edges(tau, expect):
    ctx = FakeContext(proposer(conf={1: 0.95, 2: 0.9, 3: 0.99, 4: 0.93}), V)
    c = rules.mars_cycle(ctx, PROMPT, block=4, mask=MASK, tau=tau)
    assert len(c.committed) == expect and c.passes == {"target": 1}
    assert ctx.cache == PROMPT


def test_mars_first_slot_below_tau_still_commits_one():
    ctx = FakeContext(proposer(conf={1: 0.3}), V)
    assert rules.mars_cycle(ctx, PROMPT, 4, MASK, tau=0.95).committed == [6]


def test_spec_cycle_matches_and_bonus():
    ctx_t, ctx_d = FakeContext(ar_model(), V), FakeContext(ar_model(0.7), V)
    c = rules.spec_cycle(ctx_t, ctx_d, PROMPT, k=3)
    assert c.proposed == [6, 7, 8] and c.committed == [6, 7, 8, 9] and c.n_accepted == 3
    assert c.passes == {"draft": 3, "target": 1}
    assert ctx_t.cache == PROMPT + [6, 7, 8] and ctx_d.cache == PROMPT + [6, 7]


def test_spec_cycle_rejects_wrong_draft():
    def bad_draft(prefix):
        return onehot(V, 25 if len(prefix) == 4 else successor(prefix))
    ctx_t, ctx_d = FakeContext(ar_model(), V), FakeContext(bad_draft, V)
    c = rules.spec_cycle(ctx_t, ctx_d, PROMPT, k=3)
    assert c.proposed == [6, 25, 26 % 20] and c.committed == [6, 7] and c.n_accepted == 1
    assert ctx_t.cache == PROMPT + [6] and ctx_d.cache == PROMPT + [6]


@pytest.mark.parametrize("mode", ["lossless", "ar"])
def test_engine_modes_equal_greedy_and_cache_holds_committed(mode):
    e = make_engine(proposer(wrong={3}))
    cycles, out = run(e, PROMPT, mode=mode, max_new=23)
    assert out == greedy(PROMPT, 23)
    assert cycles[-1].stop == "length"
    cache = e.contexts["target"].cache
    assert cache == e.tokens[:len(cache)]
    assert [c.start for c in cycles] == list(np.cumsum([0] + [len(c.committed) for c in cycles[:-1]]))


def test_engine_cuts_run_after_end_of_generation():
    def prop(prefix):   # proposes 6, 7, EOS, 9 ... and EOS is also the AR token after 7
        m = 0
        while prefix[-1 - m] == MASK:
            m += 1
        seq = [t for t in prefix if t != MASK]
        nxt = EOS if seq[-1] == 7 or (m and (seq[-1] + m) == 7) else (seq[-1] + m + 1) % 20
        return onehot(V, nxt)
    e = make_engine(prop)
    cycles, out = run(e, [4, 5], mode="lossless", max_new=50)
    assert out == [6, 7, EOS] and cycles[-1].stop == "eog" and len(cycles) == 1
    cache = e.contexts["target"].cache
    assert cache == [4, 5, 6, 7, EOS][:len(cache)] and len(cache) >= 4   # nothing past the cut


def test_engine_stops_when_context_full():
    e = make_engine(n_ctx=10)
    cycles, out = run(e, PROMPT, mode="lossless", max_new=50)
    assert len(PROMPT) + len(out) == 10 and cycles[-1].stop == "context"
    assert out == greedy(PROMPT, 7)


def test_engine_reuses_cache_across_requests():
    e = make_engine()
    _, out = run(e, PROMPT, mode="lossless", max_new=8)
    ctx = e.contexts["target"]
    n_evals = len(ctx.evals)
    follow = PROMPT + out + [2]
    _, out2 = run(e, follow, mode="lossless", max_new=4)
    assert out2 == greedy(follow, 4)
    # the second request evaluated the new token(s) only, never the old prompt again
    assert all(len(ev) <= 4 + 1 for ev in ctx.evals[n_evals:])


def test_engine_interrupted_generation_keeps_committed_prefix():
    e = make_engine()
    gen = e.generate(PROMPT, Settings(mode="lossless", max_new=40))
    first = next(gen)
    gen.close()                                  # the consumer stops (Ctrl-C in the CLI)
    ctx = e.contexts["target"]
    assert e.tokens == PROMPT + first.committed
    assert ctx.cache == e.tokens[:ctx.n_past] and MASK not in ctx.cache
    _, out = run(e, e.tokens, mode="lossless", max_new=5)
    assert out == greedy(PROMPT + first.committed, 5)


def test_engine_errors():
    e = make_engine()
    with pytest.raises(ModeError, match="verifier"):
        run(e, PROMPT, mode="prove")
    with pytest.raises(ModeError, match="draft"):
        run(e, PROMPT, mode="spec")
    with pytest.raises(ModeError, match="unknown mode"):
        run(e, PROMPT, mode="fast")
    with pytest.raises(Exception, match="prompt has 64 tokens"):
        run(e, [1] * 64, mode="ar")
    no_mask = Engine({"target": FakeContext(ar_model(), V)}, is_eog=lambda t: False, mask_token=None, n_ctx=64)
    with pytest.raises(ModeError, match="mask token"):
        run(no_mask, PROMPT, mode="lossless", lookup=0)        # lossless drafts by lookup alone without one
    with pytest.raises(ModeError, match="mask token"):
        run(no_mask, PROMPT, mode="mars")
    assert no_mask.default_mode() == "lossless"


def test_top1_and_prob_of():
    logits = np.log(np.array([[0.1, 0.7, 0.2], [0.5, 0.25, 0.25]], dtype=np.float32))
    ids, p = rules.top1(logits)
    assert ids.tolist() == [1, 0]
    np.testing.assert_allclose(p, [0.7, 0.5], rtol=1e-6)
    np.testing.assert_allclose(rules.prob_of(logits, [2, 1]), [0.2, 0.25], rtol=1e-6)


@pytest.mark.parametrize("vocab", [2048, 50000])
def test_row_stats_agree_with_a_float64_softmax_small_and_large_passes(vocab):
    """A small pass (rows x vocabulary <= SMALL_PASS: the embedded pair's 2,048 tokens) is read all rows at
    once, a large one row by row; both give the argmax, p̃ and the probabilities of given tokens of a
    float64 softmax to float32 rounding, logits near 0, large and negative, and NaN for rows not asked."""
    from prove_local.logits import SMALL_PASS, row_stats
    rng = np.random.default_rng(vocab)
    assert (3 * vocab <= SMALL_PASS) == (vocab < 10000)
    for shift in (0.0, 40.0, -40.0, 95.0):
        logits = (rng.standard_normal((3, vocab)) * 4 + shift).astype(np.float32)
        ref = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
        ref /= ref.sum(axis=1, keepdims=True)
        ids, p = rules.top1(logits)
        assert np.array_equal(ids, ref.argmax(axis=1))
        np.testing.assert_allclose(p, ref.max(axis=1), rtol=2e-6)
        x = rng.integers(0, vocab, 2)
        g, q = rules.greedy_and_prob(logits, x)
        assert np.array_equal(g, ids)
        np.testing.assert_allclose(q, ref[np.arange(2), x], rtol=2e-6, atol=1e-12)
        _, _, sums = row_stats(logits, exp_rows=[2, 0])
        assert np.isnan(sums[1]) and not np.isnan(sums[[0, 2]]).any()


# --------------------------------------------------------------------------------- sampling
def sampler(seed=0, **kw):
    from prove_local.sampling import Sampler
    return Sampler(np.random.default_rng(seed), **{"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **kw})


def passes_before_first_failure(ok) -> int:
    """The gate's run length by its definition, counted here (not with rules.leading_run, which the
    rules under test use themselves)."""
    n = 0
    while n < len(ok) and ok[n]:
        n += 1
    return n


def test_sampled_prove_and_mars_gate_on_processed_probabilities_and_keep_caches_clean():
    for seed in range(20):
        ctx_p, ctx_v = FakeContext(proposer(wrong={3}), V), FakeContext(verifier(), V)
        c = rules.prove_cycle(ctx_p, ctx_v, PROMPT, block=4, mask=MASK, theta=0.3, sampler=sampler(seed))
        assert c.n_accepted == len(c.committed) >= 1 and c.committed == c.proposed[:c.n_accepted]
        ok = [p * q >= 0.3 for p, q in zip(c.p, c.q)]
        assert c.n_accepted == max(1, passes_before_first_failure(ok))
        assert ctx_p.cache == PROMPT and ctx_v.cache == (PROMPT + c.committed)[:len(PROMPT) + c.n_accepted - 1]
        # T = 1, no truncation: p̃ is the plain softmax probability of the drawn token
        assert c.p[0] == pytest.approx(0.9 if c.proposed[0] == 6 else 0.1 / (V - 1), rel=1e-4)
        ctx = FakeContext(proposer(), V)
        m = rules.mars_cycle(ctx, PROMPT, block=4, mask=MASK, tau=0.5, sampler=sampler(seed))
        assert m.n_accepted == max(1, passes_before_first_failure([p >= 0.5 for p in m.p])) and ctx.cache == PROMPT


def test_sampled_spec_and_ar_keep_caches_clean_and_report_acceptance():
    def draft(prefix):
        return onehot(V, 25 if len(prefix) % 3 == 0 else successor(prefix), 0.6)
    ctx_t, ctx_d = FakeContext(ar_model(0.7), V), FakeContext(draft, V)
    tokens = list(PROMPT)
    s = sampler(3, temperature=0.8, top_k=5)
    for _ in range(20):
        c = rules.spec_cycle(ctx_t, ctx_d, tokens, 3, sampler=s)
        assert len(c.accept_prob) == 3 and len(c.committed) == c.n_accepted + 1
        assert c.residual == (c.n_accepted < 3) and c.committed[:c.n_accepted] == c.proposed[:c.n_accepted]
        tokens += c.committed
        assert ctx_t.cache == tokens[:ctx_t.n_past] and ctx_t.n_past == len(tokens) - 1
        assert ctx_d.cache == tokens[:ctx_d.n_past]
    a = rules.ar_cycle(FakeContext(ar_model(), V), PROMPT, sampler=sampler(1))
    assert len(a.committed) == 1 and a.accept_prob is None


def test_greedy_cycles_flag_the_correction_as_residual():
    c = rules.lossless_cycle(FakeContext(proposer(wrong={3}), V), PROMPT, block=5, mask=MASK)
    assert c.residual and c.accept_prob is None
    assert not rules.lossless_cycle(FakeContext(proposer(), V), PROMPT, block=4, mask=MASK).residual


# ------------------------------------------------------------------ what a cycle reports it ran
def test_each_rule_records_its_plan_and_its_gate_per_slot():
    """`Cycle.plan` is what the rule ran (a planner's verify choice resolved) and `Cycle.gate` what its
    gate decided per slot: consumers (planner, server, UI, bench) read these instead of re-deriving."""
    from prove_local.rules import AR_PLAN, Plan
    c = rules.lossless_cycle(FakeContext(proposer(wrong={3}), V), PROMPT, block=5, mask=MASK)
    assert c.plan == Plan("lossless", 5, verify=5) and c.gate == [True, True, False, None, None]
    assert modes.label(c.plan) == "B=5 v=5" and c.residual
    # a verify width chosen between the passes (as the planner does) is recorded as a number
    c = rules.lossless_cycle(FakeContext(proposer(), V), PROMPT, block=5, mask=MASK, verify=lambda p: 2)
    assert c.plan == Plan("lossless", 5, verify=2) and c.gate == [True, True, None, None, None]
    assert c.committed == [6, 7, 8] and not c.residual and modes.tested(c.plan) == 2
    # prove evaluates its threshold on every slot: slot 3 fails, slot 4 passes after it
    c = rules.prove_cycle(FakeContext(proposer(), V), FakeContext(verifier(low_at={5}), V), PROMPT, block=4,
                          mask=MASK, theta=0.05)
    assert c.plan == Plan("prove", 4) and c.gate == [True, True, False, True]
    c = rules.mars_cycle(FakeContext(proposer(conf={1: 0.95, 2: 0.5, 3: 0.99}), V), PROMPT, 3, MASK, tau=0.9)
    assert c.plan == Plan("mars", 3) and c.gate == [True, False, True] and c.committed == [6]
    # a one-slot mars block is an ar cycle (the same pass, the same token), and so is spec without drafts
    assert rules.mars_cycle(FakeContext(proposer(), V), PROMPT, 1, MASK, tau=0.9).plan == AR_PLAN
    assert rules.spec_cycle(FakeContext(ar_model(), V), FakeContext(ar_model(), V), PROMPT, k=0).plan == AR_PLAN
    def bad_draft(prefix):
        return onehot(V, 25 if len(prefix) == 4 else successor(prefix))
    c = rules.spec_cycle(FakeContext(ar_model(), V), FakeContext(bad_draft, V), PROMPT, k=3)
    assert c.plan == Plan("spec", draft_k=3) and c.gate == [True, False, None] and modes.label(c.plan) == "k=3"
    c = rules.ar_cycle(FakeContext(ar_model(), V), PROMPT)
    assert c.plan == AR_PLAN and modes.label(c.plan) == "ar" and c.gate == [True]
