"""What the decoding rules read from rows of logits, computed without copying the rows and touching
each one as few times as its question needs (a 151,936-token row is 600 kB).

- `row_stats(logits, exp_rows)`: the argmax and maximum of every row (one pass each), and the
  softmax normaliser sum(exp(row - max)) of the rows in `exp_rows` only (one exp pass and one sum
  over a reused buffer: no temporary of the row's size per call); a small pass (a small vocabulary)
  all rows at once.
- `top1`, `prob_of`, `greedy_and_prob`: the greedy verify step's questions (the argmax and p̃ of
  each row; the probability of given tokens), on `row_stats`.
- `top_candidates(row, k)`: the ids of a row's k largest logits without sorting or partitioning the
  whole row (one elementwise-maximum pass over strided groups, then a partition of the entries of
  the k best groups).

The rows may be a view into llama.cpp's output buffer (llama.Context.eval_view). One thread: a
second one (numpy releases the GIL in these loops) made a 16-row cycle slower here (10.1 against
7.4 ms at 151,936 tokens; llama.cpp's OpenMP threads still spin on the other core after a pass).

The arithmetic is the plain softmax's, in float32: p(x) = exp(l_x - max) / sum(exp(l - max)), the
sum a numpy pairwise sum of the same float32 terms as a whole-array softmax; results agree with it
to float32 rounding (tests/test_runtime.py compares them with a float64 reference on real logits).
"""
from __future__ import annotations

import math
import threading

import numpy as np

_local = threading.local()
# passes of at most this many logits (rows x vocabulary) are read all rows at once: numpy's per-call
# cost outweighs the cache the row-by-row form keeps warm (3 rows of the embedded pair's 2,048 tokens:
# 10 against 14 us in a loop; at 49,152 tokens the row-by-row form is as fast or faster from 2 rows on)
SMALL_PASS = 1 << 17


def _buffer(n: int, dtype=np.float32) -> np.ndarray:
    """A scratch row for this thread, reused across calls (allocating 600 kB per row costs page faults)."""
    key = f"buf_{np.dtype(dtype).str}"
    buf = getattr(_local, key, None)
    if buf is None or buf.shape[0] < n:
        buf = np.empty(n, dtype=dtype)
        setattr(_local, key, buf)
    return buf[:n]


def _sumexp(row: np.ndarray, m) -> np.float32:
    """sum(exp(row - m)) in float32 over a reused buffer, m = max(row). When 0 <= m <= 87 - ln(n) (a
    language model's logits, almost always) the subtraction is skipped: sum(exp(row)) * exp(-m) neither
    overflows (with m <= 87 - ln(n), n * exp(m) < 3.4e38, float32's largest) nor loses a term that
    matters (a logit below -87 underflows, and its share of the sum is below exp(-87)), and it saves
    one of three passes over the row. The result differs from the subtracted form by float32
    rounding only."""
    buf = _buffer(row.shape[0])
    if 0.0 <= m <= 87.0 - math.log(row.shape[0]):
        np.exp(row, out=buf)
        return np.float32(np.add.reduce(buf) * np.exp(-m, dtype=np.float32))
    np.subtract(row, m, out=buf)
    np.exp(buf, out=buf)
    return np.add.reduce(buf)


def row_stats(logits: np.ndarray, exp_rows=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(argmax, max, sum(exp(row - max))) per row of a float32 [rows, vocab] array; the sums only for
    the rows in `exp_rows` (indices; None: every row), NaN elsewhere. Ties go to the first index
    (numpy's argmax, as before). Row by row, so that a row's exp pass finds it in the cache its
    argmax pass just filled (a 152k-token row is 600 kB: it fits a core's L2, a pass's rows do not)."""
    n = logits.shape[0]
    if 1 < n and n * logits.shape[1] <= SMALL_PASS:
        return _row_stats_at_once(logits, exp_rows)
    ids = np.zeros(n, dtype=np.int64)
    maxes = np.zeros(n, dtype=np.float32)
    sums = np.full(n, np.nan, dtype=np.float32)
    want = range(n) if exp_rows is None else set(int(i) for i in exp_rows)
    for i in range(n):
        row = logits[i]
        a = row.argmax()
        ids[i], maxes[i] = a, row[a]
        if i in want:
            sums[i] = _sumexp(row, maxes[i])
    return ids, maxes, sums


def _row_stats_at_once(logits: np.ndarray, exp_rows=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """row_stats of a small pass (SMALL_PASS), every row in each numpy call: the argmax and max of all
    rows, then one subtraction, exp and sum over the rows in `exp_rows` (numpy's pairwise sum along
    each row, as the row-by-row form's). Few numpy calls: between two passes each costs several
    microseconds (cold caches), more than the arithmetic of a small pass."""
    n = logits.shape[0]
    ids, maxes = logits.argmax(axis=1), logits.max(axis=1)
    if exp_rows is None:
        want = slice(None)
    elif isinstance(exp_rows, range) and exp_rows.step == 1 and exp_rows.start == 0:
        want = slice(0, min(exp_rows.stop, n))            # (the verify step's: the first rows)
    else:
        want = sorted(set(int(i) for i in exp_rows))
    sums = np.full(n, np.nan, dtype=np.float32)
    e = logits[want] - maxes[want, None]
    np.exp(e, out=e)
    sums[want] = e.sum(axis=1)
    return ids, maxes, sums


def probs_at(logits: np.ndarray, maxes: np.ndarray, sums: np.ndarray, ids) -> np.ndarray:
    """exp(logits[i, ids[i]] - maxes[i]) / sums[i] for i < len(ids), in float32."""
    k = len(ids)
    if k == 0:
        return np.zeros(0, dtype=np.float32)
    z = logits[np.arange(k), np.asarray(ids, dtype=np.int64)] - maxes[:k]
    return np.exp(z) / sums[:k]


def top1(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Argmax per row and its softmax probability (p̃): one argmax pass and one exp pass per row,
    no copy of the rows."""
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


def top_candidates(row: np.ndarray, k: int, group: int = 32) -> np.ndarray:
    """Ids of the k largest entries of `row` (ties at the k-th value broken arbitrarily, as by
    np.argpartition), in no particular order, without partitioning the whole row. The row is split
    into `m` strided groups of `group` entries (column j of row[:m*group].reshape(group, m): one
    elementwise-maximum pass gives every group's maximum); the k largest entries lie in the k groups
    with the largest maxima (an entry outside them has k larger group maxima above it, i.e. k larger
    entries in distinct groups), so only those k * group entries (and the tail that does not fill
    a group) are partitioned."""
    n = row.shape[0]
    if k >= n:
        return np.arange(n)
    m = n // group
    if m < 8 * k:                                  # short rows: a partition of the row is cheap
        return np.argpartition(row, n - k)[n - k:]
    gmax = row[:m * group].reshape(group, m).max(axis=0)
    top = np.argpartition(gmax, m - k)[m - k:]
    cand = (top[None, :] + (np.arange(group) * m)[:, None]).ravel()
    if m * group < n:
        cand = np.concatenate([cand, np.arange(m * group, n)])
    vals = row[cand]
    return cand[np.argpartition(vals, vals.shape[0] - k)[vals.shape[0] - k:]]
