"""Every llama_decode of the process runs on its one compute thread (llama.decode), whichever thread
asks: with a second OpenMP team alive, libgomp stops spinning at ggml's barriers and a batched step
ran up to 3x slower (dev/omp_teams.py). A Ctrl-C while a pass is on that thread is raised once the
pass is over, so nothing touches the context while llama.cpp still works on it."""
import signal
import threading
import time

import llama_cpp as ll
import numpy as np
import pytest

from prove_local import llama
from prove_local.llama import Context, Model
from tests.tiny import tiny_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m = Model(tiny_gguf(tmp_path_factory.mktemp("compute-thread"), seed=3))
    yield m
    m.close()


@pytest.fixture
def recorded(monkeypatch):
    """llama_decode wrapped: the names of the threads it ran on (the real call still made)."""
    names, real = [], ll.llama_decode

    def spy(ctx, batch):
        names.append(threading.current_thread().name)
        return real(ctx, batch)

    monkeypatch.setattr(ll, "llama_decode", spy)
    return names


def test_decodes_from_any_thread_run_on_the_compute_thread(model, recorded):
    prompt = [1, 5, 9, 2, 7, 3]
    with Context(model, n_ctx=64, n_threads=1) as ctx:
        here = ctx.eval(prompt, rows=[2, 5])
    out = {}

    def elsewhere():
        with Context(model, n_ctx=64, n_threads=1) as ctx:
            out["rows"] = ctx.eval(prompt, rows=[2, 5])
        with Context(model, n_ctx=64, n_threads=1, n_seq=2) as shared:
            out["batch"] = shared.decode_batch([(0, 0, prompt, [2, 5]), (1, 0, prompt[:3], [2])])

    t = threading.Thread(target=elsewhere, name="a request thread")
    t.start()
    t.join()
    assert len(recorded) == 3
    assert set(recorded) == {"prove-local llama"}          # neither the main thread nor the request thread
    assert np.array_equal(here, out["rows"])
    assert np.array_equal(out["batch"][0], here) and np.array_equal(out["batch"][1][0], here[0])


def test_a_ctrl_c_during_a_decode_comes_after_it(model, monkeypatch):
    real, started, finished = ll.llama_decode, threading.Event(), threading.Event()

    def slow(ctx, batch):
        started.set()
        time.sleep(0.3)                        # long enough for the signal to land during the pass
        rc = real(ctx, batch)
        finished.set()
        return rc

    monkeypatch.setattr(ll, "llama_decode", slow)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)   # whatever this process inherited
    try:
        def interrupt():
            started.wait(30)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

        threading.Thread(target=interrupt).start()
        with Context(model, n_ctx=64, n_threads=1) as ctx:
            with pytest.raises(KeyboardInterrupt):
                ctx.eval([1, 5, 9])
            assert finished.is_set()           # the pass was over before the interrupt came out
            ctx.truncate(0)                    # and the context is usable: the engine's clean-up, then a pass
            monkeypatch.setattr(ll, "llama_decode", real)
            assert ctx.eval([1, 5, 9]).shape == (1, model.n_vocab)
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_pass_is_finished_on_the_device_before_decode_returns(model, monkeypatch):
    """llama_decode returns once a GPU backend has the work queued (llama.cpp synchronizes at the first
    read of an output), so llama.decode synchronizes the context before it returns: the time around it
    (`decode_seconds`, the planner's pass costs) is the pass's, not its launch's. A failed decode is
    not synchronized (nothing was queued)."""
    events, real_decode, real_sync = [], ll.llama_decode, ll.llama_synchronize

    def decode(ctx, batch):
        events.append("decode")
        return real_decode(ctx, batch)

    def sync(ctx):
        events.append("sync")
        return real_sync(ctx)

    monkeypatch.setattr(ll, "llama_decode", decode)
    monkeypatch.setattr(ll, "llama_synchronize", sync)
    with Context(model, n_ctx=64, n_threads=1) as ctx:
        ctx.eval([1, 5, 9], rows=[])             # no output read: only decode's own synchronize waits
        ctx.eval([2], rows=[0])
        assert events == ["decode", "sync", "decode", "sync"]
        events.clear()
        monkeypatch.setattr(ll, "llama_decode", lambda ctx, batch: events.append("decode") or 1)
        with pytest.raises(llama.LlamaError, match="no KV slot"):
            ctx.eval([3])
        assert events == ["decode"]


def test_on_compute_thread_runs_there_and_raises_here(model, recorded):
    """llama.on_compute_thread: a function run on the compute thread (a decode inside it is not handed
    over again), its result returned and its exception raised to the caller."""
    def inside(tokens):
        with Context(model, n_ctx=64, n_threads=1) as ctx:
            return threading.current_thread().name, ctx.eval(tokens)

    name, rows = llama.on_compute_thread(inside, [1, 5, 9])
    assert name == "prove-local llama" and recorded == ["prove-local llama"]
    with Context(model, n_ctx=64, n_threads=1) as ctx:
        assert np.array_equal(rows, ctx.eval([1, 5, 9]))

    def fails():
        raise ValueError("from the compute thread")

    with pytest.raises(ValueError, match="from the compute thread"):
        llama.on_compute_thread(fails)
    assert llama.on_compute_thread(lambda: 7) == 7           # the thread still serves after a failure


def test_a_pass_is_timed_without_the_wait_for_another_threads_pass(model):
    """`decode_seconds` (what calibration and the planner time passes by) counts the pass on the compute
    thread, not the time it waited there behind another thread's work: a calibration timed around that
    wait, while a pool decoded in the same process, was cached ~10x too slow. The compute thread is held
    until this thread's pass is queued behind it, then for HOLD seconds more."""
    hold, started, gate = 1.0, threading.Event(), threading.Event()
    held = {}

    def busy():                                  # another thread's work on the compute thread
        started.set()
        gate.wait(30)

    def release():
        while llama._compute.jobs.empty():       # until the pass below is queued behind `busy`
            time.sleep(0.001)
        t0 = time.perf_counter()
        time.sleep(hold)
        held["s"] = time.perf_counter() - t0
        gate.set()

    with Context(model, n_ctx=64, n_threads=1) as ctx:
        ctx.eval([1, 5, 9], rows=[])             # (the compute thread exists, the context is warm)
        before = ctx.decode_seconds
        other = threading.Thread(target=lambda: llama.on_compute_thread(busy))
        other.start()
        assert started.wait(30)
        releaser = threading.Thread(target=release)
        releaser.start()
        t0 = time.perf_counter()
        ctx.eval([2], rows=[0])
        waited = time.perf_counter() - t0
        releaser.join(30)
        other.join(30)
        assert waited >= held["s"] >= hold       # the pass did wait behind `busy` ...
        assert ctx.decode_seconds - before < held["s"]   # ... and that wait is not in its time
