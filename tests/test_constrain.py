"""constrain.py on the scripted world of tests/fakes.py: a grammar given as a fake (allowed tokens as
a function of the tokens so far), a proposer that proposes a token the grammar forbids. Every rule
commits only allowed tokens; the exact ones equal ar under the same grammar, which equals masked
greedy decoding by its definition; a dead end stops with "grammar"."""
import numpy as np
import pytest

from tests.fakes import EOS, MASK, PROMPT, V, FakeContext, make_engine, onehot, proposer, run, successor, verifier

FORBIDDEN = 25          # the token proposer(wrong=...) proposes at its wrong slots


class FakeGrammar:
    """Allowed next tokens = rule(tokens so far in the answer) (a set); `sentinel` as grammar.Grammar's."""

    def __init__(self, rule):
        self.rule, self.sentinel, self.calls = rule, EOS, 0

    def start(self):
        return FakeState(self, ())


class FakeState:
    def __init__(self, g, seq):
        self.g, self.seq = g, seq

    def allows(self, t):
        return int(t) in self.g.rule(self.seq)

    def mask(self):
        m = np.zeros(V, dtype=bool)
        m[list(self.g.rule(self.seq))] = True
        return m

    def then(self, t):
        return FakeState(self.g, self.seq + (int(t),)) if self.allows(t) else None


def no_forbidden_no_sevens(seq):
    """Every token but FORBIDDEN and 7 (the scripted model's successor of 6: the mask must move the
    argmax there), and the mask token."""
    return set(range(V)) - {FORBIDDEN, 7, MASK}


def masked_greedy(prompt, n, rule, model=successor):
    """Greedy decoding under `rule` by definition on the scripted world: the successor if allowed,
    else the lowest allowed id (onehot spreads the rest evenly: ties, broken by the first index)."""
    out = []
    for _ in range(n):
        allowed = rule(tuple(out))
        nxt = model(prompt + out)
        out.append(nxt if nxt in allowed else min(allowed))
    return out


def test_forbidden_proposals_are_never_committed_and_lossless_equals_ar():
    want = masked_greedy(PROMPT, 24, no_forbidden_no_sevens)
    assert 7 not in want and FORBIDDEN not in want
    g = FakeGrammar(no_forbidden_no_sevens)
    _, ar = run(make_engine(), PROMPT, mode="ar", max_new=24, grammar=g)
    assert ar == want
    for wrong in [(2,), (1, 3), (2, 3, 4)]:
        cycles, lossless = run(make_engine(proposer(wrong=wrong)), PROMPT, mode="lossless", block=4, lookup=0,
                               max_new=24, grammar=g)
        _, ar_same = run(make_engine(proposer(wrong=wrong)), PROMPT, mode="ar", max_new=24, grammar=g)
        assert lossless == ar_same, wrong          # the proposer is the target (slot 1 its AR row)
        assert FORBIDDEN not in lossless
        if 1 not in wrong:
            assert lossless == want
    # prove and mars commit proposals without an exact test: greedy slots are picked under the grammar
    # state their earlier slots reach, so the forbidden proposal is replaced by an allowed token
    ver = FakeContext(verifier(), V)
    cycles, prove = run(make_engine(proposer(wrong=(2,)), verifier=ver), PROMPT, mode="prove", block=4,
                        theta=0.0, max_new=24, grammar=g)
    assert FORBIDDEN not in prove and 7 not in prove and len(prove) == 24
    assert any(c.n_accepted > 1 for c in cycles)            # several slots per cycle were committed
    _, mars = run(make_engine(proposer(wrong=(2,))), PROMPT, mode="mars", block=4, tau=0.0, max_new=24, grammar=g)
    assert FORBIDDEN not in mars and 7 not in mars and len(mars) == 24


def test_sampled_rules_commit_only_allowed_tokens():
    g = FakeGrammar(no_forbidden_no_sevens)
    for mode, extra in [("ar", {}), ("lossless", {"block": 4, "lookup": 0}), ("mars", {"block": 4, "tau": 0.0})]:
        _, out = run(make_engine(proposer(wrong=(2,))), PROMPT, mode=mode, max_new=40, temperature=1.0, top_k=0,
                     top_p=1.0, min_p=0.0, seed=5, grammar=g, **extra)
        assert out and FORBIDDEN not in out and 7 not in out and MASK not in out, mode


def test_dead_end_stops_with_grammar():
    """After 5 tokens the grammar allows nothing (not even the end): the answer stops there."""
    g = FakeGrammar(lambda seq: set(range(20)) if len(seq) < 5 else set())
    for mode, extra in [("ar", {}), ("lossless", {"block": 4, "lookup": 0}), ("mars", {"block": 4, "tau": 0.0})]:
        cycles, out = run(make_engine(), PROMPT, mode=mode, max_new=24, grammar=g, **extra)
        assert out == masked_greedy(PROMPT, 5, g.rule), mode
        assert cycles[-1].stop == "grammar", mode
        e = make_engine()
        list(e.generate(PROMPT, __import__("prove_local.engine", fromlist=["Settings"]).Settings(
            mode=mode, max_new=24, grammar=g, **extra)))
        assert e.contexts["proposer"].cache == PROMPT + out[:len(e.contexts["proposer"].cache) - len(PROMPT)]


def test_logprobs_on_fakes_are_the_rows_log_softmax():
    """ar and lossless report the same numbers: the log-softmax of the target's row (masked by the
    grammar when there is one), whatever pass the row came from."""
    g = FakeGrammar(no_forbidden_no_sevens)
    rows = {}
    for mode, extra in [("ar", {}), ("lossless", {"block": 4, "lookup": 0})]:
        cycles, out = run(make_engine(proposer(wrong=(3,))), PROMPT, mode=mode, max_new=12, logprobs=3, grammar=g,
                          **extra)
        rows[mode] = [e for c in cycles for e in c.logprobs]
        assert [t for t, _, _ in rows[mode]] == out
    for (t, lp, top), (t2, lp2, top2) in zip(rows["ar"], rows["lossless"]):
        assert t == t2 and lp == pytest.approx(lp2, abs=1e-6) and [i for i, _ in top] == [i for i, _ in top2]
    # by definition: p = 0.9 on the successor if allowed; the allowed rest share (1 - 0.9) / (V - 1) each
    out = [t for t, _, _ in rows["ar"]]
    for k, (t, lp, top) in enumerate(rows["ar"]):
        probs = onehot(V, successor(PROMPT + out[:k]), 0.9)
        probs[~FakeGrammar(no_forbidden_no_sevens).start().mask()] = 0.0
        with np.errstate(divide="ignore"):
            ref = np.log(probs / probs.sum())
        assert lp == pytest.approx(ref[t], abs=1e-5)
        assert [v for _, v in top] == pytest.approx(sorted(ref[np.isfinite(ref)], reverse=True)[:3], abs=1e-5)


def test_forbidden_lookup_draft_is_rejected_by_verification():
    """A model whose own choice is always FORBIDDEN, and lookup drafts copying FORBIDDEN from the prompt:
    without a grammar the drafts are accepted; with one, verification against the masked target rows
    rejects every one of them, and the output equals ar under the grammar."""
    g = FakeGrammar(no_forbidden_no_sevens)
    prompt = [3, FORBIDDEN, FORBIDDEN, FORBIDDEN, FORBIDDEN, 3]
    cycles, free = run(make_engine(proposer(wrong=(1,))), prompt, mode="lookup", lookup=3, max_new=12)
    assert free.count(FORBIDDEN) == 12 and any(c.n_accepted for c in cycles)
    cycles, out = run(make_engine(proposer(wrong=(1,))), prompt, mode="lookup", lookup=3, max_new=12, grammar=g)
    assert any(FORBIDDEN in c.proposed for c in cycles)      # proposed, and
    assert FORBIDDEN not in out                               # never committed
    _, ar = run(make_engine(proposer(wrong=(1,))), prompt, mode="ar", max_new=12, grammar=g)
    assert out == ar


def test_sampled_lossless_under_a_grammar_is_distributed_as_ar():
    """Sampled lossless with unmasked MARS slots that propose FORBIDDEN: the first two tokens follow
    the closed form of ar sampling under the grammar (the masked, renormalised target), chi-square."""
    from tests.test_sampling import gof

    rule = no_forbidden_no_sevens
    allowed = sorted(rule(()))

    def masked(prefix):
        p = onehot(V, successor(prefix), 0.9)
        keep = np.zeros(V, dtype=bool)
        keep[allowed] = True
        p[~keep] = 0.0
        return p / p.sum()

    p1 = masked(PROMPT)
    want = {(a, b): p1[a] * masked(PROMPT + [a])[b] for a in allowed for b in allowed}
    g = FakeGrammar(rule)
    samples = []
    for seed in range(3000):
        _, out = run(make_engine(proposer(wrong=(2,))), PROMPT, mode="lossless", block=4, lookup=0, max_new=2,
                     temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed, grammar=g)
        samples.append(tuple(out))
    assert gof(samples, want) > 1e-3


def test_spec_drafts_follow_the_grammar_and_spec_equals_ar():
    """A draft model's rows are masked by the state its earlier drafts reach: a draft that prefers
    FORBIDDEN (or the target's 7) drafts allowed tokens; spec under the grammar equals ar under it."""
    from tests.fakes import ar_model

    g = FakeGrammar(no_forbidden_no_sevens)
    want = masked_greedy(PROMPT, 20, no_forbidden_no_sevens)
    for draft in (lambda prefix: onehot(V, FORBIDDEN, 0.9), ar_model()):
        cycles, out = run(make_engine(draft=FakeContext(draft, V)), PROMPT, mode="spec", draft_k=3, lookup=0,
                          max_new=20, grammar=g)
        assert out == want
        assert all(FORBIDDEN not in c.proposed and 7 not in c.proposed for c in cycles)
    assert sum(c.n_accepted for c in cycles) > 0          # the successor-following draft is accepted
