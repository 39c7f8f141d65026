"""#32's own benchmark command, `prove-local bench --modes ar,lossless --threads 1 --data
../shared/datasets/gsm8k/test_dev.jsonl --limit 8`, run again and again as fresh processes, in two arms
taking turns (the order flipping each pair): with the planner's memory (calibrate.save_memory: each
process starts from what the one before it learned; the first from nothing) and without it
(PROVE_LOCAL_MEMORY=0: every process starts from nothing, as before the memory existed). Both arms
read one copy of the user's calibration cache (the same pass curves; nothing measured again unless
it is missing), in a folder of their own, so the user's memory is neither read nor written.

Per run: per question `ar` seconds / `lossless` seconds (the same question's two answers in one
process, seconds apart), their median over the 8 questions, and the ratio of the summed seconds
(totals); per arm the median over runs. Every `lossless` answer is checked equal to `ar`'s.

`--arms`: other arms than the two (taking turns, the order rotating by one each run: with two arms each
goes first in every other run): `memory`, `no-memory`, or an arm
with planner.py's module constants set in its processes, `NAME:CONST=VALUE[;CONST=VALUE]` (the memory on;
each arm with a memory of its own, in a cache folder of its own with the same calibration copy), e.g.
`--arms memory,memory-lookup:MEMORY_LOOKUP=True` (an A/B of one planner rule in fresh processes).

Each arm's medians come with a distribution-free 95 % interval over its runs (serve_bench.median_ci), and
the spread of `ar`'s tokens/s over the runs (the machine's own speed: this host has swung 2x within
minutes, and a set of 24 runs moved 2-3 % per question from one set to the next). `--from` pools the runs
of earlier sets of the same command (their results.json) with this one's (`--runs 0`: only them).

    python scripts/issue_command.py --runs 12 --out docs/bench/issue-command-v3
    python scripts/issue_command.py --runs 0 --from docs/bench/issue-command-v11 docs/bench/issue-command-v12 --out OUT
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from serve_bench import median_ci  # noqa: E402

DATA = ROOT.parent / "shared" / "datasets" / "gsm8k" / "test_dev.jsonl"
ARMS = ("memory", "no-memory")
# a process whose planner constants are set before the command line runs (`--arms NAME:CONST=VALUE`)
RUNNER = ("import ast, sys, prove_local.planner as P\n"
          "for item in sys.argv[1].split(';'):\n"
          "    name, value = item.split('=', 1)\n"
          "    if not hasattr(P, name): sys.exit(f'issue_command: planner.py has no constant {name}')\n"
          "    setattr(P, name, ast.literal_eval(value))\n"
          "from prove_local.entry import main\n"
          "sys.exit(main(sys.argv[2:]))")


def parse_arm(spec: str) -> tuple[str, str | None]:
    """(name, the constants to set or None) of an --arms item."""
    name, _, consts = spec.partition(":")
    if not name or (not consts and name not in ARMS) or (consts and not all("=" in c for c in consts.split(";"))):
        raise SystemExit(f"issue_command: arm {spec!r} is neither {' nor '.join(ARMS)} nor NAME:CONST=VALUE[;...]")
    return name, consts or None


def arm_order(arms: list, i: int) -> list:
    """The arms' order in run i (from 0): rotated by one each run, so each arm runs at each place equally
    often (two arms: each first in every other run)."""
    k = i % len(arms)
    return arms[k:] + arms[:k]


def read_run(folder: Path) -> dict:
    """Per question (in order) the two answers' seconds and lossless' tokens per cycle, from a bench
    folder's generations.jsonl."""
    by = {}
    for line in (folder / "generations.jsonl").read_text().splitlines():
        g = json.loads(line)
        by[g["prompt"], g["run"]] = g
    prompts = list(dict.fromkeys(p for p, _ in by))
    out = []
    for p in prompts:
        ar, ll = by[p, "ar"], by[p, "lossless"]
        if ar["tokens"] != ll["tokens"]:
            raise SystemExit(f"{folder}: question {p}: lossless' tokens differ from ar's")
        out.append({"prompt": p, "ar_s": ar["seconds"], "lossless_s": ll["seconds"], "ratio": ar["seconds"] / ll["seconds"],
                    "tokens": len(ar["tokens"]), "tokens_per_cycle": len(ll["tokens"]) / max(1, len(ll["cycles"]))})
    return {"per_prompt": out, "median": statistics.median(q["ratio"] for q in out),
            "totals": sum(q["ar_s"] for q in out) / sum(q["lossless_s"] for q in out),
            "ar_tokens_per_s": sum(q["tokens"] for q in out) / sum(q["ar_s"] for q in out)}


def summarize_arms(runs: list[dict], names: list[str]) -> dict:
    """Per arm: the medians over its runs of the per-question median and of the totals ratio, each with
    a 95 % interval for that median (median_ci: low, high, coverage), per question the median over runs
    of its ratio and of lossless' tokens per cycle, `ar`'s tokens/s over the runs (min, median, max:
    how steady the machine was), and the answers split by whether a draft gained a token (`_answers`)."""
    arms = {}
    for arm in names:
        rs = [r for r in runs if r["arm"] == arm]
        if not rs:
            raise SystemExit(f"issue_command: arm {arm!r} has no runs")
        n_q = len(rs[0]["per_prompt"])
        speeds = sorted(r["ar_tokens_per_s"] for r in rs)
        arms[arm] = {"runs": len(rs),
                     "median": statistics.median(r["median"] for r in rs),
                     "median_ci": list(median_ci([r["median"] for r in rs])),
                     "totals": statistics.median(r["totals"] for r in rs),
                     "totals_ci": list(median_ci([r["totals"] for r in rs])),
                     "per_prompt": [statistics.median(r["per_prompt"][q]["ratio"] for r in rs) for q in range(n_q)],
                     "tokens_per_cycle": [statistics.median(r["per_prompt"][q]["tokens_per_cycle"] for r in rs)
                                          for q in range(n_q)],
                     "ar_tokens_per_s": [speeds[0], statistics.median(speeds), speeds[-1]],
                     "one_per_cycle": _answers(rs, lambda tpc: tpc == 1.0),
                     "gained": _answers(rs, lambda tpc: tpc > 1.0)}
    return arms


def _answers(runs: list[dict], which) -> dict | None:
    """The answers of `runs` whose lossless tokens per cycle `which` accepts, pooled over runs and questions:
    how many, and the median of their ratios with its 95 % interval (None without any). One token a cycle is
    an answer where no draft gained a token (`lossless` ran `ar`, or its drafts were rejected): per answer the
    noise is large, but pooled over runs they resolve ~1 % (48 runs: ~300 answers)."""
    xs = [q["ratio"] for r in runs for q in r["per_prompt"] if which(q["tokens_per_cycle"])]
    if not xs:
        return None
    return {"answers": len(xs), "median": statistics.median(xs), "ci": list(median_ci(xs))}


def pooled_runs(folders: list[Path], command: list[str], names: list[str]) -> list[dict]:
    """The runs of earlier sets (their results.json), numbered on from set to set; a set of another
    command or of other arms is refused, naming its folder."""
    out, offset = [], 0
    for folder in folders:
        path = Path(folder) / "results.json"
        try:
            res = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"issue_command: --from {path}: cannot read it ({type(e).__name__}: {e})") from None
        if res.get("command") != " ".join(command):
            raise SystemExit(f"issue_command: --from {path}: another command ({res.get('command')!r})")
        if sorted(res.get("arms", {})) != sorted(names):
            raise SystemExit(f"issue_command: --from {path}: arms {sorted(res.get('arms', {}))}, not {sorted(names)}")
        runs = res["runs"]
        out += [{**r, "run": r["run"] + offset, "set": str(folder)} for r in runs]
        offset += max((r["run"] for r in runs), default=0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=12, help="runs per arm")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--from", dest="pool", nargs="+", type=Path, default=[],
                    help="pool the runs of earlier sets of the same command and arms (their folders)")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help="arms taking turns: memory, no-memory, NAME:CONST=VALUE[;...] (planner constants, memory on)")
    a = ap.parse_args()
    arms_spec = [parse_arm(s) for s in a.arms.split(",")]
    names = [n for n, _ in arms_spec]
    if len(set(names)) != len(names):
        raise SystemExit(f"issue_command: arm names repeat in {a.arms!r}")
    from prove_local.calibrate import cache_path   # (after the arguments: --help loads no llama.cpp)
    from prove_local.files import write_atomic

    work = Path(tempfile.mkdtemp(prefix="issue-command-"))
    cache = work / "cache"
    cache.mkdir()
    if cache_path().exists():
        shutil.copy(cache_path(), cache / "calibration.json")
    caches = {}                                   # (an arm of planner constants: a memory of its own)
    for name, consts in arms_spec:
        caches[name] = cache
        if consts:
            caches[name] = work / f"cache-{name}"
            shutil.copytree(cache, caches[name])
    command = ["prove-local", "bench", "--modes", "ar,lossless", "--threads", "1", "--data", a.data,
               "--limit", str(a.limit), "--no-plots"]
    runs = pooled_runs(a.pool, command, names)
    if not runs and a.runs < 1:
        raise SystemExit("issue_command: nothing to summarize (--runs 0 and no --from)")
    first = 1 + max((r["run"] for r in runs), default=0)
    try:
        for i in range(a.runs):
            for arm, consts in arm_order(arms_spec, i):
                folder = work / f"{arm}-{i + 1}"
                env = {**os.environ, "PROVE_LOCAL_CACHE": str(caches[arm]),
                       "PROVE_LOCAL_MEMORY": "0" if arm == "no-memory" else "1"}
                argv = command if consts is None else [sys.executable, "-c", RUNNER, consts] + command[1:]
                t0 = time.strftime("%H:%M:%S", time.gmtime())
                done = subprocess.run(argv + ["--out", str(folder)], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"issue_command: {' '.join(command)} exited {done.returncode}:\n{done.stderr[-2000:]}")
                r = {"arm": arm, "run": first + i, "started_utc": t0, **read_run(folder)}
                runs.append(r)
                print(f"{arm:10s} run {i + 1:2d}/{a.runs}: per question {r['median']:.3f}, totals {r['totals']:.3f}, "
                      f"ar {r['ar_tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    arms = summarize_arms(runs, names)
    a.out.mkdir(parents=True, exist_ok=True)
    write_atomic(a.out / "results.json", json.dumps({"command": " ".join(command), "arms": arms, "runs": runs,
                                                     "arm_constants": dict(arms_spec),
                                                     "pooled": [str(f) for f in a.pool]}, indent=1))
    how = "with and without the planner's memory" if a.arms == ",".join(ARMS) else f"arms {a.arms}"
    given = "" if a.arms == ",".join(ARMS) else f" --arms '{a.arms}'"
    pooled = (" --from " + " ".join(str(f) for f in a.pool)) if a.pool else ""
    lines = [f"# `{' '.join(command)}`, fresh processes, {how}", "",
             f"`python scripts/issue_command.py --runs {a.runs}{given}{pooled} --out {a.out}`; {len(runs)} runs, "
             f"{runs[0]['started_utc']}–{runs[-1]['started_utc']} UTC {time.strftime('%Y-%m-%d', time.gmtime())}"
             + (f" (pooled: {len(a.pool)} earlier set(s) and this one's {a.runs} run(s) per arm)" if a.pool else "") + ". "
             "Ratios: `ar` seconds / `lossless` seconds; *per question*: the median over the questions of one run; "
             "*totals*: summed seconds; [a, b]: a distribution-free 95 % interval for the median over runs; "
             "`ar` tokens/s: min / median / max over the runs (how steady the machine was). Every answer equal to `ar`'s.", "",
             "| arm | runs | per question (median over runs) | totals (median over runs) | `ar` tokens/s | per question, each question |",
             "|---|---:|---:|---:|---:|---|"]
    split = ["", "Answers pooled over runs and questions, by what `lossless` did: one token a cycle (no draft gained a "
             "token: it ran `ar`, or its drafts were rejected) or more; the median of their ratios [95 % interval].", "",
             "| arm | one token a cycle: answers | median | more than one: answers | median |", "|---|---:|---:|---:|---:|"]
    for arm, s in arms.items():
        lo, hi, _ = s["median_ci"]
        tlo, thi, _ = s["totals_ci"]
        sp = s["ar_tokens_per_s"]
        lines.append(f"| {arm} | {s['runs']} | **{s['median']:.3f}** [{lo:.3f}, {hi:.3f}] | {s['totals']:.3f} [{tlo:.3f}, {thi:.3f}] | "
                     f"{sp[0]:.0f} / {sp[1]:.0f} / {sp[2]:.0f} | " + " ".join(f"{x:.2f}" for x in s["per_prompt"]) + " |")
        cells = []
        for part in (s["one_per_cycle"], s["gained"]):
            cells += ["0", "–"] if part is None else \
                [str(part["answers"]), f"{part['median']:.3f} [{part['ci'][0]:.3f}, {part['ci'][1]:.3f}]"]
        split.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += split
    lines += ["", "| run | arm | started (UTC) | per question | totals | `ar` tokens/s | lossless tokens/cycle, each question |",
              "|---:|---|---|---:|---:|---:|---|"]
    for r in runs:
        lines.append(f"| {r['run']} | {r['arm']} | {r['started_utc']} | {r['median']:.3f} | {r['totals']:.3f} | "
                     f"{r['ar_tokens_per_s']:.0f} | " + " ".join(f"{q['tokens_per_cycle']:.2f}" for q in r["per_prompt"]) + " |")
    write_atomic(a.out / "summary.md", "\n".join(lines) + "\n")
    print("\n".join(lines[4:6 + len(arms)] + split))
    return 0


if __name__ == "__main__":
    sys.exit(main())
