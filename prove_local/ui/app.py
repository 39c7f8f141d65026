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
import socket
import sys

from prove_local.errors import MissingExtra
from prove_local.loading import MAX_NEW, PARALLEL, PORT, add_model_args, add_width_args

from .runtime import Runtime

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860
FREE_PORT_TRIES = 5         # --port 0: free ports tried in turn (each fails only if taken meanwhile)

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
    p.add_argument("--port", type=PORT, default=DEFAULT_PORT,
                   help=f"port (default {DEFAULT_PORT}; 0 picks a free one, named on the `open` line)")
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
        runtime.close()
    return 0


def launch(demo, runtime, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, share: bool = False, **kw):
    """Serve the page; returns gradio's (app, local URL, share URL). Port 0: a free port, named in
    the local URL. (Gradio cannot bind port 0 itself: it would report port 0 and fail its own
    start-up request. So the system picks a free port here, and if another process takes it before
    gradio binds it, gradio's bind fails and another free port is tried.)"""
    import gradio as gr

    demo.queue(default_concurrency_limit=runtime.parallel)

    def start(p: int):
        return demo.launch(server_name=host, server_port=p, share=bool(share), ssr_mode=False, mcp_server=False,
                           css=CSS, head=HEAD, theme=gr.themes.Soft(primary_hue="indigo"), show_error=False,
                           footer_links=["gradio"], **kw)
    if port != 0:
        return start(port)
    for attempt in range(FREE_PORT_TRIES):
        try:
            return start(free_port(host))
        except OSError:
            if attempt == FREE_PORT_TRIES - 1:
                raise


def free_port(host: str) -> int:
    """A port no socket on `host` uses now (the system's choice for port 0)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def build_app(runtime, *, max_new: int = 256, block="auto", draft_k="auto", lookup="auto"):
    """The page (page.py), on a loaded `Runtime` (or one whose `error` says why not)."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from .page import build_app as build

    return build(runtime, max_new=max_new, block=block, draft_k=draft_k, lookup=lookup)
