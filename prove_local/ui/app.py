"""`prove-local ui`: a Gradio chat that shows every decoding cycle.

The page streams each answer as colored runs (one color per cycle, alternating; the lossless /
spec correction or bonus token in its own color). Clicking a run opens that cycle in the
inspector: every proposed slot with p̃, q, p̃·q, the gate's verdict, committed or dropped.
Gradio (the `ui` extra) is imported only when the command runs: in `launch` and `build_app`.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

from prove_local.engine import Settings, summarize
from prove_local.errors import MissingExtra
from prove_local.loading import MAX_NEW, PARALLEL, PORT, add_model_args, add_width_args
from prove_local.modes import MODES, draft_counts

from . import view
from .runtime import Runtime, Session, UIError, compare_with_ar, run_turn

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860
STREAM_INTERVAL = 0.1       # seconds between page updates while an answer streams

CSS = """
.gradio-container {max-width: 1280px !important; margin: auto;}
#title h1 {margin-bottom: 0;}
#models {color: var(--body-text-color-subdued); font-size: 0.9em;}
.chat-scroll {height: 360px; overflow-y: auto; display: flex; flex-direction: column-reverse;
  border: 1px solid var(--border-color-primary); border-radius: 10px; padding: 10px;
  background: var(--background-fill-secondary);}
.chat-empty {margin: auto; color: var(--body-text-color-subdued);}
.msg {display: flex; margin: 6px 0;}
.msg.user {justify-content: flex-end;}
.msg .bubble {max-width: 88%; padding: 8px 12px; border-radius: 12px; line-height: 1.55;
  white-space: pre-wrap; word-break: break-word; font-size: 0.95em;}
.msg.user .bubble {background: #4f46e5; color: white;}
.msg.bot .bubble {background: var(--background-fill-primary); border: 1px solid var(--border-color-primary);}
.answer .text {font-family: var(--font-mono); font-size: 0.92em;}
.answer .footer, .compare .footer {margin-top: 6px; font-size: 0.78em; color: var(--body-text-color-subdued);
  white-space: normal; font-family: var(--font);}
.answer .note {margin-top: 6px; font-size: 0.85em; color: #b91c1c; white-space: normal;}
.answer .hint {margin-top: 6px; font-size: 0.8em; color: var(--body-text-color-subdued); white-space: normal;}
.cyc {border-radius: 3px; cursor: pointer; padding: 1px 0;}
.cyc.c0, .tok.c0 {background: #dbeafe; color: #1e3a8a;}
.cyc.c1, .tok.c1 {background: #fde68a; color: #78350f;}
.cyc.fix, .tok.fix {background: #bbf7d0; color: #14532d; box-shadow: inset 0 -2px 0 #16a34a;}
.cyc.sel {outline: 2px solid #db2777; outline-offset: 0;}
.cyc.lk, .tok.lk {text-decoration: underline dotted #7c3aed; text-decoration-thickness: 2px; text-underline-offset: 3px;}
td.src.lookup {color: #7c3aed; font-weight: 600;}
.cyc:hover {filter: brightness(0.93);}
.typing {color: var(--body-text-color-subdued);}
.legend {display: flex; gap: 8px; align-items: center; font-size: 0.82em; margin: 2px 0 6px 0; flex-wrap: wrap;}
.legend .cyc {padding: 2px 6px; cursor: default;}
.legend .hint {color: var(--body-text-color-subdued);}
.stats {font-size: 0.85em; color: var(--body-text-color-subdued);}
.banner {padding: 10px 14px; border-radius: 8px; font-weight: 600; margin: 4px 0;}
.banner.error {background: #fee2e2; color: #991b1b; border: 1px solid #fca5a5;}
.banner.warn {background: #fef3c7; color: #92400e; border: 1px solid #fcd34d;}
.inspector {border: 1px solid var(--border-color-primary); border-radius: 10px; padding: 10px;
  background: var(--background-fill-primary);}
.insp-head {font-size: 0.9em; margin-bottom: 6px;}
.ctx {font-family: var(--font-mono); font-size: 0.82em; color: var(--body-text-color-subdued);
  white-space: pre-wrap; margin-bottom: 6px;}
.ctx-label {font-family: var(--font); font-weight: 600; margin-right: 6px;}
.cursor {color: #db2777;}
.insp-table {overflow-x: auto;}
.insp-table table {border-collapse: collapse; font-size: 0.78em; width: auto; margin: 0;}
.insp-table th, .insp-table td {border: 1px solid var(--border-color-primary); padding: 2px 4px;
  text-align: center; white-space: nowrap; font-variant-numeric: tabular-nums;}
.insp-table th.rowhead {text-align: right; background: var(--background-fill-secondary);}
.tok {font-family: var(--font-mono); padding: 1px 4px; border-radius: 3px; white-space: pre;}
.tok.drop {background: #f3f4f6; color: #9ca3af; text-decoration: line-through;}
.status.committed {color: #1d4ed8;}
.status.dropped {color: #9ca3af;}
.status.correction, .status.bonus {color: #15803d; font-weight: 600;}
.pass {color: #16a34a; font-weight: 700;}
.fail {color: #dc2626; font-weight: 700;}
.na {color: #9ca3af;}
.insp-foot {font-size: 0.78em; color: var(--body-text-color-subdued); margin-top: 6px;}
.verdicts {font-size: 0.82em; margin-top: 4px;}
.verdicts ol {margin: 4px 0 0 0; padding-left: 0; list-style: none; columns: 2;}
.compare {border: 1px solid var(--border-color-primary); border-radius: 10px; padding: 10px;}
.cmp-cols {display: flex; gap: 12px; margin-top: 8px;}
.cmp-col {flex: 1; min-width: 0;}
.cmp-title {font-weight: 600; margin-bottom: 4px;}
.cmp-col .text {font-family: var(--font-mono); font-size: 0.88em; white-space: pre-wrap; word-break: break-word;
  max-height: 260px; overflow-y: auto;}
#pick {display: none !important;}
#insp-bar {align-items: center; margin-top: 8px;}
#insp-title h3 {margin: 0;}
#cycle_no input {text-align: center;}
"""

# Clicking a colored run writes "turn:cycle|nonce" into the hidden #pick box; its change event
# opens that cycle in the inspector.
HEAD = """
<script>
document.addEventListener('click', (ev) => {
  const el = ev.target.closest ? ev.target.closest('[data-pick]') : null;
  if (!el) return;
  const box = document.querySelector('#pick textarea, #pick input');
  if (!box) return;
  box.value = el.dataset.pick + '|' + Date.now();
  box.dispatchEvent(new Event('input', {bubbles: true}));
});
</script>
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "ui", help="chat in the browser, every decoding cycle visible",
        description="Start a local Gradio chat that colors each cycle's committed tokens and shows, for any "
                    "cycle, the proposed block with p̃, q, the gate's verdict and what was dropped.")
    add_model_args(p)
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}: this machine only)")
    p.add_argument("--port", type=PORT, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--share", action="store_true", help="also open a public gradio.live link (off by default)")
    p.add_argument("--parallel", type=PARALLEL, default=1,
                   help="answers decoded at the same time, each on its own contexts (default 1: requests queue)")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("-n", "--max-new", type=MAX_NEW, default=256, help="initial max new tokens (default 256)")
    add_width_args(p)                   # --block / --draft-k: the sliders' initial values (0 = auto)
    p.set_defaults(func=cmd_ui)
    return p


def require_gradio() -> None:
    """Checked before any model is loaded: without the extra, one line naming it."""
    if importlib.util.find_spec("gradio") is None:
        raise MissingExtra("ui", "gradio")


def cmd_ui(args) -> int:
    require_gradio()
    runtime = Runtime.from_args(args)
    if runtime.error:
        print(f"prove-local ui: {runtime.error} (the page shows this too)", file=sys.stderr)
    demo = build_app(runtime, max_new=args.max_new, block=args.block, draft_k=args.draft_k, lookup=args.lookup)
    try:
        _, local_url, share_url = launch(demo, runtime, host=args.host, port=args.port, share=args.share,
                                         prevent_thread_lock=True, quiet=True)
    except OSError as e:
        print(f"prove-local ui: error: cannot listen on {args.host}:{args.port} ({e}); try --port", file=sys.stderr)
        return 1
    print(f"prove-local ui: open {local_url}" + (f" (public link: {share_url})" if share_url else
          "" if args.host != DEFAULT_HOST else " (this machine only; --host 0.0.0.0 or --share to open it up)"),
          file=sys.stderr)
    try:
        demo.block_thread()
    except KeyboardInterrupt:
        pass
    finally:
        demo.close()
    return 0


def launch(demo, runtime, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, share: bool = False, **kw):
    import gradio as gr

    demo.queue(default_concurrency_limit=runtime.parallel)
    return demo.launch(server_name=host, server_port=port, share=bool(share), ssr_mode=False, mcp_server=False,
                       css=CSS, head=HEAD, theme=gr.themes.Soft(primary_hue="indigo"), show_error=False, footer_links=["gradio"], **kw)


def build_app(runtime, *, max_new: int = 256, block="auto", draft_k="auto", lookup="auto"):
    """The page, on a loaded `Runtime` (or one whose `error` says why not)."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import gradio as gr

    parallel = runtime.parallel
    modes = runtime.modes
    default_mode = runtime.default_mode if runtime.default_mode in modes else (modes[0] if modes else "ar")
    placeholder = ("Ask something, e.g. a GSM8K question. Each cycle's committed tokens get one color; "
                   "click a run to see the whole proposed block.")

    # ------------------------------------------------------------------ rendering helpers
    def messages_of(sess):
        return [view.Message(t.user, t.view.spans, view.stats_line(live_stats(t), t.settings.mode), t.running, t.note,
                             t.planner_note or "") for t in sess.turns]

    def live_stats(t):
        """The finished answer's statistics, or those of the cycles so far while it streams."""
        if t.stats or not t.view.cycles:
            return t.stats
        return summarize(list(t.view.cycles), t.decode_seconds)

    def chat(sess):
        return view.chat_html(messages_of(sess), sess.selected, placeholder)

    def inspector(sess):
        if not sess.selected or sess.selected[0] >= len(sess.turns):
            return '<div class="inspector empty">No cycle selected: send a prompt, then click a colored run.</div>'
        t, c = sess.selected
        turn = sess.turns[t]
        cycles = turn.view.cycles
        if not cycles:
            return ""
        c = min(c, len(cycles) - 1)
        cycle = cycles[c]
        s = turn.settings
        rows = view.inspect_cycle(cycle, s.mode, s.theta, s.tau, runtime.token_text)
        context = "".join(sp.text for sp in turn.view.spans if sp.cycle < c) or turn.user
        return view.inspector_html(cycle, rows, s.mode, theta=s.theta, tau=s.tau, context=context,
                                   turn=t, n_cycles=len(cycles), planner_note=turn.planner_note)

    def stats(sess):
        st = live_stats(sess.turns[-1]) if sess.turns else None
        if not st:
            return ""
        t = sess.turns[-1]
        passes = ", ".join(f"{r} {n}" for r, n in st["n_passes"].items())
        # a sampled answer: its temperature and seed (with a fixed block, that seed gives this answer again)
        sampled = f"T {t.settings.temperature:g}, seed {t.seed} · " if t.settings.temperature > 0 else ""
        ppt = ", ".join(f"{r} {v:.2f}" for r, v in st["passes_per_token"].items())
        lk = draft_counts(list(t.view.cycles)).get("lookup")
        lookup = f"lookup drafts accepted {lk[1]}/{lk[0]} · " if lk else ""
        return (f'<div class="stats"><b>last answer</b> · {view.esc(view.title(t.settings.mode))} · '
                f'{st["n_tokens"]} tokens in {st["n_cycles"]} cycles · <b>{st["tokens_per_cycle"]:.2f} tokens/cycle</b> · '
                f'<b>{st["tokens_per_second"]:.1f} tokens/s</b> · passes: {passes} · passes/token: {ppt} · '
                f'{lookup}{sampled}stop: {st["stop"] or "running…"}</div>')

    def cycle_number(sess):
        return (sess.selected[1] + 1) if sess.selected else 1

    def default_cycle(turn) -> int:
        """The cycle the inspector opens on: the longest committed run that still dropped something."""
        best, key = 0, (-1, -1, -1)
        for i, c in enumerate(turn.view.cycles):
            k = (int(c.stop is None), int(c.n_accepted < len(c.proposed)), len(c.committed))
            if k > key:
                best, key = i, k
        return best

    def compare_panel(sess):
        if not sess.turns or not sess.turns[-1].compare:
            return ""
        t = sess.turns[-1]
        cmp = t.compare
        return view.compare_html(t.settings.mode, cmp["mode_text"], t.view.spans, t.stats, cmp["ar_text"],
                                 cmp["ar_stats"], cmp["speedup"], turn=len(sess.turns) - 1,
                                 temperature=t.settings.temperature)

    # ------------------------------------------------------------------ handlers
    def send(text, mode, theta, tau, block, max_new_, draft_k, lookup, temp, top_k, top_p, min_p, repeat_penalty,
             seed, sess):
        sess = sess if isinstance(sess, Session) else Session()
        text = (text or "").strip()
        if not text:
            yield chat(sess), stats(sess), inspector(sess), cycle_number(sess), view.banner_html(
                "type a message first", "warn"), compare_panel(sess), gr.update(), sess
            return
        # sampling: the side panel's "sampling" controls (seed -1: a fresh seed per answer);
        # slider value 0 is "auto": the planner picks the widths per cycle (planner.py)
        settings = Settings(mode=mode, max_new=int(max_new_), block=int(block) or "auto", theta=float(theta),
                            tau=float(tau), draft_k=int(draft_k) or "auto",
                            lookup="auto" if int(lookup) < 0 else int(lookup), temperature=float(temp), top_k=int(top_k),
                            top_p=float(top_p), min_p=float(min_p), repeat_penalty=float(repeat_penalty),
                            seed=None if seed is None or int(seed) < 0 else int(seed))
        banner = ""
        last = 0.0
        try:
            for turn in run_turn(runtime, sess, text, settings):
                now = time.monotonic()
                if turn.running and now - last < STREAM_INTERVAL:
                    continue
                last = now
                t = len(sess.turns) - 1
                if turn.view.cycles:
                    sess.selected = (t, default_cycle(turn) if not turn.running else len(turn.view.cycles) - 1)
                if not turn.running and turn.note and turn.stats and turn.stats["stop"] == "context":
                    banner = view.banner_html(turn.note, "warn")
                yield (chat(sess), stats(sess), inspector(sess), cycle_number(sess), banner, compare_panel(sess),
                       "" if not turn.running else gr.update(), sess)
        except UIError as e:
            yield (chat(sess), stats(sess), inspector(sess), cycle_number(sess), view.banner_html(str(e)),
                   compare_panel(sess), gr.update(), sess)

    def stop(sess):
        if isinstance(sess, Session):
            sess.stop_requested = True
        return sess

    def clear(sess):
        sess = Session(engine_hint=sess.engine_hint if isinstance(sess, Session) else None)
        return chat(sess), "", inspector(sess), 1, "", "", sess

    def select(sess, turn: int, cycle: int):
        sess = sess if isinstance(sess, Session) else Session()
        if sess.turns:
            turn = turn if 0 <= turn < len(sess.turns) else len(sess.turns) - 1
            n = len(sess.turns[turn].view.cycles)
            if n:
                sess.selected = (turn, max(0, min(cycle, n - 1)))
        return chat(sess), inspector(sess), cycle_number(sess), sess

    def pick(value, sess):
        try:
            t, c = (int(x) for x in (value or "").split("|")[0].split(":"))
        except ValueError:
            return select(sess, -1, 0)
        return select(sess, t, c)

    def goto(number, sess):
        turn = sess.selected[0] if isinstance(sess, Session) and sess.selected else -1
        return select(sess, turn, int(number or 1) - 1)

    def step(delta):
        def f(sess):
            t, c = sess.selected if isinstance(sess, Session) and sess.selected else (-1, 0)
            return select(sess, t, c + delta)
        return f

    def compare(sess):
        sess = sess if isinstance(sess, Session) else Session()
        try:
            compare_with_ar(runtime, sess)
        except UIError as e:
            return compare_panel(sess), view.banner_html(str(e)), sess
        return compare_panel(sess), "", sess

    def mode_changed(mode):
        m = MODES[mode]
        return (gr.update(visible=m.gate == "theta"), gr.update(visible=m.gate == "tau"),
                gr.update(visible=m.width == "block"), gr.update(visible=m.width == "draft_k"),
                gr.update(visible=m.lookup))

    # ------------------------------------------------------------------ layout
    names = runtime.names()
    model_line = " · ".join(f"**{role}** `{name}`" for role, name in names.items())
    if names:
        model_line += f" · context {runtime.n_ctx} tokens · {parallel} decoding slot{'s' if parallel > 1 else ''}"
    def why(m, msg):
        if "mask token" in msg:
            return "the proposer has no mask token"
        partner = MODES[m].partner
        return f"needs --{partner} {partner[0].upper()}.gguf" if partner else msg
    reasons: dict[str, list[str]] = {}
    for m, msg in runtime.mode_errors.items():
        reasons.setdefault(why(m, msg), []).append(m)
    unavailable = "; ".join(f"{', '.join(ms)}: {r}" for r, ms in reasons.items())

    with gr.Blocks(title="prove-local", analytics_enabled=False) as demo:
        state = gr.State(lambda: Session())
        gr.Markdown("# ProVe local · proposer–verifier decoding, cycle by cycle", elem_id="title")
        gr.Markdown(model_line or "no model loaded", elem_id="models")
        banner = gr.HTML(view.banner_html(runtime.error), elem_id="banner")
        with gr.Row(equal_height=False):
            with gr.Column(scale=5):
                gr.HTML(view.legend_html(), padding=False)
                chat_box = gr.HTML(view.chat_html([], None, placeholder), elem_id="chat", padding=False)
                with gr.Row():
                    box = gr.Textbox(show_label=False, placeholder="Message (Enter sends, Shift+Enter: new line)",
                                     lines=2, max_lines=8, scale=6, elem_id="prompt", autofocus=True)
                    with gr.Column(scale=1, min_width=110):
                        send_btn = gr.Button("Send", variant="primary", elem_id="send")
                        stop_btn = gr.Button("Stop", size="sm", elem_id="stop")
                stats_box = gr.HTML("", elem_id="stats", padding=False)
            with gr.Column(scale=2, min_width=260):
                mode = gr.Dropdown([(view.mode_choice(m), m) for m in (modes or MODES)], value=default_mode,
                                   label="mode", elem_id="mode",
                                   info=("not available with these models: " + unavailable) if unavailable else None)
                theta = gr.Slider(0.0, 1.0, value=0.05, step=0.005, label="θ (ProVe gate: commit while p̃·q ≥ θ)",
                                  visible=MODES[default_mode].gate == "theta", elem_id="theta")
                tau = gr.Slider(0.0, 1.0, value=0.95, step=0.01, label="τ (MARS rule: commit while p̃ ≥ τ)",
                                visible=MODES[default_mode].gate == "tau", elem_id="tau")
                block = gr.Slider(0, 64, value=0 if block == "auto" else block, step=1, label="block length (0 = auto: chosen per cycle)",
                                  visible=MODES[default_mode].width == "block", elem_id="block")
                draft_k = gr.Slider(0, 16, value=0 if draft_k == "auto" else draft_k, step=1, label="draft tokens per cycle (spec; 0 = auto)",
                                    visible=MODES[default_mode].width == "draft_k", elem_id="draft_k")
                lookup = gr.Slider(-1, 16, value=-1 if lookup == "auto" else lookup, step=1, elem_id="lookup",
                                   label="lookup draft tokens (copied from the text; -1 = auto, 0 = off)",
                                   visible=MODES[default_mode].lookup)
                max_new = gr.Slider(1, 2048, value=max_new, step=1, label="max new tokens", elem_id="max_new")
                with gr.Accordion("sampling", open=False, elem_id="sampling"):
                    temp = gr.Slider(0.0, 2.0, value=0.0, step=0.05, elem_id="temp",
                                     label="temperature (0: greedy; lossless/spec stay exact in distribution)")
                    top_k = gr.Slider(0, 200, value=40, step=1, label="top-k (0: off)", elem_id="top_k")
                    top_p = gr.Slider(0.0, 1.0, value=0.95, step=0.01, label="top-p (1: off)", elem_id="top_p")
                    min_p = gr.Slider(0.0, 1.0, value=0.05, step=0.01, label="min-p (0: off)", elem_id="min_p")
                    repeat_penalty = gr.Slider(0.5, 2.0, value=1.0, step=0.05, elem_id="repeat_penalty",
                                               label="repeat penalty over the last 64 tokens (1: off)")
                    seed = gr.Number(value=-1, precision=0, label="seed (-1: random)", elem_id="seed")
                compare_btn = gr.Button("Compare with AR", elem_id="compare")
                clear_btn = gr.Button("Clear conversation", size="sm", elem_id="clear")
        with gr.Row(equal_height=True, elem_id="insp-bar"):
            gr.Markdown("### Cycle inspector", elem_id="insp-title")
            prev_btn = gr.Button("◀ previous", size="sm", scale=0, min_width=110, elem_id="prev")
            cycle_no = gr.Number(value=1, precision=0, minimum=1, label="cycle", show_label=False, container=False,
                                 scale=0, min_width=80, elem_id="cycle_no")
            next_btn = gr.Button("next ▶", size="sm", scale=0, min_width=110, elem_id="next")
        insp_box = gr.HTML(inspector(Session()), elem_id="inspector", padding=False)
        compare_box = gr.HTML("", elem_id="comparison", padding=False)
        pick_box = gr.Textbox(elem_id="pick", visible="hidden", show_label=False)

        gen_outputs = [chat_box, stats_box, insp_box, cycle_no, banner, compare_box, box, state]
        gr.on([send_btn.click, box.submit], send, [box, mode, theta, tau, block, max_new, draft_k, lookup, temp, top_k, top_p,
                                                   min_p, repeat_penalty, seed, state],
              gen_outputs, concurrency_limit=parallel, concurrency_id="decode", show_progress="hidden")
        stop_btn.click(stop, state, state, queue=False, show_progress="hidden")
        clear_btn.click(clear, state, [chat_box, stats_box, insp_box, cycle_no, banner, compare_box, state],
                        queue=False, show_progress="hidden")
        compare_btn.click(compare, state, [compare_box, banner, state], concurrency_limit=parallel,
                          concurrency_id="decode", show_progress="minimal")
        sel_outputs = [chat_box, insp_box, cycle_no, state]
        pick_box.change(pick, [pick_box, state], sel_outputs, queue=False, show_progress="hidden")
        cycle_no.submit(goto, [cycle_no, state], sel_outputs, queue=False, show_progress="hidden")
        prev_btn.click(step(-1), state, sel_outputs, queue=False, show_progress="hidden")
        next_btn.click(step(1), state, sel_outputs, queue=False, show_progress="hidden")
        mode.change(mode_changed, mode, [theta, tau, block, draft_k, lookup], queue=False, show_progress="hidden")
    return demo
