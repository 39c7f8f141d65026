"""`prove-local bench`: statistics on hand-made event streams with known answers, prompt loading,
the report on synthetic data, and one small end-to-end run on tiny random-weight models."""
import itertools
import json
import os
import random
import sys
from types import SimpleNamespace

import pytest

from prove_local.bench import data as bdata
from prove_local.bench import stats
from prove_local.bench.markdown import summary_markdown
from prove_local.bench.results import build_results, write_outputs
from prove_local.bench.runner import BenchData, Record, Run, make_runs
from prove_local.engine import Settings
from prove_local.rules import Cycle, Plan


def cyc(start, proposed, committed, n_accepted=None, p=None, q=None, passes=None, seconds=1.0, decode=None, plan=None):
    """A synthetic cycle. Its plan (what the rule ran), unless given, follows the test data's passes:
    two proposer passes a lossless block, a verifier pass a prove block, drafts spec, else mars (one
    slot: ar)."""
    passes = passes or {"target": 1}
    n = len(proposed)
    if plan is None:
        plan = (Plan("spec", draft_k=passes["draft"]) if "draft" in passes else
                Plan("prove", n) if "verifier" in passes else
                Plan("lossless", n) if passes.get("target") == 2 else Plan("mars", n) if n > 1 else Plan())
    c = Cycle(list(proposed), p or [0.5] * len(proposed), q, list(committed),
              len(committed) if n_accepted is None else n_accepted, passes, plan=plan)
    c.start, c.seconds, c.decode_seconds = start, seconds, decode or {"target": seconds * 0.9}
    return c


# ---------------------------------------------------------------------------------------- AUC
def test_auc_known_values():
    assert stats.auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert stats.auc([1, 2, 3], [0, 1, 1]) == 1.0
    assert stats.auc([3, 2, 1], [0, 1, 1]) == 0.0
    assert stats.auc([0.5] * 6, [0, 1, 0, 1, 1, 0]) == 0.5                 # all tied
    assert stats.auc([0.2, 0.2, 0.9], [0, 1, 1]) == pytest.approx(0.75)    # a tie counts one half
    assert stats.auc([0.1, 0.2], [1, 1]) is None and stats.auc([], []) is None


def test_auc_equals_pairwise_definition():
    rng = random.Random(3)
    s = [rng.choice([0.1, 0.2, 0.3, 0.5, 0.9]) for _ in range(60)]
    y = [rng.random() < 0.4 for _ in range(60)]
    pos = [a for a, l in zip(s, y) if l]
    neg = [a for a, l in zip(s, y) if not l]
    brute = sum((a > b) + 0.5 * (a == b) for a, b in itertools.product(pos, neg)) / (len(pos) * len(neg))
    assert stats.auc(s, y) == pytest.approx(brute)
    fpr, tpr = stats.roc_curve(s, y)
    area = sum((fpr[i + 1] - fpr[i]) * (tpr[i + 1] + tpr[i]) / 2 for i in range(len(fpr) - 1))
    assert area == pytest.approx(brute) and fpr[-1] == tpr[-1] == 1.0


# ---------------------------------------------------------------------- slots vs greedy path
REF = [10, 11, 12, 13, 14, 15, 16, 17]


def test_slot_labels_and_rates_exact_mode():
    # lossless-like: block 4; cycle 0 matches 2 then fails, cycle 1 (start 3) matches all 4
    cycles = [cyc(0, [10, 11, 99, 98], [10, 11, 12], p=[0.9, 0.8, 0.3, 0.2], q=[0.9, 0.7, 0.1, 0.5]),
              cyc(3, [13, 14, 15, 16], [13, 14, 15, 16, 17], p=[0.9, 0.9, 0.6, 0.4], q=[0.9, 0.9, 0.8, 0.3])]
    labels = stats.slot_labels(cycles, REF, REF)
    assert [r["match"] for r in labels] == [True, True, False, False, True, True, True, True]
    rate, n = stats.match_rate_by_slot(labels, 4)
    assert rate == [1.0, 1.0, 0.5, 0.5] and n == [2, 2, 2, 2]
    runs = stats.matched_runs(cycles, REF, REF)
    assert [(r["start"], r["matched"]) for r in runs] == [(0, 2), (3, 4)]
    a = stats.detector_aucs(labels)
    assert a["n_pos"] == 6 and a["n_neg"] == 2
    assert a["p"] == pytest.approx(stats.auc([0.9, 0.8, 0.3, 0.2, 0.9, 0.9, 0.6, 0.4], [1, 1, 0, 0, 1, 1, 1, 1]))
    assert a["pq"] == pytest.approx(stats.auc([0.81, 0.56, 0.03, 0.1, 0.81, 0.81, 0.48, 0.12], [1, 1, 0, 0, 1, 1, 1, 1]))


def test_on_path_label_is_the_leading_run_and_positional_is_reported_too():
    """A slot after a wrong one is off the greedy path even when its own token happens to equal the
    greedy token at its position (the positional event): the AUCs score the former by default."""
    cycles = [cyc(0, [10, 99, 12, 13], [10], p=[0.9, 0.2, 0.8, 0.7], q=[0.9, 0.1, 0.05, 0.05]),
              cyc(1, [11, 12, 98], [11, 12], p=[0.9, 0.6, 0.3], q=[0.9, 0.8, 0.2])]
    labels = stats.slot_labels(cycles, REF, REF)
    assert [r["match"] for r in labels] == [True, False, True, True, True, True, False]
    assert [r["on_path"] for r in labels] == [True, False, False, False, True, True, False]
    on, pos = stats.detector_aucs(labels), stats.detector_aucs(labels, "match")
    # q reads the wrong slot before slots 2-3 of cycle 0 and scores them low: a perfect detector of
    # the leading run, a poor one of positional matches; p̃ (blind to earlier slots) the other way round
    assert on["q"] == 1.0 and pos["q"] < 0.75 and pos["p"] > on["p"]
    assert (on["n_pos"], pos["n_pos"]) == (3, 5)


def test_slot_labels_stop_at_divergence_and_reference_end():
    # lossy run: commits a wrong token at position 2, so cycles starting after 2 are not labelled
    gen = [10, 11, 50, 51, 52]
    cycles = [cyc(0, [10, 11, 50], [10, 11, 50], q=None), cyc(3, [51, 52, 53], [51, 52])]
    labels = stats.slot_labels(cycles, gen, REF)
    assert [(r["slot"], r["match"]) for r in labels] == [(0, True), (1, True), (2, False)]
    assert all(r["q"] is None for r in labels) and stats.detector_aucs(labels)["q"] is None
    # a cycle whose start equals the divergence point is still labelled (its context is on the path)
    cycles2 = [cyc(0, [10, 11], [10, 11]), cyc(2, [50, 51], [50])]
    assert len(stats.slot_labels(cycles2, [10, 11, 50], REF)) == 4
    # slots beyond the reference are not labelled; a run reaching the end is censored
    short = [10, 11, 12]
    c = [cyc(0, [10, 11, 12, 13], [10, 11, 12])]
    assert len(stats.slot_labels(c, short, short)) == 3
    assert stats.matched_runs(c, short, short) == []
    assert stats.matched_runs([cyc(0, [10, 99, 12, 13], [10])], short, short)[0]["matched"] == 1


def test_matched_by_position_bins():
    runs = [{"start": s, "matched": m, "block": 4, "length": 100} for s, m in
            [(0, 1), (10, 3), (30, 2), (50, 4), (70, 5), (99, 7), (100, 9)]]
    r = stats.matched_by_position(runs, n_bins=4)
    assert r["edges"] == [0, 0.25, 0.5, 0.75, 1.0]
    assert r["mean"] == [2.0, 2.0, 4.5, 8.0] and r["n"] == [2, 1, 2, 2]
    assert r["overall"] == pytest.approx(31 / 7)
    assert stats.binned_means([0.1], [1.0], [0.5, 1.0]) == ([None], [0])


# ------------------------------------------------------------------------------ speed, cost
def test_speedups_median_and_totals():
    ar = [(100, 10.0), (50, 10.0), (10, 1.0)]        # 10, 5, 10 tok/s
    mode = [(100, 5.0), (50, 2.5), (10, 2.0)]        # 20, 20, 5 tok/s: ratios 2, 4, 0.5
    s = stats.speedups(mode, ar)
    assert s["median"] == 2.0 and s["n"] == 3
    assert s["totals"] == pytest.approx((160 / 9.5) / (160 / 21.0))
    assert stats.speedups([(0, 0.0)], [(0, 0.0)]) == {"median": None, "totals": None, "n": 0}
    assert stats.throughput(mode) == pytest.approx(160 / 9.5)


def test_passes_tokens_per_cycle_and_measured_cost():
    ar = [cyc(i, [1], [1], seconds=0.01, decode={"target": 0.009}) for i in range(4)]
    ll = [cyc(0, [1] * 4, [1, 1, 1], passes={"target": 2}, seconds=0.05, decode={"target": 0.045}),
          cyc(3, [1] * 4, [1], passes={"target": 2}, seconds=0.03, decode={"target": 0.018})]
    assert stats.tokens_per_cycle(ll) == 2.0 and stats.tokens_per_cycle([]) is None
    assert stats.passes_per_token(ll) == {"target": 1.0}
    pv = [cyc(0, [1] * 4, [1, 1], passes={"target": 1, "verifier": 1})]
    assert stats.passes_per_token(pv) == {"target": 0.5, "verifier": 0.5}
    assert stats.measured_cycle_cost(ll, ar) == pytest.approx(4.0)
    assert stats.measured_cycle_cost(ll, ar, decode_only=True) == pytest.approx(0.0315 / 0.009)
    assert stats.overhead_share(ll) == pytest.approx(1 - 0.063 / 0.08)
    assert stats.host_ms_per_cycle(ll) == pytest.approx(1e3 * (0.005 + 0.012) / 2) and stats.host_ms_per_cycle([]) is None
    assert stats.measured_cycle_cost(ll, []) is None


def test_loop_share():
    a = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8]      # the second 8-gram repeats the first
    assert stats.loop_share([a]) == pytest.approx(8 / 16)
    b = list(range(20))                                       # no repeat
    assert stats.loop_share([b]) == 0.0
    assert stats.loop_share([a, b]) == pytest.approx(8 / 36)
    assert stats.loop_share([[7] * 10]) == pytest.approx(0.9)  # every 8-gram after the first repeats it
    assert stats.loop_share([]) is None


def test_tokens_per_cycle_outside_loops():
    C = SimpleNamespace
    ids = [1, 2, 3] + list(range(10, 18)) * 2       # tokens 3..18 are a loop: an 8-gram repeats
    assert stats.loop_mask(ids).tolist() == [False] * 11 + [True] * 8 and stats.loop_mask(ids[:11]).sum() == 0
    cycles = [C(start=0, committed=[1, 2, 3]), C(start=3, committed=list(range(10, 18))),
              C(start=11, committed=list(range(10, 18)))]
    assert stats.tokens_per_cycle_outside_loops([(ids, cycles)]) == pytest.approx((3 + 8) / 2)
    assert stats.tokens_per_cycle_outside_loops([]) is None


def test_pass_cost_curve_projection():
    curve = {1: 1.0, 2: 1.5, 4: 2.0, 8: 4.0, 16: 8.0}
    assert stats.curve_ratio(curve, 4) == 2.0
    assert stats.curve_ratio(curve, 3) == 1.75                      # interpolated
    assert stats.curve_ratio(curve, 32) == pytest.approx(8 + 16 * 7 / 15)   # extrapolated along the mean slope
    noisy = {1: 1.0, 8: 6.0, 16: 3.0}                                 # a falling last segment: never below t(16)
    assert stats.curve_ratio(noisy, 84) == pytest.approx(3 + 68 * 2 / 15) and stats.curve_ratio(noisy, 84) > 3
    curves = {"target": curve, "verifier": {n: t / 4 for n, t in curve.items()}, "draft": {1: 0.5, 8: 1.0}}
    cu = stats.cycle_cost_units
    assert cu("ar", 1, curves) == 1.0
    assert cu("lossless", 16, curves) == 16.0                      # two 16-row passes of 8 units
    assert cu("mars", 8, curves) == 4.0
    assert cu("prove", 16, curves) == pytest.approx(8.0 + 0.25 * 8.0)
    assert cu("spec", 4, curves) == pytest.approx(4 * 0.5 + 2.5)    # 4 drafts of ρ=0.5, target pass of 5 tokens
    assert cu("lossless", 16, curves, flat=True) == 2.0            # paper: ProVe-lossless costs 2
    assert cu("prove", 16, curves, flat=True) == 1.25              # paper: 1 + ρ
    assert cu("spec", 5, curves, flat=True) == 3.5                 # paper: 1 + kρ
    cycles = [cyc(0, [1] * 16, [1] * 6), cyc(6, [1] * 16, [1] * 2)]
    pr = stats.projected("lossless", cycles, curves)
    assert pr["cycle_cost"] == 16.0 and pr["speedup"] == 0.25 and pr["speedup_flat"] == 2.0
    with pytest.raises(ValueError):
        cu("beam", 4, curves)


def test_exact_match_and_accuracy():
    assert stats.exact_match_share([[1, 2], [1, 3], [4]], [[1, 2], [1, 2], [4]]) == pytest.approx(2 / 3)
    assert stats.exact_match_share([[1]], [None]) is None
    assert stats.accuracy([True, False, None, True]) == pytest.approx(2 / 3)
    assert stats.accuracy([None]) is None


# ---------------------------------------------------------------------------- answers, data
@pytest.mark.parametrize("family,text,answer,ok", [
    ("gsm8k", "She sold 48 + 24 = 72 clips.\n#### 72", "72", True),
    ("gsm8k", "#### 1,234.0", "1234", True),
    ("gsm8k", "the total is 70 dollars, so 71", "70", False),
    ("gsm8k", "no digits at all", "5", False),
    ("math500", "so the answer is $\\boxed{\\dfrac{1}{2}}$.", "\\frac{1}{2}", True),
    ("math500", "\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("math500", "The answer is 0.50", "0.5", True),
    ("math500", "\\boxed{7}", "8", False),
    ("bbh", "Let's think. So the answer is (B).", "(B)", True),
    ("bbh", "So the answer is True.", "True", True),
    ("bbh", "So the answer is valid.", "invalid", False),
    ("mmlu-pro", "The answer is (C)", "C", True),
    ("humaneval", "def f(): pass", None, None),
])
def test_check_answer(family, text, answer, ok):
    assert bdata.check_answer(family, text, answer) is ok


def test_load_prompts_by_format(tmp_path):
    (tmp_path / "g.jsonl").write_text(json.dumps({"question": "Q1?", "answer": "work\n#### 1,000"}) + "\n")
    (tmp_path / "m.jsonl").write_text(json.dumps({"problem": "P", "answer": "\\frac12", "unique_id": "t/1.json"}) + "\n")
    (tmp_path / "h.jsonl").write_text(json.dumps({"task_id": "HumanEval/7", "prompt": "def f():\n", "entry_point": "f"}) + "\n")
    (tmp_path / "i.jsonl").write_text(json.dumps({"key": 5, "prompt": "Write", "instruction_id_list": [], "kwargs": []}) + "\n")
    (tmp_path / "b.json").write_text(json.dumps({"canary": "x", "examples": [{"input": "I1", "target": "(A)"}, {"input": "I2", "target": "B"}]}))
    (tmp_path / "mmlu.jsonl").write_text(json.dumps({"question": "Q", "options": ["x", "y", "z"], "answer_index": 2}) + "\n")
    (tmp_path / "gpqa.csv").write_text("Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3\nQ?,right,w1,w2,w3\n")
    (tmp_path / "train.jsonl").write_text("not json\n")      # skipped in a folder
    (tmp_path / "README.md").write_text("# readme")
    ps = {}
    for p in bdata.load_prompts(tmp_path):
        ps.setdefault(p.family, p)
    assert sorted(ps) == ["bbh", "gpqa", "gsm8k", "humaneval", "ifeval", "math500", "mmlu-pro"]
    assert ps["gsm8k"].answer == "1000" and ps["gsm8k"].text == "Q1?"
    assert ps["math500"].id == "m/t/1.json" and ps["humaneval"].id == "HumanEval/7" and "def f():" in ps["humaneval"].text
    assert ps["mmlu-pro"].answer == "C" and "(C) z" in ps["mmlu-pro"].text
    g = ps["gpqa"]
    assert f"({g.answer}) right" in g.text
    assert ps["bbh"].answer == "(A)"
    # --limit: round-robin over a folder's files
    first = bdata.load_prompts(tmp_path, limit=3)
    assert len(first) == 3 and len({p.source for p in first}) == 3
    assert [p.text for p in bdata.load_prompts(tmp_path / "b.json", limit=5)] == ["I1", "I2"]
    with pytest.raises(bdata.DataError, match="no known format"):
        (tmp_path / "bad.jsonl").write_text(json.dumps({"foo": 1}) + "\n")
        bdata.load_file(tmp_path / "bad.jsonl")
    with pytest.raises(bdata.DataError, match="no such"):
        bdata.load_prompts(tmp_path / "missing")


def shared_datasets():
    """The project's shared dev sets: shared/datasets inside the repository (a device copy) or beside it
    (../shared, also in CI's clean clone), else in a folder above; $PROVE_SHARED_DATASETS first."""
    import os
    import pathlib
    repo = pathlib.Path(__file__).resolve().parents[1]
    candidates = ([pathlib.Path(os.environ["PROVE_SHARED_DATASETS"])] if os.environ.get("PROVE_SHARED_DATASETS") else [])
    candidates += [repo / "shared" / "datasets"] + [d / "shared" / "datasets" for d in repo.parents]
    return next((c for c in candidates if (c / "gsm8k").is_dir()), None)


def test_shared_dev_sets_load():
    root = shared_datasets()
    if root is None:
        pytest.skip("no shared/datasets in or above the repository")
    fams = {name: bdata.load_prompts(root / name, limit=30) for name in ("gsm8k", "humaneval", "bbh", "ifeval", "math500")}
    assert {n: {p.family for p in ps} for n, ps in fams.items()} == {
        "gsm8k": {"gsm8k"}, "humaneval": {"humaneval"}, "bbh": {"bbh"}, "ifeval": {"ifeval"}, "math500": {"math500"}}
    assert len({p.source for p in fams["bbh"]}) == 27 and all(len(ps) == 30 for ps in fams.values())


# ------------------------------------------------------------------- report on synthetic data
def synthetic() -> BenchData:
    prompts = [bdata.Prompt("g/0", "gsm8k", "q", "13"), bdata.Prompt("g/1", "gsm8k", "q", "99")]
    runs = make_runs(["ar", "lossless", "prove"], max_new=8, block=4, thetas=[0.01, 0.1], tau=0.95, draft_k=4)
    assert [r.name for r in runs] == ["ar", "lossless", "prove@0.01", "prove@0.1"]
    ref = [10, 11, 12, 13]
    gens = []
    for i in range(2):
        gens.append(Record(i, "ar", ref, [cyc(k, [t], [t], seconds=0.01) for k, t in enumerate(ref)], 0.04, text="#### 13"))
        gens.append(Record(i, "lossless", ref, [cyc(0, [10, 11, 12, 99], ref, passes={"target": 2}, seconds=0.02,
                                                        p=[0.9, 0.8, 0.7, 0.1], q=[0.9, 0.9, 0.9, 0.2])], 0.02, text="#### 13"))
        bad = [10, 11, 50, 51]
        gens.append(Record(i, "prove@0.01", bad, [cyc(0, [10, 11, 50, 51], bad, passes={"target": 1, "verifier": 1},
                                                          seconds=0.01, p=[0.9, 0.8, 0.5, 0.4], q=[0.9, 0.9, 0.3, 0.2])], 0.01, text="#### 50"))
        gens.append(Record(i, "prove@0.1", ref[:2] + [12, 13],
                               [cyc(0, [10, 11, 50, 51], [10, 11], passes={"target": 1, "verifier": 1}, seconds=0.01,
                                    p=[0.9, 0.8, 0.5, 0.4], q=[0.9, 0.9, 0.1, 0.2]),
                                cyc(2, [12, 13, 7, 7], [12, 13], passes={"target": 1, "verifier": 1}, seconds=0.01,
                                    p=[0.9, 0.9, 0.1, 0.1], q=[0.9, 0.9, 0.1, 0.1])], 0.02, text="#### 13"))
    d = BenchData(prompts, [[1, 2, 3]] * 2, runs, gens)
    d.pass_cost = {"target": {1: 0.01, 2: 0.015, 4: 0.02, 8: 0.04}, "verifier": {1: 0.005, 2: 0.006, 4: 0.008, 8: 0.01}}
    return d


def test_planner_ar_cycles_are_left_out_of_the_slot_analyses():
    """An auto run's plain ar cycles (one-token proposals, widths {"target": [1]}) are not proposals:
    slot match rates, AUCs and matched runs count the proposing cycles only."""
    d = synthetic()
    for g in d.generations:
        if g.run == "lossless":
            ar1 = cyc(0, [10], [10], passes={"target": 1})
            ar1.widths = {"target": [1]}
            block = cyc(1, [11, 12, 99], [11, 12, 13], passes={"target": 2}, p=[0.9, 0.7, 0.1], q=[0.9, 0.9, 0.2])
            block.widths = {"target": [3, 3]}
            g.cycles = [ar1, block]
    res = build_results(d, meta={"command": "x", "settings": {"max_new": 8, "block": "auto"}})
    assert res["position_match_rate"]["lossless"]["n"] == [2, 2, 2]        # 2 prompts x 1 proposing cycle
    assert res["position_match_rate"]["lossless"]["rate"] == [1.0, 1.0, 0.0]
    assert res["auc"]["lossless"]["n_pos"] == 4 and res["auc"]["lossless"]["n_neg"] == 2


def test_build_results_on_synthetic_runs(tmp_path):
    res = build_results(synthetic(), meta={"command": "prove-local bench …", "settings": {"max_new": 8, "block": 4}})
    m = res["modes"]
    assert m["ar"]["speedup_vs_ar"] == {"median": 1.0, "totals": 1.0}
    assert m["lossless"]["speedup_vs_ar"]["median"] == 2.0 and m["lossless"]["tokens_per_cycle"] == 4.0
    assert m["lossless"]["exact_match_vs_ar"] == 1.0 and m["prove@0.01"]["exact_match_vs_ar"] == 0.0
    assert m["ar"]["accuracy"] == 0.5 and m["prove@0.01"]["accuracy"] == 0.0     # prompt g/1's answer is 99
    assert m["lossless"]["passes_per_token"] == {"target": 0.5}
    assert m["lossless"]["tokens_per_cycle_by_family"] == {"gsm8k": 4.0}
    assert m["ar"]["loop_share_by_family"] == {"gsm8k": m["ar"]["loop_share"]}
    assert m["lossless"]["tokens_per_cycle_outside_loops"] == 4.0   # no loops in the synthetic runs
    assert m["lossless"]["cycle_cost"]["measured"] == 2.0
    assert m["lossless"]["cycle_cost"]["projected"] == 4.0 and m["lossless"]["projected_speedup"]["curve"] == 1.0
    assert m["prove@0.1"]["cycle_cost"]["projected_flat"] == 1.5
    assert res["position_match_rate"]["lossless"]["rate"] == [1.0, 1.0, 1.0, 0.0]
    # prove@0.01 diverges at position 2 within its only cycle: that cycle is still labelled
    assert res["position_match_rate"]["prove@0.01"]["rate"] == [1.0, 1.0, 0.0, 0.0]
    assert res["auc"]["prove@0.1"]["n_pos"] == 8 and res["auc"]["prove@0.1"]["pq"] == 1.0
    assert [r["theta"] for r in res["theta_sweep"]] == [0.01, 0.1]
    assert res["matched_tokens_by_position"]["lossless"]["overall"] == 3.0
    assert res["pass_cost"]["target"]["ratio"] == [1.0, 1.5, 2.0, 4.0]
    assert res["prompts"][0]["runs"]["prove@0.01"]["first_divergence"] == 2
    md = summary_markdown({**res, "plots": []})
    assert "| `lossless` |" in md and "paper (GSM8K, 32B)" in md and "θ" in md


def test_write_outputs_atomic_and_plots(tmp_path):
    res = write_outputs(synthetic(), tmp_path / "out", meta={"command": "x", "settings": {}})
    names = sorted(f.name for f in (tmp_path / "out").iterdir())
    assert names == sorted(["results.json", "summary.md", "generations.jsonl"] + res["plots"])
    assert set(res["plots"]) == {"speedup.png", "match_rate_by_slot.png", "matched_by_position.png", "roc.png",
                                 "theta_sweep.png", "pass_cost.png"}
    assert all((tmp_path / "out" / p).read_bytes()[:4] == b"\x89PNG" for p in res["plots"])
    assert json.loads((tmp_path / "out" / "results.json").read_text())["modes"]["lossless"]["tokens"] == 8


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from tests.tiny import tiny_gguf
    d = tmp_path_factory.mktemp("bench-models")
    return (tiny_gguf(d, seed=0), tiny_gguf(d, seed=1, hidden=32, role="verifier"),
            tiny_gguf(d, seed=2, hidden=32, role="verifier", mask=False))


def test_bench_end_to_end(tiny_models, tmp_path, capsys, monkeypatch):
    from prove_local.cli import main
    monkeypatch.setenv("PROVE_LOCAL_CACHE", str(tmp_path / "cache"))
    prop, ver, draft = tiny_models
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "x\n#### 3"}) + "\n"
                            for q in ("What is 1 + 2?", "Natalia sold 48 clips.", "unused third prompt")))
    out = tmp_path / "out"
    rc = main(["bench", "--proposer", str(prop), "--verifier", str(ver), "--draft", str(draft),
               "--modes", "ar,lossless,prove,mars,spec", "--data", str(data), "--limit", "2", "--max-new", "32",
               "--theta", "0.01,0.1", "--threads", "1", "--ctx", "512", "--kv-type", "f32", "--warmup", "4",
               "--pass-cost-reps", "2", "--pass-cost-max", "16", "--out", str(out), "-q",
               "--block", "16", "--draft-k", "4"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert list(res["modes"]) == ["ar", "lossless", "prove@0.01", "prove@0.1", "mars", "spec"]
    assert res["modes"]["lossless"]["widths"] == {**{"B=16 v=16": res["modes"]["lossless"]["n_cycles"]}}
    for name, m in res["modes"].items():
        assert m["n_prompts"] == 2 and 2 <= m["tokens"] <= 64
        assert m["tokens_per_second"] > 0 and m["tokens_per_cycle"] >= 1
        assert m["speedup_vs_ar"]["median"] > 0 and m["speedup_vs_ar"]["totals"] > 0
        assert m["cycle_cost"]["projected"] > 0 and m["projected_speedup"]["flat"] > 0
    # F32 weights and KV cache: the exact modes reproduce ar token for token
    for name in ("lossless", "spec"):
        assert res["modes"][name]["exact_match_vs_ar"] == 1.0
    # passes are measured (llama_decode calls); ar makes one per token, lossless two per cycle
    assert res["modes"]["ar"]["passes_per_token"] == {"target": 1.0}
    assert res["modes"]["lossless"]["passes_per_token"]["target"] == pytest.approx(
        2 / res["modes"]["lossless"]["tokens_per_cycle"], rel=1e-3)
    rates = res["position_match_rate"]["lossless"]
    assert len(rates["rate"]) == 16 and rates["rate"][0] == 1.0     # slot 1 is the AR token
    assert set(res["auc"]) == {"lossless", "prove@0.01", "prove@0.1", "mars", "spec"}
    assert set(res["pass_cost"]) == {"target", "verifier", "draft"}
    for role, curve in res["pass_cost"].items():     # t(n) measured at n = 1..16 (ratios: the synthetic test)
        assert curve["n"] == list(range(1, 17)) and all(t > 0 for t in curve["seconds"]), role
        assert len(curve["ratio"]) == 16 and all(r > 0 for r in curve["ratio"]), role
    assert [p["id"] for p in res["prompts"]] == ["gsm/0", "gsm/1"]
    assert res["data"]["families"] == {"gsm8k": 2} and "--max-new 32" in res["command"]
    assert len((out / "generations.jsonl").read_text().splitlines()) == 12
    md = (out / "summary.md").read_text()
    assert "## Speed and quality per run" in md and "## Cost of one pass" in md
    for p in ("speedup.png", "match_rate_by_slot.png", "matched_by_position.png", "roc.png", "theta_sweep.png", "pass_cost.png"):
        assert (out / p).read_bytes()[:4] == b"\x89PNG", p
    assert not [f for f in out.iterdir() if f.name.startswith(".")]     # no temp files left
    assert "| `lossless` |" in capsys.readouterr().out

    # --report-only rebuilds the same report from results.json + generations.jsonl, running nothing
    (out / "summary.md").unlink()
    assert main(["bench", "--out", str(out), "--report-only", "--no-plots"]) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["rebuilt"] and again["created"] == res["created"] and again["command"] == res["command"]
    for key in ("data", "settings", "models", "reference", "position_match_rate"):
        assert again[key] == res[key], key
    assert [(r["theta"], r["tokens_per_cycle"]) for r in again["theta_sweep"]] == \
        [(r["theta"], r["tokens_per_cycle"]) for r in res["theta_sweep"]]
    for name, m in res["modes"].items():
        for k in ("tokens", "n_cycles", "tokens_per_cycle", "passes_per_token", "exact_match_vs_ar", "accuracy",
                  "loop_share", "tokens_per_cycle_outside_loops"):
            assert again["modes"][name][k] == m[k], (name, k)
        assert again["modes"][name]["tokens_per_second"] == pytest.approx(m["tokens_per_second"], rel=0.02)  # seconds: 5 decimals
    for name, a in res["auc"].items():    # p and q are stored to 5 decimals: ties may move the AUC a little
        assert again["auc"][name]["p"] == pytest.approx(a["p"], abs=0.02)
    assert [p["runs"]["lossless"]["stop"] for p in again["prompts"]] == [p["runs"]["lossless"]["stop"] for p in res["prompts"]]
    assert (out / "summary.md").read_text().startswith("# prove-local bench")

    # a folder written before the target's role was named "target" ("proposer") reads back the same
    for name in ("results.json", "generations.jsonl"):
        f = out / name
        text = f.read_text()
        assert '"target":' in text
        f.write_text(text.replace('"target":', '"proposer":'))
    assert main(["bench", "--out", str(out), "--report-only", "--no-plots"]) == 0
    old = json.loads((out / "results.json").read_text())
    assert old["models"] == again["models"] and old["pass_cost"] == again["pass_cost"]
    for name, m in again["modes"].items():
        assert old["modes"][name]["passes_per_token"] == m["passes_per_token"], name


def test_bench_report_only_errors(tmp_path, capsys):
    from prove_local.cli import main
    assert main(["bench", "--out", str(tmp_path), "--report-only"]) == 1
    assert "not a readable bench folder" in capsys.readouterr().err
    assert main(["bench", "--out", str(tmp_path)]) == 1
    assert "--data PATH is required" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--modes", "ar,spec"], "needs --draft"),
    (["--modes", "ar,beam"], "unknown mode"),
    (["--modes", "prove"], "needs --verifier"),
    (["--modes", "ar", "--data", "/nonexistent/x.jsonl"], "no such file"),
])
def test_bench_usage_errors(tiny_models, tmp_path, capsys, argv, message):
    from prove_local.cli import main
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
    args = ["bench", "--proposer", str(tiny_models[0]), "--out", str(tmp_path / "o")] + argv
    if "--data" not in argv:
        args += ["--data", str(data)]
    assert main(args) == 1
    assert message in capsys.readouterr().err


def test_bench_auto_against_fixed_blocks_and_oracle(tiny_models, tmp_path, monkeypatch):
    """--block auto,N: one run per width, side by side; the report compares them, shows the widths the
    planner chose, the oracle bound and the planner's projection for a flat curve."""
    from prove_local.cli import main
    monkeypatch.setenv("PROVE_LOCAL_CACHE", str(tmp_path / "cache"))
    prop, ver, draft = tiny_models
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "x\n#### 3"}) + "\n"
                            for q in ("What is 1 + 2?", "Natalia sold 48 clips.")))
    out = tmp_path / "out"
    rc = main(["bench", "--proposer", str(prop), "--draft", str(draft), "--modes", "ar,lossless,spec",
               "--data", str(data), "--max-new", "24", "--threads", "1", "--ctx", "512", "--kv-type", "f32",
               "--warmup", "0", "--pass-cost-reps", "1", "--pass-cost-max", "16", "--out", str(out), "-q",
               "--block", "auto,2,16", "--draft-k", "auto,3", "--oracle", "--no-plots"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert list(res["modes"]) == ["ar", "lossless@auto", "lossless@B2", "lossless@B16", "spec@auto", "spec@k3"]
    for name in ("lossless@auto", "lossless@B2", "lossless@B16", "spec@auto", "spec@k3"):
        assert res["modes"][name]["exact_match_vs_ar"] == 1.0, name
    assert res["modes"]["lossless@B2"]["block"] == 2 and res["modes"]["lossless@auto"]["block"] == "auto"
    assert set(res["modes"]["lossless@B2"]["widths"]) == {"B=2 v=2"}
    a = res["auto_vs_fixed"]["lossless@auto"]
    assert set(a["fixed"]) == {"lossless@B2", "lossless@B16"} and a["best_fixed"] in a["fixed"]
    assert sum(a["widths"].values()) == res["modes"]["lossless@auto"]["n_cycles"]
    assert set(res["auto_vs_fixed"]["spec@auto"]["fixed"]) == {"spec@k3"}
    orc = res["oracle"]
    assert orc["n_positions"] == res["modes"]["ar"]["tokens"] and orc["slot_match_rate"][0] == 1.0
    for key in ("tokens_per_t1", "tokens_per_t1_flat"):
        pol = orc[key]
        assert pol["oracle"] >= 1.0 and pol["oracle"] >= max(pol["fixed_blocks"].values()) - 1e-9
    assert orc["conditional_slot_rate"][0] == 1.0 and orc["planner_choice"]["flat"] in ("ar", *range(1, 17))
    flat = res["projection"]["flat"]
    assert [r["width"] for r in flat if r["chosen"]] == [16]
    md = (out / "summary.md").read_text()
    assert "## `--block auto` against fixed widths" in md and "## Lossless: fixed blocks, the oracle bound" in md
    # the report rebuilds from its own files
    assert main(["bench", "--report-only", "--out", str(out), "--no-plots"]) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["oracle"]["match_runs"] == orc["match_runs"]
    assert again["oracle"]["tokens_per_t1_flat"] == orc["tokens_per_t1_flat"]      # no timing in it
    for name, a in res["auto_vs_fixed"].items():                       # (stored seconds are rounded)
        assert again["auto_vs_fixed"][name]["widths"] == a["widths"] and again["auto_vs_fixed"][name]["fixed"].keys() == a["fixed"].keys()
    for b, v in orc["tokens_per_t1"]["fixed_blocks"].items():      # (the stored curve is rounded)
        assert again["oracle"]["tokens_per_t1"]["fixed_blocks"][b] == pytest.approx(v, rel=1e-2)


def test_oracle_lossless_shortest_path():
    from prove_local.bench.stats import oracle_lossless
    flat = {1: 1.0, 64: 1.0}
    assert oracle_lossless([1, 1, 1, 1], flat) == pytest.approx(1.0)        # nothing matches: ar's rate
    # 6 slots match at position 0: one cycle verifying 6 commits 7 tokens for two flat passes
    assert oracle_lossless([6, 1, 1, 1, 1, 1, 1], flat) == pytest.approx(7 / 2)
    steep = {1: 1.0, 2: 2.0, 64: 64.0}                                      # width costs linearly: ar ties
    assert oracle_lossless([6, 1, 1, 1, 1, 1, 1], steep) == pytest.approx(1.0)
    # a measured curve on which a 2-token pass is cheaper than a 1-token one (noise, load): a block of
    # 2 verified whole commits 2 tokens (slot 1 and the correction) for 2 * 0.5, and the oracle knows it
    dip = {1: 1.0, 2: 0.5, 64: 64.0}
    assert oracle_lossless([1, 1, 1, 1], dip) == pytest.approx(2.0)


def test_cycle_cost_from_the_widths_actually_fed():
    """A prove cycle after one that committed 3 tokens feeds its proposer 3 + B - 1 tokens, not B."""
    from prove_local.bench.stats import cycle_cost_widths
    curves = {"target": {1: 1.0, 2: 1.5, 4: 2.0, 8: 4.0}, "verifier": {1: 0.5, 8: 4.0}}
    assert cycle_cost_widths({"target": [3 + 4 - 1]}, curves) == pytest.approx(3.0)      # t(6)/t(1)
    assert cycle_cost_widths({"target": [4, 2]}, curves) == pytest.approx(3.5)           # lossless B=4, v=2
    # the verifier's pass in proposer units: its t(4)/t(1) = 4 times rho = t_v(1)/t_p(1) = 0.5
    assert cycle_cost_widths({"target": [4], "verifier": [4]}, curves) == pytest.approx(2.0 + 0.5 * 4.0)
    assert cycle_cost_widths({"target": [4, 4]}, curves, flat=True) == 2.0


def test_bench_external_llama_speculative_baseline(tiny_models, tmp_path, monkeypatch):
    """--llama-spec BIN: run once per prompt with the proposer as target and --draft as draft; its
    'decoded N tokens in S seconds' line is compared with every run. A missing BIN is skipped with a note.
    (A stand-in executable checks the arguments; the real binary is llama.cpp's.)"""
    from prove_local.cli import main
    monkeypatch.setenv("PROVE_LOCAL_CACHE", str(tmp_path / "cache"))
    prop, ver, draft = tiny_models
    fake = tmp_path / "llama-speculative-simple"
    fake.write_text("#!" + sys.executable + "\n"
                    "import sys\n"
                    "a = sys.argv[1:]\n"
                    f"assert a[a.index('-m') + 1] == {str(prop)!r} and a[a.index('-md') + 1] == {str(draft)!r}\n"
                    "assert '--spec-draft-n-max' in a and a[a.index('--temp') + 1] == '0'\n"
                    "text = open(a[a.index('-f') + 1], encoding='utf-8').read()\n"
                    "if 'FAIL' in text: sys.exit(3)\n"
                    "n = int(a[a.index('-n') + 1])\n"
                    "print(f'decoded {n:4d} tokens in    0.010 seconds, speed: {n / 0.01:8.3f} t/s', file=sys.stderr)\n"
                    "print('accept    = 42.000%', file=sys.stderr)\n")
    fake.chmod(0o755)
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "x\n#### 3"}) + "\n" for q in ("What is 1 + 2?", "FAIL here")))
    out = tmp_path / "out"
    base = ["bench", "--proposer", str(prop), "--draft", str(draft), "--modes", "ar,spec", "--data", str(data),
            "--max-new", "8", "--threads", "1", "--ctx", "512", "--kv-type", "f32", "--warmup", "0", "--no-pass-cost",
            "--no-plots", "-q", "--draft-k", "3", "--out", str(out)]
    assert main(base + ["--llama-spec", str(fake)]) == 0
    ext = json.loads((out / "results.json").read_text())["external"]
    assert ext["n_ok"] == 1 and ext["n_failed"] == 1 and ext["tokens_per_second"] == pytest.approx(800.0)
    assert ext["runs"]["gsm/0"] == {"tokens": 8, "seconds": 0.01, "accept_percent": 42.0}
    assert set(ext["run_over_external_median"]) == {"ar", "spec"} and ext["run_over_external_median"]["ar"] > 0
    assert "llama-speculative-simple" in (out / "summary.md").read_text()
    assert main(base + ["--llama-spec", str(tmp_path / "absent")]) == 0
    assert json.loads((out / "results.json").read_text())["external"] is None


def test_slot_labels_with_a_verified_prefix():
    """--block auto: a lossless cycle may verify only v of its B slots; q exists for those alone."""
    from prove_local.bench.stats import detector_aucs, slot_labels
    from prove_local.rules import Cycle, Plan
    c = Cycle([5, 6, 7, 8], [.9, .8, .3, .2], [.9, .7], [5, 6, 9], 2, {"target": 2}, widths={"target": [4, 2]},
              plan=Plan("lossless", 4, verify=2), gate=[True, True, None, None])
    labels = slot_labels([c], [5, 6, 9], [5, 6, 9, 1])
    assert [r["q"] for r in labels] == [.9, .7, None, None] and [r["match"] for r in labels] == [True, True, False, False]
    a = detector_aucs(labels)
    assert a["p"] == 1.0 and a["q"] is None          # the verified slots all match: no negative class for q


def test_lossless_policies_and_conditional_rates():
    from prove_local.bench.stats import conditional_slot_rates, fixed_block_cost, lossless_policies
    match = {0: [3, 1, 1, 1, 2, 1], 1: [1, 1]}
    flat = lossless_policies(match, None, blocks=(1, 2, 4))
    # B=1: every cycle 2 tokens for 2 passes; B=4 on answer 0: cycles at 0 (4 tokens), 4 (3 tokens)
    assert flat["fixed_blocks"][1] == pytest.approx(1.0)
    assert fixed_block_cost(match[0], 4, None) == 4 and flat["fixed_blocks"][4] == pytest.approx(8 / (4 + 2))
    assert flat["oracle"] >= max(flat["fixed_blocks"].values())
    assert conditional_slot_rates([3, 1, 2, 1], 3) == [1.0, 0.5, 0.5]


# ------------------------------------------------------------ comparison at equal error (issue 16)
def test_equal_error_comparison_hand_computed():
    sweep = [{"theta": 0.5, "exact_match_vs_ar": 1.0, "accuracy": 0.1, "tokens_per_cycle": 1.0},
             {"theta": 0.1, "exact_match_vs_ar": 0.8, "accuracy": 0.1, "tokens_per_cycle": 1.5},
             {"theta": 0.05, "exact_match_vs_ar": 0.6, "accuracy": 0.05, "tokens_per_cycle": 1.4},  # dominated
             {"theta": 0.01, "exact_match_vs_ar": 0.4, "accuracy": 0.0, "tokens_per_cycle": 2.5},
             {"theta": 0.001, "exact_match_vs_ar": None, "accuracy": None, "tokens_per_cycle": 3.0}]
    pts = stats.error_points(sweep)
    assert [(p["theta"], round(p["error"], 6)) for p in pts] == [(0.5, 0.0), (0.1, 0.2), (0.05, 0.4), (0.01, 0.6)]
    acc = stats.error_points(sweep, "accuracy", ar_accuracy=0.1)
    assert [round(p["error"], 6) for p in acc] == [0.0, 0.0, 0.05, 0.1]
    with pytest.raises(ValueError, match="unknown error kind"):
        stats.error_points(sweep, "loss")
    # envelope: (0, 1.0) (0.2, 1.5) (0.6, 2.5); the θ=0.05 point (0.4, 1.4) is dominated
    assert stats.frontier_at(pts, 0.0) == pytest.approx(1.0)
    assert stats.frontier_at(pts, 0.1) == pytest.approx(1.25)
    assert stats.frontier_at(pts, 0.4) == pytest.approx(2.0)
    assert stats.frontier_at(pts, 0.6) == pytest.approx(2.5)
    assert stats.frontier_at(pts, 0.7) is None and stats.frontier_at([], 0.1) is None
    # a new sweep with 10 % more tokens per cycle at every error
    new = [dict(p, tokens_per_cycle=p["tokens_per_cycle"] * 1.1) for p in pts]
    cmp = stats.at_equal_error(new, pts)
    assert cmp["n"] == 3 and cmp["mean_ratio"] == pytest.approx(1.1)
    assert cmp["points"][0]["ratio"] is None          # error 0: nothing traded
    # the new sweep reaches less error range: points beyond it are not extrapolated
    short = [p for p in new if p["error"] <= 0.2]
    cmp = stats.at_equal_error(short, pts)
    assert cmp["n"] == 1 and cmp["points"][1]["ratio"] == pytest.approx(1.1)
    assert [r["ratio"] for r in cmp["points"][2:]] == [None, None]


def test_bench_parallel_batches_the_runs_and_keeps_each_output(tiny_models, tmp_path, capsys, monkeypatch):
    """--parallel 2: the runs generate the prompts two at a time on a batched pool; every request's
    tokens are those of the same request alone (--parallel 1), the groups shared their steps (fewer
    steps than the requests' passes), and the report's batched section reads back with --report-only."""
    from prove_local.cli import main
    monkeypatch.setenv("PROVE_LOCAL_CACHE", str(tmp_path / "cache"))
    prop, _, _ = tiny_models
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "#### 3"}) + "\n"
                            for q in ("What is 1 + 2?", "Natalia sold 48 clips.", "Three")))
    common = ["bench", "--proposer", str(prop), "--modes", "ar,lossless", "--data", str(data), "--max-new", "12",
              "--threads", "1", "--ctx", "256", "--kv-type", "f32", "--warmup", "2", "--no-pass-cost", "--no-plots", "-q"]
    assert main(common + ["--out", str(tmp_path / "one")]) == 0
    assert main(common + ["--parallel", "2", "--out", str(tmp_path / "two")]) == 0
    assert "batched, 2 requests at a time:" in capsys.readouterr().out
    one, two = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert one["batched"] is None and two["settings"]["parallel"] == 2 and "--parallel 2" in two["command"]

    def tokens(folder):
        return {(g["prompt"], g["run"]): g["tokens"]
                for g in map(json.loads, (tmp_path / folder / "generations.jsonl").read_text().splitlines())}
    assert tokens("two") == tokens("one") and len(tokens("two")) == 6
    assert two["modes"]["lossless"]["exact_match_vs_ar"] == 1.0
    b = two["batched"]
    assert b["parallel"] == 2 and set(b["runs"]) == {"ar", "lossless"}
    gens = [json.loads(x) for x in (tmp_path / "two" / "generations.jsonl").read_text().splitlines()]
    for name, r in b["runs"].items():
        assert r["groups"] == 2 and r["requests"] == 3 and r["tokens"] == two["modes"][name]["tokens"]
        assert r["tokens_per_second"] > 0
        assert r["decodes"] >= r["steps"] > 0
    for g in b["groups"]:
        assert len(g["prompts"]) == (2 if g["prompts"][0] == "gsm/0" else 1)
        passes = sum(sum(c["passes"].values()) for x in gens if x["run"] == g["run"] and x["prompt"] in g["prompts"]
                     for c in x["cycles"])
        if len(g["prompts"]) == 2:    # two requests in one group: their passes shared the steps
            assert g["steps"] < passes, g
        else:                         # alone, each pass is a step of its own (and the prefill one more)
            assert g["steps"] >= passes, g
    assert b["runs"]["ar"]["vs_ar"] == 1.0 and b["runs"]["lossless"]["vs_ar"] > 0
    assert "## Batched: 2 requests at a time" in (tmp_path / "two" / "summary.md").read_text()
    assert main(["bench", "--out", str(tmp_path / "two"), "--report-only", "--no-plots"]) == 0
    again = json.loads((tmp_path / "two" / "results.json").read_text())
    assert again["batched"]["groups"] == b["groups"]
    for name, r in b["runs"].items():          # (a group's seconds are stored to 5 decimals)
        assert again["batched"]["runs"][name]["vs_ar"] == pytest.approx(r["vs_ar"], rel=0.01), name


def test_parallel_sweep_script(tiny_models, tmp_path):
    """scripts/parallel_sweep.py: one bench per --parallel value, the table, the plot and the JSON."""
    import subprocess
    from pathlib import Path
    prop, _, _ = tiny_models
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "#### 3"}) + "\n" for q in ("One", "Two", "Three")))
    out = tmp_path / "sweep"
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "scripts" / "parallel_sweep.py"), "--proposer", str(prop),
                        "--parallel", "1,2", "--data", str(data), "--limit", "3", "--max-new", "6", "--threads", "1",
                        "--out", str(out), "--", "--ctx", "256", "--kv-type", "f32", "--warmup", "0"],
                       capture_output=True, text=True, timeout=240, env={**os.environ, "PROVE_LOCAL_CACHE": str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    assert set(res["sweep"]) == {"1", "2"} and "--parallel 2" in res["commands"]["2"]
    for p, v in res["sweep"].items():
        assert set(v) == {"ar", "lossless"} and v["ar"]["vs_ar"] == 1.0 and v["lossless"]["exact_match_vs_ar"] == 1.0
        assert v["ar"]["tokens_per_second"] > 0 and v["ar"]["requests"] == 3
    assert res["sweep"]["1"]["ar"]["tokens_per_step"] is None and res["sweep"]["2"]["ar"]["tokens_per_step"] > 1
    md = (out / "summary.md").read_text()
    assert "| 2 |" in md and "Every exact run's outputs equal `ar`'s at every P." in md
    assert (out / "parallel_sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "p2" / "results.json").is_file()


def test_generate_together_waits_for_every_job_to_close_after_ctrl_c():
    """Ctrl-C lands while the caller waits for the first job, whose generation takes a while to close:
    generate_together raises only once it is closed. (Waiting with Thread.join, Python 3.11 marked an
    interrupted join's thread stopped while it still ran, and the caller went on with an engine still
    decoding: the test below failed 2-6 times in 30.) Fakes: no llama.cpp."""
    import signal
    import threading
    import time
    from prove_local.bench.runner import generate_together
    main = threading.main_thread().ident

    class Gen:
        def __init__(self, interrupt_at=None, close_s=0.0):
            self.i, self.interrupt_at, self.close_s, self.closed = 0, interrupt_at, close_s, False
            self.request = object()

        def __iter__(self):
            return self

        def __next__(self):
            self.i += 1
            if self.i > 500:
                raise StopIteration
            time.sleep(0.01)
            if self.i == self.interrupt_at:
                signal.pthread_kill(main, signal.SIGINT)
            return self.i

        def close(self):
            time.sleep(self.close_s)          # (an engine cutting its caches back, slowly)
            self.closed = True

    gens = [Gen(close_s=0.5), Gen(interrupt_at=3)]
    engines = [type("E", (), {"generate": lambda self, *a, g=g: g})() for g in gens]
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            generate_together(engines, [([1], None), ([2], None)])
        assert gens[0].closed and gens[1].closed
        assert gens[0].i < 500 and gens[1].i < 500          # both stopped after their current cycle
    finally:
        signal.signal(signal.SIGINT, old)


def test_generate_together_ctrl_c_stops_every_request_and_leaves_only_committed_tokens(tiny_models):
    """Ctrl-C while a batched group generates (bench --parallel): every request stops after its
    current cycle, KeyboardInterrupt reaches the caller, and each engine's sequence then holds only
    its committed tokens (a next request on it equals the same request on a fresh engine)."""
    import signal
    import threading
    from prove_local.bench.runner import generate_together
    from prove_local.engine import Engine, Settings
    from prove_local.llama import Model
    from prove_local.loading import Loaded
    from prove_local.pool import EnginePool
    opts = dict(n_ctx=512, n_threads=1, type_k="f32", type_v="f32")
    model = Model(tiny_models[0])
    pool = EnginePool(Loaded(model, None, None, dict(opts)), parallel=2)
    # (a background job may have inherited SIGINT ignored: the test installs Python's handler itself)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pool.engine() as (_, e0), pool.engine() as (_, e1):
            real = e1.generate

            main = threading.main_thread().ident

            def interrupting(*a, **kw):          # Ctrl-C after this request's third cycle
                for k, c in enumerate(real(*a, **kw)):
                    yield c
                    if k == 2:                   # a real SIGINT to the main thread: it wakes its wait at once
                        signal.pthread_kill(main, signal.SIGINT)
            e1.generate = interrupting
            p = [model.tokenize(f"Question {i}: what is {i} + 2? ") for i in range(2)]
            s = Settings(mode="lossless", max_new=200, block=4)
            with pytest.raises(KeyboardInterrupt):
                generate_together([e0, e1], [(p[0], s), (p[1], s)])
            e1.generate = real
            for e in (e0, e1):
                ctx = e.contexts["target"]
                assert ctx.n_past <= len(e.tokens) < len(p[0]) + 200     # stopped early, nothing uncommitted
            fresh = Engine.load(model, None, None, **opts)
            try:
                want = [t for c in fresh.generate(p[1], Settings(mode="ar", max_new=12)) for t in c.committed]
                got = [t for c in e1.generate(p[1], Settings(mode="ar", max_new=12)) for t in c.committed]
                assert got == want
            finally:
                fresh.close()
    finally:
        signal.signal(signal.SIGINT, old)
        pool.close()
        model.close()


def test_bench_measures_pass_costs_then_warms_up_then_prefills_each_run_untimed(tiny_models, tmp_path, monkeypatch):
    """The order of a bench's work: the pass-cost curves, then the warm-up (what the timed runs follow),
    then each timed run right after an untimed one-token request on its own prompt (the prefill: the
    first run after it would otherwise decode slower, whichever mode the rotation put first); only the
    timed runs are recorded."""
    from prove_local.bench import runner
    from prove_local.cli import main
    monkeypatch.setenv("PROVE_LOCAL_CACHE", str(tmp_path / "cache"))
    prop, _, _ = tiny_models
    events = []
    real_once, real_cost = runner.generate_once, runner.measure_pass_cost

    def once(engine, tokens, settings):
        events.append(("gen", settings.mode, settings.max_new, tuple(tokens)))
        return real_once(engine, tokens, settings)

    def cost(*a, **kw):
        events.append(("pass cost",))
        return real_cost(*a, **kw)
    monkeypatch.setattr(runner, "generate_once", once)
    monkeypatch.setattr(runner, "measure_pass_cost", cost)
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "x\n#### 3"}) + "\n"
                            for q in ("What is 1 + 2?", "Natalia sold 48 clips.")))
    out = tmp_path / "out"
    assert main(["bench", "--proposer", str(prop), "--modes", "ar,lossless", "--data", str(data), "--max-new", "8",
                 "--threads", "1", "--ctx", "256", "--kv-type", "f32", "--warmup", "4", "--pass-cost-reps", "1",
                 "--pass-cost-max", "4", "--no-plots", "--out", str(out), "-q"]) == 0
    assert events[0] == ("pass cost",)
    assert [e[2] for e in events[1:3]] == [4, 4]                       # the warm-up: each mode, after the curves
    timed = events[3:]
    assert len(timed) == 2 * 2 * 2                                     # 2 prompts x 2 modes, each after its prefill
    for prefill, run in zip(timed[::2], timed[1::2]):
        assert prefill[2] == 1 and run[2] == 8 and prefill[1] == run[1] and prefill[3] == run[3]
    assert len((out / "generations.jsonl").read_text().splitlines()) == 4
