"""The sampler chain and exact speculative sampling, shared by every decoding mode.

Chain, per row of logits (one row = the distribution of one position):
    repetition penalty over the last `repeat_last_n` tokens of the growing prefix (committed tokens
    and the drafted tokens before that position: vLLM #6718) -> temperature -> top-k -> top-p -> min-p
giving the *processed* distribution, in float64, over the tokens that survive the chain only (a
`Row`: ids and probabilities; every other token has probability 0). This is the order of vLLM's sampler and HF's
logits processors (llama.cpp applies temperature after its filters; its defaults are kept:
top_k 40, top_p 0.95, min_p 0.05, repeat_penalty 1.0 over 64 tokens, and the CTRL penalty rule
logit/penalty if positive else logit*penalty, once per distinct token in the window).

Letters as everywhere in this project (docs/design.md, rules.Cycle): p is the proposal's
distribution (a MARS slot's, the draft model's, a point mass for a lookup draft) and p̃ = p(x) its
probability of the proposed token x; q is the target's distribution after the same prefix and q(x)
its probability of x. (The speculative sampling papers name them the other way round.)

Why numpy and not llama.cpp's sampler API (llama_sampler_chain_*): exact rejection sampling needs
the full processed q and p vectors (min(1, q(x)/p(x)) and the residual max(0, q - p)), and the
tests need them to compare against closed forms. llama.cpp's chain mutates a candidate array in
place and returns one token; it exposes no per-position distribution for an arbitrary prefix
(its penalty ring buffer follows `accept` calls, not a hypothetical draft), and drafting with it
would mean copying and rewinding sampler state per slot. Float64 because the ratio q/p of small
probabilities must not underflow (a float16 p auto-accepts: lablup/mlxcel PR #992), and p must be
the processed one the token was drawn from (raw p: HF transformers bug #47932, TV error 0.05).

Cost per row (a Qwen vocabulary's row is 600 kB): with top-k on, the row is read once (the maxima of strided groups,
logits.top_candidates) and only the k candidates (k + the penalised tokens with a repetition
penalty) are converted to float64, sorted and normalised; drawing, the ratio test and the residual
work on those few. Only top-k off (0) needs the normaliser of the whole vocabulary: one float64
pass over the row, in a reused buffer. The rows are read, never written (they may be a view into
llama.cpp's output buffer).

Random numbers, two samplers (`Settings.sampler`, `--sampler`):

* "coupled" (the default, `CoupledSampler`): the token at absolute position t (its index in the
  sequence, prompt included: len(prefix)) is argmax over the surviving ids x of log p_t(x) + g(seed, t, x),
  with g a Gumbel variate computed by hashing (seed, t, x) (`gumbel`: splitmix64, counter-based, O(surviving
  ids), never O(vocabulary)). Gumbel-max makes each draw exactly distributed as p_t; keying the noise
  by position makes every draw a function of (seed, prefix) only. A proposal (MARS slot, draft token)
  at t is drawn with the same g(seed, t, .) from its own distribution, and verification is equality, as in
  greedy decoding: accept while the proposed token equals the target's coupled sample, commit the
  target's coupled sample at the first mismatch. Every committed token is the token `ar` draws with
  that seed at that position, so `lossless`, `spec` and lookup drafts give ar's text token for token
  at any width and planner choice (Daliri, Musco and Suresh 2024, "Coupling without Communication
  and Drafter-Invariant Speculative Decoding"). Temperature 0 is the zero-noise case (one-hot rows).
* "rejection" (`Sampler`): one `numpy.random.Generator` per request (`Sampler.rng`), one uniform
  per call, in this order within a cycle:
    1. proposal: one uniform per drawn slot or draft token, in slot order (ar: its one token);
    2. verification: one uniform per accept test, in slot order, stopping at the first rejection;
    3. one uniform for the residual token (after a rejection) or the bonus token (after a full match).
  Exact in distribution (Leviathan et al. 2023), and it accepts a little more often than the
  coupling (min(1, q/p) against P(argmax(log p + g) = argmax(log q + g)) >= (1 - TV)/(1 + TV)), but
  the stream is consumed per cycle: a seed repeats a mode's text only at fixed widths, and different
  modes or widths give the same distribution, not the same text (engine.seed_note says so).
"""
from __future__ import annotations

import math

import numpy as np

from .logits import _buffer, greedy_and_prob, prob_of, top1, top_candidates

# The defaults of every front end (engine.Settings, `run`, `serve`, `bench`, the UI) and of `Sampler`:
# llama.cpp's, except the temperature (0: greedy, so that the exact modes equal ar token for token;
# llama-server's default is 0.8, OpenAI's 1.0).
TEMPERATURE = 0.0
TOP_K = 40
TOP_P = 0.95
MIN_P = 0.05
REPEAT_PENALTY = 1.0              # 1: off
REPEAT_LAST_N = 64                # -1: the whole context, 0: off
SAMPLERS = ("coupled", "rejection")   # how a token is drawn and verified (the module's docstring)
SAMPLER = "coupled"


# Below this a temperature is greedy decoding: logits are float32 (steps of ~1e-6 near 10), so a
# smaller T only tells float rounding apart, and logits / T overflows to inf for T ~ 1e-307 (then
# inf - inf: NaN probabilities). Every front end (CLI, server, UI) passes T through `temperature_of`,
# which turns 0 < T < MIN_TEMPERATURE into 0; `check` refuses what was not normalised.
MIN_TEMPERATURE = 1e-6
MIN_REPEAT_PENALTY = 1e-3         # x / penalty for a smaller one overflows the same way


def temperature_of(value) -> float:
    """The one validation of a temperature shared by the CLI, the server and the UI: a finite number
    >= 0 (ValueError otherwise, naming the value); below MIN_TEMPERATURE it is 0 (greedy)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), not {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), not {value!r}")
    return 0.0 if value < MIN_TEMPERATURE else value


def temperature_arg(text: str) -> float:
    """argparse type of --temperature: `temperature_of`, refusals as one argparse line."""
    import argparse
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    try:
        return temperature_of(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed) -> str | None:
    """A one-line complaint about the first out-of-range sampling setting, or None."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        return f"temperature must be a finite number >= 0 (0 = greedy), not {temperature!r}"
    if 0 < temperature < MIN_TEMPERATURE:
        return (f"temperature {temperature!r} is below {MIN_TEMPERATURE:g}: pass 0 (greedy), which is what it "
                "means (sampling.temperature_of)")
    if not (isinstance(top_k, int) and top_k >= 0):
        return f"top-k must be an integer >= 0 (0 = off), not {top_k!r}"
    if not (isinstance(top_p, (int, float)) and 0 <= top_p <= 1):
        return f"top-p must be in [0, 1] (1 = off), not {top_p!r}"
    if not (isinstance(min_p, (int, float)) and 0 <= min_p <= 1):
        return f"min-p must be in [0, 1] (0 = off), not {min_p!r}"
    if not (isinstance(repeat_penalty, (int, float)) and math.isfinite(repeat_penalty)
            and repeat_penalty >= MIN_REPEAT_PENALTY):
        return f"repeat penalty must be a finite number >= {MIN_REPEAT_PENALTY:g} (1 = off), not {repeat_penalty!r}"
    if not (isinstance(repeat_last_n, int) and repeat_last_n >= -1):
        return f"repeat-last-n must be an integer >= -1 (-1 = the whole context, 0 = off), not {repeat_last_n!r}"
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2 ** 64):
        return f"seed must be an integer in [0, 2^64), not {seed!r}"
    return None


class Row:
    """One processed distribution: `ids` (ascending) and their probabilities `probs` (float64);
    every other token of the `vocab`-token vocabulary has probability 0. Reads like a dense row:
    `row[x]`, `len(row)`, and `np.asarray(row)` gives the dense vector (for tests and closed forms)."""
    __slots__ = ("ids", "probs", "vocab", "_lookup")

    def __init__(self, ids: np.ndarray, probs: np.ndarray, vocab: int):
        order = np.argsort(ids, kind="stable")
        self.ids, self.probs, self.vocab = np.asarray(ids, dtype=np.int64)[order], np.asarray(probs, dtype=np.float64)[order], int(vocab)
        self._lookup: dict | None = None

    def __getitem__(self, x):
        if isinstance(x, (int, np.integer)):          # one token: a dict (the rows are short)
            if self._lookup is None:
                self._lookup = dict(zip(self.ids.tolist(), self.probs.tolist()))
            return self._lookup.get(int(x), 0.0)
        x = np.asarray(x, dtype=np.int64)
        j = np.minimum(np.searchsorted(self.ids, x), max(len(self.ids) - 1, 0))
        hit = (self.ids[j] == x) if len(self.ids) else np.zeros(x.shape, dtype=bool)
        out = np.where(hit, self.probs[j] if len(self.ids) else 0.0, 0.0)
        return float(out) if out.ndim == 0 else out

    def __len__(self) -> int:
        return self.vocab

    @property
    def shape(self) -> tuple[int]:
        return (self.vocab,)

    def __array__(self, dtype=None, copy=None):
        out = np.zeros(self.vocab, dtype=np.float64)
        out[self.ids] = self.probs
        return out if dtype is None else out.astype(dtype)


class Dists:
    """Processed distributions of several rows (row i: the distribution of one position): `d[i]`
    is a Row, `d[i, x]` a probability, `d[rows, ids]` an array of them; `np.asarray(d)` the dense
    [rows, vocab] matrix."""
    __slots__ = ("rows", "vocab")

    def __init__(self, rows: list[Row], vocab: int):
        self.rows, self.vocab = list(rows), int(vocab)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.rows), self.vocab)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, key):
        if isinstance(key, tuple):
            i, x = key
            if np.ndim(i) == 0 and np.ndim(x) == 0:
                return self.rows[int(i)][int(x)]
            i, x = np.broadcast_arrays(np.asarray(i, dtype=np.int64), np.asarray(x, dtype=np.int64))
            return np.array([self.rows[a][b] for a, b in zip(i.ravel(), x.ravel())], dtype=np.float64).reshape(i.shape)
        if isinstance(key, slice):
            return Dists(self.rows[key], self.vocab)
        return self.rows[int(key)]

    def __array__(self, dtype=None, copy=None):
        out = np.zeros(self.shape, dtype=np.float64)
        for i, r in enumerate(self.rows):
            out[i, r.ids] = r.probs
        return out if dtype is None else out.astype(dtype)


def stack(rows: list, vocab: int):
    """Rows (of `propose` results) as one matrix: a Dists when they are all Rows, else dense (a
    sampler subclass may return dense rows)."""
    if all(isinstance(r, Row) for r in rows):
        return Dists(rows, vocab)
    return np.array([np.asarray(r, dtype=np.float64) for r in rows]).reshape(len(rows), vocab)


def _dense_pair(a, b):
    return np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)


def leading_run(ok) -> int:
    """Length of the leading run of True."""
    ok = np.asarray(ok, dtype=bool)
    return int(ok.argmin()) if not ok.all() else len(ok)


class Greedy:
    """Greedy decoding as the sampler interface's zero-noise case (temperature 0, no penalty: every
    processed row one-hot on its argmax, nothing random), on argmax fast paths over the raw rows
    (logits.row_stats): no row is processed, one exp pass per row whose probability is asked for.
    The rules run `GREEDY` when the engine passes no sampler; its four methods are `Sampler`'s:
    `sample` (ar's token), `slots` (a proposal's tokens), `probs` (a verifier's probabilities of given
    tokens) and `sample_and_accept_n` (the verify step of every exact rule).

    `q`: whether `sample` and `sample_and_accept_n` also give the probabilities that decide nothing
    in greedy decoding (an `ar` token's p̃, the target's q of each verified draft: Cycle.p and Cycle.q,
    which the UI shows and the bench scores; an exp pass over the vocabulary per row). `GREEDY_ARGMAX`
    (q False) gives NaN for them and reads each row once, for its argmax: the same tokens (modes.py
    passes it where Settings.p_tilde is off, as in `run` and `serve`). The slot confidences p̃ of a
    proposal (`slots`) and a verifier's probabilities (`probs`) decide widths and gates: always computed."""

    def __init__(self, q: bool = True):
        self.q = q

    def sample(self, logits: np.ndarray, prefix) -> tuple[int, float]:
        if not self.q:
            return int(np.argmax(logits[0])), float("nan")
        ids, p = top1(logits)
        return int(ids[0]), float(p[0])

    def slots(self, logits: np.ndarray, prefix) -> tuple[list[int], np.ndarray, None]:
        ids, p = top1(logits)
        return [int(x) for x in ids], p, None

    def probs(self, logits: np.ndarray, prefix, ids) -> np.ndarray:
        return prob_of(logits, ids)

    def sample_and_accept_n(self, logits: np.ndarray, drafted, prefix, p=None) -> tuple[int, int, list[float], None, bool]:
        """Accept drafted[i] while it equals row i's argmax; the argmax of the first row that does not
        match (or of the bonus row after a full match) follows. See Sampler.sample_and_accept_n."""
        k = len(drafted)
        if self.q:
            g, target = greedy_and_prob(logits, drafted)
            target = target.tolist()
        else:                            # the argmax of each row, nothing else (ties: the first, as above)
            g, target = logits.argmax(axis=1), [float("nan")] * k
        g = g.tolist()                   # (a few drafted tokens: compared in Python, no arrays)
        n = 0
        while n < k and int(drafted[n]) == g[n]:
            n += 1
        return n, g[n], target, None, n < k


GREEDY = Greedy()
GREEDY_ARGMAX = Greedy(q=False)


class Sampler:
    """The sampler chain of one request and its random generator. The rules call the verify step's
    four methods, `sample`, `slots`, `probs` and `sample_and_accept_n` (`Greedy`'s, on processed
    distributions), which are built on `dists` (processed distributions, sparse), `propose` (draw
    slot/draft tokens), `draw`, `verify` (exact speculative sampling) and `residual`. Temperature 0
    with a repetition penalty gives one-hot distributions (greedy on the penalized logits); without a
    penalty the engine passes no sampler at all and the rules run `GREEDY`."""

    def __init__(self, rng: np.random.Generator, temperature: float = TEMPERATURE, top_k: int = TOP_K,
                 top_p: float = TOP_P, min_p: float = MIN_P, repeat_penalty: float = REPEAT_PENALTY,
                 repeat_last_n: int = REPEAT_LAST_N):
        self.rng = rng
        self.temperature = float(temperature)
        self.top_k, self.top_p, self.min_p = int(top_k), float(top_p), float(min_p)
        self.repeat_penalty, self.repeat_last_n = float(repeat_penalty), int(repeat_last_n)

    coupled = False                 # the test is a ratio (min(1, q/p)), not equality

    @staticmethod
    def for_settings(s, seed: int) -> "Sampler | None":
        """The request's sampler (`s.sampler`: "coupled" or "rejection"), or None for plain greedy
        decoding (today's code path)."""
        if s.temperature == 0 and s.repeat_penalty == 1.0:
            return None
        chain = (s.temperature, s.top_k, s.top_p, s.min_p, s.repeat_penalty, s.repeat_last_n)
        if getattr(s, "sampler", SAMPLER) == "rejection":
            return Sampler(np.random.default_rng(seed), *chain)
        return CoupledSampler(seed, *chain)

    # ------------------------------------------------------------------ the chain
    def _window(self, prefix, drafted, i: int) -> list[int]:
        n = self.repeat_last_n
        if self.repeat_penalty == 1.0 or n == 0:
            return []
        seq = list(prefix[-n:] if n > 0 else prefix) + list(drafted[:i])
        return seq[-n:] if n > 0 else seq

    def process(self, row: np.ndarray, window) -> tuple[np.ndarray, np.ndarray]:
        """One row of logits through the chain: (token ids, probabilities), most probable first.
        The row is not modified. Only candidates are converted: with top-k on, the k largest of the
        penalised row are among the k + |window| largest raw logits and the window's tokens (a
        penalty changes only the window's logits), so those are the only ones penalised and ranked."""
        n_vocab = row.shape[0]
        w = np.empty(0, dtype=np.int64)
        if len(window) and self.repeat_penalty != 1.0:
            w = np.unique(np.asarray(window, dtype=np.int64))
            w = w[(w >= 0) & (w < n_vocab)]
        k = self.top_k if self.temperature > 0 else 1
        if self.temperature == 0 and not len(w):
            return np.array([int(np.argmax(row))]), np.ones(1)
        if 0 < k < n_vocab:
            cand = top_candidates(row, min(n_vocab, k + len(w)))
            if len(w):
                cand = np.union1d(cand, w)
            cand = np.sort(cand)                       # ties below are broken by token id
            x = np.asarray(row[cand], dtype=np.float64)
            if len(w):
                self._penalise(x, np.isin(cand, w))
            if self.temperature == 0:                  # greedy on the penalised logits (first id among equals)
                return np.array([int(cand[int(np.argmax(x))])]), np.ones(1)
            if len(cand) > k:
                keep = np.sort(np.argsort(-x, kind="stable")[:k])
                cand, x = cand[keep], x[keep]
            z = x / self.temperature
            norm = None
        else:
            # no top-k: the normaliser is the whole vocabulary's; with min-p, only tokens within
            # ln(min_p) of the best (and a margin) can survive, so only they are sorted
            z_all = _buffer(n_vocab, np.float64)
            z_all[:] = row
            if len(w):
                v = z_all[w]
                self._penalise(v, np.ones(len(w), dtype=bool))
                z_all[w] = v
            z_all /= self.temperature
            z_max = z_all.max()
            norm = np.exp(z_all - z_max).sum()
            if self.min_p > 0.0:
                cand = np.flatnonzero(z_all >= z_max + math.log(self.min_p) - 1e-6)
            else:
                cand = np.arange(n_vocab)
            z = z_all[cand]
        order = np.argsort(-z, kind="stable")
        cand, z = cand[order], z[order]
        prob = np.exp(z - z[0])
        prob /= prob.sum() if norm is None else norm
        n = len(prob)
        if self.top_p < 1.0:        # smallest head whose mass reaches top_p (llama.cpp: cum_sum >= p)
            n = min(n, int(np.searchsorted(np.cumsum(prob), self.top_p)) + 1)
        if self.min_p > 0.0:        # tokens with p >= min_p * p_max (on the top-p-renormalised head)
            n = min(n, int(np.count_nonzero(prob[:n] >= self.min_p * prob[0])))
        prob = prob[:max(n, 1)]              # (n is at most len(cand): the min-p candidates suffice)
        return cand[:len(prob)], prob / prob.sum()

    def _penalise(self, x: np.ndarray, mask: np.ndarray) -> None:
        """The CTRL penalty on the entries of x (float64 logits) where mask is set, in place."""
        if mask.any():
            v = x[mask]
            x[mask] = np.where(v > 0, v / self.repeat_penalty, v * self.repeat_penalty)

    def row(self, logits_row: np.ndarray, window) -> Row:
        ids, prob = self.process(logits_row, window)
        return Row(ids, prob, logits_row.shape[0])

    def dists(self, logits: np.ndarray, prefix, drafted=()) -> Dists:
        """Processed distributions of the rows (sparse): row i is the distribution of the token
        after prefix + drafted[:i] (penalties see that growing prefix)."""
        return Dists([self.row(logits[i], self._window(prefix, drafted, i)) for i in range(len(logits))],
                     logits.shape[1])

    def dist(self, logits: np.ndarray, prefix, drafted=()) -> np.ndarray:
        """`dists` as a dense float64 [rows, vocab] matrix (for closed forms and tests; the rules
        use the sparse rows)."""
        return np.asarray(self.dists(logits, prefix, drafted))

    # ------------------------------------------------------------------ drawing
    def draw(self, probs, pos: int | None = None) -> int:
        """One token from a distribution (inverse CDF over the tokens in id order, one uniform):
        a Row, or a dense vector. Both give the same token for the same uniform. `pos` (the token's
        absolute position) is for the coupled sampler; this one consumes its stream in order."""
        if isinstance(probs, Row):
            c = np.cumsum(probs.probs)
            i = int(np.searchsorted(c, self.rng.random() * c[-1], side="right"))
            return int(probs.ids[i]) if i < len(c) else int(probs.ids[np.flatnonzero(probs.probs)[-1]])
        c = np.cumsum(probs)
        i = int(np.searchsorted(c, self.rng.random() * c[-1], side="right"))
        return i if i < len(probs) else int(np.flatnonzero(probs)[-1])

    def propose(self, logits: np.ndarray, prefix) -> tuple[list[int], Dists]:
        """Draw one token per row in order (slot tokens of a MARS block, or one draft token): row
        i's processed distribution p_i sees the tokens drawn for rows < i. Returns (tokens, p)."""
        tokens: list[int] = []
        rows = []
        for i in range(len(logits)):
            rows.append(self.row(logits[i], self._window(prefix, tokens, i)))
            tokens.append(self.draw(rows[-1], len(prefix) + i))
        return tokens, Dists(rows, logits.shape[1])

    # ------------------------------------------------------------------ the verify step (rules.py)
    def sample(self, logits: np.ndarray, prefix) -> tuple[int, float]:
        """ar's token: a draw from the first row's processed distribution at position len(prefix),
        and its probability."""
        p = self.dists(logits, prefix)
        x = self.draw(p[0], len(prefix))
        return x, float(p[0, x])

    def slots(self, logits: np.ndarray, prefix) -> tuple[list[int], np.ndarray, Dists]:
        """A proposal (MARS slots, a draft token): the tokens `propose` draws, their processed
        probabilities (p̃), and the distributions p they were drawn from."""
        tokens, p = self.propose(logits, prefix)
        return tokens, p[np.arange(len(tokens)), tokens], p

    def probs(self, logits: np.ndarray, prefix, ids) -> np.ndarray:
        """The processed probability of ids[i] under row i (row i: after prefix + ids[:i])."""
        return self.dists(logits, prefix, ids)[np.arange(len(ids)), ids]

    def sample_and_accept_n(self, logits: np.ndarray, drafted, prefix, p=None) -> tuple[int, int, list[float], list | None, bool]:
        """The verify step of every exact rule (llama.cpp's common_sampler_sample_and_accept_n): row i
        of `logits` is the target after prefix + drafted[:i], with one row more than drafted (the
        bonus position); drafted[i] was drawn from p[i] (None: drafts proposed without a model,
        point masses). `verify` decides, at positions from len(prefix). Returns (n accepted, the next
        token, the target's processed probability q(x) of each drafted token, min(1, q/p) per draft or
        None, whether the next token replaced a rejected draft)."""
        q = self.dists(logits, prefix, drafted)
        if p is None:
            p = point_mass(drafted, q.shape[1])
        n, nxt, accept, residual = self.verify(q, p, drafted, len(prefix))
        return n, nxt, [float(q[i, drafted[i]]) for i in range(len(drafted))], accept, residual

    def residual(self, q, p) -> int:
        """The token after a rejection: a draw from norm(max(0, q - p)) (q: the target's distribution,
        p: the proposal's). If that has no mass (q <= p everywhere, i.e. q == p up to rounding, when a
        rejection has probability ~0), from q."""
        if isinstance(q, Row) and isinstance(p, Row):
            ids = np.union1d(q.ids, p.ids)
            r = np.maximum(q[ids] - p[ids], 0.0)
            return self.draw(Row(ids, r, q.vocab) if r.sum() > 0 else q)
        q, p = _dense_pair(q, p)
        r = np.maximum(q - p, 0.0)
        return self.draw(r if r.sum() > 0 else q)

    def verify(self, q: np.ndarray, p: np.ndarray, drafted, start: int | None = None) -> tuple[int, int, list[float], bool]:
        """Exact speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023; vLLM
        vllm/v1/sample/rejection_sampler.py), in this project's letters: `drafted[i]` was drawn from
        the proposal p[i]; q[i] is the target after the drafts before it, q has one more row (the
        bonus position). Accept drafted[i] with probability min(1, q(x)/p(x)); at the first rejection
        draw from norm(max(0, q - p)); after a full match draw the bonus from the last q row. The
        committed token at each position is then distributed exactly as q:
        P(x) = min(q, p)(x) + (1 - sum min(q, p)) * residual(x) = q(x).
        Returns (n accepted, the next token, min(1, q/p) per draft, whether it came from the residual).
        `start`: the absolute position of drafted[0] (the coupled sampler's key; unused here)."""
        accept = []
        for i, x in enumerate(drafted):
            qx, px = q[i, x], p[i, x]
            accept.append(float(min(1.0, qx / px)) if px > 0 else float(qx > 0))
        for i in range(len(drafted)):
            if self.rng.random() >= accept[i]:
                return i, self.residual(q[i], p[i]), accept, True
        return len(drafted), self.draw(q[len(drafted)]), accept, False


def point_mass(tokens, n_vocab: int) -> Dists:
    """The proposal distribution p of tokens proposed without a model (lookup drafts): one row per
    token, all its mass on that token. With it, `Sampler.verify` accepts x with probability q(x) and
    after a rejection draws from norm(max(0, q - onehot(x))) = q without x: the committed token is
    distributed as q (the rejection step's identity with p a point mass)."""
    one = np.ones(1)
    return Dists([Row(np.array([int(x)], dtype=np.int64), one, n_vocab) for x in tokens], n_vocab)


# ---------------------------------------------------------------------------------- coupled sampling
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


_U = {k: np.uint64(k) for k in (1, 11, 27, 30, 31, _GOLDEN, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)}


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele, Lea and Flood 2014) on a uint64 array, in place (numpy's
    integer arrays wrap on overflow, silently)."""
    z ^= z >> _U[30]
    z *= _U[0xBF58476D1CE4E5B9]
    z ^= z >> _U[27]
    z *= _U[0x94D049BB133111EB]
    z ^= z >> _U[31]
    return z


def _mix_int(z: int) -> int:
    """`_mix` on one Python int (mod 2^64)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _key(seed: int, pos: int) -> int:
    """The stream of position `pos` under `seed`: two rounds of the finaliser."""
    k = _mix_int((int(seed) + _GOLDEN) & _M64)
    return _mix_int(((k ^ int(pos)) + _GOLDEN) & _M64)


def _keys(seed: int, pos):
    """`_key` of one position (an int), or of each entry of an array of positions."""
    if np.ndim(pos) == 0:
        return np.uint64(_key(seed, pos))
    uniq, inverse = np.unique(np.asarray(pos, dtype=np.int64), return_inverse=True)
    return np.array([_key(seed, int(t)) for t in uniq], dtype=np.uint64)[inverse.ravel()]


def uniform(seed: int, pos, ids) -> np.ndarray:
    """Uniforms in (0, 1), one per token id: the (id + 1)-th output of a splitmix64 stream keyed by
    (seed, pos), i.e. a pure function of (seed, pos, id). Costs O(len(ids)), whatever the vocabulary,
    and a token gets the same number whichever other tokens are asked for with it. `pos`: one
    position for all ids, or one per id (several rows' ids hashed in one call)."""
    z = np.array(ids, dtype=np.uint64)                 # a copy: the ops below work in place
    z += _U[1]
    z *= _U[_GOLDEN]
    z += _keys(seed, pos)
    z = _mix(z) >> _U[11]                              # the top 53 bits
    u = z.astype(np.float64)
    u += 0.5
    u *= 1.0 / (1 << 53)
    return u


def gumbel(seed: int, pos, ids) -> np.ndarray:
    """Standard Gumbel noise g(seed, pos, id) = -log(-log(u)), one per id (`uniform`)."""
    return -np.log(-np.log(uniform(seed, pos, ids)))


class CoupledSampler(Sampler):
    """Position-keyed coupled sampling (the module's docstring): the token at absolute position t is
    argmax_x log p_t(x) + g(seed, t, x); verification is equality with the target's coupled sample.
    The chain (`process`, `dists`, `propose`) is Sampler's; only drawing and verifying differ."""

    coupled = True

    def __init__(self, seed: int, temperature: float = TEMPERATURE, top_k: int = TOP_K, top_p: float = TOP_P,
                 min_p: float = MIN_P, repeat_penalty: float = REPEAT_PENALTY, repeat_last_n: int = REPEAT_LAST_N):
        super().__init__(None, temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n)
        self.seed = int(seed)

    def noise(self, pos, ids: np.ndarray) -> np.ndarray:
        """g at position `pos` (one, or one per id) for these ids (a subclass may key it otherwise:
        the tests' controls)."""
        return gumbel(self.seed, pos, ids)

    def draw(self, probs, pos: int | None = None) -> int:
        """The coupled sample at absolute position `pos`: argmax of log p + g over the tokens with
        p > 0 (a Row's surviving ids; a dense vector's nonzero entries). A one-hot row (temperature 0)
        gives its token: greedy is the zero-noise case."""
        if pos is None:
            raise ValueError("the coupled sampler draws at a position: pass pos (len(prefix) of the token)")
        return self.samples([probs], pos)[0]

    def propose(self, logits: np.ndarray, prefix) -> tuple[list[int], Dists]:
        """Sampler.propose; without a repetition penalty no row depends on the tokens drawn before
        it, so the rows are processed first and their noise is hashed in one call."""
        if self.repeat_penalty != 1.0 and self.repeat_last_n != 0:
            return super().propose(logits, prefix)
        rows = [self.row(logits[i], ()) for i in range(len(logits))]
        return self.samples(rows, len(prefix)), Dists(rows, logits.shape[1])

    def samples(self, rows, start: int) -> list[int]:
        """The coupled samples of rows at positions start, start + 1, ...: the rows' surviving ids are
        hashed in one call (numpy's cost per call, not per id, dominates rows of a few dozen tokens)."""
        ids, logp, lens = [], [], []
        for r in rows:
            if isinstance(r, Row):
                i, pr = r.ids, r.probs
            else:
                pr = np.asarray(r, dtype=np.float64)
                i = np.flatnonzero(pr)
                pr = pr[i]
            ids.append(i), logp.append(pr), lens.append(len(i))
        if all(n == 1 for n in lens):                   # one-hot rows (temperature 0): no noise
            return [int(i[0]) for i in ids]
        if len(rows) == 1:
            flat, logp, pos = ids[0], logp, start
        else:
            flat, pos = np.concatenate(ids), np.repeat(np.arange(start, start + len(rows)), lens)
        # a zero probability (an underflow without top-k) scores log(5e-324) = -744: it never wins
        # against the most probable token, whose log p >= -log(len(ids)), as the Gumbel noise lies in (-4, 37)
        score = np.log(np.maximum(np.concatenate(logp), 5e-324)) + self.noise(pos, flat)
        out, at = [], 0
        for n in lens:
            out.append(int(flat[at + int(np.argmax(score[at:at + n]))]))
            at += n
        return out

    def verify(self, q, p, drafted, start: int | None = None) -> tuple[int, int, None, bool]:
        """Equality with the target's coupled samples: drafted[i] (at position start + i) is accepted
        while it equals draw(q[i], start + i); the first mismatch commits the target's sample, a full
        match the bonus draw(q[k], start + k). Every committed token is the one `ar` draws with this
        seed after this prefix. The proposal p is not read (any proposal, a point mass too, is verified alike).
        Returns (n accepted, the next token, None: no acceptance probabilities, whether it replaced
        a rejected draft)."""
        if start is None:
            raise ValueError("the coupled sampler verifies at positions: pass start (the position of drafted[0])")
        k = len(drafted)
        ys = self.samples([q[i] for i in range(k + 1)], start)    # (the rows after a mismatch: cheap)
        for i, x in enumerate(drafted):
            if ys[i] != int(x):
                return i, ys[i], None, True
        return k, ys[k], None, False
