"""Interrupted work keeps what finished and writes nothing half-done; missing extras are named first."""
import ctypes
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prove_local.cli import main
from tests.signals import default_sigint
from tests.tiny import make_checkpoint, tiny_gguf

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ convert: the quantize step
def quantizer_children(marker: str) -> list[int]:
    """Pids of running quantize.py children whose command line mentions `marker`."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"prove_local.convert.quantize" in cmd and any(marker.encode() in c for c in cmd):
            pids.append(int(d.name))
    return pids


def other_threads(pid: int) -> list[int]:
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)


def send_to_thread(pid: int, tid: int, sig: int) -> None:
    """The signal to one thread of `pid` (tgkill): what the kernel does with a process's signal while
    the main thread blocks it (the converter does, for a moment, to start its quantizer)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, tid, int(sig)) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid}, {sig})")


@pytest.mark.parametrize("sig,to", [(signal.SIGTERM, "process"), (signal.SIGINT, "process"),
                                    (signal.SIGTERM, "thread"), (signal.SIGINT, "thread")])
def test_a_signal_during_quantize_stops_it_and_keeps_the_old_output(tmp_path, sig, to):
    """The converter stops at once, whichever of its threads the kernel gives the signal to: Python
    runs the handler in the main thread, which must not be stuck in a long blocking wait then."""
    ckpt = make_checkpoint(tmp_path / "hf")
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    out.write_bytes(b"the previous output")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PROVE_TEST_QUANTIZE_DELAY": "600"}   # hold the quantizer
    proc = subprocess.Popen([sys.executable, "-m", "prove_local.cli", "convert", str(ckpt), "-o", str(out),
                             "--outtype", "q4_k_m"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, preexec_fn=default_sigint)     # SIGINT reaches it even from a background run
    try:
        for line in proc.stderr:                # wait (bounded by the quantizer's delay) for the quantize step
            if "quantizing to Q4_K_M" in line:
                break
        for _ in range(600):                    # and for the child itself (at most a minute)
            if quantizer_children(str(out.parent)) or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert quantizer_children(str(out.parent)), "the quantizer never started"
        if to == "process":
            proc.send_signal(sig)
        else:
            others = other_threads(proc.pid)
            assert others, "the converter has no thread but its main one (tqdm's monitor is expected)"
            send_to_thread(proc.pid, others[0], sig)
        proc.wait(timeout=120)                  # far less than the 600 s the quantizer would take
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 128 + sig if sig == signal.SIGTERM else proc.returncode == 130, err
    assert "Traceback" not in err
    assert out.read_bytes() == b"the previous output"
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf"]      # no temporary files left
    # the child is gone: it was killed and reaped (allow a moment for /proc to catch up; an orphan
    # left behind would still be sleeping out its 600 s delay, and fails this)
    left = quantizer_children(str(out.parent))
    for _ in range(100):
        if not left:
            break
        time.sleep(0.1)
        left = quantizer_children(str(out.parent))
    for pid in left:                                                        # no orphan outlives the test
        os.kill(pid, signal.SIGKILL)
    assert left == []


# ------------------------------------------------------------------ llama.decode's hand-off
DECODE_RACE = r"""
import faulthandler, random, signal, sys, time
faulthandler.dump_traceback_later(80, exit=True)        # a deadlock prints both threads' stacks and exits
from prove_local import llama
class Boom(Exception): pass
def boom(sig, frame): raise Boom()
signal.signal(signal.SIGALRM, boom)
llama.ll.llama_decode = lambda ctx, batch: (time.sleep(random.choice([0, 1e-5, 1e-4])), 7)[1]
# until enough hand-offs were interrupted (not for a fixed time: a loaded machine makes fewer per second),
# within a bound
t_end, calls, cut, rng = time.monotonic() + float(sys.argv[1]), 0, 0, random.Random(0)
while (calls < 20000 or cut < 5000) and time.monotonic() < t_end:
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 2e-4))
            assert llama.decode(None, None) == 7
        except Boom:
            cut += 1
        signal.setitimer(signal.ITIMER_REAL, 0)
    except Boom:                                          # the timer went off outside the call
        signal.setitimer(signal.ITIMER_REAL, 0)
    calls += 1
print(calls, cut, llama._compute.thread.is_alive())
"""


def test_an_interrupt_at_any_moment_of_a_decode_hand_off_never_deadlocks():
    """llama.decode hands the decode to the compute thread and waits; an interrupt (Ctrl-C) may strike
    at any bytecode of that wait. Waiting on a threading.Event, one struck between the Event's lock and
    its `with` and left the lock held: the compute thread's set() and the next wait both blocked on it
    for good (the CLI chat hung on a Ctrl-C in CI; this loop deadlocked within seconds). Here a
    timer interrupts thousands of hand-offs at random moments (until 5,000 were cut short); every call returns or raises, and the
    compute thread lives on."""
    r = subprocess.run([sys.executable, "-c", DECODE_RACE, "50"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    calls, cut, alive = r.stdout.split()
    assert int(calls) > 1000 and int(cut) > 100 and alive == "True", r.stdout


# ------------------------------------------------------------------ bench
@pytest.fixture(scope="module")
def proposer(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("bench-int"), seed=0)


def prompts_file(tmp_path: Path, n: int) -> Path:
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 2?", "answer": f"#### {i + 2}"}) + "\n"
                            for i in range(n)))
    return data


def bench_args(proposer, data, out):
    return ["bench", "--proposer", str(proposer), "--modes", "ar,lossless", "--data", str(data), "--max-new", "8",
            "--threads", "1", "--ctx", "256", "--kv-type", "f32", "--warmup", "0", "--no-pass-cost", "--no-plots",
            "--out", str(out), "-q"]


def test_bench_ctrl_c_keeps_the_finished_prompts_marked_partial(proposer, tmp_path, monkeypatch, capsys):
    from prove_local.bench import runner
    calls = {"n": 0}
    real = runner.generate_once

    def interrupted_on_the_6th(engine, tokens, settings):   # Ctrl-C during prompt 3's second run
        if settings.max_new == 1:               # (the untimed request that prefills a run's prompt)
            return real(engine, tokens, settings)
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real(engine, tokens, settings)
    monkeypatch.setattr(runner, "generate_once", interrupted_on_the_6th)
    out = tmp_path / "out"
    assert main(bench_args(proposer, prompts_file(tmp_path, 5), out)) == 130
    res = json.loads((out / "results.json").read_text())
    assert res["partial"] is True and [p["id"] for p in res["prompts"]] == ["gsm/0", "gsm/1"]
    assert res["data"]["n_prompts"] == 2 and all(m["n_prompts"] == 2 for m in res["modes"].values())
    assert len((out / "generations.jsonl").read_text().splitlines()) == 4
    assert "**Partial: interrupted" in (out / "summary.md").read_text() and not [f for f in out.iterdir() if f.name.startswith(".")]
    assert "interrupted: partial, 2 of 5 prompts" in capsys.readouterr().err


def test_bench_ctrl_c_before_any_prompt_finished_writes_nothing(proposer, tmp_path, monkeypatch, capsys):
    from prove_local.bench import runner

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(runner, "generate_once", interrupted)
    out = tmp_path / "out"
    assert main(bench_args(proposer, prompts_file(tmp_path, 2), out)) == 130
    assert not out.exists() or not list(out.iterdir())
    assert "nothing written" in capsys.readouterr().err


def test_bench_out_that_is_a_file_is_refused_before_any_run(proposer, tmp_path, monkeypatch, capsys):
    from prove_local.bench import runner
    monkeypatch.setattr(runner, "run_bench", lambda *a, **kw: pytest.fail("ran before checking --out"))
    out = tmp_path / "results.json"
    out.write_text("keep me")
    assert main(bench_args(proposer, prompts_file(tmp_path, 2), out)) == 1
    err = capsys.readouterr().err.strip()
    assert "exists and is not a folder" in err and len(err.splitlines()) == 1
    assert out.read_text() == "keep me"


@pytest.mark.parametrize("argv,extra,module", [
    (["bench", "--data", "x.jsonl", "--out", "o", "--proposer", "/nonexistent.gguf"], "bench", "matplotlib"),
    (["ui", "/nonexistent.gguf"], "ui", "gradio"),
])
def test_missing_extras_are_one_line_before_any_work(monkeypatch, capsys, argv, extra, module):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"'{extra}' extra ({module} is not installed)" in err
    assert "nonexistent" not in err               # refused before looking at the models


def test_bench_prompt_with_a_lone_surrogate_runs(proposer, tmp_path, capsys):
    data = tmp_path / "odd.jsonl"
    data.write_text(json.dumps({"question": "What is 2 + 2?\ud800", "answer": "#### 4"}) + "\n")   # "\\ud800" in the file
    assert "\\ud800" in data.read_text()
    out = tmp_path / "out"
    assert main(bench_args(proposer, data, out)) == 0
    assert json.loads((out / "results.json").read_text())["data"]["n_prompts"] == 1
    assert "Traceback" not in capsys.readouterr().err
