"""constrain.py on the scripted world of tests/fakes.py: a grammar given as a fake (allowed tokens as
a function of the tokens so far: after an even token its successor is forbidden, so a state advanced
over the wrong token masks the wrong successor), a proposer that proposes a token the grammar
forbids. Every rule commits only allowed tokens; the exact ones equal ar under the same grammar,
which equals masked greedy decoding by its definition; a dead end stops with "grammar". The negative
control advances the grammar over a dropped draft and must fail."""
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
    argmax there), and the mask token; and, depending on the tokens so far, after an even token t
    not t + 1 (the scripted successor): the mask at a position depends on the token before it."""
    banned = {FORBIDDEN, 7, MASK}
    if seq and seq[-1] % 2 == 0:
        banned.add((seq[-1] + 1) % 20)
    return set(range(V)) - banned


def all_allowed(out, rule=no_forbidden_no_sevens) -> bool:
    """Every token of `out` allowed by `rule` after the tokens before it."""
    return all(t in rule(tuple(out[:k])) for k, t in enumerate(out))


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
    assert 7 not in want and FORBIDDEN not in want and all_allowed(want)
    assert want != masked_greedy(PROMPT, 24, lambda seq: set(range(V)) - {FORBIDDEN, 7, MASK})   # state matters
    g = FakeGrammar(no_forbidden_no_sevens)
    _, ar = run(make_engine(), PROMPT, mode="ar", max_new=24, grammar=g)
    assert ar == want
    for wrong in [(2,), (1, 3), (2, 3, 4)]:
        cycles, lossless = run(make_engine(proposer(wrong=wrong)), PROMPT, mode="lossless", block=4, lookup=0,
                               max_new=24, grammar=g)
        # the proposer is the target: its AR row (slot 1) proposes FORBIDDEN when 1 is wrong, whose
        # masked argmax is the lowest allowed id
        own = (lambda prefix: FORBIDDEN) if 1 in wrong else successor
        assert lossless == masked_greedy(PROMPT, 24, no_forbidden_no_sevens, model=own), wrong
        assert FORBIDDEN not in lossless
        if 1 not in wrong:
            assert lossless == want
    # prove and mars commit proposals without an exact test: greedy slots are picked under the grammar
    # state their earlier slots reach, so the forbidden proposal is replaced by an allowed token
    ver = FakeContext(verifier(), V)
    cycles, prove = run(make_engine(proposer(wrong=(2,)), verifier=ver), PROMPT, mode="prove", block=4,
                        theta=0.0, max_new=24, grammar=g)
    assert all_allowed(prove) and len(prove) == 24
    assert any(c.n_accepted > 1 for c in cycles)            # several slots per cycle were committed
    _, mars = run(make_engine(proposer(wrong=(2,))), PROMPT, mode="mars", block=4, tau=0.0, max_new=24, grammar=g)
    assert all_allowed(mars) and len(mars) == 24


def test_sampled_rules_commit_only_allowed_tokens():
    g = FakeGrammar(no_forbidden_no_sevens)
    for mode, extra in [("ar", {}), ("lossless", {"block": 4, "lookup": 0}), ("mars", {"block": 4, "tau": 0.0})]:
        _, out = run(make_engine(proposer(wrong=(2,))), PROMPT, mode=mode, max_new=40, temperature=1.0, top_k=0,
                     top_p=1.0, min_p=0.0, seed=5, grammar=g, **extra)
        assert out and all_allowed(out), mode


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
        assert e.contexts["target"].cache == PROMPT + out[:len(e.contexts["target"].cache) - len(PROMPT)]


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
        probs[~FakeState(FakeGrammar(no_forbidden_no_sevens), tuple(out[:k])).mask()] = 0.0
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
    assert FORBIDDEN not in out and all_allowed(out)          # never committed
    assert out == masked_greedy(prompt, 12, no_forbidden_no_sevens, model=lambda prefix: FORBIDDEN)


def test_coupled_sampling_under_a_grammar_gives_ar_text_in_every_exact_mode():
    """The coupled sampler's identity (a seed means a text, whatever the mode and width) under a
    grammar: lossless (whose slot 2 proposes FORBIDDEN), lossless with lookup drafts, lookup and spec,
    each drawing and testing on rows masked by the state its tokens reach, commit ar's tokens for
    every seed; the seeds give many texts."""
    g = FakeGrammar(no_forbidden_no_sevens)
    kw = dict(max_new=24, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, grammar=g)
    runs = [("lossless", dict(block=4, lookup=0), lambda: make_engine(proposer(wrong=(2,)))),
            ("lossless", dict(block=4, lookup=2), lambda: make_engine(proposer(wrong=(2,)))),
            ("lookup", dict(lookup=3), lambda: make_engine()),
            ("spec", dict(draft_k=3, lookup=0), lambda: make_engine(draft=FakeContext(verifier(), V)))]
    texts = set()
    for seed in range(30):
        _, ar = run(make_engine(), PROMPT, mode="ar", seed=seed, **kw)
        assert ar and all_allowed(ar)
        texts.add(tuple(ar))
        for mode, extra, engine in runs:
            _, out = run(engine(), PROMPT, mode=mode, seed=seed, **kw, **extra)
            assert out == ar, (mode, extra, seed)
    assert len(texts) > 10, len(texts)


def test_sampled_lossless_under_a_grammar_is_distributed_as_ar():
    """Sampled lossless with unmasked MARS slots that propose FORBIDDEN: the first two tokens follow
    the closed form of ar sampling under the grammar (the masked, renormalised target), chi-square."""
    from tests.test_sampling import gof

    rule = no_forbidden_no_sevens

    def masked(prefix):                          # the grammar's state after the answer's tokens so far
        p = onehot(V, successor(prefix), 0.9)
        keep = np.zeros(V, dtype=bool)
        keep[sorted(rule(tuple(prefix[len(PROMPT):])))] = True
        p[~keep] = 0.0
        return p / p.sum()

    p1 = masked(PROMPT)
    want = {(a, b): p1[a] * masked(PROMPT + [a])[b] for a in rule(()) for b in rule((a,))}
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
        # each cycle's drafts are allowed after the committed tokens before them
        assert all(all_allowed(out[:c.start] + c.proposed) for c in cycles)
    assert sum(c.n_accepted for c in cycles) > 0          # the successor-following draft is accepted


def end_over_dropped_draft(end):
    """A broken Watch.end: the grammar state after a cycle advanced over the first dropped draft
    (the proposed token where the verify pass disagreed) instead of the committed correction, as a
    grammar accepted on drafts without a rollback would be."""
    def broken(self, committed):
        ok, dead = end(self, committed)
        fed = [t for t in self._suffix.get("target", []) if t != self.mask_token]
        k = next((i for i, (a, b) in enumerate(zip(fed, committed)) if a != b), None)
        if k is not None:
            st = self.state_after(tuple(committed[:k]) + (fed[k],))
            if st is not None:
                self.state = st
        return ok, dead
    return broken


def test_negative_control_a_state_advanced_over_a_dropped_draft_fails(monkeypatch):
    """The tests above see such a bug: lossless with a proposer whose slot 2 is always wrong (every
    cycle drops a draft) leaves masked greedy decoding under the token-dependent grammar. A grammar
    whose masks ignore the tokens so far would not notice."""
    from prove_local import constrain

    want = masked_greedy(PROMPT, 24, no_forbidden_no_sevens)

    def lossless(rule):
        _, out = run(make_engine(proposer(wrong=(2,))), PROMPT, mode="lossless", block=4, lookup=0, max_new=24,
                     grammar=FakeGrammar(rule))
        return out

    assert lossless(no_forbidden_no_sevens) == want
    monkeypatch.setattr(constrain.Watch, "end", end_over_dropped_draft(constrain.Watch.end))
    assert lossless(no_forbidden_no_sevens) != want                # the bug shows

    def blind(seq):
        return set(range(V)) - {FORBIDDEN, 7, MASK}
    assert lossless(blind) == masked_greedy(PROMPT, 24, blind)     # a token-blind grammar hides it
