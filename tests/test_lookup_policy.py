"""The planner's lookup policy on text that does not copy (planner.py): a lookup draft among ar cycles
pays for the switch it causes (the one-token passes after a wider pass run slower), and the lookup
table costs little to keep. Fakes only: scripted cycles with scripted decode seconds, no timing."""
from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from prove_local.modes import LOOKUP, MODES
from prove_local.planner import SWITCH_AFTER, SWITCH_STEADY, Costs, Planner
from prove_local.rules import AR_PLAN, Cycle, Plan

ROLE = MODES["lossless"].roles[0]          # the model that proposes and verifies


def cycle(plan: Plan, decode: float, k: int = 0, accepted: int = 0) -> Cycle:
    n = max(1, k)
    return Cycle(proposed=[5] * n, p=[0.5] * n, q=None, committed=[5] * (accepted + 1), n_accepted=accepted,
                 widths={ROLE: [1 + k]}, decode_seconds={ROLE: decode}, seconds=decode, plan=plan)


def next_plan(pl: Planner, offer) -> Plan:
    """The next lossless cycle's plan as Engine.plan asks for it: a quiet cycle, else plan_cycle's."""
    if pl.quiet_cycle("lossless", 1, offer):
        return AR_PLAN
    return pl.plan_cycle("lossless", {ROLE: 1}, 4, 1000, "lossless", lookup=offer)[0]


def planner(curve=None, accept: float = 0.6) -> Planner:
    pl = Planner(Costs({ROLE: curve or {1: 1e-3, 2: 1.5e-3, 4: 2.5e-3, 16: 9e-3}}), explore=0.0)
    pl.overhead = {"ar": 0.0, LOOKUP: 0.0, (LOOKUP, 1): 0.0}
    pl._lookup_rates = lambda scores: np.full(len(scores), accept)       # every lookup slot: `accept`
    pl.start_request()
    return pl


def test_the_switch_cost_is_learned_from_the_ar_cycles_after_a_wider_pass():
    """ar passes cost 1 ms in a run of them and 1.5 ms right after a lookup verify (d = 1), 1.1 ms at d = 2:
    the switch costs 0.6 ms; ar cycles far from a wider pass are sampled, those right after it all seen."""
    pl = planner()
    assert pl.switch_cost() == 0.0                        # nothing measured yet
    for _ in range(40):
        pl.observe(cycle(Plan(LOOKUP, lookup=1), 1.5e-3, k=1), LOOKUP)
        for d in range(1, 3 * SWITCH_AFTER):
            pl.observe(cycle(AR_PLAN, {1: 1.5e-3, 2: 1.1e-3}.get(d, 1e-3)), "lossless")
    assert pl.switch_cost() == pytest.approx(0.6e-3, rel=1e-6)
    # a stalled pass moves the average by little
    pl.observe(cycle(Plan(LOOKUP, lookup=1), 1.5e-3, k=1), LOOKUP)
    pl.observe(cycle(AR_PLAN, 1.0), "lossless")
    assert pl.switch_cost() < 0.6e-3 + 3 * 1.5e-3 / 32


def test_a_mars_width_among_ar_cycles_is_priced_with_the_switch():
    """While ar is the choice, a MARS proposal's cycle among ar cycles pays the switch as a lookup draft
    does (the one-token passes after it run slower): each width's expected seconds include
    `switch_cost`, and its ceiling falls with them; once a MARS width is the choice its cycles follow
    one another, and no switch is added."""
    from prove_local.planner import Choice
    plain, switched = planner(), planner()
    for _ in range(40):                                   # switched: 0.5 ms more in the pass after a wider one
        switched.observe(cycle(Plan(LOOKUP, lookup=1), 1.5e-3, k=1), LOOKUP)
        for d in range(1, 3 * SWITCH_AFTER):
            switched.observe(cycle(AR_PLAN, 1.5e-3 if d == 1 else 1e-3), "lossless")
    sw = switched.switch_cost()
    assert sw == pytest.approx(0.5e-3, rel=1e-6)
    switched.costs.set_curve(ROLE, {1: 1e-3, 2: 1.5e-3, 4: 2.5e-3, 16: 9e-3})    # (the scale those passes moved, back)
    for pl in (plain, switched):
        pl.overhead = {"ar": 0.0}
        pl.stats_for("lossless").record([0.9] * 4, 1, 4, 3)
    a = plain.rates("lossless", {ROLE: 1}, 4)
    b = switched.rates("lossless", {ROLE: 1}, 4)
    assert b[0].seconds == pytest.approx(a[0].seconds)                  # ar: no switch
    for x, y in zip(a[1:], b[1:]):
        assert y.seconds == pytest.approx(x.seconds + sw) and y.ceiling < x.ceiling
    switched.current["lossless"] = Choice("lossless", 2, 1.0)            # a MARS width is the choice
    c = switched.rates("lossless", {ROLE: 1}, 4)
    assert [o.seconds for o in c] == pytest.approx([o.seconds for o in a])


def test_a_lookup_draft_that_only_pays_without_the_switch_is_not_drafted():
    """k = 1 at 60 % acceptance, t(2) = 1.5 t(1): 1.6 tokens for 1.5 passes beats ar (1.07x); with a
    switch of 0.2 ms after it, 1.6 tokens cost 1.7 passes (0.94x): the table has no plan."""
    free = planner()
    tab = free._lookup_table("lossless", "lossless", {ROLE: 1}, 0)
    assert tab.any and tab.rows[4] == Plan(LOOKUP, lookup=1)
    dear = planner()
    dear._after_wide = [[1e-3, 100], [1.2e-3, 100]] + [[1e-3, 100]] * (SWITCH_AFTER - 1)
    assert dear.switch_cost() == pytest.approx(0.2e-3)
    tab = dear._lookup_table("lossless", "lossless", {ROLE: 1}, 0)
    assert not tab.any and all(r is None for r in tab.rows)
    # the switch is a cost of leaving ar: a current choice that is not ar pays none
    dear.current["lossless"] = type("C", (), {"kind": "lossless", "rate": 1e3, "width": 2})()
    assert dear._lookup_table("lossless", "lossless", {ROLE: 1}, 0).any


def test_an_eager_refresh_reuses_the_costs_and_gives_the_same_table():
    """The first lookup cycles of a request recompute the table from its new acceptance record, at the
    costs of the table before it: the same plans as a full recomputation."""
    pl = planner(accept=0.9)
    full = pl._lookup_table("lossless", "lossless", {ROLE: 1}, 0)
    again = pl._lookup_table("lossless", "lossless", {ROLE: 1}, 0, costs=full.costs)
    assert again.rows == full.rows and np.array_equal(again.rates, full.rates)
    pl._lookup_rates = lambda scores: np.full(len(scores), 0.2)        # the request's drafts failed
    worse = pl._lookup_table("lossless", "lossless", {ROLE: 1}, 0, costs=full.costs)
    assert full.any and not worse.any


def test_a_missed_draft_refreshes_the_lookup_table_at_once_a_hit_waits():
    """In a request's first lookup cycles the table follows its own record: at once after a draft that
    missed (a text that does not copy stops drafting fast), after every LOOKUP_EAGER_EVERY-th otherwise."""
    from prove_local.lookup import Match
    from prove_local.planner import LOOKUP_EAGER_EVERY
    pl = planner(accept=0.9)
    offer = lambda: Match(pos=0, length=4)                                # noqa: E731
    plan = lambda: pl.plan_cycle("lossless", {ROLE: 1}, 0, 100, "lossless", lookup=offer)[0]   # noqa: E731
    assert plan() == Plan(LOOKUP, lookup=2)                              # (slow start: 2 tokens at first)
    first = pl._ltables["lossless"]
    for i in range(1, LOOKUP_EAGER_EVERY):
        pl.observe(cycle(Plan(LOOKUP, lookup=2), 1.5e-3, k=2, accepted=2), "lossless")
        plan()
        assert pl._ltables["lossless"] is first, i                       # hits: the same table
    pl.observe(cycle(Plan(LOOKUP, lookup=2), 1.5e-3, k=2, accepted=2), "lossless")
    plan()
    second = pl._ltables["lossless"]
    assert second is not first                                           # the 4th: made again
    pl.observe(cycle(Plan(LOOKUP, lookup=2), 1.5e-3, k=2, accepted=0), "lossless")
    plan()
    assert pl._ltables["lossless"] is not second                         # a miss: at once


def test_the_index_is_searched_only_for_match_lengths_the_planner_can_use():
    """offer(min_length): None at once unless the last min(min_length, 4) tokens occurred before; the
    planner asks for the shortest match length its table has a plan for (exploring: any)."""
    from prove_local.lookup import NgramIndex
    idx = NgramIndex()
    idx.sync([1, 2, 3, 4, 5, 9, 9, 3, 4, 5])          # 3 4 5 occurred before, 2 3 4 5 did not
    assert idx.offer() is not None and idx.offer().length == 3
    assert idx.offer(3) is not None and idx.offer(4) is None and idx.offer(16) is None
    idx.sync([1, 2, 3, 4, 5, 9, 9, 3, 4, 5, 6, 1, 2, 3, 4, 5])   # now 2 3 4 5 has: a match of 5
    assert idx.offer(16) is not None and idx.offer(16).length == 5
    pl = planner()
    pl._lookup_rates = lambda scores: scores          # a slot extending a match of m holds m/(m+1) of the time
    asked = []
    pl.plan_cycle("lossless", {ROLE: 1}, 0, 100, "lossless", lookup=lambda: asked.append(pl.lookup_need))
    tab = pl._ltables["lossless"]
    assert asked == [tab.min_match] and 1 < tab.min_match <= 16 and tab.rows[tab.min_match] is not None
    assert all(r is None for r in tab.rows[:tab.min_match])


def test_an_exploration_must_fit_the_regret_budget_before_it_runs():
    """A fresh planner has seen little decoding time: an exploration expected to lose more than
    explore_budget x that time is not run, however the draw falls; once enough time is seen it is."""
    from prove_local.planner import Choice
    pl = planner()
    pl.explore_by_rate = True
    pl._options["lossless"] = [Choice("ar", 1, 1000.0, 1.0, 1e-3), Choice("lossless", 2, 600.0, 1.8, 3e-3)]
    pl.rng.random = lambda: 0.0                              # every draw would explore
    ex = Plan("lossless", 2)
    assert not pl._worth_exploring(ex, "lossless", "lossless")      # expected loss 1.2 ms, budget 0
    pl.elapsed = 0.2                                          # 2 ms of budget
    assert pl._worth_exploring(ex, "lossless", "lossless")
    pl.regret = 1.5e-3                                        # most of it spent
    assert not pl._worth_exploring(ex, "lossless", "lossless")


def test_beside_other_requests_an_exploration_has_their_share_of_the_budget():
    """In a batched step an exploration holds up every request in it: beside 3 others an engine's
    budget is a quarter of explore_budget x its time, for the explorations and for the draws alike."""
    from prove_local.planner import Choice
    pl = planner()
    pl.explore_by_rate = True
    pl._options["lossless"] = [Choice("ar", 1, 1000.0, 1.0, 1e-3), Choice("lossless", 2, 600.0, 1.8, 3e-3)]
    pl.rng.random = lambda: 0.0
    ex = Plan("lossless", 2)
    pl.elapsed = 0.2                                          # alone: 2 ms of budget for a 1.2 ms loss
    assert pl._worth_exploring(ex, "lossless", "lossless") and pl._budget_left()
    pl.set_load({ROLE: 3}, 3)                                 # beside 3 others: 0.5 ms
    assert not pl._worth_exploring(ex, "lossless", "lossless")
    pl.regret = 0.6e-3
    assert not pl._budget_left()
    pl.elapsed, pl.regret = 0.8, 0.9e-3                       # 2 ms again, 0.9 spent: 0.9 + 1.2 > 2
    assert not pl._worth_exploring(ex, "lossless", "lossless") and pl._budget_left()
    pl.regret = 0.0
    assert pl._worth_exploring(ex, "lossless", "lossless")
    pl.set_load({}, 0)                                        # alone again
    assert pl._allowance() == pytest.approx(0.01 * 0.8)


def test_a_fresh_planner_prices_the_switch_from_the_cycles_after_the_prefill():
    """The prompt's prefill is a wider pass: the ar cycles right after it are the first switch records, and
    until runs of ar cycles are seen the calibrated t(1) stands for them, so a fresh engine prices the
    switch from its first request's second cycle on (a template that repeats offers a lookup at once)."""
    pl = planner()
    assert pl.switch_cost() == 0.0
    pl.observe(cycle(AR_PLAN, 1.5e-3), "lossless")          # d = 1 after the prefill (start_request)
    pl.observe(cycle(AR_PLAN, 1.2e-3), "lossless")          # d = 2
    assert pl._after_wide[0][1] == 0                         # no steady cycle yet
    assert pl.switch_cost() == pytest.approx(0.5e-3 + 0.2e-3)
    # runs of ar cycles are recorded every cycle until there are enough of them, then the measured mean counts
    for _ in range(SWITCH_AFTER - 2 + SWITCH_STEADY):
        pl.observe(cycle(AR_PLAN, 0.9e-3), "lossless")
    assert pl._after_wide[0][1] == SWITCH_STEADY
    assert pl.switch_cost() == pytest.approx(0.6e-3 + 0.3e-3 + 2 * 0.0)


def test_the_slow_passes_at_a_request_start_are_not_the_switch_once_the_request_has_switched():
    """Every request's first cycles run slow, in plain ar too (the embedded target: 2.5, 1.7, 1.15x a
    steady pass after the prefill, where a lookup verify later in a request costs the next pass 1.15x):
    the cycles after the prefill price the switch only until a wider pass of a request, from its
    SWITCH_AFTER-th cycle on, is followed by ar cycles; a wider pass in the first cycles is not recorded
    (its cost and the start's are one), nor are later requests' starts."""
    pl = planner()                                           # (start_request: the prefill was the wider pass)
    start = {1: 2.5e-3, 2: 1.7e-3, 3: 1.15e-3}
    pl.observe(cycle(AR_PLAN, start[1]), "lossless")          # cycle 0, d = 1 after the prefill
    assert pl.switch_cost() == pytest.approx(1.5e-3)          # the prior: t(1) = 1 ms until runs of ar are seen
    pl.observe(cycle(Plan(LOOKUP, lookup=1), 1.5e-3, k=1), "lossless")   # cycle 1: a lookup among the slow ones
    pl.observe(cycle(AR_PLAN, start[2]), "lossless")          # cycle 2, d = 1 after it: the start's, not recorded
    assert pl.switch_cost() == pytest.approx(1.5e-3)
    for _ in range(SWITCH_AFTER + SWITCH_STEADY):
        pl.observe(cycle(AR_PLAN, 1e-3), "lossless")
    pl.observe(cycle(Plan(LOOKUP, lookup=1), 1.5e-3, k=1), "lossless")   # later in the request
    pl.observe(cycle(AR_PLAN, 1.15e-3), "lossless")
    assert pl.switch_cost() == pytest.approx(0.15e-3)
    pl.start_request()                                       # the next request's start: the prior's records only
    for d in (1, 2, 3):
        pl.observe(cycle(AR_PLAN, start[d]), "lossless")
    assert pl.switch_cost() == pytest.approx(0.15e-3)
    assert pl._after_start[1][0] == pytest.approx(2.5e-3) and pl._after_start[1][1] == 2


def test_a_lookup_table_priced_before_the_switch_was_known_is_made_again():
    """k = 1 at 60 % acceptance, t(2) = 1.5 t(1): drafted while the switch is unknown; once the passes after
    a wider one are seen to cost 0.2 ms more, the next offer finds the table repriced and no plan."""
    from prove_local.lookup import Match
    pl = planner()
    pl._since_wide, pl._since_start = SWITCH_AFTER + 1, SWITCH_AFTER    # (later in a request: the start's passes are over)
    offer = lambda: Match(pos=0, length=4)                                # noqa: E731
    plan = lambda: pl.plan_cycle("lossless", {ROLE: 1}, 0, 100, "lossless", lookup=offer)[0]   # noqa: E731
    assert plan() == Plan(LOOKUP, lookup=1)
    made = pl._ltables["lossless"]
    assert made.switch == 0.0
    pl.observe(cycle(Plan(LOOKUP, lookup=1), 1.5e-3, k=1, accepted=1), "lossless")
    pl.observe(cycle(AR_PLAN, 1.2e-3), "lossless")          # the pass after it: 0.2 ms over t(1)
    assert pl.switch_cost() == pytest.approx(0.2e-3)
    assert plan() == AR_PLAN
    assert pl._ltables["lossless"] is not made and pl._ltables["lossless"].switch == pytest.approx(0.2e-3)


@pytest.mark.parametrize("host,accept,offers", [(0.0, 0.7, True), (0.2e-3, 0.7, True), (0.0, 0.05, True),
                                                (0.2e-3, 0.05, True), (0.0, 0.05, False), (0.2e-3, 0.05, False)])
def test_a_quiet_cycle_is_what_plan_cycle_would_have_planned(host, accept, offers, monkeypatch):
    """Engine.plan asks `quiet_cycle` first and runs ar without planning when it says so: the same
    scripted 600 cycles (offers that come and go, explorations drawn, replans, lookup drafts accepted or
    not) planned with and without asking it give the same plans and leave the random stream where it
    was; most cycles of a text that rarely copies never reach plan_cycle. `host`: each cycle's own host
    time, where 0.2 ms (a fifth of t(1)) makes the index's checks back off (Planner._host_bound).
    Where lookup drafts do not pay (`accept` 0.05: the table has no plan, a clear run), most quiet
    cycles are a lane's (Planner._grant): the engine neither plans nor observes them, and the plans,
    the random numbers drawn and the planner's books are those of the same quiet cycles without lanes;
    where they pay, the cycles of the index's back-off are a lane's (host-bound: `host` > 0);
    also without lookup (`offers` False: MARS explorations alone, the lanes start right after them)."""
    import prove_local.planner as P
    from prove_local.lookup import Match
    rng = np.random.default_rng(7)
    # the index's offer per cycle: mostly none; now and then a match of 2-9 tokens, a few in a row
    script = []
    while len(script) < 600:
        script += [None] * int(rng.integers(5, 60)) + [Match(pos=0, length=int(rng.integers(2, 10)))] * int(rng.integers(1, 4))
    accepted = rng.integers(0, 3, size=len(script))

    def drive(how: str):                  # "plain": plan_cycle alone; "quiet": quiet_cycle first; "lane": and lanes
        monkeypatch.setattr(P, "LANE", how == "lane")
        pl = planner(accept=accept)
        pl.explore = 0.05
        # (where drafts do not pay, every draw that finds a match explores: the lanes start and end around them)
        pl.explore_by_rate = accept > 0.5
        pl.rng = random.Random(11)
        drawn = []                        # every random number the planner drew, in order
        rnd = pl.rng.random
        pl.rng.random = lambda: drawn.append(rnd()) or drawn[-1]
        plans, quiet, i, lanes = [], 0, 0, 0
        waits = []
        pl._lookup_waits = lambda key: waits.append(pl._lookup_wait.get(key, 0) > 0) or type(pl)._lookup_waits(pl, key)

        def offer():                      # as NgramIndex.offer(lookup_need): no match shorter than its key
            m = script[i]
            return m if m is not None and m.length >= min(pl.lookup_need, 4) else None
        for i in range(len(script)):
            if pl.lane:                   # (as Engine.plan: a lane's cycle is ar, its seconds counted, not observed)
                pl.lane -= 1
                plans.append(AR_PLAN)
                pl.elapsed += 1e-3 + host
                quiet, lanes = quiet + 1, lanes + 1
                continue
            if how != "plain" and pl.quiet_cycle("lossless", 1, offer if offers else None):
                plan, quiet = AR_PLAN, quiet + 1
            else:
                plan, _ = pl.plan_cycle("lossless", {ROLE: 1}, 4, 1000, "lossless", lookup=offer if offers else None)
            plans.append(plan)
            if plan.kind == "ar":
                c = cycle(AR_PLAN, 1e-3)
            elif plan.kind == LOOKUP:
                k = plan.lookup
                c = cycle(plan, 1.2e-3 + 0.3e-3 * k, k=k, accepted=min(k, int(accepted[i])))
            else:                          # a MARS proposal (explored): two passes
                b = plan.block
                c = Cycle(proposed=[5] * b, p=[0.5] * b, q=[0.5] * b, committed=[5] * (1 + min(b - 1, int(accepted[i]))),
                          n_accepted=min(b - 1, int(accepted[i])), widths={ROLE: [b, b]},
                          decode_seconds={ROLE: 3e-3}, seconds=3e-3, plan=plan)
            c.seconds += host
            pl.observe(c, "lossless")
        if pl._lane is not None:
            pl._settle()                       # (the last lane's counters)
        summary = pl.summary()
        books = (pl.elapsed, pl.regret, pl._ar_seen, pl._since_start, pl._since_wide, dict(pl._quiet), summary,
                 dict(pl._lookup_wait), dict(pl._lookup_back),
                 [list(r) for r in pl._after_wide + pl._after_start])     # (the switch's records)
        return plans, quiet, drawn, sum(waits), lanes, books

    plain, none, draw_plain, waited, _, _ = drive("plain")
    slow, quiet, draw, _, no_lanes, books = drive("quiet")
    fast, quiet_fast, draw_fast, _, lanes, books_fast = drive("lane")
    assert none == 0 and no_lanes == 0 and fast == slow and quiet_fast == quiet
    # the same random numbers in the same order (the last lane drew ahead for cycles the script did not have)
    assert draw_fast[:len(draw)] == draw and len(draw_fast) - len(draw) < 128
    assert books_fast == books
    assert (waited > 0) == (host > 0 and offers)     # (the back-off's cycles were in the script)
    assert quiet > len(script) // 2                 # most cycles were quiet
    if accept > 0.5 or not offers:                   # (a clear run samples its ar cycles' costs less often than plan_cycle)
        assert slow == plain and draw == draw_plain
    if accept > 0.5:
        assert {"ar", LOOKUP} <= {p.kind for p in plain}   # the script did draft by lookup
        # where the table has plans, the index's back-off (host-bound cycles) is run in lanes
        assert (lanes > 0) == (host > 0)
    else:
        assert lanes > len(script) // 2             # most of them in lanes (neither planned nor observed)


def test_a_lane_leaves_the_switch_s_records_to_observe(monkeypatch):
    """The ar cycles right after a wider pass (within SWITCH_AFTER) are each recorded for the switch's
    price, and so are the first SWITCH_STEADY steady ones: no lane covers them (Planner._grant). A wider
    pass every 20 cycles among quiet ar cycles: the records, with lanes, are those of the same
    cycles each observed; most cycles are still a lane's."""
    import prove_local.planner as P

    def drive(lanes: bool):
        monkeypatch.setattr(P, "LANE", lanes)
        pl = planner()
        n_lane = 0
        for i in range(400):
            if i % 20 == 19:              # a wider pass (as where a replan changes the choice), the lane ended
                if pl._lane is not None:
                    pl._settle()
                pl.observe(cycle(Plan(LOOKUP, lookup=1), 1.5e-3, k=1, accepted=1), "lossless")
                continue
            if pl.lane:
                pl.lane -= 1
                pl.elapsed += 1e-3 + 1e-5 * (i % 7)
                n_lane += 1
                continue
            if not pl.quiet_cycle("lossless", 1, None):
                assert pl.plan_cycle("lossless", {ROLE: 1}, 4, 1000, "lossless")[0] == AR_PLAN
            pl.observe(cycle(AR_PLAN, 1e-3 + 1e-5 * (i % 7)), "lossless")
        if pl._lane is not None:
            pl._settle()
        return [list(r) for r in pl._after_wide + pl._after_start], pl.switch_cost(), pl.elapsed, n_lane, pl

    *books, none, _ = drive(False)
    *books_lane, n_lane, pl = drive(True)
    assert none == 0 and n_lane > 150
    assert books_lane == books
    # a cycle other than ar where a lane was granted ends it (not the engine's way: only a quiet cycle grants one)
    while not pl.lane:
        assert pl.quiet_cycle("lossless", 1, None) or pl.plan_cycle("lossless", {ROLE: 1}, 4, 1000)[0] == AR_PLAN
        pl.observe(cycle(AR_PLAN, 1e-3), "lossless")
    pl.observe(cycle(Plan(LOOKUP, lookup=1), 1.5e-3, k=1, accepted=1), "lossless")
    assert pl.lane == 0 and pl._since_wide == 1


def test_a_batched_load_that_moves_ends_a_lane_and_one_that_does_not_keeps_it():
    """A pool's engine hands its planner the others' load every few passes (Engine._load, Planner.set_load):
    a load within LOAD_TOLERANCE of the one priced leaves the prices, the quiet run and the lane as they
    are; another load is priced afresh, its first cycle replans, and the lane ends there with the cycles
    it ran counted (`_settle`)."""
    pl = planner()

    def lane():                            # quiet ar cycles until a lane is granted
        for _ in range(200):
            if pl.lane:
                return pl.lane
            if not pl.quiet_cycle("lossless", 1, None):
                assert pl.plan_cycle("lossless", {ROLE: 1}, 4, 1000)[0] == AR_PLAN
            pl.observe(cycle(AR_PLAN, 1e-3), "lossless")
        raise AssertionError("no lane granted")
    pl.set_load({ROLE: 4}, 4)
    n = lane()
    pl.lane -= 1                           # (one of its cycles run)
    seen = pl._ar_seen
    pl.set_load({ROLE: 5}, 5)              # within 25 %: kept
    assert pl.lane == n - 1 and pl._quiet
    pl.set_load({ROLE: 12}, 12)            # another load: the lane ends, its cycle counted, a replan next
    assert pl.lane == 0 and pl._lane is None and pl._ar_seen == seen + 1 and not pl._quiet


def test_one_early_miss_does_not_end_a_request_s_lookup_explorations(monkeypatch):
    """The request's own lookup record decides its plans, but explorations are what add to it: judged by
    it alone, one early miss (a 2-token draft accepted, then a 4-token one rejected at its first slot, as
    at a repeated line's end) put every draft under EXPLORE_FLOOR, and the request never explored again.
    Explorations go by the better of its record's rates and the engine-wide record's (EXPLORE_PRIOR);
    its plans still by its own."""
    import prove_local.planner as P
    from prove_local import lookup
    curve = {1: 1e-3, 2: 2.04e-3, 4: 3.9e-3, 8: 7.2e-3, 16: 12.8e-3, 32: 25e-3}   # (the embedded pair's shape)

    def request(prior: bool):
        monkeypatch.setattr(P, "EXPLORE_PRIOR", prior)
        pl = Planner(Costs({ROLE: curve}), explore=0.0)
        pl.overhead = {"ar": 0.0, LOOKUP: 0.0}
        for _ in range(300):                      # the engine-wide record: long matches copy
            pl.stats_for(LOOKUP).record([lookup.score(16 + j) for j in range(16)], 0, 16, 16)
        pl.start_request()
        for k, ok in ((2, 2), (4, 0)):
            c = Cycle(proposed=[5] * k, p=[lookup.score(16 + j) for j in range(k)], q=None, committed=[5] * (ok + 1),
                      n_accepted=ok, widths={ROLE: [1 + k]}, decode_seconds={ROLE: 3e-3}, seconds=3e-3,
                      plan=Plan(LOOKUP, lookup=k))
            pl.observe(c, "lossless")
        return pl._lookup_table("lossless", "lossless", {ROLE: 1}, 0)

    own, both = request(False), request(True)
    assert own.explore_min(P.EXPLORE_FLOOR) > P.MAX_MATCH          # its own 3 slots: nothing worth exploring
    assert both.explore_min(P.EXPLORE_FLOOR) <= P.MAX_MATCH        # the engine-wide record: worth exploring
    assert own.rows == both.rows                                     # (the plans are the request's own)


def test_a_quiet_run_whose_lookup_table_has_no_plan_checks_the_table_once():
    """Where the lookup table has no plan for any match (drafts do not pay), a quiet run's cycles need
    no table check after the first: nothing that could make it stale happens in an ar cycle. The check
    (`_table_stale`, ~3 us a cycle between the embedded pair's ~0.4 ms passes) comes back after each
    thing that can: a new request, a cycle other than ar, a new curve, another batched load."""
    from prove_local.lookup import Match
    pl = planner(accept=0.05)
    checks = []
    pl._table_stale = lambda *a: checks.append(1) or type(pl)._table_stale(pl, *a)
    asked = []

    def offer():
        asked.append(1)
        return Match(pos=0, length=16)               # (long enough for a table to be made for it)
    for _ in range(3):                                 # the table is made; quiet runs start
        assert next_plan(pl, offer).kind == "ar"
        pl.observe(cycle(AR_PLAN, 1e-3), "lossless")
    assert not pl._ltables["lossless"].any
    before = len(checks)
    asked.clear()
    for _ in range(40):
        assert next_plan(pl, offer) is AR_PLAN
        pl.observe(cycle(AR_PLAN, 1e-3), "lossless")
    assert len(checks) - before <= 1 and not asked    # (at most the quiet run's first cycle)

    def checked_again() -> bool:
        n = len(checks)
        assert next_plan(pl, offer).kind == "ar"
        pl.observe(cycle(AR_PLAN, 1e-3), "lossless")
        return len(checks) > n

    def settles() -> bool:                            # checked again, then quiet again within 3 cycles
        return checked_again() and not all(checked_again() for _ in range(3))
    assert not checked_again()
    pl.start_request()
    assert settles()
    pl.observe(cycle(Plan(LOOKUP, lookup=2), 2e-3, k=2, accepted=0), "lossless")
    assert settles()
    pl.set_curve(ROLE, {1: 1e-3, 2: 1.5e-3, 4: 2.5e-3, 16: 9e-3})
    assert settles()
    assert not asked                                  # (a table with no plan has no use for a match)
    n = len(checks)
    pl.set_load({ROLE: 3}, 3)                         # (beside 3 others a 16-token match may be drafted)
    next_plan(pl, offer)
    assert len(checks) > n


def test_plans_longer_than_the_draft_cap_that_do_not_pay_cut_to_it_leave_a_quiet_run_quiet():
    """The slow start caps a request's first lookup drafts at LOOKUP_START tokens. Where the table's
    plans are all longer drafts (t(n) nearly flat past 3 tokens: 15 tokens pay, 2 do not), a match
    they would take is no plan under the cap: the quiet run stays quiet (no plan_cycle, which came out
    `ar` after a full plan, ~90 us a time on the embedded pair, at every match). Once an accepted
    draft lifts the cap, the same match gets its draft."""
    from prove_local.lookup import Match
    from prove_local.planner import LOOKUP_START
    pl = planner(curve={1: 1e-3, 2: 2e-3, 3: 3e-3, 16: 4e-3}, accept=0.9)
    planned = []
    pl.plan_cycle = lambda *a, **k: planned.append(1) or type(pl).plan_cycle(pl, *a, **k)

    def offer():
        return Match(pos=0, length=16)
    for _ in range(3):                                 # the table is made; quiet runs start
        assert next_plan(pl, offer).kind == "ar"
        pl.observe(cycle(AR_PLAN, 1e-3), "lossless")
    tab = pl._ltables["lossless"]
    assert tab.any and tab.rows[16].lookup > LOOKUP_START            # long drafts pay,
    assert not tab.capped(LOOKUP_START, pl.lookup_margin).any         # the capped ones do not
    planned.clear()
    for _ in range(40):
        assert next_plan(pl, offer) is AR_PLAN
        pl.observe(cycle(AR_PLAN, 1e-3), "lossless")
    assert not planned
    pl.observe(cycle(Plan(LOOKUP, lookup=8), 4e-3, k=8, accepted=8), "lossless")   # (an accepted draft: cap 16)
    plan = next_plan(pl, offer)
    assert plan.kind == LOOKUP and plan.lookup > LOOKUP_START


def test_a_request_whose_drafts_are_accepted_whole_climbs_to_the_drafts_that_pay():
    """Where only long drafts pay (a pass of n tokens costs n one-token passes up to 9, then little more),
    the slow start's capped drafts pay at no cap below 16. A draft accepted whole starts a climb: at each
    match the table has a (longer) plan for, the capped draft runs as a probe, an exploration charged to
    the regret budget, and doubles the cap when it is accepted whole, until the table's own draft fits.
    A miss ends the climb; a spent budget stops the probes, and so does one without room for the probe's
    expected loss (Planner._lookup_loss_fits: a fresh engine)."""
    from prove_local.lookup import Match
    from prove_local.planner import LOOKUP_START
    pl = planner(curve={1: 1e-3, 9: 9.5e-3, 16: 10e-3}, accept=0.99)

    def offer():
        return Match(pos=0, length=16)
    for _ in range(3):
        assert next_plan(pl, offer).kind == "ar"
        pl.observe(cycle(AR_PLAN, 1e-3), "lossless")
    tab = pl._ltables["lossless"]
    assert tab.rows[16].lookup > 8 and not any(tab.capped(c, pl.lookup_margin).any for c in (2, 4, 8))
    pl.observe(cycle(Plan(LOOKUP, lookup=LOOKUP_START), 3e-3, k=2, accepted=2), "lossless")   # (an exploration's)
    fresh = copy.deepcopy(pl)
    # a capped probe is expected to lose here (a 4-token draft: ~5 ms for at most 5 tokens that ar makes in
    # 5): in an engine that has seen ~6 ms, the budget (1 % of that) has no room for it
    assert next_plan(fresh, offer) is AR_PLAN and fresh.regret == 0.0
    pl.elapsed += 1.0                     # (an engine that has decoded for a second: room for the probes)
    for cap in (4, 8):
        plan = next_plan(pl, offer)
        assert plan == Plan(LOOKUP, lookup=cap) and pl._displaced is not None    # a probe, charged as an exploration
        pl.observe(cycle(plan, cap * 1e-3, k=cap, accepted=cap), "lossless")
    assert next_plan(pl, offer) == tab.rows[16]                                   # the table's own draft
    pl.observe(cycle(Plan(LOOKUP, lookup=8), 8e-3, k=8, accepted=3), "lossless")  # a miss: the cap falls to 4
    assert next_plan(pl, offer) is AR_PLAN
    pl.observe(cycle(Plan(LOOKUP, lookup=4), 4e-3, k=4, accepted=4), "lossless")  # accepted whole: climbing again,
    pl.regret = 1.0                                                               # but the budget is spent
    assert next_plan(pl, offer) is AR_PLAN


def test_a_clear_run_samples_its_ar_cycles_less_often():
    """An ar cycle's cost is recorded 1 in AR_SAMPLE cycles (its bookkeeping ran at ~55 us between the
    embedded pair's ~0.45 ms passes, from cold caches); in a clear run, where no lookup or MARS plan is in
    reach, 1 in AR_SAMPLE_CLEAR."""
    from prove_local.lookup import Match
    from prove_local.planner import AR_SAMPLE, AR_SAMPLE_CLEAR

    def recorded(offer) -> int:
        pl = planner(accept=0.05)                  # (no lookup draft pays: the table has no plan)
        for _ in range(8):
            next_plan(pl, offer)
            pl.observe(cycle(AR_PLAN, 1e-3), "lossless")
        seen = []
        pl.costs.observe = lambda *a, **k: seen.append(1) or Costs.observe(pl.costs, *a, **k)
        for _ in range(320):
            next_plan(pl, offer)
            pl.observe(cycle(AR_PLAN, 1e-3), "lossless")
        return len(seen)
    assert AR_SAMPLE_CLEAR > AR_SAMPLE
    assert recorded(lambda: Match(pos=0, length=16)) == 320 // AR_SAMPLE_CLEAR       # a clear run
    assert recorded(None) == 320 // AR_SAMPLE                                       # no lookup offered: none


def test_an_exploration_draw_that_does_not_explore_is_charged_to_the_regret_budget():
    """A draw hands the cycle to plan_cycle (the index caught up and asked, the table read), ~90-180 us of
    host time between the embedded pair's ~0.45 ms passes. When it does not explore, the cycle's host
    time beyond an ar cycle's is regret, so that the budget bounds what exploring costs, draws included;
    a cycle without a draw is charged nothing. In a clear run (no plan) whose budget is spent, or
    whose index offers no match worth exploring (Planner._explorable), a draw stays quiet, and is
    charged: it could only come out ar."""
    from prove_local.lookup import Match
    # (t(n) = 1.25 n t(1) past n = 1: no lookup draft could beat ar, whatever its acceptance, so no
    # exploration is carried out)
    pl = planner(curve={1: 1e-3, 2: 2.5e-3, 4: 5e-3, 16: 20e-3}, accept=0.05)
    pl.overhead["ar"] = 0.1e-3                                 # an ar cycle's own host time
    offer = lambda: Match(pos=0, length=16)                   # noqa: E731
    for _ in range(4):                                          # the table (no plan) is made: a clear run
        next_plan(pl, offer)
        pl.observe(cycle(AR_PLAN, 1e-3), "lossless")
    assert pl._clear
    pl.elapsed = 1.0                                            # 10 ms of budget
    pl.explore = 1.0                                            # (every cycle draws)
    planned = []
    pl.plan_cycle = lambda *a, **k: planned.append(1) or type(pl).plan_cycle(pl, *a, **k)
    assert next_plan(pl, offer) is AR_PLAN and not planned      # no draft could beat ar: nothing worth exploring
    c = cycle(AR_PLAN, 1e-3)
    c.seconds += 0.4e-3                                         # its host time: 0.3 ms over an ar cycle's
    before = pl.regret
    pl.observe(c, "lossless")
    assert pl.regret - before == pytest.approx(0.3e-3)
    pl.explore = 0.0
    assert next_plan(pl, offer) is AR_PLAN
    before = pl.regret
    pl.observe(c, "lossless")                                   # no draw: no charge
    assert pl.regret == before
    for _ in range(3):                                          # (quiet again: the clear run back)
        next_plan(pl, offer)
        pl.observe(cycle(AR_PLAN, 1e-3), "lossless")
    assert pl._clear
    pl.explore, pl.regret = 1.0, 1.0                            # the budget spent
    planned.clear()
    for _ in range(10):
        assert next_plan(pl, offer) is AR_PLAN
        pl.observe(cycle(AR_PLAN, 1e-3), "lossless")
    assert not planned
    # a flatter curve: a one-token draft at ~0.83x ar is worth exploring, not planning (a clear run); a draw reaches
    # plan_cycle where the index offers a match, and stays quiet, charged, where it offers none
    pl = planner(curve={1: 1e-3, 2: 1.4e-3, 16: 9e-3}, accept=0.05)
    pl.overhead["ar"] = 0.1e-3
    got = [Match(pos=0, length=16)]
    for _ in range(4):
        next_plan(pl, lambda: got[0])
        pl.observe(cycle(AR_PLAN, 1e-3), "lossless")
    assert pl._clear and pl._ltables["lossless"].explore_min(0.8) <= 16
    pl.elapsed, pl.explore = 1.0, 1.0
    pl.explore_by_rate = True
    pl.plan_cycle = lambda *a, **k: planned.append(1) or type(pl).plan_cycle(pl, *a, **k)
    got[0] = None
    assert next_plan(pl, lambda: got[0]) is AR_PLAN and not planned and pl._clear
    before = pl.regret
    pl.observe(c, "lossless")
    assert pl.regret - before == pytest.approx(0.3e-3)
    got[0] = Match(pos=0, length=16)
    next_plan(pl, lambda: got[0])
    assert planned


def test_a_stale_lookup_table_is_made_again_only_once_a_match_may_use_it():
    """The lookup table (~0.4 ms of numpy between the embedded pair's ~0.5 ms passes) is made again
    only when it may be read: a replan that keeps `ar` re-compares the same rows with the new rate
    (no numpy work); any other staleness (here: other pending counts) waits for the first offer at
    most one token shorter than the shortest match the stale table planned."""
    from prove_local.lookup import Match
    pl = planner()
    pl._lookup_rates = lambda scores: scores ** 3     # drafts pay after long matches only (here: 5 tokens)
    made = []
    make = pl._lookup_table
    pl._lookup_table = lambda *a, **k: made.append(1) or make(*a, **k)      # noqa: E731
    offer = [None]

    def plan(pend: int = 1):
        return pl.plan_cycle("lossless", {ROLE: pend}, 4, 1000, "lossless", lookup=lambda: offer[0])[0]
    plan()
    offer[0] = Match(pos=0, length=16)
    pl._lookup_wait.clear()                              # (the back-off after the first cycle's empty offer)
    assert plan().kind == LOOKUP and len(made) == 2       # made before ar was the choice, then for it
    tab = pl._ltables["lossless"]
    assert tab.any and tab.min_match == 5 and tab.cur is pl.current["lossless"]
    offer[0] = None
    for _ in range(3):                                   # replans that keep ar: re-compared, not made
        pl.age["lossless"] = 1 << 30
        pl._quiet.clear()
        assert plan() == AR_PLAN
    assert plan() == AR_PLAN                             # (the table is caught up with at the next cycle)
    now = pl._ltables["lossless"]
    assert now.cur is pl.current["lossless"] and now.cur is not tab.cur
    assert len(made) == 2 and now.rows == tab.rows and now.cand is tab.cand
    pl.current["lossless"] = type("C", (), {"kind": "ar", "rate": 1e9, "width": 1})()   # an ar this fast
    pl._quiet["lossless"] = 100
    assert not pl._rebased(now, pl.current["lossless"]).any            # no draft beats it
    pl.current["lossless"] = now.cur
    pl._lookup_wait.clear()
    assert plan(pend=2) == AR_PLAN and len(made) == 2    # stale (pending 2), nothing offered: not made
    offer[0] = Match(pos=0, length=3)                    # too short for any plan: still not made
    pl._lookup_wait.clear()
    assert plan(pend=2) == AR_PLAN and len(made) == 2
    offer[0] = Match(pos=0, length=16)
    pl._lookup_wait.clear()
    plan(pend=2)
    assert len(made) == 3 and pl._ltables["lossless"].pend == 2


def test_the_index_is_asked_less_often_while_its_offers_are_of_no_use():
    """The back-off: where an ar cycle's host time is a share of its pass (here 0.2 of 1 ms, the
    embedded pair's), after an offer the table has no use for, the index is not asked for 1, 2, 4, then
    LOOKUP_BACKOFF cycles at a time; a match it can use is drafted at most LOOKUP_BACKOFF cycles after
    it starts, and from then on the index is asked every cycle. Where host time is no share (SmolLM2's
    0.1 of 6 ms), the index is asked every cycle."""
    from prove_local.lookup import Match
    from prove_local.planner import LOOKUP_BACKOFF
    pl = planner()
    pl.overhead = {k: 0.2e-3 for k in pl.overhead}         # (every kind: the same host time)
    pl._lookup_rates = lambda scores: scores ** 3     # drafts pay after long matches only
    asked, offer = [], [Match(pos=0, length=2)]      # a short match every cycle: of no use

    def look():
        asked.append(len(plans))
        return offer[0]
    plans = []
    for _ in range(200):
        plans.append(next_plan(pl, look))
    cycles = sorted(set(asked))
    gaps = [b - a for a, b in zip(cycles, cycles[1:])]
    assert all(p.kind == "ar" for p in plans) and max(gaps) == LOOKUP_BACKOFF + 1
    assert len(cycles) < 200 / LOOKUP_BACKOFF                # (replans ask it too)
    offer[0] = Match(pos=0, length=16)                       # a repeat starts
    start = len(plans)
    for _ in range(20):
        plans.append(next_plan(pl, look))
    first = next(i for i in range(start, len(plans)) if plans[i].kind == LOOKUP)
    assert first - start <= LOOKUP_BACKOFF
    assert set(range(first, len(plans))) <= set(asked)       # asked every cycle once it is of use
    pl.overhead["ar"] = 0.01e-3                              # host time no share of a pass
    pl._lookup_wait.clear()
    offer[0], asked[:] = Match(pos=0, length=2), []
    start = len(plans)
    for _ in range(30):
        plans.append(next_plan(pl, look))
    assert set(range(start, len(plans))) <= set(asked)


def test_a_request_starts_from_the_last_table_made_from_an_empty_record():
    """A new request's own lookup record is empty: it starts from the last table made from an empty
    record (no numpy work at its first cycle), never from one made from the previous request's record."""
    from prove_local.lookup import Match
    pl = planner()
    pl._lookup_rates = lambda scores: scores ** 3
    made = []
    make = pl._lookup_table
    pl._lookup_table = lambda *a, **k: made.append(1) or make(*a, **k)      # noqa: E731
    offer = [None]

    def plan():
        pl._lookup_wait.clear()
        return pl.plan_cycle("lossless", {ROLE: 1}, 4, 1000, "lossless", lookup=lambda: offer[0])[0]
    plan()
    empty = pl._ltables["lossless"]
    assert made == [1] and empty.local == 0
    pl.start_request()
    plan()
    assert made == [1] and pl._ltables["lossless"].cand is empty.cand      # (re-compared at most)
    offer[0] = Match(pos=0, length=16)                   # the request drafts, and a draft misses
    draft = plan()
    assert draft.kind == LOOKUP
    pl.observe(cycle(draft, 1.5e-3, k=draft.lookup, accepted=0), "lossless")
    plan()
    assert len(made) == 3 and pl._ltables["lossless"].local == 1           # made from its record
    pl.start_request()
    assert pl._ltables["lossless"].local == 0 and pl._ltables["lossless"].cand is not None


def test_a_batched_load_change_keeps_the_lookup_table_until_a_match_may_use_it():
    """A pool's loads move as requests join and leave (Planner.set_load): the lookup table priced at the
    old load is kept and made again only once the index offers a match it may use (`_candidate`), not at
    the next cycle whatever the index offers (every engine of a pool did, ~0.5-0.9 ms each). Alone again,
    the tables are priced afresh at once, as a single stream's are."""
    from prove_local.lookup import Match
    pl = planner(accept=0.3)
    made = []
    make = pl._lookup_table
    pl._lookup_table = lambda *a, **k: made.append(1) or make(*a, **k)      # noqa: E731
    offer = [None]
    look = lambda: offer[0]                                                  # noqa: E731
    pl.set_load({ROLE: 3}, 3)
    next_plan(pl, look)                                   # (a table, then the first choice: ar)
    offer[0] = Match(pos=0, length=16)
    pl._lookup_wait.clear()
    assert next_plan(pl, look) == AR_PLAN                 # a match: the table made again for that choice
    offer[0] = None
    tab = pl._ltables["lossless"]
    assert made == [1, 1] and not tab.any                 # at 30 %, beside 3 others: no draft pays
    assert pl._table_stale(tab, "lossless", 1) is None    # (current: priced at this load, for this choice)
    del made[:]
    pl.set_load({ROLE: 8}, 8)                             # another batched load
    assert pl._ltables["lossless"] is tab and pl._table_stale(tab, "lossless", 1) == "remake"
    for _ in range(20):                                   # nothing offered: no table made
        pl._lookup_wait.clear()
        assert next_plan(pl, look) == AR_PLAN
    assert made == [] and pl._ltables["lossless"] is tab
    offer[0] = Match(pos=0, length=16)                    # a match the old table's bar lets through
    pl._lookup_wait.clear()
    next_plan(pl, look)
    assert made == [1] and pl._ltables["lossless"] is not tab
    assert pl._table_stale(pl._ltables["lossless"], "lossless", 1) is None
    pl.set_load({}, 0)                                    # alone: made at the next cycle, whatever is offered
    assert "lossless" not in pl._ltables
    offer[0] = None
    pl._lookup_wait.clear()
    next_plan(pl, look)
    assert made == [1, 1]


def test_beside_other_requests_a_filled_proposal_spans_the_steps_of_its_passes():
    """A MARS block filled by k lookup tokens is two passes when its lookup tokens are accepted (a
    proposal and a verify), one when not: beside G other requests those are as many steps of their G
    tokens and T seconds. Flat curve (every pass 1 s, a one-token pass joins a step for free), lookup
    slots accepted half the time, the current MARS block B=16 committing 10 tokens a cycle; beside one
    ar request (G = 1, T = 1) the best row is k = 1: with P(accepted) 0.5 it spans 1.5 steps,
    (1.5 x 1 + 1.5 + 0.5 x 9) / (1.5 x 1 + 0.5 x 2 + 0.5 x 1) = 2.5 (rated as one step: 2.8)."""
    from prove_local.planner import Choice
    pl = planner(curve={1: 1.0, 64: 1.0}, accept=0.5)
    pl.overhead = {}
    pl._options["lossless"] = [Choice("ar", 1, 1.0, 1.0, 1.0), Choice("lossless", 16, 5.0, 10.0, 2.0, 16)]
    alone = pl._lookup_table("lossless", "lossless", {ROLE: 1}, 16)
    assert alone.cand[4] == Plan("lossless", 16, lookup=1) and alone.cand_r[4] == pytest.approx(6.0 / 1.5)
    pl.set_load({ROLE: 1}, 1)
    tab = pl._lookup_table("lossless", "lossless", {ROLE: 1}, 16)
    assert tab.cand[4] == Plan("lossless", 16, lookup=1) and tab.cand_r[4] == pytest.approx(2.5)


def test_a_lookup_exploration_that_could_not_win_with_every_token_accepted_is_not_made():
    """As a MARS width (Planner._worth_exploring): a k-token lookup draft that would lose to the current
    choice even if every token were accepted is not explored; where it could win, it is."""
    from prove_local.lookup import Match

    def explored(curve):
        pl = planner(curve, accept=0.3)
        pl.explore_by_rate, pl.elapsed = True, 1e6            # (the regret budget is no limit here)
        pl.rng.random = lambda: 0.0                              # every draw would explore
        tab = pl._ltables["lossless"] = pl._lookup_table("lossless", "lossless", {ROLE: 1}, 0)
        assert not tab.any                                       # at 30 % no draft is planned
        return pl._lookup_decide("lossless", "lossless", {ROLE: 1}, 0, 1000, lambda: Match(pos=0, length=4),
                                 tab, None, None, True)

    assert explored({1: 1e-3, 2: 2.5e-3, 4: 5e-3, 16: 20e-3}) is None     # k + 1 tokens cost k + 1.5 passes
    plan = explored(None)                                        # t(2) = 1.5 t(1): 2 tokens in 1.5 passes
    assert plan is not None and plan.kind == LOOKUP and plan.lookup >= 1


def test_a_lookup_exploration_is_drawn_only_where_it_could_change_the_table(monkeypatch):
    """An exploration draw asks the index only for matches whose best draft is expected at EXPLORE_FLOOR x
    the current choice's rate or more (`explore_min`); at a shorter match it explores nothing. On the
    embedded pair the 1-3 token drafts at 1-7 token matches, ~0.6x `ar`, were explored at most draws that
    found one: each a wide pass for ~1 token, and a full index catch-up for the draw."""
    from prove_local import planner as P
    from prove_local.lookup import Match

    def draw(m, floor=P.EXPLORE_FLOOR):
        monkeypatch.setattr(P, "EXPLORE_FLOOR", floor)
        pl = planner()
        pl._lookup_rates = lambda scores: np.asarray(scores) ** 6      # long matches copy, short ones rarely
        pl.explore_by_rate, pl.elapsed = True, 1e6                       # (the regret budget is no limit here)
        pl.rng.random = lambda: 0.0                                      # every draw would explore
        tab = pl._ltables["lossless"] = pl._lookup_table("lossless", "lossless", {ROLE: 1}, 0)
        plan = pl._lookup_decide("lossless", "lossless", {ROLE: 1}, 0, 1000, lambda: Match(pos=0, length=m),
                                 tab, None, None, True)
        return plan, pl.lookup_need, tab

    plan, need, tab = draw(3)
    floor = P.EXPLORE_FLOOR * tab.rate
    assert tab.best[3][1] < floor <= tab.best[4][1] and tab.rows[5] is None     # (the table plans no draft at 3 or 5)
    assert plan is None and need == 4 == tab.explore_min(P.EXPLORE_FLOOR)
    plan, need, _ = draw(5)
    assert plan is not None and plan.kind == LOOKUP and need == 4               # worth exploring: explored
    plan, need, _ = draw(3, floor=0.0)                                          # without the floor: explored
    assert plan is not None and need == 1

