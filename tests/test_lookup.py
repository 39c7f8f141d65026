"""Lookup drafts: the n-gram index against hand-written sequences and a brute-force search (matches,
and which copied slots the n-gram statistics back), and the lookup cycles on real llama.cpp contexts
(tiny F32 models): output == ar token for token with forced lookups of every length, with and without
a mask token, filled MARS proposals, the KV cache, the passes each cycle declares, the planner's
choices (slow start, the pooled request record), what it is offered (backed slots only, in a scripted
world of records), and sampling (distribution against closed forms and against the enumerated ar
distribution of a real context)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from prove_local import lookup, modes, rules
from prove_local.bench.runner import make_runs
from prove_local.engine import Engine, Settings
from prove_local.errors import ModeError
from prove_local.llama import Context, Model
from prove_local.lookup import Match, NgramIndex
from prove_local.planner import Costs, Planner
from prove_local.sampling import Sampler, point_mass
from tests import fakes
from tests.fakes import FakeContext
from tests.reference import greedy_ar, next_logits
from tests.test_sampling import (ALPHA, FAKE_SETTINGS, MASK, PROMPT, TRUNC, V, ar_dist, exact_ar, exact_pairs,
                                 fake_logits, first_tokens, gof, marginal, mars_dist)
from tests.tiny import tiny_gguf

F32 = dict(n_ctx=512, n_threads=1, type_k="f32", type_v="f32")


# ------------------------------------------------------------------ the index, by hand
def index_of(seq, **kw) -> NgramIndex:
    ix = NgramIndex(**kw)
    ix.sync(seq)
    return ix


def test_no_match_on_short_or_fresh_text():
    assert index_of([]).match() is None
    assert index_of([5]).match() is None
    assert index_of([1, 2, 3, 4]).match() is None           # no token repeats
    assert index_of([1, 2, 3, 4]).propose(4) == ([], [])


def test_a_repeated_bigram_drafts_what_followed_it():
    ix = index_of([1, 2, 3, 1, 2])                             # "a b c a b" -> c a b ...
    assert ix.match() == Match(pos=2, length=2)
    assert ix.draft(ix.match(), 3) == [3, 1, 2]
    assert ix.propose(2) == ([3, 1], [lookup.score(2), lookup.score(3)])


def test_the_longest_key_wins_over_a_more_recent_shorter_one():
    # (1, 2, 3) was followed by 4; the token 3 alone was followed by 5 more recently
    ix = index_of([1, 2, 3, 4, 7, 3, 5, 1, 2, 3])
    assert ix.match().pos == 3 and ix.draft(ix.match(), 1) == [4]


def test_equal_matches_take_the_most_recent():
    ix = index_of([1, 2, 8, 1, 2, 9, 1, 2])                    # (1, 2) -> 8, later -> 9
    assert ix.propose(1)[0] == [9]


def test_a_longer_measured_match_beats_recency_past_n_max():
    # the 4-gram (1, 2, 3, 4) occurs twice; the older occurrence shares 2 more tokens (7, 7) with the end
    seq = [7, 7, 1, 2, 3, 4, 8, 6, 1, 2, 3, 4, 9, 7, 7, 1, 2, 3, 4]
    ix = index_of(seq)
    assert ix.match() == Match(pos=6, length=6)
    assert ix.propose(1)[0] == [8]


def test_the_most_frequent_follower_wins_among_equal_matches():
    ix = index_of([1, 2, 5, 1, 2, 5, 1, 2, 6, 1, 2])           # (1, 2) -> 5, 5, then 6 (the latest)
    assert ix.match().pos == 5 and ix.propose(1)[0] == [5]


def test_an_overlapping_copy_drafts_a_loop_of_any_length():
    assert index_of([3, 1, 1, 1]).propose(5)[0] == [1] * 5
    assert index_of([9, 1, 2, 1, 2]).propose(5)[0] == [1, 2, 1, 2, 1]


def test_scores_follow_the_match_length():
    ix = index_of([1, 2, 3, 1, 2])
    _, s = ix.propose(3)
    assert s == [2 / 3, 3 / 4, 4 / 5]
    assert lookup.score(1) == 0.5 and lookup.score(9) == 0.9


def test_n_min_and_the_candidate_cap_bound_what_is_kept():
    assert index_of([4, 9, 4], n_min=2).match() is None        # a one-token match is not enough
    assert index_of([4, 9, 4]).match() == Match(pos=1, length=1)
    ix = index_of([1] * 200)
    assert ix.size() <= 4 * lookup.N_MAX                        # one key per n, at most 4 positions each
    # the oldest occurrence of (1, 2, 3, 4) (the longest match: 9 before it) was evicted by 4 later ones
    seq = [9, 1, 2, 3, 4, 100] + [x for i in range(4) for x in (50 + i, 1, 2, 3, 4, 60 + i)] + [9, 1, 2, 3, 4]
    ix = index_of(seq)
    assert ix.match() == Match(pos=len(seq) - 6, length=4) and ix.propose(1)[0] == [63]


def test_sync_extends_and_a_shorter_sequence_rebuilds():
    seq = [1, 2, 3, 1, 2, 4, 1, 2]
    ix = NgramIndex()
    for i in range(1, len(seq) + 1):
        ix.sync(seq[:i])                                        # one token at a time, as the engine does
    assert ix.propose(1)[0] == [4] and len(ix) == len(seq)
    ix.sync([1, 2, 3, 1])                                       # shorter: indexed from scratch
    assert len(ix) == 4 and ix.propose(2)[0] == [2, 3]
    ix.reset([7, 8, 7])
    assert ix.propose(1)[0] == [8]


def brute_match(seq, n_min=lookup.N_MIN, n_max=lookup.N_MAX, cands=lookup.CANDIDATES, cap=lookup.MAX_MATCH):
    """The rule by exhaustive search: the longest n whose suffix n-gram occurred earlier (with a token
    after it), its `cands` latest occurrences, ranked by measured match length, votes, recency."""
    L = len(seq)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pos = [i + n for i in range(0, L - n) if seq[i:i + n] == seq[L - n:]][-cands:]
        if not pos:
            continue
        votes = {t: sum(seq[p] == t for p in pos) for t in {seq[p] for p in pos}}
        def measured(p):
            m = 0
            while m < cap and p - 1 - m >= 0 and seq[p - 1 - m] == seq[L - 1 - m]:
                m += 1
            return m
        best = max(pos, key=lambda p: (measured(p), votes[seq[p]], p))
        return best, measured(best)
    return None


def test_a_match_being_copied_continues_and_stays_valid():
    """Asked after every token (as the engine does), a match the text continues stays the match, one
    token longer; whatever path led to it, it is a real earlier occurrence, found exactly where the
    brute-force search finds one."""
    rng = random.Random(11)
    for trial in range(200):
        vocab = rng.choice([2, 3, 6])
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(2, 50))]
        seq += seq[-rng.randrange(1, 10):] * rng.randrange(1, 4)        # a repeat to be copied
        ix = NgramIndex()
        for i in range(1, len(seq) + 1):
            ix.sync(seq[:i])
            m = ix.match()
            assert (m is None) == (brute_match(seq[:i]) is None), seq[:i]
            if m is not None:
                assert m.pos < i and m.length <= m.pos and seq[m.pos - m.length:m.pos] == seq[i - m.length:i]
    ix = NgramIndex()
    ix.sync([5, 1, 2, 3, 4, 9, 5, 1, 2])
    assert ix.match() == Match(3, 3)
    ix.sync([5, 1, 2, 3, 4, 9, 5, 1, 2, 3])                  # the copy goes on: one token longer, no search
    assert ix.match() == Match(4, 4)
    ix.sync([5, 1, 2, 3, 4, 9, 5, 1, 2, 3, 7])                # it breaks: a fresh search (7 never occurred)
    assert ix.match() is None


def test_a_catch_up_of_many_tokens_indexes_what_one_at_a_time_does():
    """The array path (`sync` of BULK tokens or more: a request's prompt, an answer the planner did not
    ask about for a while) builds the same chains, the same latest positions and the same match,
    carried or searched, as one token at a time, from empty and from an indexed prefix."""
    rng = random.Random(5)
    for trial in range(150):
        vocab = rng.choice([2, 3, 7, 50])
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
        if trial % 3 == 0:
            seq += seq[-rng.randrange(1, 30):] * rng.randrange(1, 4)       # a repeat the match carries on
        one, chunks = NgramIndex(), NgramIndex()
        i = 0
        while i < len(seq):
            j = min(len(seq), i + rng.choice([1, 2, NgramIndex.BULK, NgramIndex.BULK + 7, 60]))
            if rng.random() < 0.5:                                       # a match to carry, or none
                assert chunks.match() == one.match()
            for k in range(i + 1, j + 1):
                one.sync(seq[:k])
                one._catch()
            chunks.sync(seq[:j])
            if rng.random() < 0.5:                                       # a read builds the maps it reads
                assert chunks.match() == one.match(), (seq, i, j)
            chunks._catch()                                              # (the rest)
            assert chunks._prev == one._prev and chunks._last == one._last, (seq, i, j)
            assert chunks.match() == one.match(), (seq, i, j)
            i = j
        tail = seq[-lookup.N_MAX:]
        assert chunks.follower(tail) == one.follower(tail) and chunks.size() == one.size()


def test_a_match_found_with_the_longest_key_builds_no_shorter_map():
    ix = index_of([7, 1, 2, 3, 4, 9, 8, 1, 2, 3, 4])
    assert ix.match() == Match(pos=5, length=4)
    assert ix._held[lookup.N_MAX] == 11 and not any(ix._held[:lookup.N_MAX])
    assert ix.follower([1, 2, 3, 4]) == 9 and not any(ix._held[:lookup.N_MAX])   # (1 sample backs a 4-gram)


def test_a_truncated_index_is_the_index_of_the_prefix():
    """A new request that shares the indexed tokens' first n (a conversation's next turn) keeps them
    indexed: the chains and latest positions of the prefix's own index, short cuts and long ones."""
    rng = random.Random(9)
    for trial in range(200):
        vocab = rng.choice([2, 3, 7, 50])
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 90))]
        n = rng.randrange(0, len(seq) + 2)
        ix = index_of(seq)
        if trial % 3:
            ix._catch()                                     # (the maps hold every token, or none yet)
        ix.truncate(n)
        ix._catch()
        want = index_of(seq[:n])
        want._catch()
        assert ix.tokens == want.tokens and ix._prev == want._prev and ix._last == want._last, (seq, n)
        more = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
        ix.sync(seq[:n] + more)
        assert ix.match() == index_of(seq[:n] + more).match()


def test_an_offer_turned_down_by_a_search_of_the_tokens_is_the_offer_of_the_maps():
    """Where the maps are behind the tokens, an offer that needs a match of 2+ tokens first searches the
    raw tokens for the last ones (4-byte integers: a hit across token boundaries does not count) and
    builds nothing if they never occurred; its answer is the caught-up index's, always."""
    rng = random.Random(13)
    for trial in range(400):
        alphabet = rng.choice([[1, 256], [1, 256, 65536, 0], list(range(5)), [7, 1 << 24, 1]])
        seq = [rng.choice(alphabet) for _ in range(rng.randrange(1, 40))]
        k = rng.randrange(1, 7)
        lazy, built = index_of(seq), index_of(seq)
        built._catch()
        assert lazy.offer(k) == built.offer(k), (seq, k)
    ix = index_of([256, 0, 9, 1])                  # bytes 00 01 00 00 | 00 00 00 00 | ...: 1 = 01 00 00 00 inside
    assert not ix._occurs(1) and ix.offer(2) is None and not any(ix._held)   # nothing built


def test_a_record_s_varying_field_is_not_supported():
    # records 10 11 X 12 with X = 1, 2, 3: the copy of the latest record drafts 3, but (12, 10, 11) was
    # followed by 2 and by 3 (a tie backs nothing) and (10, 11) / 11 by 1, 2, 3 (a third each)
    ix = index_of([10, 11, 1, 12, 10, 11, 2, 12, 10, 11, 3, 12, 10, 11])
    assert ix.match() is not None and ix.draft(ix.match(), 1) == [3]
    assert ix.follower([12, 10, 11]) is None
    assert ix.supported(ix.match(), 4) == 0
    assert ix.offer() is None and ix.propose_supported(4) == ([], [])
    assert ix.propose(1)[0] == [3]                             # the plain copy (forced --lookup K) still drafts


def test_the_field_after_a_record_s_key_is_supported_up_to_the_varying_token():
    # "10 11 X 12 13": after 12 the statistics agree on 13 and then on 10 11; X varies again
    seq = [10, 11, 1, 12, 13, 10, 11, 2, 12, 13, 10, 11, 3, 12]
    ix = index_of(seq)
    assert ix.draft(ix.match(), 5) == [13, 10, 11, 3, 12]
    assert ix.supported(ix.match(), 5) == 3
    toks, scores = ix.propose_supported(5)
    assert toks == [13, 10, 11] and scores == ix.scores(ix.match(), 3)


def test_a_repeated_line_is_supported_past_the_end_of_the_text():
    ix = index_of([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])
    assert ix.propose_supported(7)[0] == [7, 8, 5, 6, 7, 8, 5]
    assert ix.offer() == ix.match()


def test_short_keys_need_two_samples_and_a_majority():
    # unigram 9 followed once by 2: one sample is not enough for n = 1 (llama.cpp: 2)
    assert index_of([1, 9, 2, 7, 9]).match() is not None
    assert index_of([1, 9, 2, 7, 9]).offer() is None
    # twice by 2: 2 of 2 > 66 %
    ix = index_of([1, 9, 2, 5, 9, 2, 7, 9])
    assert ix.follower([7, 9]) == 2 and ix.supported(ix.match(), 1) == 1
    # 2, 2, 3: 2 of 3 = 66.7 % > 66 %; 2, 3, 3, 2 (a tie): nothing
    assert index_of([9, 2, 9, 2, 9, 3, 8, 9]).follower([8, 9]) == 2
    assert index_of([9, 2, 9, 3, 9, 3, 9, 2, 8, 9]).follower([8, 9]) is None
    # a 3-gram seen once backs its follower (llama.cpp: 1 sample for n >= 3)
    assert index_of([4, 5, 6, 1, 4, 5, 6]).follower([4, 5, 6]) == 1


def test_the_longest_key_that_passes_decides():
    # (3, 4, 5) was followed by 8 once; the unigram 5 by 9 twice: the 3-gram (1 sample suffices) wins
    ix = index_of([5, 9, 5, 9, 3, 4, 5, 8, 3, 4, 5])
    assert ix.follower([3, 4, 5]) == 8
    # a 4-gram seen with followers 1 and 2 (a tie) gives way to its shorter keys
    ix = index_of([7, 3, 4, 5, 1, 7, 3, 4, 5, 2, 0, 4, 5, 2])
    assert ix.follower([7, 3, 4, 5]) == 2                        # (4, 5) -> 1, 2, 2
    # llama.cpp's rule lets the tie through (the latest of the two): ties=True
    ix = index_of([4, 5, 6, 1, 4, 5, 6, 2, 4, 5, 6])
    assert ix.follower([4, 5, 6]) is None and ix.follower([4, 5, 6], ties=True) == 2


def test_the_index_equals_a_brute_force_search():
    rng = random.Random(7)
    for trial in range(300):
        vocab = rng.choice([2, 3, 5, 20])
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        ix = index_of(seq)
        m = ix.match()
        want = brute_match(seq)
        assert (None if m is None else (m.pos, m.length)) == want, seq


# ------------------------------------------------------------------ the history (earlier requests' tokens)
def with_history(history, live) -> NgramIndex:
    """An index that served `history` and then a request that dropped it all: `live` follows it (however
    few tokens were dropped)."""
    ix = index_of(history)
    least, lookup.ARCHIVE_MIN = lookup.ARCHIVE_MIN, 0
    try:
        ix.restart(0)
    finally:
        lookup.ARCHIVE_MIN = least
    ix.sync(live)
    return ix


def brute_history_match(history, live, cands=lookup.CANDIDATES, past=lookup.HISTORY_CANDIDATES,
                        cap=lookup.MAX_MATCH, least=lookup.HISTORY_MIN_MATCH):
    """The rule with a history, by exhaustive search: the longest n (at most the request's own tokens)
    whose suffix n-gram occurred before; its `cands` latest occurrences in the request's own tokens (the
    n-gram in them) and `past` latest in the history's, a match measured past its key within the part
    it is in (and within the request's own tokens on their side); history occurrences only with a match
    of `least` or more; then as brute_match: measured length, votes (each part's apart), recency."""
    seq, base, L = history + live, len(history), len(history) + len(live)
    for n in range(min(lookup.N_MAX, len(live)), lookup.N_MIN - 1, -1):
        occ = [i + n for i in range(0, L - n) if seq[i:i + n] == seq[L - n:]]
        own = [p for p in occ if p - n >= base][-cands:]      # (a key across the boundary is neither's)
        old = [p for p in occ if p < base][-past:]
        pos = old + own
        if not pos:
            continue

        def votes(p):                                   # (the request's own and the history's apart)
            part = own if p >= base else old
            return sum(seq[q] == seq[p] for q in part)

        def measured(p):
            m, lo = n, (base if p >= base else 0)
            while m < cap and p - 1 - m >= lo and L - 1 - m >= base and seq[p - 1 - m] == seq[L - 1 - m]:
                m += 1
            return m
        ok = [p for p in pos if p >= base or measured(p) >= least]
        if ok:
            best = max(ok, key=lambda p: (measured(p), votes(p), p))
            return best, measured(best)
    return None


def test_a_repeated_question_is_copied_from_the_history():
    q = list(range(100, 120))                               # a 20-token question (>= HISTORY_MIN_MATCH)
    answer = [7, 8, 9, 10, 11, 12]
    ix = with_history(q + answer + [2], q)
    m = ix.match()
    assert m == Match(len(q), lookup.MAX_MATCH)
    assert with_history(q + answer, q[-lookup.HISTORY_MIN_MATCH + 1:]).match() is None   # (one token short)
    assert ix.draft(m, 10) == answer + [2]                  # (the copy stops at the history's end)
    assert ix.offer() == m and ix.propose_supported(4)[0] == answer[:4]   # (a history copy: backed whole)
    assert len(ix) == len(q) and ix.base == len(q) + len(answer) + 1


def test_a_short_match_in_the_history_is_no_repeat():
    template = [1, 2, 3, 4, 5]                              # a shared chat template's end: 5 tokens
    ix = with_history([50, 51] + template + [60, 61, 62], [70, 71] + template)
    assert ix.match() is None and ix.offer() is None
    assert ix.propose(3) == ([], [])
    # the same words in the request's own tokens are a match, however short
    ix.sync([70, 71] + template + [72] + template)
    assert ix.match() == Match(ix.base + len(template) + 2, len(template))


def test_the_request_s_own_statistics_ignore_the_history():
    # the history says (2, 3, 4) -> 9 six times; the request's own (2, 3, 4) -> 5 once backs 5 alone
    ix = with_history([2, 3, 4, 9] * 6, [2, 3, 4, 5, 6, 2, 3, 4])
    assert ix.match().pos >= ix.base and ix.draft(ix.match(), 1) == [5]
    assert ix.follower([2, 3, 4]) == 5
    assert ix.supported(ix.match(), 2) == 2


def test_a_copy_of_the_history_is_backed_whole_where_its_n_grams_disagree():
    # three earlier answers after the same template end [1, 2, 3, 4]: its followers 50, 60, 70 split
    # the vote, but the question before it (14 tokens, 18 with the template: 16 measured) matches the
    # second request's alone
    qs = [list(range(100 + 20 * i, 114 + 20 * i)) for i in range(3)]
    history = [t for i, q in enumerate(qs) for t in q + [1, 2, 3, 4] + [50 + 10 * i, 51, 52, 53]]
    ix = with_history(history, qs[1] + [1, 2, 3, 4])
    m = ix.match()
    assert m.pos < ix.base and m.length == lookup.MAX_MATCH and ix.draft(m, 4) == [60, 51, 52, 53]
    assert ix.supported(m, 6) == 6 and ix.offer() == m              # (the whole copy)
    assert ix.supported(Match(len(history) - 2, 16), 6) == 2        # (up to the history's end)


def test_a_match_being_copied_from_the_history_ends_at_its_end():
    q = list(range(100, 116))
    ix = with_history(q + [7, 8], q)
    assert ix.match() == Match(16, 16)
    ix.sync(q + [7])                                        # (the copy continues: the cached match moves on)
    assert ix.match() == Match(17, 16)
    ix.sync(q + [7, 8])                                     # the history has nothing after 8: no copy runs on
    m = ix.match()                                          # into the request's own tokens, nor any other match
    assert m is None or m.pos >= ix.base
    assert m is None


def test_restart_keeps_a_dropped_answer_and_cuts_a_re_closed_turn():
    ix = index_of([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    ix.restart(9)                                           # 3 dropped (< ARCHIVE_MIN): a chat's next turn
    assert ix.base == 0 and ix.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    ix.sync([1, 2, 3, 4, 5, 6, 7, 8, 9, 20])
    ix.restart(1)                                           # 9 dropped: kept before the new request
    assert ix.base == 10 and len(ix) == 0
    ix.sync([1, 30, 31])
    assert ix.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 1, 30, 31] and len(ix) == 3
    ix.restart(1, recall=False)                             # no recall: the history goes, the shared prefix stays
    assert ix.base == 0 and ix.tokens == [1]


def test_a_request_without_recall_becomes_no_one_s_history():
    ix = index_of([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    ix.restart(0, recall=False)                             # a request that may not recall
    ix.sync([40, 41, 42, 43, 44, 45, 46, 47, 48, 49])
    ix.restart(0, others=lambda: [(60, 61, 62)])            # the next one may: the pool's answers, not its
    assert ix.tokens == [60, 61, 62] and ix.base == 3
    ix.sync(list(range(70, 80)))
    ix.restart(0)                                           # and the one after keeps that one's as usual
    assert ix.tokens == [60, 61, 62] + list(range(70, 80)) and ix.base == 13


def test_the_history_is_bounded(monkeypatch):
    monkeypatch.setattr(lookup, "HISTORY_TOKENS", 40)
    ix = NgramIndex()
    for r in range(12):
        ix.restart(0)
        ix.sync([r] * 15)                                   # each request drops the last one's 15 tokens
        assert len(ix.tokens) - len(ix) <= 40 and len(ix) == 15
    assert ix.tokens[-15:] == [11] * 15 and ix.tokens[ix.base - 15:ix.base] == [10] * 15
    monkeypatch.setattr(lookup, "HISTORY_TOKENS", 0)
    ix.restart(0)
    assert ix.base == 0 and ix.tokens == []


def test_only_the_longest_map_indexes_the_history():
    """A history match measures HISTORY_MIN_MATCH (16) tokens, so its n_max-gram is a key and the n_max
    map finds every history match a shorter map would: the shorter maps skip the history's positions
    (a pool's engines take in each other's answers at every request; indexed in one map, not four),
    and the matches are the same (the brute-force search below searches every n)."""
    rng = random.Random(5)
    history = [rng.randrange(6) for _ in range(300)]
    ix = with_history(history, history[100:130] + history[:3])
    ix._catch()
    for n in range(lookup.N_MIN, lookup.N_MAX):
        assert all(p >= ix.base for p in ix._last[n].values()), n
        assert ix._held[n] == len(ix.tokens) and len(ix._prev[n]) == len(ix.tokens)
    assert any(p < ix.base for p in ix._last[lookup.N_MAX].values())
    ix.restart(0)                                           # again: the last request is history now too
    ix.sync(history[100:130])
    assert ix.match() == Match(330, lookup.MAX_MATCH)       # (the latest copy: the last request's)


def test_an_offer_that_needs_a_longer_match_still_finds_the_history():
    """The planner's `lookup_need` > 1 turns an offer down with one dict lookup when the sequence's last
    n-gram never occurred; the history's positions are in the n_max map alone, so a repeated question
    whose last n-grams occur only in the history (its end: the chat template) is still offered."""
    q, answer = list(range(100, 120)), [7, 8, 9, 10, 11, 12]
    ix = with_history(q + answer + [2], q)
    ix._catch()                                              # (every map caught up: the dict lookups)
    for need in (1, 2, 3, 4, 6):
        assert ix.offer(need) == Match(len(q), lookup.MAX_MATCH), need
    short = with_history(q + answer, q[-lookup.HISTORY_MIN_MATCH + 1:])      # (one token short: no repeat)
    short._catch()
    assert all(short.offer(need) is None for need in (1, 2, 4))


def test_the_index_with_a_history_equals_a_brute_force_search():
    rng = random.Random(21)
    for trial in range(400):
        vocab = rng.choice([2, 3, 5, 20])
        unit = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        history = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))] + unit + \
            [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        live = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))] + unit[:rng.randrange(1, len(unit) + 1)]
        ix = with_history(history, live)
        m = ix.match()
        assert (None if m is None else (m.pos, m.length)) == brute_history_match(history, live), (history, live)
        # an offer that needs a match of `need` tokens: turned down only where the match is shorter (or
        # unbacked), whether the maps are behind the tokens (a raw search) or caught up (dict lookups)
        for caught in (False, True):
            for need in (2, 3, 5):
                fresh = with_history(history, live)
                if caught:
                    fresh._catch()
                got = fresh.offer(need)
                assert got is None or got == m, (history, live, need)
                if m is not None and m.length >= need and ix.supported(m, 1):
                    assert got == m, (history, live, need, caught)


# ------------------------------------------------------------------ real contexts: exactness
PROMPTS = ["a a a a a", "The cat sat on the mat. The cat sat on the mat. The cat",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n", "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1,",
           "Natalia sold clips to 48 of her friends.", "12345 + 678 = ?"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("lookup-models")
    prop = Model(tiny_gguf(d, seed=0))
    plain = Model(tiny_gguf(d, seed=3, mask=False, role="verifier"))
    return prop, plain


@pytest.fixture(scope="module")
def references(models):
    return {(id(m), p): greedy_ar(m, m.tokenize(p), 48) for m in models for p in PROMPTS}


def run(engine, prompt, **kw):
    cycles = list(engine.generate(prompt, Settings(max_new=48, **kw)))
    return cycles, [t for c in cycles for t in c.committed]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 8, 12, 16])
def test_forced_lookups_of_every_length_equal_ar(models, references, k):
    prop, plain = models
    for model, mode, block in ((prop, "lossless", "auto"), (prop, "lossless", 4), (plain, "lossless", "auto"),
                               (plain, "lookup", "auto"), (prop, "lookup", "auto"), (prop, "spec", "auto")):
        e = Engine.load(model, draft=plain if model is prop else None, **F32)
        n_lookup = 0
        for p in PROMPTS:
            cycles, out = run(e, model.tokenize(p), mode=mode, block=block, lookup=k)
            assert out == references[(id(model), p)], (mode, block, k, p)
            for c in cycles:
                if c.plan.lookup:
                    n_lookup += 1
                    # k tokens, or what the request can still commit (engine._committable), or up to an
                    # end-of-generation token
                    n = len(c.proposed)
                    assert n == min(k, 48 - c.start - 1) or (n < k and model.is_eog(c.proposed[-1])), (k, c.start, n)
                    assert modes.label(c.plan) == f"L={n}"
                    assert c.source == ["lookup"] * len(c.proposed) and c.passes == {"target": 1}
                    assert c.committed[:c.n_accepted] == c.proposed[:c.n_accepted]
        assert n_lookup >= 5, (mode, block, k)


def test_auto_lookup_without_a_mask_token_is_the_default_and_exact(models, references):
    prop, plain = models
    e = Engine.load(plain, **F32)
    # (tiny random models: make the planner try lookup drafts, whatever the measured timings say)
    e.planner.explore, e.planner.explore_by_rate, e.planner.explore_budget = 0.5, False, float("inf")
    assert e.default_mode() == "lossless"
    n_drafts = 0
    for p in PROMPTS:
        gen = e.generate(plain.tokenize(p), Settings(mode=e.default_mode(), block="auto", max_new=48))
        cycles = list(gen)
        out = [t for c in cycles for t in c.committed]
        assert gen.request.auto and gen.request.lookup == "auto"
        assert out == references[(id(plain), p)], p
        # the planner's drafts are copies cut where the n-gram statistics stop backing them
        text = plain.tokenize(p)
        for c in cycles:
            if c.plan.lookup:
                ix = index_of(text)
                n_drafts += 1
                assert c.proposed == ix.draft(ix.match(), len(c.proposed))
                assert ix.supported(ix.match(), len(c.proposed)) == len(c.proposed)
            text = text + c.committed
    assert n_drafts >= 1                          # (the scripted test below drafts many)
    with pytest.raises(ModeError, match="--lookup 0"):
        e.generate(plain.tokenize("hi"), Settings(mode="lossless", lookup=0))
    with pytest.raises(ModeError, match="drafts nothing"):
        e.generate(plain.tokenize("hi"), Settings(mode="lookup", lookup=0))
    with pytest.raises(ModeError, match="lookup must be"):
        e.generate(plain.tokenize("hi"), Settings(mode="lossless", lookup=-2))


def test_the_lookup_index_catches_up_only_when_it_is_asked(models, references):
    """The engine indexes the committed tokens (the prompt's included) when the planner asks the index
    for a match (`Engine._offer`), not with the prefill: a request whose planner never asks (its lookup
    table has no plan: here every cycle quiet) never pays for its index. Exact either way."""
    prop, plain = models
    e = Engine.load(plain, **F32)
    asked = []
    offer = e._offer

    def counted():
        out = offer()
        asked.append((len(e.tokens), len(e.index)))
        return out
    e._offer = counted
    quiet = e.planner.quiet_cycle
    e.planner.quiet_cycle = lambda *a, **k: True          # every cycle an ar cycle of a quiet run
    for p in PROMPTS[:2]:
        _, out = run(e, plain.tokenize(p), mode="lossless", block="auto")
        assert out == references[(id(plain), p)]
    assert not asked and len(e.index) == 0
    e.planner.quiet_cycle = quiet
    e.planner.explore, e.planner.explore_by_rate, e.planner.explore_budget = 0.5, False, float("inf")
    for p in PROMPTS[:2]:
        _, out = run(e, plain.tokenize(p), mode="lossless", block="auto")
        assert out == references[(id(plain), p)]
    assert asked and all(n == k for n, k in asked)          # each offer saw every committed token indexed
    assert e.index.tokens[e.index.base:] == e.tokens[:len(e.index)]   # (its own part; before it, the history)


def test_a_conversation_s_next_turn_keeps_its_history_indexed(models):
    """The next request's prompt shares the last one's tokens but their end (a chat's next turn: history,
    the answer closed by the template, a new message): the index keeps what they share (NgramIndex.truncate) instead of indexing it all
    again, and ends as a fresh index of the committed tokens; the answer is ar's."""
    prop, _ = models
    e = Engine.load(prop, **F32)
    first = prop.tokenize(PROMPTS[2])
    run(e, first, mode="lossless", block="auto", lookup=4)
    history = list(e.tokens)
    assert len(e.index) > len(first)                       # (forced drafts: the index caught up)
    # (the template closes the answer its own way: the new prompt leaves the last tokens 3 from the end)
    turn = history[:-3] + prop.tokenize(" The dog")
    gen = e.generate(turn, Settings(max_new=24, mode="lossless", block="auto", lookup=4))
    assert e.index.tokens == history[:len(history) - 3]
    out = [t for c in gen for t in c.committed]
    assert out == greedy_ar(prop, turn, 24)
    fresh = index_of(e.tokens[:len(e.index)])
    fresh._catch(), e.index._catch()
    assert e.index._last == fresh._last and e.index._prev == fresh._prev


def test_a_repeated_request_copies_its_earlier_answer_and_equals_ar(models, references):
    """A request that asks again what the engine answered before (a repeated question to the server,
    a retried request) drafts that answer from the index's history: greedy ar's text, far fewer cycles
    than the same request that may not recall, and only committed tokens in the cache. Bench's runs
    never recall (each run alone: runner.make_runs)."""
    prop, plain = models
    for model, mode in ((prop, "lossless"), (plain, "lookup")):
        e = Engine.load(model, **F32)
        a, b = (model.tokenize(p) for p in PROMPTS[4:6])
        run(e, a, mode=mode, lookup=4)
        run(e, b, mode=mode, lookup=4)                     # another question in between
        again, out = run(e, a, mode=mode, lookup=4)
        assert out == references[(id(model), PROMPTS[4])]
        assert e.index.base > 0 and e.index.tokens[e.index.base:] == e.tokens[:len(e.index)]   # (its own: a prefix)
        with Context(model, **F32) as fresh:
            assert np.array_equal(next_logits(e.contexts["target"], e.tokens), next_logits(fresh, e.tokens))
        alone, out = run(e, a, mode=mode, lookup=4, recall=False)
        assert out == references[(id(model), PROMPTS[4])] and e.index.base == 0
        copied = sum(c.n_accepted for c in again if c.plan.lookup)
        assert copied >= 36 and len(again) <= 48 // 5 + 2, (mode, copied, len(again))   # (4 copied + 1 a cycle)
        assert len(alone) > 2 * len(again), (mode, len(alone), len(again))
    runs = make_runs(["lossless", "lookup", "ar"], max_new=8, block="auto", thetas=[0.05], tau=0.95, draft_k="auto",
                     lookup=["auto", 4])
    assert runs and all(r.settings.recall is False for r in runs)


def test_a_request_that_may_not_recall_is_not_recalled_by_the_next_one(models, references):
    """`recall: false` keeps a request's text out of the history of the next request on the same engine
    too, not only out of the pool's shared answers: the same question asked next with recall on drafts
    what a fresh engine drafts (its own prompt alone); asked once more, it copies the answer before it."""
    prop, _ = models
    a = prop.tokenize(PROMPTS[4])
    fresh, want = run(Engine.load(prop, **F32), a, mode="lossless", lookup=4)
    e = Engine.load(prop, **F32)
    run(e, a, mode="lossless", lookup=4, recall=False)
    after, out = run(e, a, mode="lossless", lookup=4)
    assert out == want == references[(id(prop), PROMPTS[4])]
    assert e.index.base == 0 and [c.plan for c in after] == [c.plan for c in fresh]
    again, out = run(e, a, mode="lossless", lookup=4)
    assert out == want and e.index.base > 0 and len(again) < len(fresh) // 2, (len(again), len(fresh))


def test_an_answer_the_planner_never_looked_up_still_goes_to_the_history(models):
    """The index catches up only when the planner asks it; a request it never asked (every cycle quiet)
    is taken in whole before the next request makes it history."""
    prop, _ = models
    e = Engine.load(prop, **F32)
    e.planner.quiet_cycle = lambda *a, **k: True          # (no offer asked: the index never caught up)
    a, b = (prop.tokenize(p) for p in PROMPTS[4:6])
    run(e, a, mode="lossless", block="auto")
    answered = list(e.tokens)
    assert len(e.index) == 0 and len(answered) > len(a)
    run(e, b, mode="lossless", block="auto")
    assert e.index.tokens[:e.index.base] == answered


def test_spec_takes_lookup_drafts_under_the_planner(models, references):
    """spec with auto widths: the planner may run lookup cycles (the draft model sits them out and
    catches up); the output is ar's."""
    prop, plain = models
    e = Engine.load(prop, draft=plain, **F32)
    # (tiny random models: make the planner try lookup drafts, whatever the measured timings say)
    e.planner.explore, e.planner.explore_by_rate, e.planner.explore_budget = 0.5, False, float("inf")
    kinds = set()
    for p in PROMPTS:
        cycles, out = run(e, prop.tokenize(p), mode="spec", draft_k="auto")
        assert out == references[(id(prop), p)], p
        kinds |= {c.plan.kind for c in cycles}
    assert "lookup" in kinds


def test_lookup_auto_with_fixed_widths_is_off(models):
    prop, _ = models
    e = Engine.load(prop, **F32)
    cycles, _ = run(e, prop.tokenize(PROMPTS[1]), mode="lossless", block=4)          # lookup "auto", block fixed
    assert not any(c.plan.lookup for c in cycles)


@pytest.mark.parametrize("j,block", [(1, 2), (2, 4), (3, 3), (5, 6), (8, 2)])
def test_filled_proposals_equal_ar_and_keep_the_cache_clean(models, references, j, block):
    """Filled proposals with the index's drafts (often right on repeated text) and with wrong drafts:
    output == ar, every cycle commits its lookup run before any MARS slot, and after every cycle the
    cache holds exactly the committed tokens (next-token logits == a fresh context's)."""
    prop, _ = models
    e = Engine.load(prop, **F32)
    ctx = e.contexts["target"]
    ix = NgramIndex()
    for wrong in (False, True):
        for p in PROMPTS[:3]:
            prompt = prop.tokenize(p)
            ctx.truncate(0)
            ctx.eval(prompt[:-1], rows=[])
            tokens = list(prompt)
            want = references[(id(prop), p)]
            n_full = 0
            while len(tokens) - len(prompt) < len(want):
                ix.reset(tokens)
                d, s = ix.propose(j)
                if not d or wrong:
                    d, s = [(tokens[-1] * 7 + 3 + i) % prop.n_vocab for i in range(j)], [0.5] * j
                c = rules.lossless_fill_cycle(ctx, tokens, d, s, block, e.mask_token, verify=None)
                assert c.committed[:min(c.n_accepted, j)] == d[:min(c.n_accepted, j)]
                assert c.plan.lookup == j and c.plan.block == block and (c.plan.verify == 0) == (c.n_accepted < j)
                n_full += c.n_accepted >= j
                tokens += c.committed
                if ctx.n_past >= len(tokens):
                    ctx.truncate(len(tokens) - 1)
                got = ctx.eval(tokens[ctx.n_past:])[0]
                ctx.truncate(len(tokens) - 1)
                fresh = Context(prop, **F32)
                ref = fresh.eval(tokens)[0]
                fresh.close()
                np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
            n = len(want)
            assert tokens[len(prompt):len(prompt) + n] == want, (j, block, p, wrong)
            if not wrong and p.startswith("a a"):
                assert n_full >= 1


@pytest.mark.parametrize("plan", [modes.Plan("lookup", lookup=3), modes.Plan("lookup", lookup=1),
                                  modes.Plan("lossless", 4, lookup=2), modes.Plan("lossless", 3, lookup=5)])
def test_passes_measured_equal_declared(models, plan):
    """modes.cycle_cost's widths (Mode.widths) are the passes lookup and filled cycles really make."""
    prop, _ = models
    e = Engine.load(prop, n_batch=512, **F32)
    prompt = prop.tokenize(PROMPTS[1])
    ctx = e.contexts["target"]
    ctx.eval(prompt[:-1], rows=[])
    tokens = list(prompt)
    ix = NgramIndex()
    for _ in range(12):
        ix.reset(tokens)
        pending = {"target": len(tokens) - ctx.n_past}
        before = ctx.n_decode
        c = modes.of(plan).cycle(e.contexts, tokens, plan, Settings(), e.mask_token,
                                 hooks=modes.Hooks(propose_lookup=ix.propose))
        if modes.proposes(c.plan):                        # (no match: a plain ar cycle)
            assert c.widths == modes.of(c.plan).widths(pending, c.plan), c.plan
            assert ctx.n_decode - before == len(c.widths["target"])
        tokens += c.committed


# ------------------------------------------------------------------ the planner
def test_the_planner_drafts_where_the_lookup_has_earned_it():
    curve = {1: 1e-3, 2: 1.9e-3, 4: 2.6e-3, 8: 4.9e-3, 16: 9e-3}        # SmolLM2 on 2 cores (the figures)
    pl = Planner(Costs({"target": curve}), explore=0.0)
    st = pl.stats_for(modes.LOOKUP)
    # a track record: long matches are accepted, one-token matches are not
    for _ in range(300):
        st.record([lookup.score(8 + j) for j in range(8)], 0, 8, 8)
        st.record([lookup.score(1)], 0, 1, 0)
    match_long, match_short = Match(10, 12), Match(10, 1)
    p_long = pl.plan("lookup", {"target": 1}, 0, 4000, lookup=lambda: match_long)
    assert p_long.kind == "lookup" and p_long.lookup >= 6, p_long
    assert pl.plan("lookup", {"target": 1}, 0, 4000, lookup=lambda: match_short) == modes.AR_PLAN
    assert pl.plan("lookup", {"target": 1}, 0, 4000, lookup=None) == modes.AR_PLAN
    # near the end of the context the draft is cut to what fits
    assert pl.plan("lookup", {"target": 1}, 0, 4, lookup=lambda: match_long).lookup == 3
    # a lookup track record of rejections: no lookup draft at any match length
    bad = Planner(Costs({"target": curve}), explore=0.0)
    for _ in range(300):
        for m in range(1, 17):                      # the first drafted slot is rejected, at every match length
            bad.stats_for(modes.LOOKUP).record([lookup.score(m)], 0, 1, 0)
    assert all(bad.plan("lookup", {"target": 1}, 0, 4000, lookup=lambda: Match(5, m)) == modes.AR_PLAN for m in (1, 4, 16))


def test_a_requests_lookup_drafts_start_short_and_grow_with_its_own_record():
    """Slow start: the engine-wide record says 8-token drafts pay, but a new request's first draft is at
    most planner.LOOKUP_START long; a draft accepted whole lets the next be twice as long as it was (short
    drafts accepted do not raise the cap), a rejection brings it back to what was accepted + 1, or to
    half the cap where that is more (planner.LOOKUP_KEEP: a request that climbed to long drafts on a
    copy keeps drafting after one miss, as at a repeated line's end). (A short answer that does not
    copy lost 10 % to two 9-token misses on SmolLM2 before.)"""
    from prove_local.planner import LOOKUP_START
    from prove_local.rules import Cycle
    curve = {1: 1e-3, 2: 1.2e-3, 4: 1.5e-3, 8: 2.2e-3, 16: 3.5e-3}       # cheap enough that short drafts pay too
    pl = Planner(Costs({"target": curve}), explore=0.0)
    for _ in range(300):
        pl.stats_for(modes.LOOKUP).record([lookup.score(8 + j) for j in range(8)], 0, 8, 8)
    long = lambda: Match(10, 12)
    assert pl.plan("lookup", {"target": 1}, 0, 4000, lookup=long).lookup >= 6     # outside a request: no cap

    def outcome(plan, accepted):
        k = plan.lookup
        c = Cycle(list(range(k)), [lookup.score(12 + j) for j in range(k)], None, list(range(accepted + 1)),
                  accepted, {"target": 1}, {"target": [1 + k]}, plan=plan)
        c.seconds, c.decode_seconds = 1e-3, {"target": 1e-3}
        pl.observe(c, "lookup", planned=False)

    pl.start_request()
    first = pl.plan("lookup", {"target": 1}, 0, 4000, lookup=long)
    assert first.kind == "lookup" and first.lookup == LOOKUP_START, first
    outcome(first, LOOKUP_START)                                  # accepted whole: may double
    second = pl.plan("lookup", {"target": 1}, 0, 4000, lookup=long)
    assert second.lookup == 2 * LOOKUP_START, second
    outcome(second, 1)                                            # one of four accepted: back to 2
    assert pl.plan("lookup", {"target": 1}, 0, 4000, lookup=long).lookup == 2
    for _ in range(4):                                            # one-token drafts accepted whole...
        outcome(rules.Plan("lookup", lookup=1), 1)
    assert pl.plan("lookup", {"target": 1}, 0, 4000, lookup=long).lookup == 2   # ...earn two tokens, not 16
    for _ in range(4):                                            # the climb: 2, 4, 8, the table's best, accepted whole
        plan = pl.plan("lookup", {"target": 1}, 0, 4000, lookup=long)
        outcome(plan, plan.lookup)
    top = pl.plan("lookup", {"target": 1}, 0, 4000, lookup=long)
    assert top.lookup > 8 and pl._lookup_cap == 16, top
    outcome(top, 0)                                               # a miss at its first token: half the cap stands
    assert pl.plan("lookup", {"target": 1}, 0, 4000, lookup=long).lookup == 8
    outcome(rules.Plan("lookup", lookup=8), 0)                    # and again: half again, down to the start
    assert pl.plan("lookup", {"target": 1}, 0, 4000, lookup=long).lookup == 4
    pl.start_request()                                            # the next request starts short again
    assert pl.plan("lookup", {"target": 1}, 0, 4000, lookup=long).lookup == LOOKUP_START


def test_the_planner_fills_mars_proposals_where_passes_are_flat():
    """On a flat curve (a GPU) with a good MARS proposer, short matches whose first two copied tokens
    hold (and the third does not): a bare lookup draft commits ~3 tokens a pass, a MARS block ~17 in
    two passes, and the copied pair in front of the masks ~19 in two: the planner fills."""
    flat = {1: 1e-3, 64: 1.05e-3}
    pl = Planner(Costs({"target": flat}), explore=0.0)
    st = pl.stats_for("lossless")
    for _ in range(300):
        st.record([0.99] * 16, 1, 16, 16)
        pl.stats_for(modes.LOOKUP).record([lookup.score(1), lookup.score(2), lookup.score(3)], 0, 3, 2)
    for _ in range(20):                                # replans: the current choice becomes a MARS block
        pl.plan("lossless", {"target": 1}, 16, 4000)
    assert pl.current["lossless"].kind == "lossless"
    plan, choose_verify = pl.plan_cycle("lossless", {"target": 1}, 16, 4000, lookup=lambda: Match(10, 1))
    assert modes.filled(plan) and plan.lookup == 2 and plan.block > 8 and choose_verify is not None, plan


# ------------------------------------------------------------------ sampling
class AlwaysAccept(Sampler):
    """A broken lookup verification (control): every drafted token is accepted."""

    def verify(self, p, q, drafted, start=None):
        return len(drafted), self.draw(p[len(drafted)]), [1.0] * len(drafted), False


def lookup_drafts(tokens):
    """A deterministic stand-in for the index on the fake vocabulary: the last two tokens again."""
    return [tokens[-2], tokens[-1]], [0.5, 0.6]


@pytest.mark.parametrize("kind,sampler_cls,ok", [("lookup", Sampler, True), ("fill", Sampler, True),
                                                 ("lookup", AlwaysAccept, False), ("fill", AlwaysAccept, False)])
def test_sampled_lookup_cycles_match_closed_form_ar(kind, sampler_cls, ok):
    """Three tokens with truncation and a sliding penalty window, against the enumerated ar distribution
    (tests/test_sampling.py's fakes): point-mass drafts keep the output distributed as ar's."""
    exact = exact_ar(fake_logits(ar_dist), PROMPT, FAKE_SETTINGS, 3)
    s = sampler_cls(np.random.default_rng(5), **FAKE_SETTINGS)
    if kind == "lookup":
        ctx = FakeContext(ar_dist, V)
        def cycle(t): return rules.lookup_cycle(ctx, t, *lookup_drafts(t), sampler=s)
    else:
        ctx = FakeContext(mars_dist, V)
        def cycle(t): return rules.lossless_fill_cycle(ctx, t, *lookup_drafts(t), 3, MASK, sampler=s)
    samples = [first_tokens(cycle, 3) for _ in range(2500 if ok else 800)]
    pval = gof(samples, exact)
    assert (pval > ALPHA) if ok else (pval < ALPHA), pval


def test_point_mass_rejection_closed_form():
    """Accept x with probability p(x); the residual is p without x: P(token) = p."""
    p = np.array([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]])
    q = point_mass([1], 4)
    assert np.asarray(q).tolist() == [[0, 1, 0, 0]]
    s = Sampler(np.random.default_rng(3), temperature=1.0)
    counts = np.zeros(4)
    for _ in range(20000):
        n, nxt, acc, res = s.verify(p, q, [1])
        assert acc == [0.3]
        counts[1 if n == 1 else nxt] += 1
    assert gof([i for i in range(4) for _ in range(int(counts[i]))], dict(enumerate(p[0]))) > ALPHA


@pytest.fixture(scope="module")
def embedded():
    from prove_local.loading import EMBEDDED_PROPOSER
    prop = Model(EMBEDDED_PROPOSER)
    opts = dict(n_ctx=256, n_threads=1, type_k="f32", type_v="f32")
    return prop, Context(prop, **opts), Context(prop, **opts)


@pytest.mark.parametrize("kind", ["lookup", "fill"])
def test_sampled_lookup_on_llama_cpp_matches_ar(embedded, kind):
    """The first two tokens of lookup / filled cycles on the embedded F32 proposer, drafts copied from a
    repetitive prompt, against the enumerated ar distribution of the same model."""
    from prove_local.chat import Conversation
    prop, ref_ctx, ctx = embedded
    prompt = Conversation(prop).prompt_tokens("Repeat: 3 + 4 = 7. 3 + 4 = 7. 3 + 4 = 7. 3 + 4 =")
    settings = dict(temperature=0.8, **TRUNC)
    exact = exact_pairs(ref_ctx, prompt, settings)
    s = Sampler(np.random.default_rng(99), **settings)
    ix = NgramIndex()
    ctx.truncate(0)

    def drafts(tokens):
        ix.reset(tokens)
        d, sc = ix.propose(3)
        return (d, sc) if d else ([tokens[-1]] * 3, [0.5] * 3)

    if kind == "lookup":
        def cycle(t): return rules.lookup_cycle(ctx, t, *drafts(t), sampler=s)
    else:
        def cycle(t): return rules.lossless_fill_cycle(ctx, t, *drafts(t), 3, prop.mask_token, sampler=s)
    samples = [first_tokens(cycle, 2, prompt) for _ in range(500)]
    pval = min(gof(samples, exact), *(gof([x[i] for x in samples], marginal(exact, i)) for i in (0, 1)))
    assert pval > ALPHA, pval


def test_seeded_forced_lookup_reproduces(models):
    prop, _ = models
    e = Engine.load(prop, **F32)
    prompt = prop.tokenize(PROMPTS[1])
    kw = dict(mode="lossless", block=4, lookup=3, temperature=0.9, seed=1234, max_new=40)
    a = [t for c in e.generate(prompt, Settings(**kw)) for t in c.committed]
    b = [t for c in e.generate(prompt, Settings(**kw)) for t in c.committed]
    assert a == b


# ------------------------------------------------------------------ front ends
def test_draft_counts_by_source():
    mk = lambda plan, prop, n, src=None: rules.Cycle(prop, [0.5] * len(prop), None, prop[:n] + [0], n,  # noqa: E731
                                                     {"target": 1}, plan=plan, source=src,
                                                     gate=[True] * n + [False] * (n < len(prop)))
    cycles = [mk(modes.Plan("lookup", lookup=3), [1, 2, 3], 2, ["lookup"] * 3),
              mk(modes.Plan("lossless", 2), [4, 5], 1),                               # source from the table
              mk(modes.Plan("lossless", 2, verify=2, lookup=1), [6, 7, 8], 3, ["lookup", "mask", "mask"]),
              mk(modes.AR_PLAN, [9], 1)]
    # slot 1 of a MARS block (the first "mask" slot, also after a filled proposal's lookup tokens) is
    # the model's own token, not a draft
    d = modes.draft_counts(cycles)
    assert d == {"lookup": (4, 3), "mask": (2, 1)} and (d.drafted, d.accepted) == (6, 4)
    assert d.n_drafts == 3 and d.accepted_by_pos == {0: 2, 1: 2}
    from prove_local.ui import view
    rows = view.inspect_cycle(cycles[0], "lossless")
    assert [r.source for r in rows[:3]] == ["lookup"] * 3 and "copied by lookup" in rows[0].verdict
    assert rows[2].status == "dropped" and "copied by lookup" in rows[2].verdict
    html = view.inspector_html(cycles[0], rows, "lossless", theta=0.05, tau=0.95)
    assert ">source<" in html and 'class="tok c0 lk"' in html and "lookup draft" in html
    spans = view.AnswerView(type("M", (), {"piece": staticmethod(lambda t: b"x")})())
    spans.add(cycles[0])
    assert [s.kind for s in spans.spans] == ["lookup", "fix"]


def test_cli_json_reports_lookup_drafts(models, tmp_path):
    import json
    import subprocess
    import sys
    _, plain = models
    r = subprocess.run([sys.executable, "-m", "prove_local.cli", "run", str(plain.path), "--raw", "-p", PROMPTS[1],
                        "-n", "24", "--lookup", "4", "--json", "--ctx", "256", "--threads", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mode"] == "lossless" and out["settings"]["lookup"] == 4
    assert out["drafts"]["lookup"]["drafted"] >= out["drafts"]["lookup"]["accepted"] >= 0
    assert any(k.startswith("L=") for k in out["widths"]) and "drafts by lookup only" in r.stderr
    bad = subprocess.run([sys.executable, "-m", "prove_local.cli", "run", str(plain.path), "-p", "x", "--lookup", "-1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--lookup" in bad.stderr


def test_bench_runs_per_lookup_value_and_drafts_by_source(models, tmp_path):
    import json
    from prove_local.bench.runner import make_runs
    from prove_local.cli import main
    runs = make_runs(["ar", "lossless", "lookup"], max_new=8, block="auto", thetas=[0.05], tau=0.95, draft_k="auto",
                     lookup=["auto", 0])
    assert [r.name for r in runs] == ["ar", "lossless@Lauto", "lossless@L0", "lookup"]
    assert [r.settings.lookup for r in runs[1:]] == ["auto", 0, "auto"]
    prop, _ = models
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    out = tmp_path / "out"
    assert main(["bench", "--proposer", str(prop.path), "--modes", "ar,lossless", "--lookup", "4,0", "--block", "3",
                 "--data", str(data), "--max-new", "16", "--threads", "1", "--ctx", "256", "--kv-type", "f32",
                 "--warmup", "0", "--no-pass-cost", "--no-plots", "-q", "--raw", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    m = res["modes"]
    assert set(m) == {"ar", "lossless@L4", "lossless@L0"} and res["settings"]["lookup"] == "4,0"
    assert m["lossless@L4"]["exact_match_vs_ar"] == 1.0 and m["lossless@L0"]["exact_match_vs_ar"] == 1.0
    assert m["lossless@L4"]["drafts"]["lookup"]["drafted"] > 0 and "lookup" not in m["lossless@L0"]["drafts"]
    assert m["lossless@L4"]["lookup"] == 4 and "lookup " in (out / "summary.md").read_text()
    lines = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    assert any(c["source"] and "lookup" in c["source"] for x in lines for c in x["cycles"])
    assert main(["bench", "--out", str(out), "--report-only", "--no-plots"]) == 0
    assert json.loads((out / "results.json").read_text())["modes"]["lossless@L4"]["drafts"] == m["lossless@L4"]["drafts"]


# ------------------------------------------------------------------ what the planner is offered (scripted world)
def records(prefix):
    """Records "10 11 X 12": X = 13 + the record's index, a field that never repeats; 10, 11 and 12 do."""
    t = prefix[-1]
    nxt = {10: 11, 12: 10}.get(t, 12 if t >= 13 else 13 + prefix.count(11) - 1)
    return fakes.onehot(fakes.V, nxt)


def test_the_planner_is_offered_only_what_the_statistics_back():
    """On records whose one field never repeats, the planner's lookup drafts (auto) hold only the
    record's fixed tokens; the plain copy (--lookup 4) drafts the previous record's field and loses it."""
    prompt = [10, 11, 13, 12, 10, 11, 14, 12, 10, 11, 15, 12]      # (12, 10, 11) seen twice, two fields
    want = list(prompt)
    for _ in range(40):
        want.append(int(np.argmax(records(want))))
    e = Engine({"target": FakeContext(records, fakes.V)}, is_eog=lambda t: t == fakes.EOS, mask_token=None,
               n_ctx=256, block_size=4)
    s = Settings(mode="lossless", block="auto", lookup="auto", max_new=40)
    # flat passes: drafts pay (set before prepare, which makes the first plans with the costs it finds)
    e.planner.costs = Costs({"target": {1: 1e-3, 64: 1.1e-3}})
    e.planner.explore = 0.0
    e.prepare(s)
    cycles = list(e.generate(prompt, s))
    assert [t for c in cycles for t in c.committed] == want[len(prompt):]
    drafted = [t for c in cycles if c.plan.lookup for t in c.proposed]
    assert len([c for c in cycles if c.plan.lookup]) >= 5
    assert drafted and set(drafted) <= {10, 11, 12}, drafted
    forced = list(e.generate(prompt, Settings(mode="lossless", lookup=4, max_new=40)))
    assert any(t >= 13 for c in forced if c.plan.lookup for t in c.proposed)
    assert [t for c in forced for t in c.committed] == want[len(prompt):]


def test_a_request_that_does_not_copy_stops_drafting_at_match_lengths_it_has_not_tried():
    """The engine-wide record says lookup slots are accepted ~90 % of the time at every match length;
    this request's drafts at short matches (1..3, three score bins) are rejected. Its record, pooled
    over the bins, scales the engine-wide prior down, so a long match (a bin it never tried) gets no
    draft either; a request whose drafts are accepted keeps drafting there."""
    from prove_local.rules import Cycle
    curve = {1: 1e-3, 2: 1.58e-3, 4: 2.7e-3, 8: 4.6e-3, 16: 9e-3}       # SmolLM2 Q4_1, 2 threads (calibrated)
    pl = Planner(Costs({"target": curve}), explore=0.0)
    for _ in range(300):
        for m in range(1, 17):
            pl.stats_for(modes.LOOKUP).record([lookup.score(m + j) for j in range(2)], 0, 2,
                                              2 if m % 10 else 1)       # ~90 %+ of slots accepted
    at = lambda m: (lambda: Match(5, m))

    def outcome(m, k, accepted):
        plan = modes.Plan("lookup", lookup=k)
        c = Cycle(list(range(k)), [lookup.score(m + j) for j in range(k)], None, list(range(accepted + 1)),
                  accepted, {"target": 1}, {"target": [1 + k]}, plan=plan)
        c.seconds, c.decode_seconds = 1e-3, {"target": 1e-3}
        pl.observe(c, "lookup", planned=False)

    pl.start_request()
    assert pl.plan("lookup", {"target": 1}, 0, 4000, lookup=at(6)).kind == "lookup"
    for m in (1, 2, 3, 1, 2, 3):                  # six one-token drafts rejected, in three bins
        outcome(m, 1, 0)
    assert pl.plan("lookup", {"target": 1}, 0, 4000, lookup=at(6)) == modes.AR_PLAN
    pl.start_request()                            # a request whose drafts hold
    for m in (1, 2, 3, 1, 2, 3):
        outcome(m, 1, 1)
    assert pl.plan("lookup", {"target": 1}, 0, 4000, lookup=at(6)).kind == "lookup"


def loop_world(eos_after: int | None):
    """A text that loops 1..8 (after `eos_after`, the end of generation, then the loop goes on)."""
    def world(prefix):
        t = prefix[-1]
        if t == eos_after:
            return fakes.onehot(fakes.V, fakes.EOS)
        return fakes.onehot(fakes.V, 1 if t in (8, fakes.EOS) or t > 8 else t + 1)
    return world


def test_lookup_drafts_stop_at_the_end_of_generation_and_at_max_new():
    """Nothing after an end-of-generation token, nor past max_new, can be committed: a forced 8-token
    lookup draft that copies the prompt's "4 5 <eos> 6 7 8 1 2" is cut after <eos>, and near the end of
    a request no draft is longer than the tokens left less one (the cycle adds the model's own token).
    Output = the world's greedy text in both."""
    prompt = [1, 2, 3, 4, 5, fakes.EOS, 6, 7, 8, 1, 2, 3]
    e = Engine({"target": FakeContext(loop_world(5), fakes.V)}, is_eog=lambda t: t == fakes.EOS, mask_token=None,
               n_ctx=256, block_size=4)
    cycles = list(e.generate(prompt, Settings(mode="lossless", lookup=8, max_new=20)))
    assert [c.proposed for c in cycles] == [[4, 5, fakes.EOS]]
    assert [t for c in cycles for t in c.committed] == [4, 5, fakes.EOS] and cycles[-1].stop == "eog"
    e = Engine({"target": FakeContext(loop_world(None), fakes.V)}, is_eog=lambda t: t == fakes.EOS, mask_token=None,
               n_ctx=256, block_size=4)
    for max_new in (5, 10, 13):
        # (recall off: each request copies its own prompt, not the last one's answer: the history's
        # copies stop at its end, here a few tokens on)
        cycles = list(e.generate([1, 2, 3, 4, 5, 6, 7, 8] * 2, Settings(mode="lossless", lookup=16, max_new=max_new,
                                                                        recall=False)))
        assert [t for c in cycles for t in c.committed] == ([1, 2, 3, 4, 5, 6, 7, 8] * 3)[:max_new]
        assert [len(c.proposed) for c in cycles] == [max_new - 1], [modes.label(c.plan) for c in cycles]
