"""Native resources close in order without the caller's help: an engine closes its contexts (before
their models), a pool its engines once they are given back, and a model the contexts made on it;
nothing decodes on a closed context (an error, not a crash)."""
import threading
import time

import pytest

from prove_local.engine import Engine, EngineBusy, Settings
from prove_local.errors import LlamaError
from prove_local.llama import Context, Model
from prove_local.pool import Cancelled, EnginePool
from tests.fakes import MASK, PROMPT, V, FakeContext, greedy, proposer


class ClosingContext(FakeContext):
    """A fake context that counts its closes."""

    def __init__(self, *a):
        super().__init__(*a)
        self.closes = 0

    def close(self):
        self.closes += 1


def fake_engine() -> Engine:
    return Engine({"target": ClosingContext(proposer(), V)}, is_eog=lambda t: False, mask_token=MASK, n_ctx=64)


def test_an_engine_closes_its_contexts_at_the_end_of_its_block():
    with fake_engine() as e:
        out = [t for c in e.generate(PROMPT, Settings(mode="lossless", block=4, max_new=8)) for t in c.committed]
        assert out == greedy(PROMPT, 8)
        ctx = e.contexts["target"]
        assert ctx.closes == 0
    assert ctx.closes == 1 and e.closed
    with pytest.raises(EngineBusy, match="closed"):
        e.generate(PROMPT, Settings(mode="ar", max_new=2))
    e.close()                                     # idempotent: the context's close is its own business
    assert e.tokens == []


def test_closing_an_engine_releases_its_open_generation_first():
    e = fake_engine()
    gen = e.generate(PROMPT, Settings(mode="lossless", block=4, max_new=20))
    next(gen)
    e.close()
    assert e.active is None and e.contexts["target"].closes == 1
    gen.close()                                   # the handle's own clean-up finds nothing to do


class FakeLoaded:
    """What EnginePool needs of loading.Loaded: engine()."""

    def __init__(self):
        self.made = []

    def engine(self):
        self.made.append(fake_engine())
        return self.made[-1]


def test_a_pool_closes_idle_engines_at_once_and_busy_ones_when_given_back():
    loaded = FakeLoaded()
    pool = EnginePool(loaded, parallel=2)
    held, release = threading.Event(), threading.Event()

    def hold():
        with pool.engine() as (_, eng):
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(10)
    with pool.engine() as (_, second):            # the second slot: made on first use
        pass
    assert len(loaded.made) == 2
    assert pool.close(timeout=0.05) is False      # the first engine is still busy: left open
    busy, idle = loaded.made
    assert idle.closed and not busy.closed
    with pytest.raises(Cancelled, match="closed"):
        with pool.engine():
            pass
    release.set()
    t.join(10)
    assert pool.close() is True and busy.closed


def test_a_request_waiting_for_an_engine_is_cancelled_when_the_pool_closes():
    with EnginePool(FakeLoaded(), parallel=1) as pool:
        held, release, result = threading.Event(), threading.Event(), []

        def hold():
            with pool.engine():
                held.set()
                release.wait(10)

        def wait():
            try:
                with pool.engine():
                    result.append("served")
            except Cancelled as e:
                result.append(str(e))

        a = threading.Thread(target=hold)
        a.start()
        assert held.wait(10)
        b = threading.Thread(target=wait)
        b.start()
        while pool.n_waiting == 0:
            time.sleep(0.01)
        closer = threading.Thread(target=pool.close)
        closer.start()
        b.join(10)
        assert result and "closed" in result[0]
        release.set()
        a.join(10), closer.join(10)
        assert not closer.is_alive()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny import tiny_gguf
    return tiny_gguf(tmp_path_factory.mktemp("resources"), seed=0)


OPTS = dict(n_ctx=128, n_threads=1, type_k="f32", type_v="f32")


def test_engine_contexts_close_before_the_model_and_a_closed_context_refuses_to_decode(tiny):
    with Model(tiny) as m:
        with Engine.load(m, **OPTS) as e:
            prompt = m.tokenize("hello", add_special=True)
            out = [t for c in e.generate(prompt, Settings(mode="ar", max_new=3)) for t in c.committed]
            assert len(out) == 3
            ctx = e.contexts["target"]
        assert ctx._ctx is None and m._model          # the engine's context is freed, its model is not
        with pytest.raises(LlamaError, match="closed"):
            ctx.eval(prompt)
        ctx.truncate(0)                               # nothing held, nothing to drop
        scorer = Context(m, **OPTS)
    assert scorer._ctx is None and m._model is None   # the model closed the context made on it first


def test_a_closed_model_refuses_its_vocabulary_instead_of_crashing(tiny):
    """tokenize, piece, special_text on a closed model: an error naming the file (llama.cpp would read
    the freed vocabulary and crash the process)."""
    m = Model(tiny)
    assert m.tokenize("hello") and m.piece(5) is not None
    m.close()
    for call in (lambda: m.tokenize("hello"), lambda: m.piece(5), lambda: m.special_text("eos")):
        with pytest.raises(LlamaError, match=rf"{tiny.name}: the model is closed"):
            call()


def test_an_engine_whose_model_was_closed_first_cleans_up_without_touching_freed_memory(tiny):
    m = Model(tiny)
    e = Engine.load(m, **OPTS)
    prompt = m.tokenize("hello", add_special=True)
    gen = e.generate(prompt, Settings(mode="ar", max_new=8))
    next(gen)
    m.close()                                         # closes the engine's context first
    gen.close()                                       # the engine's clean-up: truncating a closed context
    e.close()
    assert e.closed


def test_the_ui_runtime_closes_its_pool_then_its_models(tiny):
    from prove_local.loading import Loaded
    from prove_local.ui.runtime import Runtime

    loaded = Loaded(Model(tiny), context_options=dict(OPTS))
    with Runtime(loaded, parallel=2) as rt:
        assert rt.error is None, rt.error
        with rt.engine() as (_, e):
            prompt = rt.target.tokenize("hi", add_special=True)
            assert len([t for c in e.generate(prompt, Settings(mode="ar", max_new=2)) for t in c.committed]) == 2
        ctx = e.contexts["target"]
    assert e.closed and ctx._ctx is None and loaded.target._model is None


def test_the_server_closes_its_pool_then_its_models_at_shutdown(tiny):
    """The app's lifespan: at shutdown the open generations stop, the engines close, then the models."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from prove_local.loading import Loaded
    from prove_local.server import State
    from prove_local.server.app import create_app

    loaded = Loaded(Model(tiny), context_options=dict(OPTS))
    state = State(pool=EnginePool(loaded, parallel=2), owns=True)     # as State.load leaves it
    with state.pool.engine() as (_, e):
        prompt = loaded.target.tokenize("hi", add_special=True)
        assert len([t for c in e.generate(prompt, Settings(mode="ar", max_new=2)) for t in c.committed]) == 2
    borrowed = State(pool=state.pool)             # an app on a pool it did not make leaves it open
    with TestClient(create_app(borrowed), base_url="http://127.0.0.1") as client:
        assert client.get("/health").status_code == 200
    assert borrowed.closing and not e.closed and loaded.target._model
    with TestClient(create_app(state), base_url="http://127.0.0.1") as client:
        assert client.get("/health").status_code == 200
        assert not e.closed and loaded.target._model
    assert state.closing and e.closed and loaded.target._model is None


def test_the_server_keeps_its_models_while_an_engine_is_still_busy():
    """An engine still held when the pool's wait runs out stays open, and so do the models under it."""
    class Models(FakeLoaded):
        closed = False

        def close(self):
            self.closed = True

    from prove_local.server.state import State
    loaded = Models()
    state = State(pool=EnginePool(loaded, parallel=1), owns=True)
    held, release = threading.Event(), threading.Event()

    def hold():
        with state.pool.engine():
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(10)
    assert state.close(timeout=0.05) is False and state.closing
    assert not loaded.made[0].closed and not loaded.closed
    release.set()
    t.join(10)
    assert state.close() is True and loaded.made[0].closed and loaded.closed
