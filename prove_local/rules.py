"""The decoding rules: one cycle each, as pure functions over contexts, greedy and sampled alike.

A context is anything with `n_past`, `eval(tokens, rows) -> logits[len(rows), vocab]` and
`truncate(n)` (see llama.py; tests use a fake); a context that also has `eval_view` (llama.Context)
lends its rows without a copy. The rules read from the rows only what they decide with (argmax,
p̃, the probability of a proposed token, a sampled row's surviving candidates): logits.py. `tokens`
is the committed sequence so far (prompt + generated). On entry and on return, every context holds a
prefix of `tokens` in its KV cache; the tokens after its `n_past` are pending and go at the front of
its next eval. A cycle never mutates `tokens`; it returns a `Cycle` whose `committed` run the caller
appends.

Sampling: every cycle takes an optional `sampler` (sampling.Sampler: the request's sampler chain and
its randomness); None is greedy decoding, run as the sampler interface's zero-noise case
(sampling.GREEDY, on argmax fast paths). Each rule asks the sampler for what it decides with:
`sample` (ar's token), `slots` (a proposal's tokens drawn from their processed distributions p_i at
their absolute positions, len(prefix), and their probabilities p̃), `probs` (a verifier's
probabilities) and, in every exact rule, the one verify step `accept_n` (llama.cpp's
common_sampler_sample_and_accept_n): the target's rows after each drafted prefix decide the accepted
run and the token after it (greedy: equality with the argmax; coupled: equality with the target's
position-keyed sample, so the output is ar's token for token for the seed; rejection: exact
speculative sampling, distributed exactly as `ar` sampling).
"""
from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

from .logits import greedy_and_prob, prob_of, top1
from .sampling import GREEDY, leading_run, point_mass, stack

__all__ = ["AR_PLAN", "Cycle", "Plan", "accept_n", "ar_cycle", "gated", "gated_lossless_cycle", "greedy_and_prob",
           "leading_run", "lookup_cycle", "lossless_cycle", "lossless_fill_cycle", "mars_cycle", "prob_of",
           "proposal_logits", "propose", "prove_cycle", "spec_cycle", "top1"]


@dataclass(frozen=True)
class Plan:
    """The widths of one cycle, as plain data: what the engine asks a rule to run (from the request's
    fixed settings or the planner), and, recorded in `Cycle.plan`, what the rule ran.
    `kind` names the rule: a mode's name, or "ar" (a plain one-token cycle, the planner's fallback in
    any mode); `block`: proposal slots (lossless, prove, mars); `draft_k`: drafted tokens (spec);
    `verify` (lossless): proposed tokens fed to the verify pass, 1..block (None: all of them; a
    planner may instead choose it between the two passes, modes.Hooks.choose_verify, and the
    recorded plan holds the width it picked).
    `lookup`: tokens drafted by lookup (lookup.py: copied from the request's own tokens). A "lookup"
    plan verifies them in one pass; a lossless plan with `lookup` > 0 is a *filled* proposal: the
    lookup tokens go in front of the masks of its proposal pass (`lossless_fill_cycle`), and
    `verify` = 0 records that the second pass was skipped (a lookup token was rejected).
    What a plan means for its kind (its width, the tokens it tests, its label) is its mode's: modes.Mode."""
    kind: str = "ar"
    block: int = 1
    draft_k: int = 0
    verify: int | None = None
    lookup: int = 0

    def as_dict(self) -> dict:
        return {"kind": self.kind, "block": self.block, "draft_k": self.draft_k, "verify": self.verify,
                "lookup": self.lookup}


AR_PLAN = Plan()


@dataclass
class Cycle:
    """What one cycle did. `committed[:n_accepted]` are accepted proposals; a further token
    (lossless/spec) is the target's own correction, or the bonus token after a full match.

    Roles and letters, as everywhere in this project (docs/design.md): the *target* is the model whose
    text is decoded (ar's model; in lossless, prove and mars it also proposes the MARS blocks), the
    *draft* is spec's draft model, the *verifier* prove's stock gate model. `p` (p̃) is the proposing
    side's probability of each proposed token: a MARS slot's confidence, the draft model's, a lookup
    draft's score; `q` the checking side's: the target's in the exact modes (its verify pass), the
    verifier's in prove. When sampling, p is the proposal's distribution the token was drawn from
    and q the target's, so a slot is accepted with min(1, q/p̃) and a rejection draws from
    norm(max(0, q - p)) (the speculative sampling papers swap the letters)."""
    proposed: list[int]
    p: list[float]                # p̃: the proposal's probability (score) of each proposed token
    q: list[float] | None         # the target's (prove: the verifier's) probability of it; None: no check
    committed: list[int]
    n_accepted: int
    # forward passes per model: the llama_decode calls the engine counted during the cycle (a pass wider
    # than n_batch is several); left None by the rules, which record the passes they made in `widths`
    # (one entry per pass), and then one per entry of widths
    passes: dict[str, int] | None = None
    widths: dict[str, list[int]] = field(default_factory=dict)   # tokens fed in each pass, per model
    decode_seconds: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0          # wall time of the whole cycle
    index: int = 0                # set by the driver
    start: int = 0                # generated tokens before this cycle
    stop: str | None = None       # on the last cycle: "eog", "length" or "context"
    # sampling (exact modes): min(1, q/p̃) of each verified slot (lossless slot 1: 1.0, an exact
    # sample of the target); None when greedy or coupled (the test is equality). `residual`: the token after
    # the accepted run replaced a rejected proposal (drawn from norm(max(0, q - p)) when sampling,
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
    # per model, when requests are batched (batching.py, a pool's engines): (sequences, tokens) of each
    # llama_decode the cycle's passes were in, i.e. the step's batch size; empty for contexts of their own.
    # decode_seconds is then the request's share of those decodes, by tokens
    batch: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    # seconds the cycle's passes waited in batched steps beyond their share of the decodes (the other
    # requests' share, and the step's barrier): in `seconds`, neither decode nor this request's host time
    waited: float = 0.0

    def __post_init__(self):
        if self.passes is None:
            self.passes = {role: len(w) for role, w in self.widths.items()}


def _gate(ok, tested: int, n_slots: int, stop_at_failure: bool) -> list:
    """Per-slot gate outcomes for `Cycle.gate` from the tests of the first `tested` slots."""
    out = [bool(x) for x in list(ok)[:tested]]
    if stop_at_failure and False in out:
        first = out.index(False)
        out = out[:first + 1]
    return out + [None] * (n_slots - len(out))



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


def _tested(n: int, rejected: bool, n_slots: int) -> list:
    """Gate outcomes of an exact cycle: n accepted, then the rejected slot if there was one."""
    return _gate([True] * n + [False] * rejected, n + rejected, n_slots, True)


def _joined(*parts) -> list | None:
    """Acceptance probabilities of a cycle from its parts; None where the sampler gives none (greedy
    and the coupled sampler: the test is equality)."""
    return None if any(x is None for x in parts) else [v for x in parts for v in x]


def _rows(p, start: int, stop: int | None = None):
    """Rows start:stop of the distributions a proposal was drawn from (None: greedy, none)."""
    return None if p is None else p[start:stop]


def _stacked(rows: list, vocab: int):
    """Draft rows drawn one pass at a time as one matrix (None: greedy, or no draft)."""
    return None if not rows or rows[0] is None else stack(rows, vocab)


def _width(verify, conf, block: int) -> int:
    """The verify width of a MARS block: `verify` (None: the whole block; a function of the slot
    confidences p̃, called between the two passes: a planner's choice), cut to 1..block."""
    if callable(verify):
        verify = verify(conf)
    return block if verify is None else max(1, min(int(verify), block))


def _mars_plan(block: int) -> Plan:
    return Plan("mars", block) if block > 1 else AR_PLAN    # one slot: the same pass and token as ar


def _spec_plan(k: int) -> Plan:
    return Plan("spec", draft_k=k) if k else AR_PLAN          # no drafts: a plain ar cycle


# ---------------------------------------------------------------------------------- the verify step

def accept_n(ctx, logits: np.ndarray, drafted: list[int], prefix: list[int], sampler, p=None):
    """The verify step of every exact rule (llama.cpp's common_sampler_sample_and_accept_n). Row i of
    `logits` (ctx's pass) is the target after prefix + drafted[:i], one row more than drafted; the
    sampler (sampling.GREEDY or a Sampler) accepts the leading run of drafted that the target
    confirms and gives the target's token after it: the correction at the first rejection (greedy:
    the argmax; sampled: the coupled sample or the residual draw), or the bonus after a full match.
    `p`: the distributions drafted was drawn from (None: point masses, drafts proposed without a
    model). ctx keeps prefix + the accepted run; the token after it stays pending. Returns
    (n, committed = drafted[:n] + [next], the target's probability q of each drafted token, min(1, q/p)
    per draft or None, whether the next token replaced a rejected draft)."""
    n, nxt, target, accept, residual = sampler.sample_and_accept_n(logits, drafted, prefix, p)
    ctx.truncate(len(prefix) + n)
    return n, list(drafted[:n]) + [nxt], target, accept, residual


def _verify_block(ctx, prefix: list[int], d: list[int], conf, p_rest, block: int, verify, sampler):
    """The verify pass of a MARS block d whose slot 1 is the model's own token after prefix (the last
    row of the proposal pass, before any mask: causal attention, the masks after it are unseen):
    feed d[:v]; row i is the target after prefix + d[:i+1], so d[1:v] go through `accept_n`
    (`p_rest`: their distributions) and slot 1 is accepted as it is. Returns (v, n accepted with slot 1,
    committed, the target's probability per verified slot, acceptance probabilities, residual)."""
    v = _width(verify, conf, block)
    logits = _logits(ctx, d[:v], rows=list(range(v)))
    n, committed, target, accept, residual = accept_n(ctx, logits, d[1:v], prefix + d[:1], sampler,
                                                      _rows(p_rest, 0, v - 1))
    return v, n + 1, d[:1] + committed, [float(conf[0])] + target, _joined([1.0], accept), residual


# ---------------------------------------------------------------------------------- the rules

def ar_cycle(ctx, tokens: list[int], sampler=None) -> Cycle:
    """One token from the model's next-token row (greedy: its argmax; sampled: a draw). With
    sampling.GREEDY_ARGMAX: the argmax alone, p̃ NaN (its softmax needs an exp pass over the vocabulary)."""
    pending = _pending(ctx, tokens)
    logits = _logits(ctx, pending)
    x, p = (sampler or GREEDY).sample(logits, tokens)
    return Cycle([x], [p], None, [x], 1, widths={"target": [len(pending)]}, plan=AR_PLAN, gate=[True])


def lossless_cycle(ctx, tokens: list[int], block: int, mask: int, verify=None, sampler=None) -> Cycle:
    """ProVe-lossless: the target proposes a MARS block and verifies it in a second pass.
    Row i of the verify pass is the target after tokens + d[:i+1]; d[i+1] is accepted while the
    verify step confirms it (greedy: it equals that row's argmax). Slot 1 is read from the ordinary
    next-token row (the greedy token; sampled: an exact sample of the target, accepted with
    probability 1), so >= 1 token is accepted, and the target's token at the first rejection (or
    after a full match) is committed too: every token is ar's. Sampled, the slots d_i ~ p_i are drawn
    from the processed MARS slot distributions (penalties over tokens + d[:i-1]).
    `verify` < block feeds only d[:verify] to the second pass (the rest of the proposal is dropped
    unread: a narrower pass is cheaper where width costs time, as on a CPU). It may be a function
    of the slot confidences p̃, called between the two passes (a planner's choice)."""
    if gated(ctx):
        return gated_lossless_cycle(ctx, tokens, [], [], block, mask, verify=verify, sampler=sampler)
    s = sampler or GREEDY
    pending = len(_pending(ctx, tokens))
    d, conf, dists = s.slots(proposal_logits(ctx, tokens, block, mask), tokens)
    v, n, committed, target, accept, residual = _verify_block(ctx, tokens, d, conf, _rows(dists, 1), block, verify, s)
    return Cycle(d, conf.tolist(), target, committed, n, widths={"target": [pending + block - 1, v]},
                 accept_prob=accept, residual=residual, plan=Plan("lossless", block, verify=v),
                 gate=_tested(n, residual, block))


def prove_cycle(ctx_tgt, ctx_ver, tokens: list[int], block: int, mask: int, theta: float, sampler=None) -> Cycle:
    """ProVe: a stock AR verifier reads the block teacher-forced; q_i is its probability of d_i
    after d[:i]. Commit the longest leading run with p̃_i * q_i >= theta, at least slot 1 (the
    target's own AR token). No correction token: the next cycle starts at the first failure.
    Sampled (lossy by design): the slot tokens are drawn from the processed slot distributions, and
    p̃_i, q_i are the processed probabilities of the drawn token under the target's proposal and under the
    verifier with the same chain and prefix."""
    s = sampler or GREEDY
    width = len(_pending(ctx_tgt, tokens)) + block - 1
    d, p, _ = s.slots(proposal_logits(ctx_tgt, tokens, block, mask), tokens)
    pending = _pending(ctx_ver, tokens)
    feed = pending + d[:-1]
    q = s.probs(_logits(ctx_ver, feed, rows=list(range(len(pending) - 1, len(feed)))), tokens, d)
    ok = p * q >= theta
    n = max(1, leading_run(ok))
    ctx_ver.truncate(len(tokens) + n - 1)         # keep d[:n-1]; d[n-1] stays pending
    return Cycle(d, p.tolist(), q.tolist(), d[:n], n, widths={"target": [width], "verifier": [len(feed)]},
                 plan=Plan("prove", block), gate=_gate(ok, block, block, False))


def mars_cycle(ctx, tokens: list[int], block: int, mask: int, tau: float, sampler=None) -> Cycle:
    """MARS confidence rule: commit the leading run with p̃_i >= tau, at least one. One pass.
    Sampled (lossy): the slot tokens drawn from the processed slot distributions, p̃_i their
    processed probability."""
    s = sampler or GREEDY
    width = len(_pending(ctx, tokens)) + block - 1
    d, p, _ = s.slots(proposal_logits(ctx, tokens, block, mask), tokens)
    ok = p >= tau
    n = max(1, leading_run(ok))
    return Cycle(d, p.tolist(), None, d[:n], n, widths={"target": [width]},
                 plan=_mars_plan(block), gate=_gate(ok, block, block, False))


def spec_cycle(ctx_tgt, ctx_draft, tokens: list[int], k: int, sampler=None) -> Cycle:
    """Speculative decoding: the draft proposes k tokens, one pass each (greedy: its argmax; sampled:
    x_j ~ q_j, its processed distribution after tokens + x[:j-1]); the target scores
    [pending, x_1..x_k] in one pass, and the verify step commits the accepted run plus the target's
    own next token."""
    s = sampler or GREEDY
    x, px, dists, draft_widths = [], [], [], []
    feed = _pending(ctx_draft, tokens)
    for _ in range(k):
        (xj,), pj, dj = s.slots(_logits(ctx_draft, feed), tokens + x)
        draft_widths.append(len(feed))
        x.append(xj), px.append(float(pj[0])), dists.append(None if dj is None else dj[0])
        feed = x[-1:]
    pending = _pending(ctx_tgt, tokens)
    logits = _logits(ctx_tgt, pending + x, rows=list(range(len(pending) - 1, len(pending) + k)))
    n, committed, target, accept, residual = accept_n(ctx_tgt, logits, x, tokens, s, _stacked(dists, logits.shape[1]))
    ctx_draft.truncate(min(ctx_draft.n_past, len(tokens) + n))
    return Cycle(x, px, target, committed, n, widths={"draft": draft_widths, "target": [len(pending) + k]},
                 accept_prob=accept, residual=residual, plan=_spec_plan(k), gate=_tested(n, residual, k))


# ---------------------------------------------------------------------------------- lookup drafts
# Drafts copied from the request's own tokens (lookup.py) cost no pass: they are verified exactly in
# the target's one pass, as spec's target verifies its draft. Sampled, the draft's distribution is
# a point mass on the drafted token (p = one-hot: accept x with probability q(x); after a rejection
# draw from norm(max(0, q - onehot(x))), i.e. q without x), so the output is distributed as ar's.

def lookup_cycle(ctx, tokens: list[int], draft: list[int], scores: list[float], sampler=None) -> Cycle:
    """Verify lookup-drafted tokens x_1..x_k in one pass of [pending..., x_1..x_k]: row j is the
    model's next token after tokens + x[:j]; commit the accepted run of x plus the model's token
    after that run (the correction, or the bonus after a full match). `scores`: the lookup's score
    of each slot (Cycle.p). Without a draft, a plain ar cycle."""
    draft = [int(x) for x in draft]
    if not draft:
        return ar_cycle(ctx, tokens, sampler=sampler)
    s = sampler or GREEDY
    k = len(draft)
    pending = _pending(ctx, tokens)
    logits = _logits(ctx, pending + draft, rows=list(range(len(pending) - 1, len(pending) + k)))
    n, committed, target, accept, residual = accept_n(ctx, logits, draft, tokens, s)
    return Cycle(draft, [float(x) for x in scores], target, committed, n, widths={"target": [len(pending) + k]},
                 accept_prob=accept, residual=residual, plan=Plan("lookup", lookup=k),
                 gate=_tested(n, residual, k), source=["lookup"] * k)


def lossless_fill_cycle(ctx, tokens: list[int], draft: list[int], scores: list[float], block: int, mask: int,
                        verify=None, sampler=None) -> Cycle:
    """A MARS proposal whose first slots are filled by lookup tokens: the proposal pass reads
    [pending..., x_1..x_j, <mask> x (block-1)]. Its rows before the masks verify x exactly (row i:
    the model's token after tokens + x[:i], causal attention: the masks after them are unseen), so a
    rejected x_i ends the cycle there with the model's own token, one pass. After a full match the
    token after x_j (the bonus of that verify step) is slot 1 of a MARS block that continues the
    copied run, and the mask rows are slots 2..block: the second pass verifies them as
    lossless_cycle does (`verify` as there). Every committed token is the model's own greedy token
    (sampled: its coupled sample, or in distribution with the rejection sampler). Sampled, the
    uniforms come in this order: the point-mass tests of x (then the residual after a rejection, or
    the bonus: slot 1), the slot draws 2..block, their tests, the residual or bonus."""
    draft = [int(x) for x in draft]
    if gated(ctx):
        return gated_lossless_cycle(ctx, tokens, draft, scores, block, mask, verify=verify, sampler=sampler)
    s = sampler or GREEDY
    j = len(draft)
    scores = [float(x) for x in scores]
    pend = _pending(ctx, tokens)
    P = len(pend)
    width1 = P + j + block - 1
    logits = _logits(ctx, pend + draft + [mask] * (block - 1), rows=list(range(P - 1, P + j + block - 1)))
    ctx.truncate(len(tokens) + j)                # the masks go at once; x stays until it is judged
    n, committed, target_l, accept_l, residual = accept_n(ctx, logits[:j + 1], draft, tokens, s)
    if n < j:                                    # a lookup token was rejected: one pass, as lookup_cycle
        return Cycle(draft, scores, target_l, committed, n, widths={"target": [width1]}, accept_prob=accept_l,
                     residual=True, plan=Plan("lossless", block, verify=0, lookup=j), gate=_tested(n, True, j),
                     source=["lookup"] * j)
    prefix, first = tokens + draft, committed[-1]
    # slot 1: the token after x_j; slots 2..: the masks (their penalties see slot 1); read before the
    # verify pass reuses the rows
    rest, conf_rest, dists = s.slots(logits[j + 1:], prefix + [first])
    d = [first] + rest
    conf = np.concatenate([s.probs(logits[j:j + 1], prefix, [first]), conf_rest])
    v, n2, committed, target, accept, residual = _verify_block(ctx, prefix, d, conf, dists, block, verify, s)
    return Cycle(draft + d, scores + conf.tolist(), target_l + target, draft + committed, j + n2,
                 widths={"target": [width1, v]}, accept_prob=_joined(accept_l, accept), residual=residual,
                 plan=Plan("lossless", block, verify=v, lookup=j), gate=[True] * j + _tested(n2, residual, block),
                 source=["lookup"] * j + ["mask"] * block)


# ---------------------------------------------------------------------------------- a gated adapter
# A stock model with a MARS adapter that is on for the proposal pass only (llama.Context.gated,
# train/adapter.py). The proposal pass is no stock pass, so nothing it wrote is kept and its slot 1
# is only the adapter's guess; the verify pass is stock and tests every proposed token.

def gated_lossless_cycle(ctx, tokens: list[int], draft: list[int], scores: list[float], block: int, mask: int,
                         verify=None, sampler=None) -> Cycle:
    """ProVe-lossless on a gated adapter. Pass 1, adapter on: [pending..., x..., <mask> x (block-1)]
    (x: lookup tokens of a filled proposal, usually none); its rows from x's end give the slots d,
    and every position it wrote is removed. Pass 2, stock: [pending..., x..., d[:v]]; its row i is
    the stock model's next token after tokens + (x + d)[:i], so the verify step tests every proposed
    token (greedy: equality; with a sampler: exact speculative sampling, x as point masses), and
    the stock token after the accepted run is committed: the output is the stock model's, token for
    token, and the cache holds only stock KV of committed tokens. `verify`: as lossless_cycle's."""
    draft = [int(x) for x in draft]
    s = sampler or GREEDY
    j = len(draft)
    pend = _pending(ctx, tokens)
    P, start = len(pend), ctx.n_past
    logits = _logits(ctx, pend + draft + [mask] * (block - 1), rows=list(range(P + j - 1, P + j + block - 1)),
                     adapter=True)
    d, conf, dists = s.slots(logits, tokens + draft)
    ctx.truncate(start)                          # nothing of the adapter pass stays
    v = _width(verify, conf, block)
    feed = draft + d[:v]
    k = len(feed)
    logits2 = _logits(ctx, pend + feed, rows=list(range(P - 1, P + k)))   # row i: stock, after tokens + feed[:i]
    fed = _rows(dists, 0, v)                     # the distributions feed was drawn from
    if fed is not None and j:
        fed = np.concatenate([point_mass(draft, logits2.shape[1]), fed])
    n, committed, target, accept, residual = accept_n(ctx, logits2, feed, tokens, s, fed)
    return Cycle(draft + d, [float(x) for x in scores] + [float(x) for x in conf], target, committed, n,
                 widths={"target": [P + j + block - 1, P + k]}, accept_prob=accept, residual=residual,
                 plan=Plan("lossless", block, verify=v, lookup=j), gate=_tested(n, residual, j + block),
                 source=["lookup"] * j + ["adapter"] * block)     # every slot a draft (modes.drafted_slots)
