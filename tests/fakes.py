"""A fake context with scripted logits: the decoding rules see only n_past / eval / truncate."""
from __future__ import annotations

import numpy as np


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
