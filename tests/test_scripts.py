"""Every tool kept in scripts/ answers --help, quickly and without loading llama.cpp or an optional
extra: its arguments are parsed before its heavy imports, so a broken import path or a script that
was renamed away shows here, in seconds. Experiments live in dev/ and are not run (dev/README.md)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"

# Modules a --help must not import: llama.cpp itself and the heavy or optional packages. Each is
# set to None in sys.modules, so importing it raises ImportError and the script fails.
POISONED = ("llama_cpp", "gguf", "torch", "gradio", "matplotlib", "playwright", "fastapi", "uvicorn",
            "openai", "scipy", "prove_local.llama", "prove_local.engine")
# Scripts not run here, and why.
NOT_RUN = {
    "test.sh": "the test command itself: it installs packages before running pytest (.ci/run runs it)",
}
RUNNER = """
import runpy, sys
for name in {poisoned!r}:
    sys.modules[name] = None
sys.argv = [{path!r}, "--help"]
runpy.run_path({path!r}, run_name="__main__")
"""


def kept_scripts() -> list[str]:
    return sorted(p.name for p in SCRIPTS.iterdir() if p.is_file() and p.suffix in (".py", ".sh"))


def test_every_file_in_scripts_is_a_tested_tool():
    names = kept_scripts()
    assert {"soak.py", "gpu_check.sh", "inflate.py", "lookup_bench.py"} <= set(names)
    stray = [p.name for p in SCRIPTS.iterdir() if p.is_file() and p.suffix not in (".py", ".sh")]
    assert stray == [], f"scripts/ holds tools only (experiments go to dev/): {stray}"
    assert set(NOT_RUN) <= set(names)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [n for n in kept_scripts() if n not in NOT_RUN])
def test_help(name):
    path = str(SCRIPTS / name)
    if name.endswith(".py"):
        cmd = [sys.executable, "-c", RUNNER.format(poisoned=POISONED, path=path)]
    else:
        cmd = ["bash", path, "--help"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, f"{name} --help: exit {r.returncode}\n{r.stderr[-2000:]}"
    out = r.stdout.lower()
    assert ("usage" in out) if name.endswith(".py") else len(r.stdout.strip()) > 40, r.stdout


def test_serve_bench_pairs_each_run_with_llama_server_in_the_same_round():
    """serve_bench's paired ratio: the median over rounds of a run's tokens/s over llama-server's at the
    same round and concurrency (a machine that speeds up from round to round moves both alike), next to
    the ratio of the medians."""
    sb = _serve_bench()

    def run(server, rnd, tps, clients=1):
        ours = server != "llama-server"            # per request: the server's ms per token, ours its llama_decode part
        requests = [{"ms_per_token": 10.0 + rnd + k, "decode_ms_per_token": 9.0 + rnd + k if ours else None}
                    for k in (0.0, 0.5)]
        return {"server": server, "mode": None if server == "llama-server" else "ar", "clients": clients,
                "round": rnd, "tokens_per_s": tps, "p50_s": 1.0, "p95_s": 1.0, "ok": 1, "sent": 1, "requests": requests}
    runs = [run("llama-server", 0, 100.0), run("prove-local", 0, 90.0),      # 0.9
            run("llama-server", 1, 200.0), run("prove-local", 1, 190.0),     # 0.95
            run("llama-server", 2, 300.0), run("prove-local", 2, 330.0),     # 1.1
            run("prove-local", 3, 50.0)]                                     # no llama-server run: not paired
    rows = {r["server"]: r for r in sb.summarize(runs)}
    assert rows["prove-local"]["paired"] == pytest.approx(0.95)
    assert rows["llama-server"]["paired"] is None
    assert rows["prove-local"]["tokens_per_s"] == pytest.approx((90.0 + 190.0) / 2)   # the median of 4 rounds
    # ms per token: the median over every request of the rounds (prove-local: 8 requests, 10.0 .. 13.5)
    assert rows["prove-local"]["ms_per_token"] == pytest.approx(11.75)
    assert rows["prove-local"]["decode_ms_per_token"] == pytest.approx(10.75)
    assert rows["llama-server"]["ms_per_token"] == pytest.approx(11.25)       # rounds 0-2
    assert rows["llama-server"]["decode_ms_per_token"] is None
    md = sb.markdown(list(rows.values()), {"model_name": "m", "parallel": 4, "threads": 2, "command": "c",
                                           "requests": 3, "max_tokens": 64, "rounds": 4, "when": "now"})
    assert "| 0.95 |" in md
    assert "| 11.75 | 10.75 |" in md and "| 11.25 | — |" in md
    # the median request, not the mean: one slow request (a prefill, a stall) does not move it
    skewed = run("prove-local", 0, 90.0)
    skewed["requests"] = [{"ms_per_token": x, "decode_ms_per_token": None} for x in (10.0, 11.0, 40.0)]
    assert sb._median_of([skewed], "ms_per_token") == pytest.approx(11.0)


def _serve_bench():
    import importlib.util
    spec = importlib.util.spec_from_file_location("serve_bench", SCRIPTS / "serve_bench.py")
    sb = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec.loader.exec_module(sb)
    finally:
        sys.path.remove(str(SCRIPTS))
    return sb


def test_serve_bench_paired_interval_is_the_order_statistics_one():
    """The paired ratio's 95 % interval: the k-th smallest and k-th largest of n rounds' ratios, k the
    largest with 1 - 2 P(Binomial(n, 1/2) < k) >= 0.95 (n = 12: k = 3, 96.1 %; n = 6: k = 1, 96.9 %;
    n = 5: too few, min and max at 93.75 %); summarize and the table carry it, and --from DIR
    summarizes a saved run again without starting a server."""
    sb = _serve_bench()
    xs = [0.90 + 0.01 * i for i in (7, 2, 11, 0, 5, 9, 1, 4, 10, 3, 8, 6)]     # 0.90 .. 1.01, shuffled
    lo, hi, cov = sb.median_ci(xs)
    assert (lo, hi) == (pytest.approx(0.92), pytest.approx(0.99)) and cov == pytest.approx(1 - 2 * 79 / 4096)
    assert sb.median_ci([3.0, 1.0, 2.0, 5.0, 4.0, 6.0])[:2] == (1.0, 6.0)
    assert sb.median_ci([3.0, 1.0, 2.0, 5.0, 4.0])[2] == pytest.approx(0.9375)
    assert sb.median_ci(list(range(100)))[:2] == (39, 60)   # k = 40 (the normal approximation's 50 -/+ 9.8)
    with pytest.raises(ValueError):
        sb.median_ci([])

    def run(server, rnd, tps):
        return {"server": server, "mode": None if server == "llama-server" else "ar", "clients": 2, "round": rnd,
                "tokens_per_s": tps, "p50_s": 1.0, "p95_s": 1.0, "ok": 1, "sent": 1,
                "requests": [{"ms_per_token": 10.0}]}
    runs = [r for i in range(6) for r in (run("llama-server", i, 100.0), run("prove-local", i, 95.0 + 2 * i))]
    rows = {r["server"]: r for r in sb.summarize(runs)}
    assert rows["prove-local"]["paired_ci"][:2] == (pytest.approx(0.95), pytest.approx(1.05))
    assert rows["llama-server"]["paired_ci"] is None
    one = {r["server"]: r for r in sb.summarize(runs[:2])}            # one round: no interval
    assert one["prove-local"]["paired_ci"] is None
    meta = {"model_name": "m", "parallel": 4, "threads": 2, "command": "c", "requests": 3, "max_tokens": 64,
            "rounds": 6, "when": "now"}
    assert "| 1.00 | 0.95–1.05 |" in sb.markdown(list(rows.values()), meta)
    five = {r["server"]: r for r in sb.summarize(runs[:10])}
    assert "| 0.95–1.03 (94%) |" in sb.markdown(list(five.values()), meta)


def test_serve_bench_from_summarizes_a_saved_run_again(tmp_path):
    import json
    sb = _serve_bench()
    runs = [{"server": s, "mode": m, "clients": 1, "round": i, "tokens_per_s": t, "p50_s": 1.0, "p95_s": 1.0,
             "ok": 1, "sent": 1, "requests": [{"ms_per_token": 10.0}]}
            for i in range(3) for s, m, t in (("llama-server", None, 100.0), ("prove-local", "ar", 90.0 + 10 * i))]
    src = tmp_path / "old"
    src.mkdir()
    meta = {"model_name": "m", "parallel": 4, "threads": 2, "command": "c", "requests": 3, "max_tokens": 64,
            "rounds": 3, "when": "then"}
    (src / "results.json").write_text(json.dumps({"meta": meta, "summary": [], "runs": runs}))
    assert sb.main(["--from", str(src), "--out", str(tmp_path / "new")]) == 0
    text = (tmp_path / "new" / "summary.md").read_text()
    assert "| 1.00 | 0.90–1.10 (75%) |" in text                       # 3 rounds: min and max, 75 % coverage
    again = json.loads((tmp_path / "new" / "results.json").read_text())
    assert again["runs"] == runs and again["meta"] == meta
    assert [r["paired_ci"] for r in again["summary"] if r["server"] == "prove-local"] == [[0.9, 1.1, 0.75]]
    assert not (src / "summary.md").exists()                         # the source folder is left alone
    with pytest.raises(SystemExit):
        sb.main(["--from", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit):
        sb.main(["--rounds", "2"])                                    # neither --out nor --from


def test_serve_bench_from_pools_the_rounds_of_several_runs(tmp_path, capsys):
    """--from A --from B: the rounds of both, numbered on (each round still paired within itself), one
    interval over all of them; a run of another configuration is refused, naming the key."""
    import json
    sb = _serve_bench()
    meta = {"model_name": "m", "parallel": 4, "threads": 2, "ctx": 2048, "command": "c", "requests": 3,
            "max_tokens": 64, "modes": ["ar"], "rounds": 3, "when": "then"}

    def saved(name, ours, **change):
        runs = [{"server": s, "mode": m, "clients": 1, "round": i, "tokens_per_s": t, "p50_s": 1.0, "p95_s": 1.0,
                 "ok": 1, "sent": 1, "requests": [{"ms_per_token": 10.0}]}
                for i in range(3) for s, m, t in (("llama-server", None, 100.0), ("prove-local", "ar", ours[i]))]
        d = tmp_path / name
        d.mkdir()
        (d / "results.json").write_text(json.dumps({"meta": {**meta, "when": name, **change}, "summary": [],
                                                    "runs": runs}))
        return d
    a = saved("a", [90.0, 95.0, 100.0])
    b = saved("b", [105.0, 110.0, 115.0])
    assert sb.main(["--from", str(a), "--from", str(b), "--out", str(tmp_path / "both")]) == 0
    res = json.loads((tmp_path / "both" / "results.json").read_text())
    assert sorted({r["round"] for r in res["runs"]}) == [0, 1, 2, 3, 4, 5]
    assert res["meta"]["rounds"] == 6 and [p["from"] for p in res["meta"]["pooled"]] == [str(a), str(b)]
    row = next(r for r in res["summary"] if r["server"] == "prove-local")
    assert row["paired"] == pytest.approx(1.025)                      # median of 0.90 .. 1.15
    assert row["paired_ci"] == [pytest.approx(0.90), pytest.approx(1.15), pytest.approx(1 - 2 / 64)]
    with pytest.raises(SystemExit):                                   # several sources need --out
        sb.main(["--from", str(a), "--from", str(b)])
    other = saved("other", [100.0] * 3, threads=4)
    with pytest.raises(SystemExit):
        sb.main(["--from", str(a), "--from", str(other), "--out", str(tmp_path / "no")])
    assert "threads is 4" in capsys.readouterr().err
    # a run with nothing repeated (--distinct) is another configuration; one saved before the key existed
    # asked the repeated prompts
    distinct = saved("distinct", [100.0] * 3, prompts="distinct")
    with pytest.raises(SystemExit):
        sb.main(["--from", str(a), "--from", str(distinct), "--out", str(tmp_path / "no2")])
    assert "prompts is 'distinct'" in capsys.readouterr().err
    repeated = saved("repeated", [100.0] * 3, prompts="repeated")
    assert sb.main(["--from", str(a), "--from", str(repeated), "--out", str(tmp_path / "old-new")]) == 0


def test_serve_bench_pairs_a_mode_with_its_no_recall_twin_in_the_same_round():
    """recall_pairs: MODE over MODE/no-recall at the same round and concurrency, the median over rounds
    (a mode without its twin, and llama-server, give none); the summary prints it under the table."""
    sb = _serve_bench()

    def run(server, mode, rnd, tps, clients):
        return {"server": server, "mode": mode, "clients": clients, "round": rnd, "tokens_per_s": tps,
                "p50_s": 1.0, "p95_s": 1.0, "ok": 1, "sent": 1, "requests": []}
    runs = []
    for rnd, (on, off) in enumerate([(110.0, 100.0), (90.0, 100.0), (210.0, 200.0)]):   # 1.10, 0.90, 1.05
        runs += [run("prove-local", "lossless", rnd, on, 4), run("prove-local", "lossless/no-recall", rnd, off, 4),
                 run("prove-local", "ar", rnd, 100.0, 4), run("llama-server", None, rnd, 100.0, 4)]
    runs += [run("prove-local", "lossless", 0, 50.0, 8), run("prove-local", "lossless/no-recall", 1, 50.0, 8)]
    pairs = sb.recall_pairs(runs)
    assert [(q["mode"], q["clients"], q["rounds"]) for q in pairs] == [("lossless", 4, 3)]   # (8: never the same round)
    assert pairs[0]["paired"] == pytest.approx(1.05) and pairs[0]["paired_ci"][:2] == pytest.approx((0.9, 1.1))
    meta = {"model_name": "m", "parallel": 4, "threads": 2, "command": "c", "requests": 3, "max_tokens": 64,
            "rounds": 3, "when": "now"}
    md = sb.markdown(sb.summarize(runs), meta, pairs)
    assert "| lossless | 4 | 3 | 1.050 | 0.90–1.10 (75%) |" in md
    assert "no-recall, paired" not in sb.markdown(sb.summarize(runs), meta)


def test_serve_bench_modes_name_the_request_fields():
    """--modes items: MODE, or MODE/no-recall (the request's `recall: false`); anything else stops it."""
    sb = _serve_bench()
    assert sb.mode_fields("lossless") == {"mode": "lossless"} and sb.mode_fields(None) == {}
    assert sb.mode_fields("lossless/no-recall") == {"mode": "lossless", "recall": False}
    with pytest.raises(SystemExit):
        sb.mode_fields("lossless/bogus")


@pytest.mark.timeout(300)
def test_embedded_pair_pairs_the_modes_round_by_round(tmp_path):
    """scripts/embedded_pair.py on two questions of its own, two rounds, lossless with 2-token lookup
    drafts: both modes ran every prompt every round (lossless = ar, or it stops), ar commits one token a
    cycle, lossless more (the tiny model's answers repeat themselves: its drafts are accepted), and the
    medians lie inside their intervals."""
    import json
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "#### 4"}) + "\n" for q in (
        "Tom has 2 apples and buys 2 more. How many apples does he have?",
        "A box holds 3 pens. How many pens are in 2 boxes?")))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(SCRIPTS / "embedded_pair.py"), "--data", str(data), "--limit", "2",
                        "--rounds", "2", "--max-new", "64", "--lookup", "2", "--out", str(out)], capture_output=True, text=True,
                       timeout=280, cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    assert res["prompts"] == 2 and len(res["rounds"]) == 2
    for rd in res["rounds"]:
        assert rd["modes"]["ar"]["tokens"] == rd["modes"]["lossless"]["tokens"] > 0
        assert rd["modes"]["ar"]["cycles"] == rd["modes"]["ar"]["tokens"]
        assert rd["modes"]["lossless"]["cycles"] <= rd["modes"]["lossless"]["tokens"]
        assert rd["modes"]["lossless"]["cycles"] < rd["modes"]["lossless"]["tokens"]    # (drafts accepted)
    for k in ("per_prompt", "totals"):
        assert res[k]["low"] <= res[k]["median"] <= res[k]["high"]
    assert res["modes"]["ar"]["tokens_per_cycle"] == 1.0
    assert res["lookup"] == 2 and res["lossless_drafts"]["lookup"]["accepted"] > 0
    # per prompt, the medians over the rounds: each round's own ratios and lossless tokens per cycle
    for i, d in enumerate(res["prompts_detail"]):
        rs = sorted(rd["ratios"][i] for rd in res["rounds"])
        assert d["ratio"] == pytest.approx((rs[0] + rs[1]) / 2)
        tpc = sorted(rd["tokens_per_cycle"][i] for rd in res["rounds"])
        assert d["tokens_per_cycle"] == pytest.approx((tpc[0] + tpc[1]) / 2) and d["tokens_per_cycle"] >= 1.0
    assert len(res["prompts_detail"]) == 2
    assert (out / "summary.md").read_text().startswith("# lossless (defaults) / ar")


def test_issue_command_reads_a_bench_folders_answers_in_pairs(tmp_path):
    """scripts/issue_command.py: per question `ar` seconds over `lossless` seconds (the two answers of one
    process), their median and the summed seconds' ratio; an answer that differs from `ar`'s stops it."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("issue_command", SCRIPTS / "issue_command.py")
    ic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ic)

    def write(lossless_tokens):
        lines = []
        for q, (ar_s, ll_s) in enumerate([(1.0, 0.5), (1.0, 1.0), (2.0, 4.0)]):
            for run, secs, toks in (("ar", ar_s, [1, 2, 3, 4]), ("lossless", ll_s, lossless_tokens)):
                cycles = [{}] * (2 if run == "lossless" else 4)
                lines.append(json.dumps({"prompt": f"q{q}", "run": run, "seconds": secs, "tokens": toks, "cycles": cycles}))
        (tmp_path / "generations.jsonl").write_text("\n".join(lines))

    write([1, 2, 3, 4])
    r = ic.read_run(tmp_path)
    assert [q["ratio"] for q in r["per_prompt"]] == [2.0, 1.0, 0.5]
    assert r["median"] == 1.0 and r["totals"] == pytest.approx(4.0 / 5.5)
    assert [q["tokens_per_cycle"] for q in r["per_prompt"]] == [2.0] * 3
    write([1, 2, 3, 5])
    with pytest.raises(SystemExit, match="differ"):
        ic.read_run(tmp_path)


def test_issue_command_arms_set_planner_constants_in_their_processes(tmp_path):
    """scripts/issue_command.py --arms: `memory`, `no-memory`, or NAME:CONST=VALUE[;...], whose processes
    set planner.py's constants before the command line runs; an unknown constant stops the process."""
    import importlib.util
    import subprocess
    import sys

    spec = importlib.util.spec_from_file_location("issue_command", SCRIPTS / "issue_command.py")
    ic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ic)
    assert ic.parse_arm("memory") == ("memory", None)
    # each arm at each place equally often (two arms: each first in every other run)
    assert [ic.arm_order(["a", "b"], i)[0] for i in range(4)] == ["a", "b", "a", "b"]
    assert sorted(tuple(ic.arm_order(["a", "b", "c"], i)) for i in range(3)) == \
        [("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b")]
    assert ic.parse_arm("a:MEMORY_LOOKUP=False;LANE=True") == ("a", "MEMORY_LOOKUP=False;LANE=True")
    for bad in ("other", ":LANE=1", "a:LANE"):
        with pytest.raises(SystemExit, match="neither"):
            ic.parse_arm(bad)
    # the runner: the constant set (printed by a command line that reads it), then prove-local's own main
    probe = ic.RUNNER.replace("from prove_local.entry import main\nsys.exit(main(sys.argv[2:]))",
                              "print(P.MEMORY_LOOKUP, P.LANE)")
    done = subprocess.run([sys.executable, "-c", probe, "MEMORY_LOOKUP=True;LANE=False"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["True", "False"]     # (both the defaults' opposite)
    done = subprocess.run([sys.executable, "-c", ic.RUNNER, "NO_SUCH=1", "--version"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "no constant NO_SUCH" in done.stderr
    done = subprocess.run([sys.executable, "-c", ic.RUNNER, "LANE=True", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "bench" in done.stdout


def test_issue_command_summarizes_arms_with_intervals_and_pools_earlier_sets(tmp_path):
    """scripts/issue_command.py: per arm the medians over runs with a 95 % interval (serve_bench.median_ci),
    `ar`'s tokens/s over the runs, the answers pooled over runs by whether a draft gained a token; --from
    pools earlier sets of the same command and arms, runs numbered on, and refuses another command's or
    other arms' set naming the file."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("issue_command", SCRIPTS / "issue_command.py")
    ic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ic)

    def run(arm, i, med, tot, speed):
        return {"arm": arm, "run": i, "started_utc": "00:00:00", "median": med, "totals": tot, "ar_tokens_per_s": speed,
                "per_prompt": [{"ratio": med, "tokens_per_cycle": 1.0}, {"ratio": 2 * med, "tokens_per_cycle": 1.5}]}
    meds = [0.90, 0.95, 0.97, 0.99, 1.00, 1.01, 1.02, 1.04, 1.10]
    runs = [run("memory", i + 1, m, m + 0.01, 1000.0 + 100 * i) for i, m in enumerate(meds)]
    runs += [run("no-memory", i + 1, 1.0, 1.0, 500.0) for i in range(9)]
    arms = ic.summarize_arms(runs, ["memory", "no-memory"])
    m = arms["memory"]
    assert m["runs"] == 9 and m["median"] == 1.00 and m["totals"] == pytest.approx(1.01)
    # 9 runs: the 2nd smallest and 2nd largest cover the median with 96 %
    assert m["median_ci"][:2] == [0.95, 1.04] and m["median_ci"][2] >= 0.95
    assert m["totals_ci"][:2] == pytest.approx([0.96, 1.05])
    assert m["per_prompt"] == [1.00, 2.00] and m["tokens_per_cycle"] == [1.0, 1.5]
    assert m["ar_tokens_per_s"] == [1000.0, 1400.0, 1800.0]
    # the answers pooled by what lossless did: one token a cycle (the first question of each run) or more
    assert m["one_per_cycle"]["answers"] == 9 and m["one_per_cycle"]["median"] == 1.00
    assert m["one_per_cycle"]["ci"][:2] == [0.95, 1.04]
    assert m["gained"]["answers"] == 9 and m["gained"]["median"] == 2.00
    assert ic.summarize_arms([{**r, "per_prompt": r["per_prompt"][:1]} for r in runs], ["memory"])["memory"]["gained"] is None
    with pytest.raises(SystemExit, match="'other' has no runs"):
        ic.summarize_arms(runs, ["other"])

    command = ["prove-local", "bench", "--limit", "8"]
    # (each set's runs numbered from 1, as issue_command writes them)
    for name, rs in (("a", runs[:3] + runs[9:12]), ("b", [{**r, "run": r["run"] - 3} for r in runs[3:5] + runs[12:14]])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(
            {"command": " ".join(command), "arms": {"memory": {}, "no-memory": {}}, "runs": rs}))
    pooled = ic.pooled_runs([tmp_path / "a", tmp_path / "b"], command, ["no-memory", "memory"])
    assert [(r["arm"], r["run"]) for r in pooled if r["arm"] == "memory"] == [("memory", n) for n in (1, 2, 3, 4, 5)]
    assert pooled[-1]["set"] == str(tmp_path / "b")
    with pytest.raises(SystemExit, match="another command"):
        ic.pooled_runs([tmp_path / "a"], command + ["--no-plots"], ["memory", "no-memory"])
    with pytest.raises(SystemExit, match="arms"):
        ic.pooled_runs([tmp_path / "a"], command, ["memory"])
    with pytest.raises(SystemExit, match="cannot read"):
        ic.pooled_runs([tmp_path / "missing"], command, ["memory", "no-memory"])
