"""The chat UI: the projection of cycles to spans and inspector rows (pure), the session runtime on
tiny GGUFs, and the page end to end in Debian's chromium (Playwright with `executable_path`).

The browser test does not skip: without /usr/bin/chromium it fails and says what to install. Its
fixtures (the tiny pair, the UI process, the browser) are in conftest.py, its helpers in ui_page.py.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from prove_local.chat import Conversation
from prove_local.engine import Settings
from prove_local.loading import Loaded
from prove_local.rules import Cycle, Plan
from prove_local.ui import view
from prove_local.ui.runtime import Runtime, Session, UIError, compare_with_ar, run_turn
from tests.reference import greedy_ar
from tests.ui_page import F32, MAX_NEW, answer_done, answer_spans, launch_here, open_page, reference, send

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                                        "ignore:.*:Warning:gradio.queueing")
ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------ pure projection
class FakePieces:
    """token id -> bytes; ids >= 100 are control tokens (empty pieces)."""
    table = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: b"\n", 6: "é".encode()[:1], 7: "é".encode()[1:],
             8: b"<b>&", 9: b" !"}

    def piece(self, t, special=False):
        return self.table.get(t, b"") if t < 100 else (b"<|im_end|>" if special else b"")


def cyc(proposed, p, q, committed, n_accepted, index=0, stop=None, plan=None, gate=None, residual=False):
    """A cycle as a rule reports it: the plan it ran and its gate's outcome per slot are given
    explicitly (what the rule decided), not derived here."""
    return Cycle(proposed, p, q, committed, n_accepted, {"target": 1}, index=index, stop=stop,
                 plan=plan or Plan("mars", len(proposed)), gate=gate, residual=residual)


def name(t):
    return view.token_label(FakePieces().piece(t, True))


def test_spans_alternate_per_cycle_and_concatenate_to_the_text():
    cycles = [cyc([1, 2, 3], [.9] * 3, None, [1, 2], 2, 0),             # mars-like
              cyc([3, 4, 4], [.9] * 3, [.9] * 3, [3, 4, 5], 2, 1),       # lossless: 5 is the correction
              cyc([6, 7, 8, 9], [.9] * 4, [.9] * 4, [6, 7, 8, 9, 1], 4, 2),  # bonus token 1, é split in cycle
              cyc([6], [.5], None, [6], 1, 3),                              # a split UTF-8 byte ...
              cyc([7, 200], [.5, .5], None, [7, 200], 2, 4, stop="eog")]    # ... completed here, then EOG
    v = view.AnswerView(FakePieces())
    for c in cycles:
        v.add(c)
    v.finish()
    want = b"".join(FakePieces().piece(t) for c in cycles for t in c.committed).decode("utf-8", "replace")
    assert v.text == want == "Hello world\né<b>& !Helé"
    assert [(s.cycle, s.kind) for s in v.spans] == [(0, "run"), (1, "run"), (1, "fix"), (2, "run"), (2, "fix"), (4, "run")]
    assert v.tokens == [t for c in cycles for t in c.committed]
    h = view.spans_html(3, v.spans, selected=1)
    assert h.count('class="cyc c0"') == 3 and h.count('class="cyc c1 sel"') == 1 and h.count('class="cyc fix') == 2
    assert 'data-pick="3:2"' in h and "&lt;b&gt;&amp;" in h and "<b>" not in h


def test_inspector_rows_prove():
    # slots 1-2 pass p*q >= theta, slot 3 fails (the run ends), slot 4 passes after the failure
    c = cyc([1, 2, 3, 4], [0.5, 0.9, 0.9, 0.9], [0.2, 0.5, 0.01, 0.9], [1, 2], 2, plan=Plan("prove", 4),
            gate=[True, True, False, True])
    rows = view.inspect_cycle(c, "prove", theta=0.05, token_text=name)
    assert [r.slot for r in rows] == [1, 2, 3, 4]
    assert [r.gate for r in rows] == [True, True, False, True]
    assert [r.status for r in rows] == ["committed", "committed", "dropped", "dropped"]
    assert rows[0].pq == pytest.approx(0.1) and rows[0].verdict == "p̃·q ≥ θ = 0.05"
    assert "run ends" in rows[2].verdict and "after the first failure" in rows[3].verdict
    assert rows[0].text == "Hel" and rows[2].text == "␣wor"
    # slot 1 fails the gate but is committed anyway: it is the target's AR token
    c = cyc([1, 2], [0.5, 0.9], [0.01, 0.9], [1], 1, plan=Plan("prove", 2), gate=[False, True])
    rows = view.inspect_cycle(c, "prove", theta=0.05, token_text=name)
    assert [(r.gate, r.status) for r in rows] == [(False, "committed"), (True, "dropped")]
    assert "AR token" in rows[0].verdict and "after the first failure" in rows[1].verdict


def test_inspector_rows_mars_and_ar():
    rows = view.inspect_cycle(cyc([1, 2, 3], [0.99, 0.97, 0.5], None, [1, 2], 2, gate=[True, True, False]), "mars",
                              tau=0.95, token_text=name)
    assert [(r.gate, r.status, r.q, r.pq) for r in rows] == [(True, "committed", None, None)] * 2 + [(False, "dropped", None, None)]
    rows = view.inspect_cycle(cyc([5], [0.3], None, [5], 1, plan=Plan(), gate=[True]), "ar", token_text=name)
    assert len(rows) == 1 and rows[0].status == "committed" and rows[0].text == "↵"


def test_inspector_rows_lossless_correction_and_bonus():
    c = cyc([1, 2, 3, 4], [.9, .8, .7, .6], [.9, .8, .1, .5], [1, 2, 9], 2, plan=Plan("lossless", 4),
            gate=[True, True, False, None], residual=True)
    rows = view.inspect_cycle(c, "lossless", token_text=name)
    assert [r.status for r in rows] == ["committed", "committed", "dropped", "dropped", "correction"]
    assert [r.gate for r in rows] == [True, True, False, None, None]
    assert "␣!" in rows[2].verdict and rows[4].slot is None and rows[4].text == "␣!"
    full = view.inspect_cycle(cyc([1, 2], [.9, .9], [.9, .9], [1, 2, 3], 2, plan=Plan("lossless", 2), gate=[True, True]),
                              "lossless", token_text=name)
    assert full[-1].status == "bonus"
    # cut by max new tokens inside the accepted run: no correction token, the rest is "cut"
    cut = view.inspect_cycle(cyc([1, 2, 3], [.9] * 3, [.9] * 3, [1], 1, stop="length", plan=Plan("lossless", 3),
                                 gate=[True, True, True]), "lossless", token_text=name)
    assert [r.status for r in cut] == ["committed", "dropped", "dropped"] and "stopped" in cut[1].verdict


def test_inspector_rows_spec():
    c = Cycle([1, 2, 3], [.9, .8, .7], [.6, .1, .2], [1, 4], 1, {"draft": 3, "target": 1},
              plan=Plan("spec", draft_k=3), gate=[True, False, None], residual=True)
    rows = view.inspect_cycle(c, "spec", token_text=name)
    assert [r.status for r in rows] == ["committed", "dropped", "dropped", "correction"]
    assert rows[1].gate is False and "target" in rows[1].verdict


def test_inspector_and_compare_html_escape_model_text():
    c = cyc([8, 2], [.9, .01], [.9, .9], [8], 1, index=4, plan=Plan("prove", 2), gate=[True, False])
    rows = view.inspect_cycle(c, "prove", theta=0.05, token_text=name)
    h = view.inspector_html(c, rows, "prove", theta=0.05, tau=0.95, context="<script>x</script>", turn=2, n_cycles=9)
    assert "<script>" not in h and "&lt;b&gt;&amp;" in h and 'data-cycle="2:4"' in h and "cycle 5 of 9" in h
    assert h.count("<th>") == 2 and "committed 1 of 2" in h
    stats = {"n_tokens": 3, "n_cycles": 2, "tokens_per_cycle": 1.5, "n_passes": {"target": 2},
             "tokens_per_second": 10.0, "stop": "eog"}
    cmp = view.compare_html("lossless", "a<b", [view.Span("a<b", 0, "run")], stats, "a<b", stats, 1.5)
    assert "identical ✓" in cmp and "1.50×" in cmp and "a<b" not in cmp
    assert "differ" in view.compare_html("lossless", "a", [], stats, "b", stats, None)
    assert view.banner_html("x <y>") == '<div class="banner error" role="alert">x &lt;y&gt;</div>'


def test_command_line_defaults_are_safe():
    import argparse

    from prove_local.ui.app import add_parser
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["ui"])
    assert (a.model, a.host, a.port, a.share, a.parallel) == (None, "127.0.0.1", 7860, False, 1)
    a = parser.parse_args(["ui", "m.gguf", "--verifier", "v.gguf", "--draft", "d.gguf", "--port", "9000"])
    assert (a.model, a.verifier, a.draft, a.port) == ("m.gguf", "v.gguf", "d.gguf", 9000)
    # `prove-local run` does not pay for gradio: the ui command imports it when it runs
    out = subprocess.run([sys.executable, "-c", "import sys, prove_local.cli, prove_local.ui.app; print('gradio' in sys.modules)"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


# ------------------------------------------------------------------------ runtime, tiny GGUFs
def ui_args(**kw):
    base = dict(model=None, verifier=None, draft=None, ctx=512, threads=1, kv_type="f32", flash_attn=False,
                n_gpu_layers=0, mask_token=None, parallel=1, system=None)
    base.update(kw)
    return Namespace(**base)


def test_runtime_turns_equal_the_engine_and_compare(ui_models, ui_paths):
    rt = Runtime(Loaded(*ui_models, context_options=F32), parallel=1)
    assert rt.error is None and rt.default_mode == "lossless" and set(rt.modes) == {"ar", "lossless", "prove", "mars", "lookup"}
    assert "draft" in rt.mode_errors["spec"]
    sess = Session()
    users = ["What is 7 times 8?", "And 9 times 9?"]
    for user in users:
        turns = list(run_turn(rt, sess, user, Settings(mode="lossless", max_new=MAX_NEW)))
        assert turns[-1].running is False and turns[-1].stats["n_tokens"] >= 1
    assert [t.view.text for t in sess.turns] == reference(ui_models, users)
    cmp = compare_with_ar(rt, sess)
    assert cmp["identical"] and cmp["speedup"] > 0
    # another session on the same engine: the engine's KV reuse keeps them apart
    other = Session()
    list(run_turn(rt, other, "Hello", Settings(mode="lossless", max_new=MAX_NEW, block=3)))
    assert other.turns[0].view.text == reference(ui_models, ["Hello"])[0]
    # and the first session goes on from its own conversation
    list(run_turn(rt, sess, "Thanks", Settings(mode="ar", max_new=MAX_NEW)))
    assert sess.turns[-1].view.text == reference(ui_models, users + ["Thanks"])[-1]


def test_two_sessions_decode_at_the_same_time_with_parallel_2(ui_models):
    """With --parallel 2 two answers are open at once: each session, after its first cycle, waits until
    the other has made its first cycle too (with one engine the second would wait for the first to
    finish, and the barrier would time out). Both answers equal the independent reference."""
    import threading
    rt = Runtime(Loaded(*ui_models, context_options=F32), parallel=2)
    prompts = ["Weng earns $12 an hour for babysitting. How much did she earn?", "def f(x): return x * 2"]
    both_started = threading.Barrier(2, timeout=60)
    results, failures = {}, []

    def session(i):
        try:
            sess = Session()
            for k, turn in enumerate(run_turn(rt, sess, prompts[i], Settings(mode="lossless", max_new=MAX_NEW, block=3))):
                if k == 0:
                    both_started.wait()      # raises BrokenBarrierError if the other never got an engine
            results[i] = sess.turns[0].view.text
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(f"session {i}: {type(e).__name__}: {e}")
            both_started.abort()
    threads = [threading.Thread(target=session, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures and not any(t.is_alive() for t in threads), failures
    assert [results[0], results[1]] == [reference(ui_models, [p])[0] for p in prompts]


def test_stop_mid_answer_then_next_turn(ui_models):
    rt = Runtime(Loaded(*ui_models, context_options=F32))
    sess = Session()
    prompt = "Natalia sold clips to 48 of her friends in April. How many clips did she sell?"
    gen = run_turn(rt, sess, prompt, Settings(mode="lossless", max_new=MAX_NEW, block=2))
    next(gen)
    with pytest.raises(UIError, match="still being generated"):   # one answer at a time per session
        next(run_turn(rt, sess, "again", Settings()))
    sess.stop_requested = True                      # what the Stop button does
    last = list(gen)[-1]
    assert last.note == "stopped" and last.stats["stop"] == "stopped" and len(last.view.cycles) == 2
    assert sess.messages[-1] == {"role": "assistant", "content": last.view.text}
    list(run_turn(rt, sess, "Go on", Settings(mode="lossless", max_new=MAX_NEW)))
    prop, ver = ui_models
    conv = Conversation(prop)
    conv.prompt_tokens(prompt)
    conv.add_reply(last.view.text)
    assert sess.turns[-1].view.tokens == greedy_ar(prop, conv.prompt_tokens("Go on"), MAX_NEW, **F32)


def test_runtime_errors_are_messages(ui_models, ui_paths, tmp_path):
    rt = Runtime.from_args(ui_args(model=str(tmp_path / "missing.gguf")))
    assert rt.error.startswith("model failed to load") and "missing.gguf" in rt.error and rt.modes == []
    with pytest.raises(UIError, match="model failed to load"):
        list(run_turn(rt, Session(), "hi", Settings()))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" * 10)
    assert "not a GGUF file" in Runtime.from_args(ui_args(model=str(bad))).error
    rt = Runtime.from_args(ui_args(model=str(ui_paths[0]), ctx=64))
    assert rt.error is None and "prove" in rt.mode_errors
    sess = Session()
    with pytest.raises(UIError, match="context full"):
        list(run_turn(rt, sess, "long " * 80, Settings(max_new=8)))
    assert sess.turns == [] and sess.messages == []
    turns = list(run_turn(rt, sess, "hi", Settings(max_new=200)))   # fills the context: cut, with a note
    assert turns[-1].stats["stop"] in ("context", "eog") and (turns[-1].stats["stop"] == "eog" or "context" in turns[-1].note)


# ------------------------------------------------------------------------ the page in chromium
def test_page_end_to_end(browser, ui_server, ui_models, tmp_path):
    prompt = "Natalia sold clips to 48 of her friends in April. How many clips did she sell?"
    want = reference(ui_models, [prompt])[0]
    page = open_page(browser, ui_server)
    send(page, prompt, 0)()
    spans = answer_spans(page, 0)
    assert "".join(s["text"] for s in spans) == want
    cycles = [int(s["pick"].split(":")[1]) for s in spans]
    assert cycles == sorted(cycles)
    for s, c in zip(spans, cycles):                     # alternating colors; correction tokens marked
        assert ("fix" in s["cls"]) or (f"c{c % 2}" in s["cls"])
    assert "tokens/cycle" in page.inner_text("#stats") and "tokens/s" in page.inner_text("#stats")

    # open the inspector on one cycle by clicking its run
    target = spans[min(1, len(spans) - 1)]
    page.click(f'#chat .answer[data-turn="0"] span.cyc[data-pick="{target["pick"]}"] >> nth=0')
    page.wait_for_selector(f'#inspector .inspector[data-cycle="{target["pick"]}"]')
    heads = page.eval_on_selector_all("#inspector .insp-table tr:first-child th", "els => els.map(e => e.textContent)")
    assert heads[0] == "slot" and heads[1] == "1" and len(heads) >= 3
    assert "widths: target 16+16" in page.inner_text("#inspector .insp-head")
    assert page.locator("#inspector .insp-table .tok").count() == len(heads) - 1
    statuses = page.eval_on_selector_all("#inspector td.status", "els => els.map(e => e.textContent)")
    assert statuses[0] == "committed" and set(statuses) <= {"committed", "dropped", "correction", "bonus"}

    page.click("#compare")
    page.wait_for_selector("#comparison .compare")
    head = page.inner_text("#comparison .cmp-head")
    assert "speedup" in head and "×" in head and "identical" in head, head
    shot = tmp_path / "ui-screenshot.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("PROVE_ARTIFACTS"):
        Path(os.environ["PROVE_ARTIFACTS"]).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(os.environ["PROVE_ARTIFACTS"]) / shot.name)
    print(f"screenshot: {shot}")
    page.close()


def test_enter_sends_and_shift_enter_is_a_new_line(browser, ui_server, ui_models):
    """Keys as a user types them: Shift+Enter puts a new line in the message, Enter sends it. Had
    Shift+Enter sent the first line, turn 0 would answer that line alone, not the two-line message."""
    from playwright.sync_api import expect

    page = open_page(browser, ui_server)
    box = page.locator("#prompt textarea")
    box.click()
    page.keyboard.type("What is 7 times 8?")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("Answer briefly.")
    assert box.input_value() == "What is 7 times 8?\nAnswer briefly."
    page.keyboard.press("Enter")
    answer_done(page, 0)()
    want = reference(ui_models, ["What is 7 times 8?\nAnswer briefly."])[0]
    assert "".join(s["text"] for s in answer_spans(page, 0)) == want
    assert page.locator("#chat .msg.user").count() == 1                 # sent once
    expect(box).to_have_value("")                                       # and the box emptied
    page.close()


def test_two_sessions_at_once_give_their_answers_alone(browser, ui_server, ui_models):
    prompts = ["Weng earns $12 an hour for babysitting. How much did she earn?", "def f(x): return x * 2"]
    alone = [reference(ui_models, [p]) for p in prompts]
    follow_up = reference(ui_models, [prompts[0], "And for 50 minutes?"])
    pages = [open_page(browser, ui_server) for _ in prompts]
    waits = [send(pg, p, 0) for pg, p in zip(pages, prompts)]     # both generate at the same time
    for w in waits:
        w()
    for pg, want in zip(pages, alone):
        assert "".join(s["text"] for s in answer_spans(pg, 0)) == want[0]
    send(pages[0], "And for 50 minutes?", 1)()                     # a second turn, after the other session ran
    assert "".join(s["text"] for s in answer_spans(pages[0], 1)) == follow_up[1]
    for pg in pages:
        pg.close()


def test_errors_show_in_the_page(browser, ui_models, ui_paths, tmp_path):
    from prove_local.ui.app import build_app

    apps = []
    try:
        for rt in (Runtime.from_args(ui_args(model=str(tmp_path / "nope.gguf"))),
                   Runtime.from_args(ui_args(model=str(ui_paths[0]), ctx=64))):
            demo = build_app(rt, max_new=8)
            apps.append((demo, launch_here(demo, rt)))
        page = open_page(browser, apps[0][1])
        assert "model failed to load" in page.inner_text("#banner") and "nope.gguf" in page.inner_text("#banner")
        page.goto(apps[1][1])
        page.wait_for_selector("#chat .chat-scroll")
        page.fill("#prompt textarea", "long " * 80)
        page.click("#send")
        page.wait_for_selector("#banner .banner.error")
        assert "context full" in page.inner_text("#banner")
        page.close()
    finally:
        for demo, _ in apps:
            demo.close()


def test_two_pages_decode_at_the_same_time_with_parallel_2(browser, ui_models, monkeypatch):
    """Through gradio's queue too: each answer, after its first cycle, waits until the other page's
    answer has made its first cycle (holding its engine). Were the two requests served one after the
    other, the barrier would break and the answers would carry an error instead of the reference."""
    import threading

    from prove_local.ui import runtime as runtime_mod
    from prove_local.ui.app import build_app

    both_started = threading.Barrier(2, timeout=60)
    met = []
    real = runtime_mod.run_turn

    def run_turn_meeting(rt, sess, user, settings):
        for k, turn in enumerate(real(rt, sess, user, settings)):
            if k == 0:
                both_started.wait()
                met.append(user)
            yield turn
    monkeypatch.setattr(runtime_mod, "run_turn", run_turn_meeting)
    rt = Runtime(Loaded(*ui_models, context_options=F32), parallel=2)
    demo = build_app(rt, max_new=MAX_NEW)
    url = launch_here(demo, rt)
    try:
        prompts = ["Weng earns $12 an hour for babysitting. How much did she earn?", "def f(x): return x * 2"]
        pages = [open_page(browser, url) for _ in prompts]
        waits = [send(pg, p, 0) for pg, p in zip(pages, prompts)]
        for w in waits:
            w()
        assert sorted(met) == sorted(prompts)
        for pg, p in zip(pages, prompts):
            assert "".join(s["text"] for s in answer_spans(pg, 0)) == reference(ui_models, [p])[0]
            pg.close()
    finally:
        demo.close()


def test_inspector_sampled_cycle_with_a_verify_prefix():
    """A sampled lossless cycle whose planner verified 2 of 4 slots: slots 3-4 were never tested."""
    c = Cycle([1, 2, 3, 4], [.9, .8, .7, .6], [.9, .8], [1, 2, 9], 2, {"target": 2},
              widths={"target": [4, 2]}, accept_prob=[1.0, 0.7], residual=False,
              plan=Plan("lossless", 4, verify=2), gate=[True, True, None, None])
    rows = view.inspect_cycle(c, "lossless", token_text=name)
    assert [r.status for r in rows[:4]] == ["committed", "committed", "dropped", "dropped"]
    assert all("not verified" in r.verdict for r in rows[2:4]), [r.verdict for r in rows]
    assert "min(1, q/p̃) = 0.7" in rows[1].verdict.replace("0.700", "0.7")


def test_inspector_shows_the_planners_widths():
    """--block auto: a lossless cycle that verified a prefix, and a plain ar cycle inside a lossless answer."""
    c = Cycle([1, 2, 3, 4], [.9, .8, .7, .6], [.9, .8], [1, 2, 9], 2, {"target": 2},
              widths={"target": [4, 2]}, plan=Plan("lossless", 4, verify=2), gate=[True, True, None, None])
    rows = view.inspect_cycle(c, "lossless", token_text=name)
    assert [r.status for r in rows] == ["committed", "committed", "dropped", "dropped", "bonus"]
    assert "not verified" in rows[2].verdict and rows[2].q is None
    html = view.inspector_html(c, rows, "lossless", theta=0.05, tau=0.95)
    assert "widths: target 4+2 (B=4 v=2)" in html
    ar = Cycle([5], [.7], None, [5], 1, {"target": 1}, widths={"target": [1]})
    rows = view.inspect_cycle(ar, "lossless", token_text=name)
    assert [r.status for r in rows] == ["committed"] and "AR token" in rows[0].verdict
    assert "(ar)" in view.inspector_html(ar, rows, "lossless", theta=0.05, tau=0.95)
    # the inspector never shows an empty proposal without saying why, and how to see proposals
    html = view.inspector_html(ar, rows, "lossless", theta=0.05, tau=0.95, planner_note="auto chose ar: X")
    assert "no proposal in this cycle" in html and "auto chose ar: X" in html
    assert "Fix the block length" in view.inspector_html(ar, rows, "lossless", theta=0.05, tau=0.95)
    assert "no proposal" not in view.inspector_html(ar, rows, "ar", theta=0.05, tau=0.95)   # ar mode itself
    chat = view.chat_html([view.ChatItem("q", [view.Span("a", 0, "run")], hint="auto chose ar: <why>")])
    assert '<div class="hint">auto chose ar: &lt;why&gt;</div>' in chat
