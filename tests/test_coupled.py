"""Coupled sampling (sampling.CoupledSampler): the noise g(seed, position, token id), the Gumbel-max
draw's distribution, and the identity it buys: sampled `lossless`, `spec` and lookup drafts equal
sampled `ar` token for token for a seed, at any width, on real llama.cpp contexts (the embedded F32
pair). Negative controls must fail: noise keyed by the cycle instead of the position breaks the
identity; uniform instead of Gumbel noise breaks the distribution.

Goodness-of-fit tests reject at p < ALPHA = 1e-8 (tests/test_sampling.py's threshold).
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sst

from prove_local import modes, rules
from prove_local.engine import Engine, Settings
from prove_local.planner import Costs, Planner
from prove_local.sampling import CoupledSampler, Row, Sampler, gumbel, uniform
from tests.fakes import FakeContext
from tests.reference import greedy_ar
from tests.test_sampling import (ALPHA, FAKE_SETTINGS, FULL, MASK, PROMPT, QUESTION, TRUNC, V, ar_dist, draft_dist,
                                 exact_ar, exact_pairs, fake_logits, first_tokens, gof, mars_dist, marginal, pair)

__all__ = ["pair"]          # the embedded F32 pair's fixture, shared with test_sampling


# ------------------------------------------------------------------------------ the noise
def test_noise_is_a_function_of_seed_position_and_id_only():
    """The same (seed, pos, id) gets the same number whatever else is asked for with it (another
    support, another order, another vocabulary size), and nothing else gets it."""
    ids = np.arange(0, 152064, 7)
    full = gumbel(11, 40, ids)
    sub = ids[[3, 500, 17, 9000, 2]]
    np.testing.assert_array_equal(gumbel(11, 40, sub), full[[3, 500, 17, 9000, 2]])
    assert gumbel(11, 40, [21])[0] == full[3]
    assert len(set(full.tolist())) == len(full)                          # distinct per id
    assert gumbel(12, 40, [21])[0] != full[3] and gumbel(11, 41, [21])[0] != full[3]
    # the draw reads the noise of the surviving ids only, and a row's vocabulary size plays no part
    probs = np.array([0.5, 0.3, 0.2])
    for pos in range(50):
        picks = {CoupledSampler(5).draw(Row(np.array([4, 9, 30]), probs, v), pos) for v in (31, 1000, 152064)}
        assert len(picks) == 1
    # a token that survives in one distribution and not in the other keeps the others' noise: with
    # the extra token at (almost) no mass the draw is the same
    s = CoupledSampler(5)
    for pos in range(200):
        a = s.draw(Row(np.array([4, 9, 30]), probs, 50), pos)
        b = s.draw(Row(np.array([4, 9, 30, 44]), np.append(probs * (1 - 1e-12), 1e-12), 50), pos)
        assert a == b


class CountingNoise(CoupledSampler):
    """Records how many ids each noise call was asked for."""
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.sizes = []

    def noise(self, pos, ids):
        self.sizes.append(len(ids))
        return super().noise(pos, ids)


def test_draws_cost_the_surviving_tokens_not_the_vocabulary():
    """On a 152k-token row with top-k 40 the chain keeps at most 40 tokens, and only they get noise."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((3, 152064)) * 3).astype(np.float32)
    s = CountingNoise(3, temperature=1.0, top_k=40, top_p=1.0, min_p=0.0)
    tokens, q = s.propose(logits, [1, 2, 3])
    assert sum(s.sizes) == 3 * 40 and all(q[i, t] > 0 for i, t in enumerate(tokens))
    s = CountingNoise(3, temperature=1.0, top_k=40, top_p=1.0, min_p=0.0, repeat_penalty=1.3)
    s.propose(logits, [1, 2, 3])                    # a penalty: row by row (each sees the tokens before it)
    assert len(s.sizes) == 3 and all(40 <= n <= 43 for n in s.sizes)


def test_uniforms_are_uniform_over_ids_positions_and_seeds():
    ks = [sst.kstest(uniform(3, 17, np.arange(20000)), "uniform").pvalue,
          sst.kstest(np.array([uniform(3, t, [5])[0] for t in range(20000)]), "uniform").pvalue,
          sst.kstest(np.array([uniform(s, 17, [5])[0] for s in range(20000)]), "uniform").pvalue]
    assert min(ks) > ALPHA, ks
    g = gumbel(9, 3, np.arange(200000))
    assert abs(g.mean() - np.euler_gamma) < 6 * np.sqrt(np.pi ** 2 / 6 / len(g))
    # neighbouring positions and seeds are not correlated
    a, b = uniform(3, 100, np.arange(20000)), uniform(3, 101, np.arange(20000))
    c = uniform(4, 100, np.arange(20000))
    assert abs(np.corrcoef(a, b)[0, 1]) < 6 / np.sqrt(20000) and abs(np.corrcoef(a, c)[0, 1]) < 6 / np.sqrt(20000)


@pytest.mark.parametrize("case", range(3))
def test_gumbel_max_draw_is_distributed_as_p(case):
    """Over seeds (one draw each) and over positions (one seed): the coupled draw ~ p, a Row and
    the dense vector alike (the same token)."""
    rng = np.random.default_rng(case)
    p = rng.dirichlet(np.full(12, 0.6))
    p[[2, 7]] = 0.0                                           # truncated: never drawn
    p /= p.sum()
    row = Row(np.flatnonzero(p), p[p > 0], 12)
    over_seeds = [CoupledSampler(s).draw(row, 33) for s in range(20000)]
    one = CoupledSampler(1000 + case)
    over_pos = [one.draw(row, t) for t in range(20000)]
    assert over_seeds[:200] == [CoupledSampler(seed).draw(p, 33) for seed in range(200)]
    assert 2 not in over_seeds and 7 not in over_pos
    assert gof(over_seeds, dict(enumerate(p))) > ALPHA and gof(over_pos, dict(enumerate(p))) > ALPHA


def test_greedy_is_the_zero_noise_case_and_positions_are_required():
    s = CoupledSampler(1, temperature=0.0, repeat_penalty=1.5)
    assert all(s.draw(Row(np.array([6]), np.ones(1), 10), t) == 6 for t in range(20))
    with pytest.raises(ValueError, match="pos"):
        s.draw(Row(np.array([1, 2]), np.array([0.5, 0.5]), 10))
    with pytest.raises(ValueError, match="start"):
        s.verify(np.full((2, 3), 1 / 3), np.full((1, 3), 1 / 3), [1])


def test_verify_is_equality_with_the_targets_coupled_sample():
    s = CoupledSampler(7)
    p = np.array([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3], [0.3, 0.3, 0.4]])
    y = [s.draw(p[i], 10 + i) for i in range(3)]
    assert s.verify(p, None, y[:2], 10) == (2, y[2], None, False)
    wrong = (y[0] + 1) % 3
    assert s.verify(p, None, [wrong, y[1]], 10) == (0, y[0], None, True)
    assert s.verify(p, None, [y[0], (y[1] + 1) % 3], 10) == (1, y[1], None, True)


# ------------------------------------------------------------------ negative controls (samplers)
class CycleKeyed(CoupledSampler):
    """Bug (control): the noise is keyed by the cycle and the slot within it, not by the position
    (as a per-cycle random stream is): `start(tokens)` is called before each cycle."""
    cycle, base = 0, 0

    def start(self, tokens):
        self.cycle, self.base = self.cycle + 1, len(tokens)

    def noise(self, pos, ids):
        return gumbel(self.seed * 1000003 + self.cycle, pos - self.base, ids)


class UniformNoise(CoupledSampler):
    """Bug (control): argmax of log p + u with uniform u, not Gumbel noise: not distributed as p."""
    def noise(self, pos, ids):
        return uniform(self.seed, pos, ids)


def test_cycle_keyed_noise_still_reproduces_ar_one_token_per_cycle():
    """The control is a real sampler: its ar (one cycle per token) is as random as the coupled one."""
    ctx = FakeContext(ar_dist, V)
    out = []
    for seed in range(300):
        s = CycleKeyed(seed, **FAKE_SETTINGS)
        out.append(first_tokens(_cycles(lambda t: rules.ar_cycle(ctx, t, sampler=s), s), 3))
    assert gof(out, exact_ar(fake_logits(ar_dist), PROMPT, FAKE_SETTINGS, 3)) > ALPHA


def _cycles(cycle, s):
    """A cycle function that tells a CycleKeyed sampler where each cycle starts."""
    def run(t):
        if isinstance(s, CycleKeyed):
            s.start(t)
        return cycle(t)
    return run


def likely_drafts(t):
    """Two drafted tokens the target often confirms (the argmax of its raw rows), so that filled
    proposals reach their MARS slots."""
    a = int(np.argmax(ar_dist(t)))
    return [a, int(np.argmax(ar_dist(t + [a])))], [0.5, 0.5]


def fake_cycle(mode, s, block=4, k=3):
    if mode == "ar":
        ctx = FakeContext(ar_dist, V)
        return _cycles(lambda t: rules.ar_cycle(ctx, t, sampler=s), s)
    if mode == "lossless":
        ctx = FakeContext(mars_dist, V)
        return _cycles(lambda t: rules.lossless_cycle(ctx, t, block, MASK, sampler=s), s)
    if mode == "lookup":
        ctx = FakeContext(ar_dist, V)
        return _cycles(lambda t: rules.lookup_cycle(ctx, t, [t[-2], t[-1]], [0.5, 0.5], sampler=s), s)
    if mode == "fill":              # a MARS block filled by two lookup tokens (rules.lossless_fill_cycle)
        ctx = FakeContext(mars_dist, V)
        return _cycles(lambda t: rules.lossless_fill_cycle(ctx, t, *likely_drafts(t), block, MASK, sampler=s), s)
    tgt, dft = FakeContext(ar_dist, V), FakeContext(draft_dist, V)
    return _cycles(lambda t: rules.spec_cycle(tgt, dft, t, k, sampler=s), s)


def mismatches(sampler_cls, modes=("lossless", "spec", "lookup"), seeds=range(40), n=12) -> list:
    """The identity test on the scripted models: (mode, seed) pairs where the mode's first n tokens
    differ from ar's with the same seed and sampler class."""
    bad = []
    for seed in seeds:
        ar = first_tokens(fake_cycle("ar", sampler_cls(seed, **FAKE_SETTINGS)), n)
        bad += [(m, seed) for m in modes if first_tokens(fake_cycle(m, sampler_cls(seed, **FAKE_SETTINGS)), n) != ar]
    return bad


def test_identity_on_fakes_and_its_negative_control():
    assert mismatches(CoupledSampler) == []
    bad = mismatches(CycleKeyed)
    assert len(bad) > 60, bad                  # of 120: keyed by cycle, the modes' texts are not ar's


def test_identity_on_filled_proposals_and_its_negative_control():
    """A filled proposal (lookup tokens in front of the masks, then the MARS slots verified in a second
    pass when they all hold) gives ar's text for the seed; both of its passes ran in some cycles; keyed
    by the cycle, the texts are not ar's."""
    full = 0
    for seed in range(40):
        s = CoupledSampler(seed, **FAKE_SETTINGS)
        cycle = fake_cycle("fill", s)

        def counted(t):
            nonlocal full
            c = cycle(t)
            full += len(c.widths["target"]) == 2          # the lookup tokens held: the MARS slots verified
            return c
        first_tokens(counted, 12)
    assert full > 20, full
    assert mismatches(CoupledSampler, modes=("fill",)) == []
    assert len(mismatches(CycleKeyed, modes=("fill",))) > 20       # of 40


@pytest.mark.parametrize("mode,sampler_cls,ok", [
    ("ar", CoupledSampler, True), ("lossless", CoupledSampler, True), ("spec", CoupledSampler, True),
    ("lookup", CoupledSampler, True), ("ar", UniformNoise, False), ("lossless", UniformNoise, False)])
def test_coupled_modes_on_fakes_match_closed_form_ar(mode, sampler_cls, ok):
    """Three tokens over 3,000 seeds (one sample each), truncation and a sliding penalty window,
    against the enumerated ar distribution."""
    exact = exact_ar(fake_logits(ar_dist), PROMPT, FAKE_SETTINGS, 3)
    samples = [first_tokens(fake_cycle(mode, sampler_cls(seed, **FAKE_SETTINGS)), 3) for seed in range(3000)]
    pval = gof(samples, exact)
    assert (pval > ALPHA) if ok else (pval < ALPHA), pval


# ------------------------------------------------------------------ real llama.cpp contexts
@pytest.mark.parametrize("mode,T,trunc", [("lossless", 0.7, TRUNC), ("spec", 1.0, FULL), ("lossless", 1.0, FULL)])
def test_coupled_on_llama_cpp_matches_enumerated_ar(pair, mode, T, trunc):
    """The first two tokens of coupled lossless (block 4) / spec (k 2) over 600 seeds on the embedded
    F32 pair, against ar's distribution enumerated from one-token passes."""
    from prove_local.chat import Conversation
    prop, _, ref, ctx, ctx_draft = pair
    prompt = Conversation(prop).prompt_tokens(QUESTION)
    settings = dict(temperature=T, **trunc)
    exact = exact_pairs(ref, prompt, settings)
    ctx.truncate(0), ctx_draft.truncate(0)
    samples = []
    for seed in range(600):
        s = CoupledSampler(seed, **settings)
        if mode == "lossless":
            def cycle(t): return rules.lossless_cycle(ctx, t, 4, prop.mask_token, sampler=s)
        else:
            def cycle(t): return rules.spec_cycle(ctx, ctx_draft, t, 2, sampler=s)
        samples.append(first_tokens(cycle, 2, prompt))
    pval = min(gof(samples, exact), *(gof([x[i] for x in samples], marginal(exact, i)) for i in (0, 1)))
    assert pval > ALPHA, pval


@pytest.fixture(scope="module")
def engine(pair):
    prop, ver, *_ = pair
    return Engine.load(prop, ver, ver, n_ctx=512, n_threads=1, type_k="f32", type_v="f32")


FLAT = {1: 1e-3, 64: 1.1e-3}          # pass costs of a GPU: the planner proposes wide blocks and explores
REPEAT = "Repeat: 3 + 4 = 7. 3 + 4 = 7. 3 + 4 = 7. 3 + 4 ="
N_NEW = 40


def text(engine, prompt, **kw) -> list[int]:
    return [t for c in engine.generate(prompt, Settings(max_new=N_NEW, **kw)) for t in c.committed]


# what each identity case runs: (label, settings); "auto" cases run the planner on flat costs
WIDTHS = [("lossless B2", dict(mode="lossless", block=2, lookup=0)),
          ("lossless B4", dict(mode="lossless", block=4, lookup=0)),
          ("lossless B16", dict(mode="lossless", block=16, lookup=0)),
          ("lossless B4 + lookup 3", dict(mode="lossless", block=4, lookup=3)),
          ("lookup 3", dict(mode="lookup", lookup=3)),
          ("spec k2", dict(mode="spec", draft_k=2, lookup=0)),
          ("spec k4 + lookup 2", dict(mode="spec", draft_k=4, lookup=2)),
          ("lossless auto", dict(mode="lossless", block="auto", lookup="auto")),
          ("spec auto", dict(mode="spec", draft_k="auto", lookup="auto"))]


@pytest.mark.parametrize("T,extra", [(0.7, {}), (1.0, dict(top_k=0, top_p=1.0, min_p=0.0)),
                                     (1.2, dict(repeat_penalty=1.2, repeat_last_n=16))])
def test_sampled_exact_modes_equal_sampled_ar_on_llama_cpp(pair, engine, T, extra):
    """For four seeds, two prompts (one that lookup drafts from): every exact mode at every width,
    fixed or the planner's (flat costs, exploration on), gives ar's sampled text token for token."""
    from prove_local.chat import Conversation
    engine.planner = Planner(Costs({"target": FLAT, "draft": FLAT, "verifier": FLAT}), explore=0.3, seed=1)
    bad, planned = [], set()
    for question in (QUESTION, REPEAT):
        prompt = Conversation(pair[0]).prompt_tokens(question)
        for seed in (1, 2, 3, 4):
            ar = text(engine, prompt, mode="ar", temperature=T, seed=seed, **extra)
            assert len(ar) == N_NEW or engine.is_eog(ar[-1])
            if seed == 1:                 # ar itself against sampled ar by hand (tests/reference.py)
                assert ar == greedy_ar(pair[0], prompt, N_NEW, CoupledSampler(seed, temperature=T, **extra),
                                       n_ctx=512)
            for label, kw in WIDTHS:
                gen = engine.generate(prompt, Settings(max_new=N_NEW, temperature=T, seed=seed, **kw, **extra))
                cycles = list(gen)
                planned |= {modes.label(c.plan) for c in cycles}
                if [t for c in cycles for t in c.committed] != ar:
                    bad.append((question[:8], seed, label))
    assert bad == []
    assert len(planned) >= 8, planned                 # the widths really varied (the planner's included)


def forced_verify(ctx, mask, sampler, block=8):
    """Lossless cycles whose verify width is forced, cycle after cycle, through 1..block (a number,
    then a function of the slot confidences as the planner's choice is)."""
    state = {"i": 0}

    def cycle(t):
        state["i"] += 1
        v = state["i"] % block + 1
        verify = v if state["i"] % 2 else (lambda conf, v=v: v)
        return rules.lossless_cycle(ctx, t, block, mask, verify=verify, sampler=sampler)
    return cycle


def test_forced_verify_widths_equal_ar_and_cycle_keyed_noise_fails(pair):
    """Rules-level runs on the embedded pair: lossless with forced verify widths equals ar for every
    seed; the same identity test with noise keyed by the cycle (a per-cycle random stream) fails."""
    from prove_local.chat import Conversation
    prop, _, ref, ctx, _ = pair
    prompt = Conversation(prop).prompt_tokens(QUESTION)
    settings = dict(temperature=1.0, top_k=40, top_p=0.95, min_p=0.0)

    def identity_failures(sampler_cls) -> list[int]:
        failures = []
        for seed in range(6):
            ref.truncate(0), ctx.truncate(0)
            s_ar = sampler_cls(seed, **settings)
            ar = first_tokens(_cycles(lambda t: rules.ar_cycle(ref, t, sampler=s_ar), s_ar), 32, prompt)
            s = sampler_cls(seed, **settings)
            out = first_tokens(_cycles(forced_verify(ctx, prop.mask_token, s), s), 32, prompt)
            failures += [seed] if out != ar else []
        return failures

    assert identity_failures(CoupledSampler) == []
    assert len(identity_failures(CycleKeyed)) >= 5     # the control: the identity test detects the break


def test_rejection_sampler_is_kept_as_an_option(pair, engine):
    """--sampler rejection: exact speculative sampling (acceptance probabilities reported), a seed
    repeats its text at fixed widths; its text is not ar's (the stream is consumed per cycle)."""
    from prove_local.chat import Conversation
    prompt = Conversation(pair[0]).prompt_tokens(QUESTION)
    kw = dict(mode="lossless", block=4, temperature=1.0, sampler="rejection", lookup=0)
    cycles = list(engine.generate(prompt, Settings(max_new=N_NEW, seed=5, **kw)))
    assert any(c.accept_prob is not None and not c.coupled for c in cycles)
    a = [t for c in cycles for t in c.committed]
    assert text(engine, prompt, seed=5, **kw) == a
    ars = [text(engine, prompt, mode="ar", temperature=1.0, sampler="rejection", seed=s) for s in range(5, 9)]
    outs = [text(engine, prompt, seed=s, **kw) for s in range(5, 9)]
    assert any(x != y for x, y in zip(ars, outs))
    coupled = list(engine.generate(prompt, Settings(max_new=N_NEW, seed=5, mode="lossless", block=4, temperature=1.0)))
    assert all(c.accept_prob is None and c.coupled for c in coupled)
    with pytest.raises(Exception, match="sampler must be one of coupled, rejection"):
        engine.check(Settings(sampler="gumbel", temperature=1.0))


def test_seed_note_only_where_a_seed_cannot_repeat_the_text():
    from prove_local.engine import seed_note
    assert seed_note(Settings(mode="lossless", block="auto", temperature=0.8, seed=3)) is None
    assert seed_note(Settings(mode="spec", draft_k="auto", temperature=0.8, seed=3)) is None
    assert "rejection" in seed_note(Settings(mode="lossless", block="auto", temperature=0.8, seed=3, sampler="rejection"))
    assert "lossy" in seed_note(Settings(mode="mars", block="auto", temperature=0.8, seed=3))
    assert seed_note(Settings(mode="mars", block=4, temperature=0.8, seed=3)) is None
    assert seed_note(Settings(mode="lossless", block="auto", temperature=0.0, seed=3, sampler="rejection")) is None


def test_rejection_negative_controls_still_use_sampler():
    """The rejection sampler (tests/test_sampling.py's subject) stays the base class: its draw ignores
    the position and consumes its generator."""
    s = Sampler(np.random.default_rng(0), temperature=1.0)
    draws = [s.draw(np.array([0.5, 0.5]), 7) for _ in range(200)]
    assert 50 < sum(draws) < 150 and not s.coupled


def test_cli_seed_gives_the_same_text_in_every_exact_mode(capsys):
    """`run --json` at T 0.8: lossless under --block auto, ar and lookup print the same tokens for a
    seed; without a seed, the one drawn is reported and replays the answer."""
    import json
    from prove_local.cli import main
    q = "A baker made 24 muffins and sold half of them. How many are left?"
    base = ["run", "embedded", "-p", q, "-n", "32", "--json", "--threads", "1", "--temp", "0.8"]

    def run(*extra):
        assert main(base + list(extra)) == 0
        return json.loads(capsys.readouterr().out)
    auto = run("--seed", "5")
    assert auto["settings"]["seed"] == 5 and auto["settings"]["sampler"] == "coupled"
    assert run("--seed", "5", "--mode", "ar")["token_ids"] == auto["token_ids"]
    assert run("--seed", "5", "--mode", "lookup", "--lookup", "4")["token_ids"] == auto["token_ids"]
    fresh = run()
    assert run("--seed", str(fresh["settings"]["seed"]), "--mode", "ar")["token_ids"] == fresh["token_ids"]
    assert run("--seed", "5", "--sampler", "rejection", "--block", "4")["settings"]["sampler"] == "rejection"
