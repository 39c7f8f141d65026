"""The chat page of `prove-local ui`: its layout, what it shows for a session (HTML from
`view.py`), and the handlers its events are wired to. Imported when the page is built (it imports
gradio); the command, the launch and the page's CSS live in `app.py`.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import gradio as gr

from prove_local import sampling
from prove_local.answer import summary
from prove_local.engine import Settings
from prove_local.modes import MODES, draft_counts

from . import runtime as rt
from . import view

STREAM_INTERVAL = 0.1       # seconds between page updates while an answer streams
PLACEHOLDER = ("Ask something, e.g. a GSM8K question. Each cycle's committed tokens get one color; "
               "click a run to see the whole proposed block.")
NO_CYCLE = '<div class="inspector empty">No cycle selected: send a prompt, then click a colored run.</div>'


def build_app(runtime, *, max_new: int = 256, block="auto", draft_k="auto", lookup="auto"):
    """The page, on a loaded `Runtime` (or one whose `error` says why not): its layout, then the
    wiring of its events to the handlers of `Page`."""
    page = Page(runtime)
    with gr.Blocks(title="prove-local", analytics_enabled=False) as demo:
        ui = layout(page, max_new=max_new, block=block, draft_k=draft_k, lookup=lookup)
        wire(page, ui)
    return demo


# ---------------------------------------------------------------------- what a session's page shows
def live_stats(t):
    """The finished answer's statistics, or those of the cycles so far while it streams."""
    if t.stats or not t.view.cycles:
        return t.stats
    return summary(list(t.view.cycles), t.request)


def default_cycle(turn) -> int:
    """The cycle the inspector opens on: the longest committed run that still dropped something."""
    best, key = 0, (-1, -1, -1)
    for i, c in enumerate(turn.view.cycles):
        k = (int(c.stop is None), int(c.n_accepted < len(c.proposed)), len(c.committed))
        if k > key:
            best, key = i, k
    return best


def cycle_number(sess) -> int:
    return (sess.selected[1] + 1) if sess.selected else 1


class Page:
    """One page's rendering (HTML from ui/view.py, per session) and the handlers of its events, on
    one `Runtime`. Gradio passes the session (`gr.State`) in and takes it back out of every handler."""

    def __init__(self, runtime):
        self.runtime = runtime

    @staticmethod
    def session(sess):
        return sess if isinstance(sess, rt.Session) else rt.Session()

    # ------------------------------------------------------------------ rendering
    def chat(self, sess) -> str:
        messages = [view.ChatItem(t.user, t.view.spans, view.stats_line(live_stats(t), t.settings.mode), t.running,
                                 t.note, t.planner_note or "") for t in sess.turns]
        return view.chat_html(messages, sess.selected, PLACEHOLDER)

    def inspector(self, sess) -> str:
        if not sess.selected or sess.selected[0] >= len(sess.turns):
            return NO_CYCLE
        t, c = sess.selected
        turn = sess.turns[t]
        cycles = turn.view.cycles
        if not cycles:
            return ""
        c = min(c, len(cycles) - 1)
        cycle = cycles[c]
        s = turn.settings
        rows = view.inspect_cycle(cycle, s.mode, s.theta, s.tau, self.runtime.token_text)
        context = "".join(sp.text for sp in turn.view.spans if sp.cycle < c) or turn.user
        return view.inspector_html(cycle, rows, s.mode, theta=s.theta, tau=s.tau, context=context,
                                   turn=t, n_cycles=len(cycles), planner_note=turn.planner_note)

    def stats(self, sess) -> str:
        st = live_stats(sess.turns[-1]) if sess.turns else None
        if not st:
            return ""
        t = sess.turns[-1]
        passes = ", ".join(f"{r} {n}" for r, n in st["n_passes"].items())
        # a sampled answer: its temperature and seed (that seed gives this answer again; with the coupled
        # sampler at any width, and in ar, lossless, spec and lookup alike)
        sampled = f"T {t.settings.temperature:g}, seed {t.seed} · " if t.settings.temperature > 0 else ""
        ppt = ", ".join(f"{r} {v:.2f}" for r, v in st["passes_per_token"].items())
        lk = draft_counts(list(t.view.cycles)).get("lookup")
        lookup = f"lookup drafts accepted {lk[1]}/{lk[0]} · " if lk else ""
        return (f'<div class="stats"><b>last answer</b> · {view.esc(view.title(t.settings.mode))} · '
                f'{st["n_tokens"]} tokens in {st["n_cycles"]} cycles · <b>{st["tokens_per_cycle"]:.2f} tokens/cycle</b> · '
                f'<b>{st["tokens_per_second"]:.1f} tokens/s</b> · passes: {passes} · passes/token: {ppt} · '
                f'{lookup}{sampled}stop: {st["stop"] or "running…"}</div>')

    def compare_panel(self, sess) -> str:
        if not sess.turns or not sess.turns[-1].compare:
            return ""
        t = sess.turns[-1]
        cmp = t.compare
        return view.compare_html(t.settings.mode, cmp["mode_text"], t.view.spans, t.stats, cmp["ar_text"],
                                 cmp["ar_stats"], cmp["speedup"], turn=len(sess.turns) - 1,
                                 temperature=t.settings.temperature, coupled=t.settings.sampler == "coupled")

    def answer_outputs(self, sess, banner, box):
        """What a send updates: chat, stats, inspector, cycle number, banner, comparison, message box, session."""
        return (self.chat(sess), self.stats(sess), self.inspector(sess), cycle_number(sess), banner,
                self.compare_panel(sess), box, sess)

    # ------------------------------------------------------------------ handlers
    def send(self, text, mode, theta, tau, block, max_new, draft_k, lookup, temp, top_k, top_p, min_p,
             repeat_penalty, seed, sess):
        sess = self.session(sess)
        text = (text or "").strip()
        if not text:
            yield self.answer_outputs(sess, view.banner_html("type a message first", "warn"), gr.update())
            return
        # sampling: the side panel's "sampling" controls (seed -1: a fresh seed per answer);
        # slider value 0 is "auto": the planner picks the widths per cycle (planner.py)
        try:        # the one rule of the CLI and the server: finite, >= 0, a tiny T is greedy
            temperature = sampling.temperature_of(float(temp))
        except (TypeError, ValueError) as e:
            yield self.answer_outputs(sess, view.banner_html(str(e)), gr.update())
            return
        settings = Settings(mode=mode, max_new=int(max_new), block=int(block) or "auto", theta=float(theta),
                            tau=float(tau), draft_k=int(draft_k) or "auto",
                            lookup="auto" if int(lookup) < 0 else int(lookup), temperature=temperature, top_k=int(top_k),
                            top_p=float(top_p), min_p=float(min_p), repeat_penalty=float(repeat_penalty),
                            seed=None if seed is None or int(seed) < 0 else int(seed))
        banner = ""
        last = 0.0
        try:
            for turn in rt.run_turn(self.runtime, sess, text, settings):
                now = time.monotonic()
                if turn.running and now - last < STREAM_INTERVAL:
                    continue
                last = now
                t = len(sess.turns) - 1
                if turn.view.cycles:
                    sess.selected = (t, default_cycle(turn) if not turn.running else len(turn.view.cycles) - 1)
                if not turn.running and turn.note and turn.stats and turn.stats["stop"] == "context":
                    banner = view.banner_html(turn.note, "warn")
                # the message box empties when the answer is done
                yield self.answer_outputs(sess, banner, "" if not turn.running else gr.update())
        except rt.UIError as e:
            yield self.answer_outputs(sess, view.banner_html(str(e)), gr.update())

    def stop(self, sess):
        if isinstance(sess, rt.Session):
            sess.stop_requested = True
        return sess

    def clear(self, sess):
        sess = rt.Session(engine_hint=sess.engine_hint if isinstance(sess, rt.Session) else None)
        return self.chat(sess), "", self.inspector(sess), 1, "", "", sess

    def select(self, sess, turn: int, cycle: int):
        sess = self.session(sess)
        if sess.turns:
            turn = turn if 0 <= turn < len(sess.turns) else len(sess.turns) - 1
            n = len(sess.turns[turn].view.cycles)
            if n:
                sess.selected = (turn, max(0, min(cycle, n - 1)))
        return self.chat(sess), self.inspector(sess), cycle_number(sess), sess

    def pick(self, value, sess):
        """A click on a colored run: "turn:cycle|nonce" from the page's script (HEAD)."""
        try:
            t, c = (int(x) for x in (value or "").split("|")[0].split(":"))
        except ValueError:
            return self.select(sess, -1, 0)
        return self.select(sess, t, c)

    def goto(self, number, sess):
        turn = sess.selected[0] if isinstance(sess, rt.Session) and sess.selected else -1
        return self.select(sess, turn, int(number or 1) - 1)

    def step(self, delta: int):
        def f(sess):
            t, c = sess.selected if isinstance(sess, rt.Session) and sess.selected else (-1, 0)
            return self.select(sess, t, c + delta)
        return f

    def compare(self, sess):
        sess = self.session(sess)
        try:
            rt.compare_with_ar(self.runtime, sess)
        except rt.UIError as e:
            return self.compare_panel(sess), view.banner_html(str(e)), sess
        return self.compare_panel(sess), "", sess

    @staticmethod
    def mode_changed(mode):
        m = MODES[mode]
        return (gr.update(visible=m.gate == "theta"), gr.update(visible=m.gate == "tau"),
                gr.update(visible=m.width == "block"), gr.update(visible=m.width == "draft_k"),
                gr.update(visible=m.lookup))


# ---------------------------------------------------------------------- layout
def models_line(runtime) -> str:
    """The models, the context and the decoding slots, as one Markdown line."""
    names = runtime.names()
    line = " · ".join(f"**{role}** `{name}`" for role, name in names.items())
    if names:
        line += f" · context {runtime.n_ctx} tokens · {runtime.parallel} decoding slot{'s' if runtime.parallel > 1 else ''}"
    return line or "no model loaded"


def unavailable_modes(runtime) -> str:
    """The modes these models cannot run, grouped by reason ("prove: needs --verifier V.gguf")."""
    def why(m, msg):
        if "mask token" in msg:
            return "the target model has no mask token"
        partner = MODES[m].partner
        return f"needs --{partner} {partner[0].upper()}.gguf" if partner else msg
    reasons: dict[str, list[str]] = {}
    for m, msg in runtime.mode_errors.items():
        reasons.setdefault(why(m, msg), []).append(m)
    return "; ".join(f"{', '.join(ms)}: {r}" for r, ms in reasons.items())


def layout(page: Page, *, max_new: int, block, draft_k, lookup) -> SimpleNamespace:
    """The page's components (inside an open gr.Blocks), by name."""
    ui = SimpleNamespace(state=gr.State(lambda: rt.Session()))
    gr.Markdown("# ProVe local · proposer–verifier decoding, cycle by cycle", elem_id="title")
    gr.Markdown(models_line(page.runtime), elem_id="models")
    ui.banner = gr.HTML(view.banner_html(page.runtime.error), elem_id="banner")
    with gr.Row(equal_height=False):
        with gr.Column(scale=5):
            chat_column(ui)
        with gr.Column(scale=2, min_width=260):
            settings_column(ui, page.runtime, max_new=max_new, block=block, draft_k=draft_k, lookup=lookup)
    inspector_row(ui, page)
    return ui


def chat_column(ui: SimpleNamespace) -> None:
    gr.HTML(view.legend_html(), padding=False)
    ui.chat_box = gr.HTML(view.chat_html([], None, PLACEHOLDER), elem_id="chat", padding=False)
    with gr.Row():
        # lines=1 with max_lines > 1: Gradio's textarea grows with the text, Enter submits and
        # Shift+Enter is a new line (with lines > 1 Gradio swaps the two: Enter would not send)
        ui.box = gr.Textbox(show_label=False, placeholder="Message (Enter sends, Shift+Enter: new line)",
                            lines=1, max_lines=8, scale=6, elem_id="prompt", autofocus=True)
        with gr.Column(scale=1, min_width=110):
            ui.send_btn = gr.Button("Send", variant="primary", elem_id="send")
            ui.stop_btn = gr.Button("Stop", size="sm", elem_id="stop")
    ui.stats_box = gr.HTML("", elem_id="stats", padding=False)


def settings_column(ui: SimpleNamespace, runtime, *, max_new: int, block, draft_k, lookup) -> None:
    modes = runtime.modes
    default_mode = runtime.default_mode if runtime.default_mode in modes else (modes[0] if modes else "ar")
    unavailable = unavailable_modes(runtime)
    ui.mode = gr.Dropdown([(view.mode_choice(m), m) for m in (modes or MODES)], value=default_mode,
                          label="mode", elem_id="mode",
                          info=("not available with these models: " + unavailable) if unavailable else None)
    ui.theta = gr.Slider(0.0, 1.0, value=0.05, step=0.005, label="θ (ProVe gate: commit while p̃·q ≥ θ)",
                         visible=MODES[default_mode].gate == "theta", elem_id="theta")
    ui.tau = gr.Slider(0.0, 1.0, value=0.95, step=0.01, label="τ (MARS rule: commit while p̃ ≥ τ)",
                       visible=MODES[default_mode].gate == "tau", elem_id="tau")
    ui.block = gr.Slider(0, 64, value=0 if block == "auto" else block, step=1,
                         label="block length (0 = auto: chosen per cycle)",
                         visible=MODES[default_mode].width == "block", elem_id="block")
    ui.draft_k = gr.Slider(0, 16, value=0 if draft_k == "auto" else draft_k, step=1,
                           label="draft tokens per cycle (spec; 0 = auto)", visible=MODES[default_mode].width == "draft_k",
                           elem_id="draft_k")
    ui.lookup = gr.Slider(-1, 16, value=-1 if lookup == "auto" else lookup, step=1, elem_id="lookup",
                          label="lookup draft tokens (copied from the text; -1 = auto, 0 = off)",
                          visible=MODES[default_mode].lookup)
    ui.max_new = gr.Slider(1, 2048, value=max_new, step=1, label="max new tokens", elem_id="max_new")
    with gr.Accordion("sampling", open=False, elem_id="sampling"):
        ui.temp = gr.Slider(0.0, 2.0, value=0.0, step=0.05, elem_id="temp",
                            label="temperature (0: greedy; sampled lossless/spec give ar's text for the seed)")
        ui.top_k = gr.Slider(0, 200, value=40, step=1, label="top-k (0: off)", elem_id="top_k")
        ui.top_p = gr.Slider(0.0, 1.0, value=0.95, step=0.01, label="top-p (1: off)", elem_id="top_p")
        ui.min_p = gr.Slider(0.0, 1.0, value=0.05, step=0.01, label="min-p (0: off)", elem_id="min_p")
        ui.repeat_penalty = gr.Slider(0.5, 2.0, value=1.0, step=0.05, elem_id="repeat_penalty",
                                      label="repeat penalty over the last 64 tokens (1: off)")
        ui.seed = gr.Number(value=-1, precision=0, label="seed (-1: random)", elem_id="seed")
    ui.compare_btn = gr.Button("Compare with AR", elem_id="compare")
    ui.clear_btn = gr.Button("Clear conversation", size="sm", elem_id="clear")


def inspector_row(ui: SimpleNamespace, page: Page) -> None:
    with gr.Row(equal_height=True, elem_id="insp-bar"):
        gr.Markdown("### Cycle inspector", elem_id="insp-title")
        ui.prev_btn = gr.Button("◀ previous", size="sm", scale=0, min_width=110, elem_id="prev")
        ui.cycle_no = gr.Number(value=1, precision=0, minimum=1, label="cycle", show_label=False, container=False,
                                scale=0, min_width=80, elem_id="cycle_no")
        ui.next_btn = gr.Button("next ▶", size="sm", scale=0, min_width=110, elem_id="next")
    ui.insp_box = gr.HTML(page.inspector(rt.Session()), elem_id="inspector", padding=False)
    ui.compare_box = gr.HTML("", elem_id="comparison", padding=False)
    ui.pick_box = gr.Textbox(elem_id="pick", visible="hidden", show_label=False)


# ---------------------------------------------------------------------- events
def wire(page: Page, ui: SimpleNamespace) -> None:
    """Events to handlers. Decoding (send, compare) shares `parallel` slots of gradio's queue; the
    cheap ones (stop, clear, selecting a cycle) skip the queue, so Stop works while an answer streams."""
    parallel = page.runtime.parallel
    settings = [ui.mode, ui.theta, ui.tau, ui.block, ui.max_new, ui.draft_k, ui.lookup, ui.temp, ui.top_k, ui.top_p,
                ui.min_p, ui.repeat_penalty, ui.seed]
    answer = [ui.chat_box, ui.stats_box, ui.insp_box, ui.cycle_no, ui.banner, ui.compare_box, ui.box, ui.state]
    gr.on([ui.send_btn.click, ui.box.submit], page.send, [ui.box, *settings, ui.state], answer,
          concurrency_limit=parallel, concurrency_id="decode", show_progress="hidden")
    ui.stop_btn.click(page.stop, ui.state, ui.state, queue=False, show_progress="hidden")
    ui.clear_btn.click(page.clear, ui.state, [ui.chat_box, ui.stats_box, ui.insp_box, ui.cycle_no, ui.banner,
                                               ui.compare_box, ui.state], queue=False, show_progress="hidden")
    ui.compare_btn.click(page.compare, ui.state, [ui.compare_box, ui.banner, ui.state], concurrency_limit=parallel,
                         concurrency_id="decode", show_progress="minimal")
    selection = [ui.chat_box, ui.insp_box, ui.cycle_no, ui.state]
    ui.pick_box.change(page.pick, [ui.pick_box, ui.state], selection, queue=False, show_progress="hidden")
    ui.cycle_no.submit(page.goto, [ui.cycle_no, ui.state], selection, queue=False, show_progress="hidden")
    ui.prev_btn.click(page.step(-1), ui.state, selection, queue=False, show_progress="hidden")
    ui.next_btn.click(page.step(1), ui.state, selection, queue=False, show_progress="hidden")
    ui.mode.change(page.mode_changed, ui.mode, [ui.theta, ui.tau, ui.block, ui.draft_k, ui.lookup], queue=False,
                   show_progress="hidden")
