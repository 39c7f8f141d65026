"""The engine's stop reasons, its one-open-generation rule and its no-token error, on fake contexts."""
import subprocess
import sys

import pytest

from prove_local import modes, rules
from prove_local.engine import Settings
from prove_local.errors import EngineBusy
from tests.fakes import EOS, MASK, PROMPT, V, greedy, make_engine, onehot, run


def eos_after_7(prefix):
    """Proposes t+1 (and t+m+1 at mask m); the token after 7 is EOS, also for the AR row."""
    m = 0
    while prefix[-1 - m] == MASK:
        m += 1
    seq = [t for t in prefix if t != MASK]
    nxt = EOS if seq[-1] == 7 or (m and (seq[-1] + m) == 7) else (seq[-1] + m + 1) % 20
    return onehot(V, nxt)


def test_eog_cut_by_max_new_stops_for_length():
    e = make_engine(eos_after_7)
    cycles, out = run(e, [4, 5], mode="lossless", max_new=2)     # the cycle commits 6, 7, EOS
    assert out == [6, 7] and cycles[-1].stop == "length"


def test_eog_kept_at_exactly_max_new_stops_for_eog():
    e = make_engine(eos_after_7)
    cycles, out = run(e, [4, 5], mode="lossless", max_new=3)
    assert out == [6, 7, EOS] and cycles[-1].stop == "eog"


def test_eog_cut_by_the_context_stops_for_context():
    e = make_engine(eos_after_7, n_ctx=4)
    cycles, out = run(e, [4, 5], mode="lossless", max_new=50)
    assert out == [6, 7] and cycles[-1].stop == "context"


def test_second_generate_while_one_is_suspended_is_refused():
    e = make_engine()
    first = e.generate(PROMPT, Settings(mode="lossless", max_new=40))
    c1 = next(first)                                  # suspended mid-generation
    with pytest.raises(EngineBusy, match="still open"):
        e.generate(PROMPT + [9], Settings(mode="ar", max_new=4))
    c2 = next(first)                                  # the first one was not disturbed
    assert c1.committed + c2.committed == greedy(PROMPT, len(c1.committed + c2.committed))
    first.close()
    _, out = run(e, PROMPT + [9], mode="ar", max_new=4)  # closed: the engine takes a new request
    assert out == greedy(PROMPT + [9], 4)


def test_dropping_an_unfinished_generation_frees_the_engine():
    e = make_engine()
    gen = e.generate(PROMPT, Settings(mode="lossless", max_new=40))
    next(gen)
    del gen                                           # no close(): the handle's finalizer cleans up
    _, out = run(e, PROMPT, mode="ar", max_new=5)
    assert out == greedy(PROMPT, 5)
    ctx = e.contexts["target"]
    assert ctx.cache == e.tokens[:ctx.n_past] and MASK not in ctx.cache


def test_a_generation_never_started_can_be_closed():
    e = make_engine()
    e.generate(PROMPT, Settings(mode="lossless", max_new=4)).close()
    assert run(e, PROMPT, mode="lossless", max_new=4)[1] == greedy(PROMPT, 4)


def _broken_mode():
    """A mode whose cycle evaluates but commits nothing (a broken rule)."""
    def cycle(contexts, tokens, plan, s, mask, sampler=None, hooks=None):
        rules.ar_cycle(contexts["target"], tokens)
        return rules.Cycle([], [], None, [], 0, {"target": 1})
    return modes.Mode("broken", "broken", "test", ("target",), needs_mask=False, exact=True, width=None, gate=None,
                      gate_text="", q_text="", free_first=True, correction=False, verify_choice=False,
                      cycle=cycle, widths=lambda pend, plan: {}, width_field="block", label_text="broken")


def test_a_cycle_that_commits_nothing_is_an_error(monkeypatch):
    monkeypatch.setitem(modes.MODES, "broken", _broken_mode())
    e = make_engine()
    with pytest.raises(RuntimeError, match="committed no token"):
        run(e, PROMPT, mode="broken", max_new=4)
    assert e.active is None                           # and the engine is free again


def test_the_no_token_error_survives_python_O():
    """`assert` vanishes under -O; the engine's check must not."""
    code = (
        "import sys; sys.path.insert(0, '.');"
        "from prove_local import modes;"
        "from tests.fakes import make_engine, run, PROMPT;"
        "from tests.test_engine_guards import _broken_mode;"
        "modes.MODES['broken'] = _broken_mode();"
        "e = make_engine()\n"
        "try:\n    run(e, PROMPT, mode='broken', max_new=4)\n"
        "except RuntimeError as err:\n    print('raised:', err)\n")
    r = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "raised:" in r.stdout and "committed no token" in r.stdout
