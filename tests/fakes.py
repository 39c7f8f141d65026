"""A fake context with scripted logits (the decoding rules see only n_past / eval / truncate), and the
scripted world the rule and engine tests share: a vocabulary, a "true" successor, proposers and
verifiers that follow or miss it, and an engine on fake contexts."""
from __future__ import annotations

import numpy as np

from prove_local.engine import Engine, Settings


class FakeContext:
    """`next_dist(prefix) -> probs over the vocab` decides the logits of the row after `prefix`.
    The fake keeps the actual token sequence of its cache, so tests can check it."""

    def __init__(self, next_dist, vocab: int):
        self.next_dist = next_dist
        self.vocab = vocab
        self.cache: list[int] = []
        self.evals: list[list[int]] = []
        self.decode_seconds = 0.0
        self.n_decode = 0          # passes, counted as llama.py's Context counts them

    @property
    def n_past(self) -> int:
        return len(self.cache)

    def eval(self, tokens, rows=None):
        rows = [len(tokens) - 1] if rows is None else rows
        self.evals.append(list(tokens))
        self.n_decode += 1
        base = list(self.cache)
        self.cache += list(tokens)
        out = np.empty((len(rows), self.vocab), dtype=np.float32)
        for j, r in enumerate(rows):
            probs = np.asarray(self.next_dist(base + list(tokens[:r + 1])), dtype=np.float64)
            out[j] = np.log(np.maximum(probs, 1e-30))
        return out

    def truncate(self, n):
        assert 0 <= n <= len(self.cache), (n, len(self.cache))
        del self.cache[n:]


def onehot(vocab: int, token: int, p: float = 0.9) -> np.ndarray:
    """A distribution with probability p on `token`, the rest spread evenly."""
    d = np.full(vocab, (1 - p) / (vocab - 1))
    d[token] = p
    return d


# ------------------------------------------------------------------ a scripted world (test_rules, test_engine_guards)
V, MASK, EOS = 32, 31, 30


def successor(prefix):
    """The 'true' next token: last real token + 1 (mod 20)."""
    real = [t for t in prefix if t != MASK]
    return (real[-1] + 1) % 20


def ar_model(p=0.9):
    return lambda prefix: onehot(V, successor(prefix), p)


def proposer(wrong=(), conf=None):
    """A MARS-like proposer: after real token t and m masks it proposes t + m + 1, except at the
    block slots in `wrong` (1-based) where it proposes 25. `conf[slot]` sets its confidence."""
    conf = conf or {}

    def dist(prefix):
        m = 0
        while prefix[-1 - m] == MASK:
            m += 1
        real = prefix[-1 - m]
        slot = m + 1
        tok = 25 if slot in wrong else (real + m + 1) % 20
        return onehot(V, tok, conf.get(slot, 0.9))
    return dist


def greedy(prompt, n):
    """The scripted world's greedy continuation, by its definition (successor), without any rule."""
    out = list(prompt)
    for _ in range(n):
        out.append(successor(out))
    return out[len(prompt):]


PROMPT = [3, 4, 5]


def verifier(p_true=0.8, low_at=()):
    """A stock AR verifier: probability p_true on the true successor, except after prefixes of the
    lengths in `low_at`, where it puts only 0.01 on it."""
    def dist(prefix):
        return onehot(V, successor(prefix), 0.01 if len(prefix) in low_at else p_true)
    return dist


def make_engine(prop=None, n_ctx=64, **ctx):
    """An engine on fake contexts (proposer: `prop`, default the scripted one; more roles in `ctx`)."""
    contexts = {"target": FakeContext(prop or proposer(), V), **ctx}
    return Engine(contexts, is_eog=lambda t: t == EOS, mask_token=MASK, n_ctx=n_ctx, block_size=4)


def run(engine, prompt, **kw):
    """(cycles, committed tokens) of one generation."""
    cycles = list(engine.generate(prompt, Settings(**kw)))
    return cycles, [t for c in cycles for t in c.committed]
