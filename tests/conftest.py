"""Session-wide test settings, and the fixtures shared by several test modules (plain helpers are in
non-test modules: fakes.py, reference.py, tiny.py, ui_page.py)."""
import os
import shutil
import tempfile
from pathlib import Path

import pytest


_CACHE_BEFORE: str | None = None
_CACHE_DIR: str | None = None


def pytest_configure(config):
    """Pass-cost calibrations (calibrate.py) of the tests' models go to a temporary folder, never to
    the user's ~/.cache/prove-local. Set here, before any test module is imported: a module that
    copies os.environ at import for its subprocesses (test_rpc's ENV) inherits it too (a session
    fixture came after collection, and `prove-local run` subprocesses wrote the tests' models into
    the user's cache)."""
    global _CACHE_BEFORE, _CACHE_DIR
    _CACHE_BEFORE = os.environ.get("PROVE_LOCAL_CACHE")
    _CACHE_DIR = os.environ["PROVE_LOCAL_CACHE"] = tempfile.mkdtemp(prefix="prove-local-cache-")


def pytest_unconfigure(config):
    if _CACHE_DIR is not None:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)
    if _CACHE_BEFORE is None:
        os.environ.pop("PROVE_LOCAL_CACHE", None)
    else:
        os.environ["PROVE_LOCAL_CACHE"] = _CACHE_BEFORE


# ------------------------------------------------------------------ the chat UI (test_ui, test_sampling)
@pytest.fixture(scope="module")
def ui_paths(tmp_path_factory):
    """A tiny proposer and verifier (F32 GGUFs) for the UI tests."""
    from tests.tiny import tiny_gguf

    d = tmp_path_factory.mktemp("ui-models")
    return tiny_gguf(d, seed=0), tiny_gguf(d, seed=1, hidden=32, role="verifier")


@pytest.fixture(scope="module")
def ui_models(ui_paths):
    from prove_local.llama import Model

    return Model(ui_paths[0]), Model(ui_paths[1])


@pytest.fixture(scope="module")
def ui_server(ui_paths, tmp_path_factory):
    """`prove-local ui` on the tiny pair as its own process, on a port of the system's choosing; its URL."""
    from tests.ui_page import MAX_NEW, start_ui, stop

    log = tmp_path_factory.mktemp("ui-server") / "stderr.log"
    proc, url = start_ui([str(ui_paths[0]), "--verifier", str(ui_paths[1]), "--ctx", "512", "--kv-type", "f32",
                          "--threads", "1", "--parallel", "2", "-n", str(MAX_NEW),
                          "--block", "16"], log)     # a fixed block: the inspector shows 16 slots
    try:
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium through Playwright. Does not skip: without it the test fails and says what to install."""
    from tests.ui_page import CHROMIUM, CHROMIUM_ARGS

    if not Path(CHROMIUM).is_file():
        pytest.fail(f"{CHROMIUM} is missing: the browser test needs Debian's chromium "
                    "(apt-get install -y chromium), as .ci/run installs it")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the Python package playwright is missing: pip install playwright==1.65.2 (the test extra)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()
