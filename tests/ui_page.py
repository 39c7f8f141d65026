"""Helpers of the browser tests (test_ui, test_sampling): the page's UI process and in-process
launches on port 0, Playwright pages on Debian's chromium, and the reference answers. Their
fixtures are in conftest.py."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reference import chat_reference

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("PROVE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
F32 = dict(n_ctx=512, n_threads=1, type_k="f32", type_v="f32")
MAX_NEW = 40


def reference(models, turns: list[str]) -> list[str]:
    """Every turn's greedy answer, decoded from scratch by hand on a fresh llama.cpp context
    (tests/reference.py: no engine, no decoding rule); lossless and ar must give exactly these."""
    prop = models[0]
    return [prop.detokenize([t for t in ids if not prop.is_eog(t)])
            for ids in chat_reference(prop, turns, MAX_NEW, **F32)]


# ------------------------------------------------------------------ the page's server
def start_ui(args: list[str], log: Path, timeout: float = 120.0):
    """`prove-local ui ARGS --port 0` as a process: (process, URL), the URL from its `open` line
    (the port the system gave it). Fails the test with the log if it exits or never says so."""
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1")
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "prove_local.cli", "ui", *args, "--port", "0"], cwd=ROOT,
                                env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
    deadline = time.monotonic() + timeout
    while True:
        found = re.search(r"prove-local ui: open (http://127\.0\.0\.1:\d+/)", log.read_text())
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            pytest.fail(f"`prove-local ui` exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            stop(proc)
            pytest.fail(f"`prove-local ui` never said where it listens:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def launch_here(demo, runtime) -> str:
    """Serve a built page from this process on a free port (port 0); its URL."""
    from prove_local.ui.app import launch

    _, url, _ = launch(demo, runtime, port=0, prevent_thread_lock=True, quiet=True)
    return url


# ------------------------------------------------------------------ pages
def open_page(browser, url):
    page = browser.new_page(viewport={"width": 1360, "height": 1100})
    page.set_default_timeout(60_000)
    page.goto(url)
    page.wait_for_selector("#chat .chat-scroll")
    return page


def send(page, text: str, turn: int):
    """Fill in `text` and click Send; returns a wait for the answer of `turn` to be done."""
    page.fill("#prompt textarea", text)
    page.click("#send")
    return answer_done(page, turn)


def answer_done(page, turn: int):
    return lambda: page.wait_for_selector(f'#chat .answer.done[data-turn="{turn}"]')


def answer_spans(page, turn: int) -> list[dict]:
    return page.eval_on_selector_all(f'#chat .answer[data-turn="{turn}"] span.cyc',
                                     "els => els.map(e => ({text: e.textContent, cls: e.className, pick: e.dataset.pick}))")
