"""Grammar constraints and logprobs on any decoding rule, without touching the rules: the engine hands
a rule *watched* contexts, which pass every pass through to the real ones and hand back the rows the
rule reads, masked by the grammar (and recorded for logprobs when asked).

Which grammar state applies to a row follows from the tokens fed before it, which the wrapper sees
(the cycle starts from the committed tokens T; every context holds a prefix of T):
- an ordinary row (the prefix after T holds real tokens only: slot 1, a verify pass, a draft model's
  row, a lookup verify row, a ProVe verifier row) is the distribution of the next token after
  T + those tokens: it is masked by the grammar's state after them (logits of forbidden tokens set
  to -inf: the argmax is the best allowed token, a softmax renormalises over the allowed ones). If
  one of those tokens is itself forbidden, the row is handed back as it is: an exact rule never
  commits from such a row (it has rejected the forbidden token at the row before, whose state was
  valid and whose masked argmax / masked distribution cannot produce it).
- a MARS slot row (the prefix after T ends in mask tokens) is slot j+1 after base + j masks; the
  state is the grammar's after base + the tokens proposed for the j slots before it, which a greedy
  rule picks as the argmax of their (masked) rows: the wrapper picks them the same way, in order,
  so greedy proposals are grammar-valid (a lossless verify pass then accepts them more often; prove
  and mars commit them). A sampled rule draws slot tokens with its random generator, which the
  wrapper cannot replay: sampled slot rows past slot 1 are handed back unmasked (lossless verifies
  them exactly against masked targets: a forbidden one has target probability 0 and is rejected;
  prove and mars commits are cut at the first forbidden one, below).
- a row whose state allows nothing (a dead end: the grammar cannot continue and cannot end) offers
  one token, an end-of-generation token (Grammar.sentinel), which the grammar forbids too.

After the cycle, `end` walks the committed tokens through the grammar: they are all allowed except
at a dead end (or after a sampled prove/mars slot drawn unmasked); the engine keeps the allowed
prefix and stops with "grammar" at a dead end. So with a grammar, ar decodes exactly as llama.cpp's
grammar sampler followed by argmax (or the sampler chain), and lossless / spec / lookup equal ar
token for token (greedy; in distribution when sampling), because every target row they verify
against is the masked row ar reads at that position.

Logprobs: the recorded (masked) target row of each committed token gives its log-probability and
the top N alternatives, from the rows the rule read (no pass of its own): see `Watch.logprobs`.
"""
from __future__ import annotations

import numpy as np

NEG_INF = np.float32(-np.inf)


class _Watched:
    """A context as a rule sees it: n_past, eval / eval_view, truncate; rows through `Watch.rows`."""

    def __init__(self, watch: "Watch", role: str, ctx):
        self._w, self.role, self.ctx = watch, role, ctx

    @property
    def n_past(self) -> int:
        return self.ctx.n_past

    def truncate(self, n: int) -> None:
        self.ctx.truncate(n)

    def eval(self, tokens, rows=None):
        return self._pass(tokens, rows, getattr(self.ctx, "eval"))

    def eval_view(self, tokens, rows=None):
        return self._pass(tokens, rows, getattr(self.ctx, "eval_view", None) or self.ctx.eval)

    def _pass(self, tokens, rows, run):
        p = self.ctx.n_past
        tokens = [int(t) for t in tokens]
        rows = [len(tokens) - 1] if rows is None else list(rows)
        logits = run(tokens, rows)
        return self._w.rows(self.role, p, tokens, rows, logits)


class Watch:
    """The watched contexts of one request. `grammar`: a grammar.Grammar (or a fake with `start()`
    and `sentinel`), or None; `logprobs`: N top alternatives to record (None: no logprobs);
    `sampled`: the request samples (slot rows past slot 1 are left unmasked, see the module doc)."""

    def __init__(self, contexts: dict, *, grammar=None, mask_token: int | None = None,
                 logprobs: int | None = None, sampled: bool = False):
        self.contexts = {role: _Watched(self, role, c) for role, c in contexts.items()}
        self.grammar, self.mask_token, self.n_top, self.sampled = grammar, mask_token, logprobs, sampled
        self.state = grammar.start() if grammar is not None else None      # after the committed tokens
        self.tokens: list[int] = []
        self._states: dict = {}
        self._suffix: dict[str, list[int]] = {}
        self._picks: dict = {}
        self._recorded: dict = {}

    # ------------------------------------------------------------------ a cycle
    def begin(self, tokens: list[int]) -> dict:
        """Start a cycle after the committed `tokens`; returns the contexts to hand the rule."""
        self.tokens = tokens
        self._states = {(): self.state}
        self._suffix = {r: [] for r in self.contexts}
        self._picks, self._recorded = {}, {}
        return self.contexts

    def state_after(self, suffix: tuple):
        """The grammar's state after T + suffix; None if a token of the suffix is forbidden."""
        st = self._states.get(suffix, 0)
        if st == 0:
            prev = self.state_after(suffix[:-1])
            st = prev.then(suffix[-1]) if prev is not None else None
            self._states[suffix] = st
        return st

    def rows(self, role: str, p: int, feed: list[int], rows: list[int], logits: np.ndarray) -> np.ndarray:
        """The rows of one pass as the rule must see them (a copy when anything is masked or recorded)."""
        L = len(self.tokens)
        # the tokens after T in this context's cache once the pass is done (p <= L: feed starts with
        # the pending committed tokens T[p:])
        full = (self._suffix[role][:p - L] + feed) if p >= L else feed[L - p:]
        self._suffix[role] = full if p + len(feed) > L else []
        if self.grammar is None and self.n_top is None:
            return logits
        out = None
        for j, r in enumerate(rows):
            n = p + r + 1 - L                 # tokens after T before the row's prediction
            if n < 0:
                continue                      # a row inside the committed tokens: not a decision
            suffix = tuple(full[:n])
            row = self._row(role, suffix, logits[j])
            if row is not logits[j]:
                if out is None:
                    out = np.array(logits, dtype=np.float32, copy=True)
                out[j] = row
            if self.n_top is not None:
                self._recorded[role, suffix] = np.array(row, dtype=np.float32, copy=True)
        return logits if out is None else out

    def _row(self, role: str, suffix: tuple, row: np.ndarray) -> np.ndarray:
        if self.grammar is None:
            return row
        mask = self.mask_token
        if mask is not None and mask in suffix:                 # a MARS slot row
            i = suffix.index(mask)
            base, j = suffix[:i], len(suffix) - i
            if self.sampled or any(t != mask for t in suffix[i:]):
                return row
            picks = [self._picks.get((role, base + (mask,) * k)) for k in range(j)]
            if any(x is None for x in picks):
                return row
            state = self.state_after(base + tuple(picks))
        else:
            state = self.state_after(suffix)
        if state is None:
            return row                       # after a forbidden token: never committed from (module doc)
        if not self.sampled and self.n_top is None:
            a = int(np.argmax(row))          # greedy without logprobs: only the argmax matters, and the
            if state.allows(a):              # best token allowed is the best allowed token
                self._picks[role, suffix] = a
                return row
        allowed = state.mask()
        if not allowed.any():                # a dead end: offer the sentinel, which the grammar forbids too
            out = np.full(row.shape, NEG_INF, dtype=np.float32)
            out[self.grammar.sentinel] = 0.0
        else:
            out = np.where(allowed, row, NEG_INF).astype(np.float32, copy=False)
        self._picks[role, suffix] = int(np.argmax(out))
        return out

    def end(self, committed: list[int]) -> tuple[int, bool]:
        """(how many leading committed tokens the grammar allows, whether it allows nothing after
        them: a dead end). The committed state moves past the allowed ones."""
        if self.grammar is None:
            return len(committed), False
        ok = 0
        while ok < len(committed) and self.state_after(tuple(committed[:ok + 1])) is not None:
            ok += 1
        self.state = self.state_after(tuple(committed[:ok]))
        dead = ok < len(committed) and not self.state.mask().any()
        return ok, dead

    # ------------------------------------------------------------------ logprobs
    def logprobs(self, committed: list[int], slot_rows: bool, sampler=None) -> list:
        """(token, logprob, [(id, logprob), ... the N most likely]) per committed token, from the
        row it was chosen from: the target's row after T + committed[:k] (ar and the exact modes:
        the row ar reads at that position), or, `slot_rows` (prove, mars), the target's proposal row of
        slot k+1, whose argmax (or draw) the rule committed. The distribution is the processed one
        when sampling (temperature > 0: the sampler chain, tokens outside it have no entry), else the
        softmax of the row (after the grammar's mask and a repetition penalty)."""
        out = []
        for k, tok in enumerate(committed):
            key = (self.mask_token,) * k if slot_rows else tuple(committed[:k])
            row = self._recorded.get(("target", key))
            if row is None:
                raise RuntimeError(f"no row recorded for committed token {k} (a decoding rule read it elsewhere)")
            window = _window(sampler, self.tokens, committed, k)
            out.append(entry(row, int(tok), self.n_top, sampler, window))
        return out


def _window(sampler, prefix, drafted, k: int) -> list[int]:
    if sampler is None:
        return []
    return sampler._window(prefix, drafted, k)


def entry(row: np.ndarray, token: int, n_top: int, sampler=None, window=()) -> tuple:
    """(token, its log-probability, the n_top most likely (id, log-probability)) under the row's
    processed distribution (see Watch.logprobs)."""
    if sampler is not None and sampler.temperature > 0:
        ids, probs = sampler.process(row, window)
        with np.errstate(divide="ignore"):
            lp = np.log(probs)
        where = np.flatnonzero(ids == token)
        own = float(lp[where[0]]) if len(where) else float("-inf")
        top = [(int(i), float(v)) for i, v in zip(ids[:n_top], lp[:n_top]) if np.isfinite(v)]
        return token, own, top
    z = np.asarray(row, dtype=np.float64).copy()
    if sampler is not None and len(window) and sampler.repeat_penalty != 1.0:
        w = np.unique(np.asarray(window, dtype=np.int64))          # the chain's CTRL penalty (sampling.py)
        v = z[w]
        z[w] = np.where(v > 0, v / sampler.repeat_penalty, v * sampler.repeat_penalty)
    m = z.max()
    lse = m + np.log(np.exp(z - m).sum())
    lp = z - lse
    order = np.argsort(-lp, kind="stable")[:n_top]
    top = [(int(i), float(lp[i])) for i in order if np.isfinite(lp[i])]
    return token, float(lp[token]), top
