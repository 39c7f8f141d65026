"""Lookup drafts: continuations copied from the request's own tokens (prompt + answer so far).

Text that repeats (structured records, code edits, quotations, lists, a model's own loops) is
predicted for free by the text itself: find the longest recent earlier occurrence of the sequence's
last tokens and propose what followed it. The decoding rules verify such drafts exactly (rules.py:
`lookup_cycle`), so they can only cost time, never change the output; the planner decides per cycle,
from the match and the lookup's track record, whether a draft and of what length pays (planner.py).

What this absorbs, and from where:
  * llama.cpp `common/ngram-cache.{h,cpp}` (`llama-lookup`): maps of n-grams, n = 1..4 (its
    LLAMA_NGRAM_MIN/MAX), to the tokens that followed them, updated once per committed token; a
    draft grows one token at a time, each the dominant follower of the longest n-gram (ending in the
    tokens drafted so far) whose followers pass two thresholds, a sample size and a share
    (draft_min_sample_size_lax = 2, 2, 1, 1 and draft_min_percent_lax = 66, 50, 50, 50 for n = 1..4),
    and it stops at the first token without one. Here: n = 1..4 too, with the latest `candidates`
    positions of each n-gram instead of full counts, a vote among them for the most frequent
    follower, and the same thresholds as a check on the copy (`supported`, below), except that a
    tie backs nothing here (llama.cpp lets a 50 % tie through: 1 of 2 passes for n >= 2).
  * llama.cpp `common/ngram-map.{h,cpp}` (`--spec-type ngram-simple`, `ngram-map-k`): search the token
    history backwards for the most recent occurrence of the key and copy the m tokens after it; keep
    a few values per key (COMMON_NGRAM_MAX_VALUES = 4). Here: the copy, and 4 positions per key.
  * llama.cpp `common/ngram-mod.{h,cpp}` (`--spec-type ngram-mod`): a fixed-size table, O(1) update
    per token, reset when too full; bounded memory. Here: memory is O(n_max · L) with L <= the
    context, and each key keeps at most `candidates` positions.
  * vLLM `vllm/v1/spec_decode/ngram_proposer.py` (`prompt_lookup_min/max`): the longest suffix
    n-gram in [min_n, max_n] that occurred before, then up to k tokens after it. Here: candidates are
    ranked by their *measured* match length (the backward walk goes past n_max, up to `max_match`),
    then by the vote, then by recency (vLLM takes the earliest position, ngram-simple the latest).
  * LZ77's overlapping copy: when the copy reaches the end of the sequence it continues with its own
    drafted tokens, so a period-p loop ("1, 1, 1," or a repeated line) drafts any length.

What the planner drafts (`offer`, `propose_supported`) is the copy cut at its first slot that the
n-gram statistics do not back: a slot is *supported* when its token is the dominant follower, by
llama.cpp's thresholds, of the longest n-gram that ends just before it. Slots the statistics back
are accepted far more often than the rest (the varying field of a record, a word the model changes;
measured with scripts/lookup_replay.py, docs/lookup.md): on a CPU, where a drafted token costs most
of a pass, that cut is the difference between a draft that pays and one that does not.
`propose(k)` is the plain copy (forced `--lookup K`).

Each drafted slot carries a score (m + j - 1) / (m + j) for slot j of a match of m tokens: Laplace's
rule of succession on "the text has agreed for m tokens in a row". It is a ranking, not a
probability: the planner calibrates it into an acceptance rate from what the verifier accepted
(planner.SlotStats' p̃ bins), and Cycle.p holds it for lookup slots.
"""
from __future__ import annotations

import threading
from array import array
from collections import deque
from typing import Callable, NamedTuple

N_MIN = 1                 # shortest n-gram that counts as a match (llama.cpp's LLAMA_NGRAM_MIN)
N_MAX = 4                 # longest n-gram key (LLAMA_NGRAM_MAX); matches are measured further back
CANDIDATES = 4            # latest positions kept per key (ngram-map's COMMON_NGRAM_MAX_VALUES)
MAX_MATCH = 16            # how far back a candidate's match is measured
# a follower backs a drafted token when the n-gram's latest positions are at least MIN_SAMPLES[n-1] and
# it holds more than MIN_PERCENT[n-1] % of them (llama.cpp common/ngram-cache.cpp's *_lax thresholds,
# where "at least" lets a tie through; longer keys than 4 use n = 4's)
MIN_SAMPLES = (2, 2, 1, 1)
MIN_PERCENT = (66, 50, 50, 50)
# earlier requests' tokens (the history: `NgramIndex.restart`), copied from where a request repeats them
HISTORY_TOKENS = 8192     # most history tokens kept (past it, the latest half is kept); 0: none
HISTORY_MIN_MATCH = MAX_MATCH   # a match in the history counts only this long: a repeated question matches
                          # its whole tail; a chat template's ~6 tokens and a word or two are no repeat, nor
                          # are GSM8K's "2*3=<<2*3=6>>6" 12-15 token echoes, whose copies were right for
                          # 0.9 of 8 tokens (22 such matches in 100 answers against an 8,192-token history)
HISTORY_CANDIDATES = 8    # latest history positions a match looks at per key (besides the request's own)
ARCHIVE_MIN = 8           # a new request that drops this many of the last one's tokens or more keeps them as
                          # history; fewer (a chat's next turn re-closing the answer) are cut as before
WALK = 64                 # most links of a key's chain walked to reach its history positions
PUBLISH_CONTEXT = 64      # a finished request's prompt tokens shared with the pool's other engines (its end)


def score(m: int) -> float:
    """The score of a slot that extends a match of m tokens (Laplace's rule of succession)."""
    return m / (m + 1.0)


class Match(NamedTuple):
    """The best earlier occurrence of the sequence's end: `pos` is the index of the token that
    followed it (the first token a draft copies), `length` the tokens matched before it (n_min..max_match)."""
    pos: int
    length: int


class NgramIndex:
    """n-gram -> the latest positions that followed it, over one token sequence that only grows
    (the engine's committed tokens). `sync(tokens)` takes in what is new (a sequence that is not an
    extension of the known one starts from scratch; `truncate` keeps a shared prefix); `match()` finds
    the best earlier occurrence of the end; `draft(match, k)` copies k tokens after it.

    The history: `restart` at a new request that drops an answer (a repeated question, a regenerated or
    edited turn) keeps every earlier token, the new request's following them; the tokens before `base`
    are the history, the rest the request's own ("live"). A match in the history must measure
    HISTORY_MIN_MATCH tokens, its copy is backed whole and stops at the history's end; the request's
    own n-grams, matches, votes and statistics are its own tokens' alone. llama.cpp's
    `llama-lookup --lookup-cache-dynamic` (an n-gram cache kept across generations) and SGLang's NGRAM
    speculative decoding (one trie over earlier requests' prompts and outputs) do the same across
    requests. With no history (`base` 0) the index is exactly the request's own.

    Kept as hash chains (LZ77's, zlib's `head`/`prev`): per n, the latest position that followed
    each key and, per position, the one before it that followed the same key; a key's candidates are
    the chain's first `candidates` links. Each n's map is built when it is read (`_index`), many
    positions at once over keys built in C (slices zipped: a request's ~160-token prompt and answer
    ~140 us from cold caches between two of the embedded pair's passes, against ~240 for a dict of
    position lists updated a token at a time); an offer that needs a longer match than the text has
    repeated is turned down by a search of the raw tokens (`_occurs`) with no map built. Memory: the
    tokens twice (a list, 4 bytes each) and n_max positions per token."""

    BULK = 8                                  # a catch-up of this many tokens or more: n by n

    def __init__(self, n_min: int = N_MIN, n_max: int = N_MAX, candidates: int = CANDIDATES,
                 max_match: int = MAX_MATCH):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"lookup n-gram sizes must satisfy 1 <= n_min <= n_max, not {n_min}..{n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.candidates, self.max_match = max(1, candidates), max(n_max, max_match)
        self.clear()

    def __len__(self) -> int:
        """The request's own tokens indexed (the history's not counted)."""
        return len(self.tokens) - self.base

    def clear(self) -> None:
        self.base = 0                             # the history: tokens[:base]
        self._private = False                     # the request's own tokens may not become history (`restart`)
        self.tokens: list[int] = []
        self._raw = bytearray()                   # the tokens as 4-byte integers (`_occurs`: a search in C)
        self._held = [0] * (self.n_max + 1)       # [n] -> the tokens map n holds (`_index`)
        self._last: list[dict] = [{} for _ in range(self.n_max + 1)]   # [n] -> {key: latest position after it}
        self._prev: list[list[int]] = [[] for _ in range(self.n_max + 1)]   # [n][i] -> the one before (-1: none)
        self._match_at = -1                       # the sequence length `_match` was computed for
        self._match: Match | None = None

    def sync(self, tokens) -> None:
        """Take in `tokens`: the new ones after the known prefix. The caller promises that the known
        tokens are a prefix of `tokens` when len(tokens) >= len(self); a shorter sequence, or one the
        caller says differs (`reset`), starts from scratch. Each n's map catches up when next read
        (`_index`): an offer that a search of the tokens turns down (`offer`) builds none, and a match
        found at n = 4 builds no shorter one."""
        n = len(self.tokens) - self.base
        if len(tokens) < n:                       # (the history stays)
            self.truncate(self.base)
            n = 0
        self._append(tokens[n:])

    def _append(self, tokens) -> None:
        """`tokens` after the known ones (the maps catch up when next read)."""
        new = [int(t) for t in tokens]
        if new:
            self.tokens.extend(new)
            self._raw += array("i", new).tobytes()

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (a new request that shares them: a conversation's next turn keeps the
        history before it indexed). In each map, each key whose latest position goes takes the latest
        before n on its chain; that costs what indexing the dropped positions did, so a cut of more than
        half of what a map holds drops it (built again when next read)."""
        n = max(0, n)
        if n >= len(self.tokens):
            return
        self.base = min(self.base, n)
        seq = self.tokens
        for m in range(self.n_min, self.n_max + 1):
            held, last, prev = self._held[m], self._last[m], self._prev[m]
            if held - n > n:
                self._last[m], self._prev[m], self._held[m] = {}, [], 0
            elif held > n:
                for i in range(held - 1, max(n, m) - 1, -1):      # latest first: a key's chain is walked down
                    key = seq[i - 1] if m == 1 else tuple(seq[i - m:i])
                    if last.get(key) == i:
                        if prev[i] >= 0:
                            last[key] = prev[i]
                        else:
                            del last[key]
                del prev[n:]
                self._held[m] = n
        del seq[n:]
        del self._raw[4 * n:]
        self._match_at, self._match = -1, None

    def reset(self, tokens) -> None:
        """Start from scratch with `tokens`, the history dropped too."""
        self.clear()
        self.sync(tokens)

    def restart(self, keep: int, recall: bool = True, others: Callable[[], list] | None = None) -> None:
        """A new request whose prompt shares the request's own first `keep` tokens (then `sync` it).
        Where it drops ARCHIVE_MIN or more of them (a repeated question, a regenerated answer), or
        there are none (a fresh index), every token so far becomes history, then the token sequences
        `others()` returns (other engines' finished requests: `Recent`), and the new request's tokens
        follow them (`recall`; past HISTORY_TOKENS the latest half is kept); otherwise, or without
        `recall` (the history dropped too), the index keeps the shared prefix as `truncate` does. A
        request without `recall` is not recalled either: the next restart drops its tokens, history or not."""
        live = len(self.tokens) - self.base
        keep = max(0, min(keep, live))
        if not recall or HISTORY_TOKENS <= 0:
            if self.base:
                self.reset(self.tokens[self.base:self.base + keep])
            else:
                self.truncate(keep)
            self._private = True
            return
        if self._private:                         # (the last request's tokens: no one's history)
            self.clear()
            live = keep = 0
        if live and live - keep < ARCHIVE_MIN:
            self.truncate(self.base + keep)
            return
        for seq in (others() if others is not None else ()):
            self._append(seq)
        if len(self.tokens) > HISTORY_TOKENS:
            self.reset(self.tokens[-(HISTORY_TOKENS // 2):])
        self.base = len(self.tokens)
        self._match_at, self._match = -1, None

    def _catch(self) -> None:
        """Every map caught up with the tokens."""
        for n in range(self.n_min, self.n_max + 1):
            self._index(n)

    def _index(self, n: int) -> None:
        """Map n caught up: each position i it does not hold yet becomes the latest follower of the n-gram
        that ends just before it, the one before on its chain the key's previous latest. Many positions
        at once go over keys built in C (a slice, or a zip of n slices)."""
        seq, L, start = self.tokens, len(self.tokens), self._held[n]
        if start == L:
            return
        prev, last = self._prev[n], self._last[n]
        if start < self.base and n < self._history_n():          # (the history: its maps alone)
            prev.extend([-1] * (self.base - start))
            start = self._held[n] = self.base
            if start == L:
                return
        if start < n:                                           # positions before a whole n-gram
            prev.extend([-1] * (min(n, L) - start))
            start = min(n, L)
        get, link = last.get, prev.append
        if L - start >= self.BULK:
            keys = seq[start - 1:L - 1] if n == 1 else zip(*(seq[start - n + k:L - n + k] for k in range(n)))
            for i, key in enumerate(keys, start):
                link(get(key, -1))
                last[key] = i
        else:
            for i in range(start, L):
                key = seq[i - 1] if n == 1 else tuple(seq[i - n:i])
                link(get(key, -1))
                last[key] = i
        self._held[n] = L

    def _history_n(self) -> int:
        """The shortest n whose map holds the history's positions: a history match measures
        HISTORY_MIN_MATCH tokens, so its n_max-gram is a key too, and a shorter key's chain (a superset,
        walked as far) finds no history match the n_max one did not; the shorter maps skip the history."""
        return min(self.n_max, max(self.n_min, HISTORY_MIN_MATCH))

    def _seen(self, n: int) -> bool:
        """Whether the last n tokens occurred before with a token after them as far as map n knows: one
        dict lookup where it holds every token, else a search of the raw tokens (`_occurs`)."""
        seq = self.tokens
        if self._held[n] == len(seq):
            return (seq[-1] if n == 1 else tuple(seq[-n:])) in self._last[n]
        return self._occurs(n)

    def _occurs(self, n: int) -> bool:
        """Whether the last n tokens occurred before with a token after them (what `key in _last[n]`
        says once the maps hold every token), by a search of the raw tokens: no catch-up."""
        raw, L = self._raw, len(self.tokens)
        needle, end = raw[4 * (L - n):], 4 * (L - 1)
        i = raw.find(needle, 0, end)
        while i > 0 and i % 4:                   # (a match across token boundaries: search on)
            i = raw.find(needle, i + 1, end)
        return i >= 0

    def _positions(self, n: int, key, past: int = 0) -> list[int] | None:
        """The latest `candidates` positions of the request's own that followed the n-gram `key` (the
        n-gram within its own tokens) and the latest `past` of the history's, oldest first (None: none)."""
        if self._held[n] != len(self.tokens):
            self._index(n)
        p = self._last[n].get(key)
        if p is None:
            return None
        base, cap, prev = self.base, self.candidates, self._prev[n]
        own = base + n                           # (the first position whose n-gram is the request's own)
        if base == 0 or past == 0:
            if p < own:
                return None
            out = [p]
            while len(out) < cap:
                p = prev[p]
                if p < own:
                    break
                out.append(p)
            out.reverse()
            return out
        out, live, old, links = [], 0, 0, 0
        while p >= 0 and links < WALK:
            if p >= base:
                if live < cap and p >= own:       # (an n-gram across the boundary is neither's)
                    out.append(p)
                    live += 1
            else:
                if old == past:
                    break
                out.append(p)
                old += 1
            p, links = prev[p], links + 1
        out.reverse()
        return out or None

    def match(self) -> Match | None:
        """The best earlier occurrence of the end of the sequence: the longest n-gram key (n_max down to
        n_min) that occurred before; among its latest positions, the longest measured match (walking
        back up to max_match tokens), then the follower most of them share, then the latest. Cached
        until the sequence grows; a match that the tokens since continued stays the match, as many tokens
        longer (the common case inside a repeat: no search)."""
        seq = self.tokens
        L = len(seq)
        if self._match is not None and 0 <= self._match_at < L:
            p, m = self._match
            end = self.base if p < self.base else L    # (a copy of the history stops at its end)
            for i in range(self._match_at, L):
                if seq[p] != seq[i]:
                    break
                p, m = p + 1, (m + 1 if m < self.max_match else m)
                if p >= end:
                    break
            else:
                self._match, self._match_at = Match(p, m), L
            if self._match_at != L:
                self._match, self._match_at = None, -1
        if self._match_at == L:
            return self._match
        best, past, deep = None, HISTORY_CANDIDATES if self.base else 0, self._history_n()
        for n in range(min(self.n_max, L - self.base), self.n_min - 1, -1):
            key = seq[L - 1] if n == 1 else tuple(seq[L - n:L])
            cands = self._positions(n, key, past=past if n >= deep else 0)
            if cands:
                best = self._choose(cands, n)
                if best is not None:
                    break
        self._match_at, self._match = L, best
        return best

    def _choose(self, cands: list[int], n: int) -> Match | None:
        """The best of `cands` (positions after the n-gram that ends the tokens): the longest measured
        match, then the follower most of them share (the request's own and the history's counted
        apart), then the latest; history positions only with a match of HISTORY_MIN_MATCH tokens or
        more (None: none)."""
        seq, L, cap, base = self.tokens, len(self.tokens), self.max_match, self.base
        votes: dict[tuple, int] = {}             # (part, follower) -> positions: the history votes apart
        for p in cands:
            v = (p < base, seq[p])
            votes[v] = votes.get(v, 0) + 1
        best_key, best = None, None
        for p in cands:                          # oldest first: a tie goes to the later one
            m, lo = n, (base if p >= base else 0)
            while m < cap and p - 1 - m >= lo and L - 1 - m >= base and seq[p - 1 - m] == seq[L - 1 - m]:
                m += 1
            if p < base and m < HISTORY_MIN_MATCH:
                continue
            k = (m, votes[(p < base, seq[p])], p)
            if best_key is None or k >= best_key:
                best_key, best = k, Match(p, m)
        return best

    def draft(self, match: Match, k: int) -> list[int]:
        """k tokens copied from match.pos on; past the end of the sequence the copy reads its own
        drafted tokens (an overlapping copy: a repeated line or a loop drafts any length)."""
        seq, L = self.tokens, len(self.tokens)
        if match.pos < self.base:                # (a copy of the history stops at its end)
            k = min(k, self.base - match.pos)
        out: list[int] = []
        for j in range(k):
            i = match.pos + j
            out.append(seq[i] if i < L else out[i - L])
        return out

    @staticmethod
    def scores(match: Match, k: int) -> list[float]:
        """Per drafted slot j = 1..k: score(match.length + j - 1), the match it extends if the slots before it hold."""
        return [score(match.length + j) for j in range(k)]

    def propose(self, k: int) -> tuple[list[int], list[float]]:
        """k drafted tokens after the end of the sequence (the plain copy) and their scores ([] without a match)."""
        m = self.match()
        if m is None or k <= 0:
            return [], []
        return self.draft(m, k), self.scores(m, k)

    def follower(self, tail, ties: bool = False) -> int | None:
        """The token the n-gram statistics expect after `tail` (the sequence's last tokens, drafted ones
        included): the most frequent follower, the latest on a tie, among the latest positions of the
        longest n-gram ending `tail` that has at least MIN_SAMPLES[n-1] of them and in which that
        follower holds more than MIN_PERCENT[n-1] % (`ties`: at least, as llama.cpp's try_draft);
        None if no n-gram passes. The request's own positions only."""
        seq = self.tokens
        for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
            pos = self._positions(n, tail[-1] if n == 1 else tuple(tail[-n:]))
            i = min(n, len(MIN_SAMPLES)) - 1
            if not pos or len(pos) < MIN_SAMPLES[i]:
                continue
            votes: dict[int, int] = {}
            for p in pos:
                votes[seq[p]] = votes.get(seq[p], 0) + 1
            best = max(reversed(pos), key=lambda p: votes[seq[p]])    # the latest among the most frequent
            share, bar = 100 * votes[seq[best]], MIN_PERCENT[i] * len(pos)
            if share > bar or (ties and share == bar):
                return seq[best]
        return None

    def supported(self, match: Match, k: int) -> int:
        """How many of the first k slots of the copy at `match` the statistics back: the leading run
        of drafted tokens each equal to `follower` of the tokens before it. A copy of the history is
        backed whole (to the history's end): its match of HISTORY_MIN_MATCH tokens or more says more
        than n-grams of n_max tokens, whose followers in the history are every earlier answer's (a
        chat template's last tokens: each request's first answer token)."""
        draft = self.draft(match, k)
        if match.pos < self.base:
            return len(draft)
        tail = self.tokens[-self.n_max:]
        for j, t in enumerate(draft):
            if self.follower(tail) != t:
                return j
            tail.append(t)
        return len(draft)

    def offer(self, min_length: int = 1) -> Match | None:
        """The match, if the statistics back at least its first slot (what the planner is offered).
        `min_length` > 1: the planner can use no shorter match, so none is searched for unless the
        sequence's last min(min_length, n_max) tokens occurred before: one dict lookup, or where the
        maps are behind the tokens, a search of the tokens in C instead of their catch-up (a request
        whose offers are turned down this way never builds its maps)."""
        if min_length > 1:
            n, deep = min(min_length, self.n_max), self._history_n()
            if len(self.tokens) <= n:
                return None
            if not self._seen(n) and not (self.base and n < deep and len(self) >= HISTORY_MIN_MATCH
                                          and self._seen(deep)):   # (the history: the deep map's alone)
                return None
        m = self.match()
        return m if m is not None and self.supported(m, 1) else None

    def propose_supported(self, k: int) -> tuple[list[int], list[float]]:
        """Up to k drafted tokens: the copy cut at its first slot the statistics do not back."""
        m = self.match()
        if m is None or k <= 0:
            return [], []
        n = self.supported(m, k)
        return self.draft(m, n), self.scores(m, n)

    def size(self) -> int:
        """Positions stored over all keys (the memory bound's count)."""
        self._catch()
        return sum(len(self._positions(n, key) or ()) for n in range(self.n_min, self.n_max + 1) for key in self._last[n])


class Recent:
    """The token sequences a pool's engines finished with (the end of each prompt and its answer),
    for the other engines' lookup histories: a repeated question is copied on whichever engine takes
    it, not only on the one that answered it (SGLang's NGRAM cache is one for all requests). Bounded to
    HISTORY_TOKENS tokens (the oldest go first); thread-safe (each engine runs on a thread of its own)."""

    def __init__(self, limit: int | None = None):
        self.limit = HISTORY_TOKENS if limit is None else limit
        self._lock = threading.Lock()
        self._items: deque = deque()              # (serial, owner id, tokens)
        self._serial = 0
        self._tokens = 0
        self._seen: dict[int, int] = {}           # owner id -> the last serial it took

    def add(self, owner, tokens) -> None:
        """A finished request's tokens, from the engine `owner`."""
        seq = tuple(int(t) for t in tokens)
        if not seq or self.limit <= 0:
            return
        with self._lock:
            self._serial += 1
            self._items.append((self._serial, id(owner), seq))
            self._tokens += len(seq)
            while self._tokens > self.limit and len(self._items) > 1:
                self._tokens -= len(self._items.popleft()[2])

    def since(self, owner) -> list[tuple[int, ...]]:
        """The sequences other engines added since `owner` last asked (oldest first); not its own."""
        key = id(owner)
        with self._lock:
            last = self._seen.get(key, 0)
            self._seen[key] = self._serial
            return [seq for serial, who, seq in self._items if serial > last and who != key]
