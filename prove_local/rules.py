"""The decoding rules: one cycle each, as pure functions over contexts.

A context is anything with `n_past`, `eval(tokens, rows) -> logits[len(rows), vocab]` and
`truncate(n)` (see llama.py; tests use a fake); a context that also has `eval_view` (llama.Context)
lends its rows without a copy. The rules read from the rows only what they decide with (argmax,
p̃, the probability of a proposed token, a sampled row's surviving candidates): logits.py. `tokens` is the committed sequence so far
(prompt + generated). On entry and on return, every context holds a prefix of `tokens` in its
KV cache; the tokens after its `n_past` are pending and go at the front of its next eval.
A cycle never mutates `tokens`; it returns a `Cycle` whose `committed` run the caller appends.

Sampling: every cycle takes an optional `sampler` (sampling.Sampler: the request's sampler chain
and its randomness). None is greedy decoding, today's code, bit for bit. With a sampler, each
rule has a `_sampled` twin: slot/draft tokens are drawn from their processed distributions q_i at
their absolute positions (len(prefix)), and the exact modes verify them against the processed
targets p_i with `sampler.verify(p, q, drafted, start)`: equality with the target's position-keyed
coupled sample (sampling.CoupledSampler: the output is ar's, token for token, for the seed), or exact
speculative sampling (sampling.Sampler: distributed exactly as `ar` sampling).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .logits import probs_at, row_stats
from .sampling import point_mass, stack


@dataclass(frozen=True)
class Plan:
    """The widths of one cycle: what the engine asks a rule to run (from the request's fixed settings
    or the planner), and, recorded in `Cycle.plan`, what the rule ran.
    `kind` names the rule ("ar": a plain one-token cycle, the planner's fallback in any mode);
    `block`: proposal slots (lossless, prove, mars); `draft_k`: drafted tokens (spec);
    `verify` (lossless): proposed tokens fed to the verify pass, 1..block (None: all of them).
    `choose_verify`, on a plan handed to a rule only, picks the verify width from the slot
    confidences p̃ between the two passes (the planner's marginal choice); the recorded plan holds
    the width it picked in `verify`.
    `lookup`: tokens drafted by lookup (lookup.py: copied from the request's own tokens). A "lookup"
    plan verifies them in one pass; a lossless plan with `lookup` > 0 is a *filled* proposal: the
    lookup tokens go in front of the masks of its proposal pass (`lossless_fill_cycle`), and
    `verify` = 0 records that the second pass was skipped (a lookup token was rejected).
    `propose_lookup(k) -> (tokens, scores)`, on a plan handed to a rule only, drafts them (the
    engine's index, synced to the committed tokens)."""
    kind: str = "ar"
    block: int = 1
    draft_k: int = 0
    verify: int | None = None
    choose_verify: Callable | None = field(default=None, compare=False, repr=False)
    lookup: int = 0
    propose_lookup: Callable | None = field(default=None, compare=False, repr=False)

    @property
    def proposes(self) -> bool:
        """Whether the cycle proposed tokens (False: a plain ar cycle)."""
        return self.kind != "ar"

    @property
    def width(self) -> int:
        """The value of the mode's width parameter: k for spec, the lookup draft for lookup, the block otherwise."""
        if self.kind == "lookup":
            return self.lookup
        return self.draft_k if self.kind == "spec" else self.block

    @property
    def filled(self) -> bool:
        """A MARS proposal whose first slots were filled by lookup tokens (lossless_fill_cycle)."""
        return self.lookup > 0 and self.kind != "lookup"

    @property
    def tested(self) -> int:
        """Proposed tokens up for acceptance: verified (lossless), drafted (spec, lookup), or the block;
        a filled proposal's lookup tokens plus its verified slots."""
        if self.kind == "spec":
            return self.draft_k
        if self.kind == "lookup":
            return self.lookup
        return self.lookup + (self.block if self.verify is None else self.verify)

    def label(self) -> str:
        """'ar', 'B=4 v=2' (lossless), 'B=4' (prove, mars), 'k=3' (spec), 'L=3' (lookup),
        'L=3+B=4 v=2' (a filled proposal)."""
        if self.kind == "ar":
            return "ar"
        if self.kind == "spec":
            return f"k={self.draft_k}"
        if self.kind == "lookup":
            return f"L={self.lookup}"
        fill = f"L={self.lookup}+" if self.lookup else ""
        v = self.block if self.verify is None else self.verify
        return fill + (f"B={self.block} v={v}" if self.kind == "lossless" else f"B={self.block}")

    def as_dict(self) -> dict:
        return {"kind": self.kind, "block": self.block, "draft_k": self.draft_k, "verify": self.verify,
                "lookup": self.lookup}


AR_PLAN = Plan()


@dataclass
class Cycle:
    """What one cycle did. `committed[:n_accepted]` are accepted proposals; a further token
    (lossless/spec) is the model's own correction, or the bonus token after a full match."""
    proposed: list[int]
    p: list[float]                # proposer (or draft) confidence per slot
    q: list[float] | None         # verifier probability of each proposed token (None: no verifier)
    committed: list[int]
    n_accepted: int
    passes: dict[str, int]        # forward passes per model (the engine replaces it with measured counts)
    widths: dict[str, list[int]] = field(default_factory=dict)   # tokens fed in each pass, per model
    decode_seconds: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0          # wall time of the whole cycle
    index: int = 0                # set by the driver
    start: int = 0                # generated tokens before this cycle
    stop: str | None = None       # on the last cycle: "eog", "length" or "context"
    # sampling (exact modes): min(1, p/q) of each verified slot (lossless slot 1: 1.0, an exact
    # sample of the target); None when greedy or coupled (the test is equality). `residual`: the token after
    # the accepted run replaced a rejected proposal (drawn from norm(max(0, p - q)) when sampling,
    # the target's argmax when greedy) rather than being the bonus token after a full match.
    accept_prob: list[float] | None = None
    residual: bool = False
    # the plan the rule ran (kind and widths; a planner's verify choice resolved), and the gate's
    # outcome per proposed slot: True passed, False failed, None not tested (exact modes stop testing
    # at the first failure; a threshold gate (prove, mars) is evaluated on every slot)
    plan: Plan = AR_PLAN
    gate: list | None = None
    # where each proposed slot came from: "mask" (a MARS slot), "adapter" (a MARS slot of a gated adapter,
    # slot 1 included: a guess, not the model's own token), "lookup" (lookup.py), "draft" (spec's
    # draft model); the engine fills it from the mode table (Mode.source) where a rule leaves it None
    source: list[str] | None = None
    # per committed token, when the request asks for logprobs: (token, logprob, [(id, logprob), ...]),
    # filled in by the engine from the rows the rule read (constrain.Watch.logprobs)
    logprobs: list | None = None
    # sampled with the coupled sampler (sampling.CoupledSampler: set by the engine): the tests were
    # equalities with the target's position-keyed sample, not greedy tokens
    coupled: bool = False


def _gate(ok, tested: int, n_slots: int, stop_at_failure: bool) -> list:
    """Per-slot gate outcomes for `Cycle.gate` from the tests of the first `tested` slots."""
    out = [bool(x) for x in list(ok)[:tested]]
    if stop_at_failure and False in out:
        first = out.index(False)
        out = out[:first + 1]
    return out + [None] * (n_slots - len(out))


def top1(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Argmax per row and its softmax probability (p̃): one argmax pass and one exp pass per row
    (logits.row_stats), no copy of the rows."""
    ids, _, sums = row_stats(logits)
    return ids, (1.0 / sums).astype(np.float32)


def prob_of(logits: np.ndarray, ids) -> np.ndarray:
    """Softmax probability of ids[i] under row i."""
    _, maxes, sums = row_stats(logits)
    return probs_at(logits, maxes, sums, ids)


def greedy_and_prob(logits: np.ndarray, ids) -> tuple[np.ndarray, np.ndarray]:
    """Argmax of every row, and the probability of ids[i] under row i for the first len(ids)
    rows: an exp pass only over those rows (the last row of a verify pass needs its argmax only)."""
    g, maxes, sums = row_stats(logits, exp_rows=range(len(ids)))
    return g, probs_at(logits, maxes, sums, ids)


def _logits(ctx, tokens: list[int], rows: list[int] | None = None, adapter: bool = False) -> np.ndarray:
    """ctx.eval's logits, as a view into the context's output buffer where the context offers one
    (llama.Context.eval_view: valid until its next pass, which is all a rule needs: it reads the
    rows before evaluating again); a copy from contexts that have only `eval` (the tests' fakes).
    `adapter`: the pass runs with the context's gated MARS adapter on (a proposal pass)."""
    view = getattr(ctx, "eval_view", None) or ctx.eval
    return view(tokens, rows, adapter=True) if adapter else view(tokens, rows)


def gated(ctx) -> bool:
    """Whether ctx proposes through a gated MARS adapter (llama.Context.gated): its proposal pass
    runs with the adapter on and is no stock pass, so the positions it writes are not kept as
    stock KV, and slot 1 is the adapter's guess of the next token rather than the model's own."""
    return bool(getattr(ctx, "gated", False))


def _pending(ctx, tokens: list[int]) -> list[int]:
    """Committed tokens not yet in ctx's cache; at least the last one, which yields the next logits."""
    if ctx.n_past >= len(tokens):
        ctx.truncate(len(tokens) - 1)
    return tokens[ctx.n_past:]


def proposal_logits(ctx, tokens: list[int], block: int, mask: int, keep: bool = True) -> np.ndarray:
    """MARS proposal pass: [pending..., <mask> x (block-1)]. The last pending row is slot 1 (the
    ordinary next-token distribution); the j-th mask's row is slot j+1. Masks are removed after.
    On a gated context the pass runs with the adapter on; `keep` False removes the pending tokens
    too (their KV is the adapter's: the exact modes re-feed them in their stock verify pass), `keep`
    True keeps them (the lossy modes, which make no stock pass: the context records it, n_stock)."""
    pending = _pending(ctx, tokens)
    start = ctx.n_past
    logits = _logits(ctx, pending + [mask] * (block - 1), rows=list(range(len(pending) - 1, len(pending) + block - 1)),
                     adapter=gated(ctx))
    ctx.truncate(len(tokens) if keep or not gated(ctx) else start)
    return logits


def propose(ctx, tokens: list[int], block: int, mask: int):
    """Greedy proposal: the argmax of every slot and its probability."""
    return top1(proposal_logits(ctx, tokens, block, mask))


def leading_run(ok) -> int:
    """Length of the leading run of True."""
    ok = np.asarray(ok, dtype=bool)
    return int(ok.argmin()) if not ok.all() else len(ok)


def _tested(n: int, rejected: bool, n_slots: int) -> list:
    """Gate outcomes of an exact sampled cycle: n accepted, then the rejected slot if there was one."""
    return _gate([True] * n + [False] * rejected, n + rejected, n_slots, True)


def _joined(*parts) -> list | None:
    """Acceptance probabilities of a sampled cycle from its parts; None where the sampler gives none
    (the coupled sampler's test is equality)."""
    return None if any(x is None for x in parts) else [v for x in parts for v in x]


def _mars_plan(block: int) -> Plan:
    return Plan("mars", block) if block > 1 else AR_PLAN    # one slot: the same pass and token as ar


def _spec_plan(k: int) -> Plan:
    return Plan("spec", draft_k=k) if k else AR_PLAN          # no drafts: a plain ar cycle


def ar_cycle(ctx, tokens: list[int], sampler=None) -> Cycle:
    if sampler is not None:
        return _ar_sampled(ctx, tokens, sampler)
    pending = _pending(ctx, tokens)
    ids, p = top1(_logits(ctx, pending))
    return Cycle([int(ids[0])], [float(p[0])], None, [int(ids[0])], 1, {"proposer": 1},
                 {"proposer": [len(pending)]}, plan=AR_PLAN, gate=[True])


def lossless_cycle(ctx, tokens: list[int], block: int, mask: int, verify=None, sampler=None) -> Cycle:
    """ProVe-lossless: the proposer verifies its own block in a second pass.
    Row i of the verify pass is the greedy token after tokens + d[:i+1]; d[i+1] is accepted while
    it equals that token. Slot 1 is the AR token, so >= 1 token is accepted, and the greedy token at
    the first mismatch (or after a full match) is committed too: every token is greedy AR's.
    `verify` < block feeds only d[:verify] to the second pass (the rest of the proposal is dropped
    unread: a narrower pass is cheaper where width costs time, as on a CPU). It may be a function
    of the slot confidences p, called between the two passes (a planner's choice)."""
    if gated(ctx):
        return gated_lossless_cycle(ctx, tokens, [], [], block, mask, verify=verify, sampler=sampler)
    if sampler is not None:
        return _lossless_sampled(ctx, tokens, block, mask, verify, sampler)
    pending = len(_pending(ctx, tokens))
    d, p = propose(ctx, tokens, block, mask)
    if callable(verify):
        verify = verify(p)
    v = block if verify is None else max(1, min(int(verify), block))
    logits = _logits(ctx, d[:v].tolist(), rows=list(range(v)))
    g, q = greedy_and_prob(logits, d[1:v])
    ok = np.concatenate([[True], d[1:v] == g[:-1]])
    n = leading_run(ok)
    ctx.truncate(len(tokens) + n)                # keep d[:n]; g[n-1] stays pending
    committed = d[:n].tolist() + [int(g[n - 1])]
    return Cycle(d.tolist(), p.tolist(), [float(p[0])] + q.tolist(), committed, n, {"proposer": 2},
                 {"proposer": [pending + block - 1, v]}, residual=n < v,
                 plan=Plan("lossless", block, verify=v), gate=_gate(ok, v, block, True))


def prove_cycle(ctx_prop, ctx_ver, tokens: list[int], block: int, mask: int, theta: float, sampler=None) -> Cycle:
    """ProVe: a stock AR verifier reads the block teacher-forced; q_i is its probability of d_i
    after d[:i]. Commit the longest leading run with p_i * q_i >= theta, at least slot 1 (the
    proposer's own AR token). No correction token: the next cycle starts at the first failure."""
    if sampler is not None:
        return _prove_sampled(ctx_prop, ctx_ver, tokens, block, mask, theta, sampler)
    width = len(_pending(ctx_prop, tokens)) + block - 1
    d, p = propose(ctx_prop, tokens, block, mask)
    pending = _pending(ctx_ver, tokens)
    feed = pending + d[:-1].tolist()
    logits = _logits(ctx_ver, feed, rows=list(range(len(pending) - 1, len(feed))))
    q = prob_of(logits, d)
    ok = p * q >= theta
    n = max(1, leading_run(ok))
    ctx_ver.truncate(len(tokens) + n - 1)         # keep d[:n-1]; d[n-1] stays pending
    return Cycle(d.tolist(), p.tolist(), q.tolist(), d[:n].tolist(), n, {"proposer": 1, "verifier": 1},
                 {"proposer": [width], "verifier": [len(feed)]},
                 plan=Plan("prove", block), gate=_gate(ok, block, block, False))


def mars_cycle(ctx, tokens: list[int], block: int, mask: int, tau: float, sampler=None) -> Cycle:
    """MARS confidence rule: commit the leading run with p_i >= tau, at least one. One pass."""
    if sampler is not None:
        return _mars_sampled(ctx, tokens, block, mask, tau, sampler)
    width = len(_pending(ctx, tokens)) + block - 1
    d, p = propose(ctx, tokens, block, mask)
    ok = p >= tau
    n = max(1, leading_run(ok))
    return Cycle(d.tolist(), p.tolist(), None, d[:n].tolist(), n, {"proposer": 1}, {"proposer": [width]},
                 plan=_mars_plan(block), gate=_gate(ok, block, block, False))


def spec_cycle(ctx_tgt, ctx_draft, tokens: list[int], k: int, sampler=None) -> Cycle:
    """Speculative decoding: the draft proposes k tokens greedily, one pass each; the target
    scores [pending, x_1..x_k] in one pass and commits the matching run plus its own next token."""
    if sampler is not None:
        return _spec_sampled(ctx_tgt, ctx_draft, tokens, k, sampler)
    x, px, draft_widths = [], [], []
    feed = _pending(ctx_draft, tokens)
    for _ in range(k):
        ids, p = top1(_logits(ctx_draft, feed))
        draft_widths.append(len(feed))
        x.append(int(ids[0])), px.append(float(p[0]))
        feed = x[-1:]
    pending = _pending(ctx_tgt, tokens)
    logits = _logits(ctx_tgt, pending + x, rows=list(range(len(pending) - 1, len(pending) + k)))
    g, q = greedy_and_prob(logits, x)
    ok = np.array(x, dtype=np.int64) == g[:k]
    n = leading_run(ok)
    ctx_tgt.truncate(len(tokens) + n)
    ctx_draft.truncate(min(ctx_draft.n_past, len(tokens) + n))
    return Cycle(x, px, q.tolist(), x[:n] + [int(g[n])], n, {"draft": k, "proposer": 1},
                 {"draft": draft_widths, "proposer": [len(pending) + k]}, residual=n < k,
                 plan=_spec_plan(k), gate=_gate(ok, k, k, True))


# ---------------------------------------------------------------------------------- sampling
# The same cycles with a sampler (temperature > 0, or a repetition penalty). q: the processed
# distributions the proposed tokens were drawn from; p: the processed target distributions.

def _ar_sampled(ctx, tokens, sampler) -> Cycle:
    pending = _pending(ctx, tokens)
    p = sampler.dists(_logits(ctx, pending), tokens)
    x = sampler.draw(p[0], len(tokens))
    return Cycle([x], [float(p[0, x])], None, [x], 1, {"proposer": 1}, {"proposer": [len(pending)]},
                 plan=AR_PLAN, gate=[True])


def _lossless_sampled(ctx, tokens, block, mask, verify, sampler) -> Cycle:
    """Slot tokens d_i ~ q_i (the processed MARS slot distributions, penalties over tokens + d[:i-1]);
    the verify pass gives the targets p_i. Slot 1's row is the ordinary next-token distribution of
    the same model after the same prefix (causal attention: the masks after it are unseen), so q_1
    IS the target and d_1 is an exact sample of it: accepted with probability 1. Slots 2..v go
    through exact speculative sampling; the residual or bonus token follows, as greedy's correction.
    A `verify` function gets the processed probabilities of the drawn slot tokens."""
    pending = len(_pending(ctx, tokens))
    d, q = sampler.propose(proposal_logits(ctx, tokens, block, mask), tokens)
    conf = q[np.arange(block), d]                    # processed probability of each drawn slot token
    if callable(verify):
        verify = verify(conf)
    v = block if verify is None else max(1, min(int(verify), block))
    # row i of the verify pass: the target after tokens + d[:i+1]
    p = sampler.dists(_logits(ctx, d[:v], rows=list(range(v))), tokens + d[:1], d[1:v])
    n, nxt, accept, residual = sampler.verify(p, q[1:v], d[1:v], len(tokens) + 1)
    n += 1                                           # slot 1 (exact)
    ctx.truncate(len(tokens) + n)                    # keep d[:n]; nxt stays pending
    target = [float(conf[0])] + [float(p[i, d[i + 1]]) for i in range(v - 1)]
    return Cycle(d, conf.tolist(), target, d[:n] + [nxt], n, {"proposer": 2},
                 {"proposer": [pending + block - 1, v]}, accept_prob=_joined([1.0], accept), residual=residual,
                 plan=Plan("lossless", block, verify=v), gate=_tested(n, residual, block))


def _spec_sampled(ctx_tgt, ctx_draft, tokens, k, sampler) -> Cycle:
    """The draft samples x_j ~ q_j (its processed distribution after tokens + x[:j-1]), one pass
    each; the target's processed p_j from one pass; exact speculative sampling decides."""
    x, q, draft_widths = [], [], []
    feed = _pending(ctx_draft, tokens)
    for _ in range(k):
        (xj,), qj = sampler.propose(_logits(ctx_draft, feed), tokens + x)
        draft_widths.append(len(feed))
        x.append(xj), q.append(qj[0])
        feed = x[-1:]
    pending = _pending(ctx_tgt, tokens)
    logits = _logits(ctx_tgt, pending + x, rows=list(range(len(pending) - 1, len(pending) + k)))
    p = sampler.dists(logits, tokens, x)              # row j: the target after tokens + x[:j]
    q = stack(q, p.shape[1])
    n, nxt, accept, residual = sampler.verify(p, q, x, len(tokens))
    ctx_tgt.truncate(len(tokens) + n)
    ctx_draft.truncate(min(ctx_draft.n_past, len(tokens) + n))
    return Cycle(x, [float(q[j, x[j]]) for j in range(k)], [float(p[j, x[j]]) for j in range(k)], x[:n] + [nxt], n,
                 {"draft": k, "proposer": 1}, {"draft": draft_widths, "proposer": [len(pending) + k]},
                 accept_prob=accept, residual=residual, plan=_spec_plan(k), gate=_tested(n, residual, k))


def _prove_sampled(ctx_prop, ctx_ver, tokens, block, mask, theta, sampler) -> Cycle:
    """ProVe with sampling (lossy by design): slot tokens drawn from the processed slot
    distributions; the gate p̃_i * q_i >= theta uses the processed probability of the drawn token
    under the proposer (p̃_i) and under the verifier with the same chain and prefix (q_i). Slot 1 is
    an exact sample of the proposer's AR distribution and is always committed."""
    width = len(_pending(ctx_prop, tokens)) + block - 1
    d, qp = sampler.propose(proposal_logits(ctx_prop, tokens, block, mask), tokens)
    conf = qp[np.arange(block), d]
    pending = _pending(ctx_ver, tokens)
    feed = pending + d[:-1]
    pv = sampler.dists(_logits(ctx_ver, feed, rows=list(range(len(pending) - 1, len(feed)))), tokens, d)
    q = pv[np.arange(block), d]
    ok = conf * q >= theta
    n = max(1, leading_run(ok))
    ctx_ver.truncate(len(tokens) + n - 1)            # keep d[:n-1]; d[n-1] stays pending
    return Cycle(d, conf.tolist(), q.tolist(), d[:n], n, {"proposer": 1, "verifier": 1},
                 {"proposer": [width], "verifier": [len(feed)]},
                 plan=Plan("prove", block), gate=_gate(ok, block, block, False))


def _mars_sampled(ctx, tokens, block, mask, tau, sampler) -> Cycle:
    """MARS rule with sampling (lossy): slot tokens drawn from the processed slot distributions,
    committed while their processed probability p̃_i >= tau (at least slot 1, an exact AR sample)."""
    width = len(_pending(ctx, tokens)) + block - 1
    d, q = sampler.propose(proposal_logits(ctx, tokens, block, mask), tokens)
    conf = q[np.arange(block), d]
    ok = conf >= tau
    n = max(1, leading_run(ok))
    return Cycle(d, conf.tolist(), None, d[:n], n, {"proposer": 1}, {"proposer": [width]},
                 plan=_mars_plan(block), gate=_gate(ok, block, block, False))


# ---------------------------------------------------------------------------------- lookup drafts
# Drafts copied from the request's own tokens (lookup.py) cost no pass: they are verified exactly in
# the proposer's one pass, as spec's target verifies its draft. Greedy: commit the matching run plus
# the model's own next token. Sampling: exact speculative sampling with the draft's distribution a
# point mass on the drafted token (q = one-hot: accept x with probability p(x); after a rejection
# draw from norm(max(0, p - onehot(x))), i.e. p without x), so the output is distributed as ar's.

def lookup_cycle(ctx, tokens: list[int], draft: list[int], scores: list[float], sampler=None) -> Cycle:
    """Verify lookup-drafted tokens x_1..x_k in one pass of [pending..., x_1..x_k]: row j is the
    model's next token after tokens + x[:j]; commit the leading run of x that matches it plus the
    model's token after that run (the correction, or the bonus after a full match). `scores`: the
    lookup's score of each slot (Cycle.p). Without a draft, a plain ar cycle."""
    draft = [int(x) for x in draft]
    if not draft:
        return ar_cycle(ctx, tokens, sampler=sampler)
    if sampler is not None:
        return _lookup_sampled(ctx, tokens, draft, scores, sampler)
    k = len(draft)
    pending = _pending(ctx, tokens)
    logits = _logits(ctx, pending + draft, rows=list(range(len(pending) - 1, len(pending) + k)))
    g, q = greedy_and_prob(logits, draft)
    ok = np.asarray(draft, dtype=np.int64) == g[:k]
    n = leading_run(ok)
    ctx.truncate(len(tokens) + n)                # keep x[:n]; the correction / bonus stays pending
    return Cycle(draft, [float(s) for s in scores], q.tolist(), draft[:n] + [int(g[n])], n, {"proposer": 1},
                 {"proposer": [len(pending) + k]}, residual=n < k, plan=Plan("lookup", lookup=k),
                 gate=_gate(ok, k, k, True), source=["lookup"] * k)


def _lookup_sampled(ctx, tokens, draft, scores, sampler) -> Cycle:
    """Row j's processed target p_j (penalties over tokens + x[:j]); the point-mass rejection step
    (sampling.Sampler.verify with q = sampling.point_mass)."""
    k = len(draft)
    pending = _pending(ctx, tokens)
    logits = _logits(ctx, pending + draft, rows=list(range(len(pending) - 1, len(pending) + k)))
    p = sampler.dists(logits, tokens, draft)
    n, nxt, accept, residual = sampler.verify(p, point_mass(draft, p.shape[1]), draft, len(tokens))
    ctx.truncate(len(tokens) + n)
    return Cycle(draft, [float(s) for s in scores], [float(p[j, draft[j]]) for j in range(k)], draft[:n] + [nxt], n,
                 {"proposer": 1}, {"proposer": [len(pending) + k]}, accept_prob=accept, residual=residual,
                 plan=Plan("lookup", lookup=k), gate=_tested(n, residual, k), source=["lookup"] * k)


def lossless_fill_cycle(ctx, tokens: list[int], draft: list[int], scores: list[float], block: int, mask: int,
                        verify=None, sampler=None) -> Cycle:
    """A MARS proposal whose first slots are filled by lookup tokens: the proposal pass reads
    [pending..., x_1..x_j, <mask> x (block-1)]. Its rows before the masks verify x exactly (row i:
    the model's token after tokens + x[:i], causal attention: the masks after them are unseen), so a
    rejected x_i ends the cycle there with the model's own token, one pass. After a full match the
    row of x_j is slot 1 of a MARS block that continues the copied run (its own AR token) and the
    mask rows are slots 2..block: the second pass verifies them as lossless_cycle does (`verify`
    as there). Every committed token is the model's own greedy token (sampled: its coupled sample, or in distribution with the rejection sampler)."""
    draft = [int(x) for x in draft]
    if gated(ctx):
        return gated_lossless_cycle(ctx, tokens, draft, scores, block, mask, verify=verify, sampler=sampler)
    j = len(draft)
    pend = _pending(ctx, tokens)
    P = len(pend)
    logits = _logits(ctx, pend + draft + [mask] * (block - 1), rows=list(range(P - 1, P + j + block - 1)))
    ctx.truncate(len(tokens) + j)                # the masks go at once; x stays until it is judged
    if sampler is not None:
        return _fill_sampled(ctx, tokens, draft, scores, block, verify, sampler, logits, P)
    g = logits[:j].argmax(axis=1)
    ok_l = np.asarray(draft, dtype=np.int64) == g
    n = leading_run(ok_l)
    width1 = P + j + block - 1
    if n < j:                                    # a lookup token was rejected: one pass, as lookup_cycle
        ctx.truncate(len(tokens) + n)
        q = prob_of(logits[:j], draft)
        return Cycle(draft, [float(s) for s in scores], q.tolist(), draft[:n] + [int(g[n])], n, {"proposer": 1},
                     {"proposer": [width1]}, residual=True, plan=Plan("lossless", block, verify=0, lookup=j),
                     gate=_gate(ok_l, j, j, True), source=["lookup"] * j)
    d, p = top1(logits[j:])                      # slot 1: the token after x_j; slots 2..: the masks
    q_l = prob_of(logits[:j], draft) if j else np.zeros(0)   # read before the next pass reuses the rows
    if callable(verify):
        verify = verify(p)
    v = block if verify is None else max(1, min(int(verify), block))
    logits2 = _logits(ctx, d[:v].tolist(), rows=list(range(v)))
    g2, q2 = greedy_and_prob(logits2, d[1:v])
    ok = np.concatenate([[True], d[1:v] == g2[:-1]])
    n2 = leading_run(ok)
    ctx.truncate(len(tokens) + j + n2)
    return Cycle(draft + d.tolist(), [float(s) for s in scores] + p.tolist(), q_l.tolist() + [float(p[0])] + q2.tolist(),
                 draft + d[:n2].tolist() + [int(g2[n2 - 1])], j + n2, {"proposer": 2},
                 {"proposer": [width1, v]}, residual=n2 < v, plan=Plan("lossless", block, verify=v, lookup=j),
                 gate=[True] * j + _gate(ok, v, block, True), source=["lookup"] * j + ["mask"] * block)


def _fill_sampled(ctx, tokens, draft, scores, block, verify, sampler, logits, P) -> Cycle:
    """The filled proposal with a sampler. Uniforms in this order: the point-mass tests of x (then the
    residual after a rejection, or the bonus: slot 1, an exact sample of the target after x), the
    slot draws 2..block, their tests, the residual or bonus."""
    j = len(draft)
    width1 = P + j + block - 1
    p_l = sampler.dists(logits[:j + 1], tokens, draft)           # row i: the target after tokens + x[:i]
    n, nxt, accept_l, residual = sampler.verify(p_l, point_mass(draft, p_l.shape[1]), draft, len(tokens))
    target_l = [float(p_l[i, draft[i]]) for i in range(j)]
    if n < j:
        ctx.truncate(len(tokens) + n)
        return Cycle(draft, [float(s) for s in scores], target_l, draft[:n] + [nxt], n, {"proposer": 1},
                     {"proposer": [width1]}, accept_prob=accept_l, residual=True,
                     plan=Plan("lossless", block, verify=0, lookup=j), gate=_tested(n, True, j),
                     source=["lookup"] * j)
    prefix = tokens + draft
    rest, q = sampler.propose(logits[j + 1:], prefix + [nxt])   # slots 2..block, penalties see slot 1
    d = [nxt] + rest
    conf = [float(p_l[j, nxt])] + [float(q[i, rest[i]]) for i in range(block - 1)]
    if callable(verify):
        verify = verify(np.asarray(conf))
    v = block if verify is None else max(1, min(int(verify), block))
    p = sampler.dists(_logits(ctx, d[:v], rows=list(range(v))), prefix + d[:1], d[1:v])
    n2, nxt2, accept, residual2 = sampler.verify(p, q[:v - 1], d[1:v], len(prefix) + 1)
    n2 += 1                                       # slot 1 (exact)
    ctx.truncate(len(tokens) + j + n2)
    target = target_l + [conf[0]] + [float(p[i, d[i + 1]]) for i in range(v - 1)]
    return Cycle(draft + d, [float(s) for s in scores] + conf, target, draft + d[:n2] + [nxt2], j + n2,
                 {"proposer": 2}, {"proposer": [width1, v]}, accept_prob=_joined(accept_l, [1.0], accept),
                 residual=residual2, plan=Plan("lossless", block, verify=v, lookup=j),
                 gate=[True] * j + _tested(n2, residual2, block), source=["lookup"] * j + ["mask"] * block)


# ---------------------------------------------------------------------------------- a gated adapter
# A stock model with a MARS adapter that is on for the proposal pass only (llama.Context.gated,
# train/adapter.py). The proposal pass is no stock pass, so nothing it wrote is kept and its slot 1
# is only the adapter's guess; the verify pass is stock and tests every proposed token.

def gated_lossless_cycle(ctx, tokens: list[int], draft: list[int], scores: list[float], block: int, mask: int,
                         verify=None, sampler=None) -> Cycle:
    """ProVe-lossless on a gated adapter. Pass 1, adapter on: [pending..., x..., <mask> x (block-1)]
    (x: lookup tokens of a filled proposal, usually none); its rows from x's end give the slots d,
    and every position it wrote is removed. Pass 2, stock: [pending..., x..., d[:v]]; its row i is
    the stock model's next token after tokens + (x + d)[:i], so each proposed token is accepted while
    it equals that token (greedy; with a sampler: exact speculative sampling, x as point masses), and
    the stock token after the accepted run is committed: the output is the stock model's, token for
    token, and the cache holds only stock KV of committed tokens. `verify`: as lossless_cycle's."""
    draft = [int(x) for x in draft]
    j = len(draft)
    pend = _pending(ctx, tokens)
    P, start = len(pend), ctx.n_past
    logits = _logits(ctx, pend + draft + [mask] * (block - 1), rows=list(range(P + j - 1, P + j + block - 1)),
                     adapter=True)
    if sampler is None:
        d, conf = top1(logits)
        d = [int(x) for x in d]
    else:
        d, q = sampler.propose(logits, tokens + draft)
        conf = q[np.arange(block), d]
    ctx.truncate(start)                          # nothing of the adapter pass stays
    if callable(verify):
        verify = verify(conf)
    v = block if verify is None else max(1, min(int(verify), block))
    feed = draft + d[:v]
    k = len(feed)
    logits2 = _logits(ctx, pend + feed, rows=list(range(P - 1, P + k)))   # row i: stock, after tokens + feed[:i]
    if sampler is None:
        g, target = greedy_and_prob(logits2, feed)
        ok = np.asarray(feed, dtype=np.int64) == g[:k]
        n = leading_run(ok)
        nxt, accept, residual, target = int(g[n]), None, n < k, target.tolist()
        gate = _gate(ok, k, j + block, True)
    else:
        pt = sampler.dists(logits2, tokens, feed)
        qq = np.concatenate([point_mass(draft, pt.shape[1]), q[:v]]) if j else q[:v]
        n, nxt, accept, residual = sampler.verify(pt, qq, feed, len(tokens))
        target = [float(pt[i, feed[i]]) for i in range(k)]
        gate = _tested(n, residual, j + block)
    ctx.truncate(len(tokens) + n)                # keep feed[:n]; nxt stays pending
    return Cycle(draft + d, [float(x) for x in scores] + [float(x) for x in conf], target, feed[:n] + [nxt], n,
                 {"proposer": 2}, {"proposer": [P + j + block - 1, P + k]}, accept_prob=accept, residual=residual,
                 plan=Plan("lossless", block, verify=v, lookup=j), gate=gate,
                 source=["lookup"] * j + ["adapter"] * block)     # every slot a draft (modes.drafted_slots)
