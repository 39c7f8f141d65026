"""Drafted tokens as llama-server means them (modes.draft_counts, GET /metrics): lookup tokens, a
draft model's tokens and the MARS slots after the first are drafts; slot 1 of a lossless / prove /
mars block is the model's own next token and is not. Expected counts are written out by hand."""
from types import SimpleNamespace

from prove_local import modes
from prove_local.rules import AR_PLAN, Cycle, Plan
from prove_local.server.metrics import Metrics


def cycle(plan, proposed, n_accepted, source=None):
    committed = proposed[:n_accepted] + [99]
    return Cycle(proposed, [0.5] * len(proposed), None, committed, n_accepted, {"target": 1},
                 plan=plan, source=source)


CYCLES = [
    cycle(Plan("lossless", 4), [1, 2, 3, 4], 2),          # slot 1 + slot 2 accepted: drafts 3 (mask), 1 accepted
    cycle(Plan("prove", 3), [1, 2, 3], 1),                # slot 1 only: drafts 2, 0 accepted
    cycle(Plan("mars", 2), [1, 2], 2),                    # both slots: drafts 1, 1 accepted
    cycle(Plan("spec", draft_k=3), [1, 2, 3], 3),         # a draft model's 3 tokens, all accepted
    cycle(Plan("lookup", lookup=2), [1, 2], 0),           # 2 lookup tokens, none accepted
    # a filled proposal: 2 lookup tokens, then a 3-slot MARS block whose slot 1 (index 2) is no draft;
    # accepted: both lookup tokens, slot 1 and slot 2
    cycle(Plan("lossless", 3, lookup=2), [1, 2, 3, 4, 5], 4, ["lookup"] * 2 + ["mask"] * 3),
    cycle(AR_PLAN, [7], 1),                               # the planner's ar cycle: nothing drafted
]


def test_drafted_slots_leave_out_slot_1_of_a_mars_block():
    assert [modes.drafted_slots(c) for c in CYCLES] == [
        [(1, "mask"), (2, "mask"), (3, "mask")],
        [(1, "mask"), (2, "mask")],
        [(1, "mask")],
        [(0, "draft"), (1, "draft"), (2, "draft")],
        [(0, "lookup"), (1, "lookup")],
        [(0, "lookup"), (1, "lookup"), (3, "mask"), (4, "mask")],
        [],
    ]


def test_draft_counts():
    d = modes.draft_counts(CYCLES)
    assert dict(d) == {"mask": (8, 3), "draft": (3, 3), "lookup": (4, 2)}
    assert (d.drafted, d.accepted, d.n_drafts) == (15, 8, 6)
    assert d.accepted_by_pos == {0: 4, 1: 2, 2: 2}
    empty = modes.draft_counts([CYCLES[-1]])
    assert (dict(empty), empty.drafted, empty.accepted, empty.n_drafts) == ({}, 0, 0, 0)


def parse(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_metrics_count_what_llama_server_counts():
    m = Metrics()
    m.generation(SimpleNamespace(finish="stop", prompt=[1, 2, 3], cycles=CYCLES, slot=0))
    got = parse(m.render(None))
    assert got["llamacpp:spec_decode_num_drafts_total"] == 6
    assert got["llamacpp:spec_decode_num_draft_tokens_total"] == 15
    assert got["llamacpp:spec_decode_num_accepted_tokens_total"] == 8
    per_pos = {k: v for k, v in got.items() if k.startswith("llamacpp:spec_decode_num_accepted_tokens_per_pos")}
    assert per_pos == {f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}': n
                       for i, n in ((0, 4), (1, 2), (2, 2))}
    assert (got["prove_draft_n_total"], got["prove_draft_n_accepted_total"]) == (15, 8)
    assert got['prove_drafts_total{source="mask"}'] == 8 and got['prove_drafts_accepted_total{source="mask"}'] == 3
    assert got['prove_drafts_total{source="lookup"}'] == 4 and got['prove_drafts_accepted_total{source="draft"}'] == 3
    # Cycle.n_accepted (our own counter) still counts slot 1: 2 + 1 + 2 + 3 + 0 + 4 + 1
    assert got['prove_accepted_tokens_total{slot="0"}'] == 13
