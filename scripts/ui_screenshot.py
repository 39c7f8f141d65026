"""Screenshot of the chat UI for the README: a real answer with the cycle inspector open.

    python scripts/ui_screenshot.py                       # SmolLM2 + its MARS adapter, lossless, block 8
    python scripts/ui_screenshot.py embedded --mode prove --block 0 --question "..."   # the embedded pair
    python scripts/ui_screenshot.py MODEL.gguf --verifier V.gguf --mode prove
    python scripts/ui_screenshot.py --tiny                # random-weight test models (gibberish text)

Starts the UI in this process on a free port, drives it in Debian's chromium (Playwright with
`executable_path`), sends a question, opens the inspector on one cycle, runs
"Compare with AR", and saves the page to docs/ui-screenshot.png (or --out).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from argparse import Namespace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTION = "Tell me about the planet Mars in three sentences."
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="model GGUF, or 'embedded' (default: SmolLM2 + its MARS adapter)")
    ap.add_argument("--adapter", help="MARS adapter GGUF for MODEL")
    ap.add_argument("--verifier", help="verifier GGUF")
    ap.add_argument("--draft", help="draft GGUF")
    ap.add_argument("--tiny", action="store_true", help="use tiny random-weight test models")
    ap.add_argument("--mode", default="lossless", help="decoding mode to select (default: lossless)")
    ap.add_argument("--block", type=int, default=8,
                    help="the block slider's value (default 8: a fixed block shows MARS blocks even where the "
                         "planner would pick ar on this CPU; 0: auto)")
    ap.add_argument("--lookup", type=int, default=0, help="lookup drafts (default 0: MARS blocks only; -1: auto)")
    ap.add_argument("--question", default=QUESTION)
    ap.add_argument("-n", "--max-new", type=int, default=160)
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads per context (default 1: the embedded models are tiny, and on shared cores "
                         "more threads mostly wait for each other)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "ui-screenshot.png"))
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    a = ap.parse_args()

    from playwright.sync_api import sync_playwright

    from prove_local.ui.app import build_app, launch
    from prove_local.ui.runtime import Runtime

    model, verifier = a.model, a.verifier
    if a.tiny:
        from tests.tiny import tiny_gguf
        d = Path(tempfile.mkdtemp(prefix="ui-shot-"))
        model, verifier = str(tiny_gguf(d, seed=0)), str(tiny_gguf(d, seed=1, hidden=32, role="verifier"))
    args = Namespace(model=model, verifier=verifier, draft=a.draft, adapter=a.adapter, ctx=4096, threads=a.threads, kv_type=None,
                     flash_attn="auto", n_gpu_layers=None, mask_token=None, parallel=1, system=None)
    runtime = Runtime.from_args(args)
    if runtime.error:
        print(f"error: {runtime.error}", file=sys.stderr)
        return 1
    demo = build_app(runtime, max_new=a.max_new, block=a.block or "auto",
                     lookup="auto" if a.lookup < 0 else a.lookup)
    _, url, _ = launch(demo, runtime, port=0, prevent_thread_lock=True, quiet=True)     # a free port
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=a.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1360, "height": 1000}, device_scale_factor=1)
            page.set_default_timeout(600_000)
            page.goto(url)
            page.wait_for_selector("#chat .chat-scroll")
            if a.mode:
                page.click("#mode input")
                page.click(f'li[role="option"][aria-label^="{a.mode} "]')
            page.fill("#prompt textarea", a.question)
            page.click("#send")
            page.wait_for_selector('#chat .answer.done[data-turn="0"]')
            picked = page.get_attribute("#inspector .inspector", "data-cycle")
            if picked:   # click the run of the cycle the inspector opened on (it gets outlined)
                page.click(f'#chat span.cyc[data-pick="{picked}"] >> nth=0')
                page.wait_for_selector(f'#chat span.cyc.sel[data-pick="{picked}"]')
            page.click("#compare")
            page.wait_for_selector("#comparison .compare")
            page.evaluate("() => document.querySelector('#pick').blur()")
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=a.out, full_page=True)
            print(page.inner_text("#stats"))
            print(page.inner_text("#comparison .cmp-head"))
            browser.close()
    finally:
        demo.close()
    print(f"saved {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
