"""Session-wide test settings, and the fixtures shared by several test modules (plain helpers are in
non-test modules: fakes.py, reference.py, tiny.py, ui_page.py)."""
import os
from pathlib import Path

import pytest


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache_in_tmp(tmp_path_factory):
    """Pass-cost calibrations (calibrate.py) of the tests' models go to a temporary folder, never to
    the user's ~/.cache/prove-local (subprocesses inherit the variable)."""
    old = os.environ.get("PROVE_LOCAL_CACHE")
    os.environ["PROVE_LOCAL_CACHE"] = str(tmp_path_factory.mktemp("prove-local-cache"))
    yield
    if old is None:
        os.environ.pop("PROVE_LOCAL_CACHE", None)
    else:
        os.environ["PROVE_LOCAL_CACHE"] = old


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
