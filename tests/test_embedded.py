"""The embedded default pair shipped in prove_local/models: metadata, exactness, and the CLI default."""
import json
import subprocess
import sys

import pytest

from prove_local.chat import Conversation
from prove_local.loading import EMBEDDED_PROPOSER, EMBEDDED_VERIFIER
from prove_local.engine import Engine, Settings
from prove_local.llama import Model

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "A baker made 24 muffins and sold half of them. How many are left?",
    "Tom has 3 boxes with 7 pencils each. He gives away 5 pencils. How many pencils does he have?",
    "A train travels 60 miles per hour for 3 hours. How far does it go?",
]


@pytest.fixture(scope="module")
def pair():
    prop, ver = Model(EMBEDDED_PROPOSER), Model(EMBEDDED_VERIFIER)
    return prop, ver, Engine.load(prop, ver, ver, n_ctx=1024, n_threads=1, type_k="f32", type_v="f32")


def test_shipped_files_carry_their_metadata(pair):
    prop, ver, _ = pair
    assert prop.role == "proposer" and ver.role == "verifier"
    assert prop.block_size == 16 and prop.mask_token is not None
    assert prop.detokenize([prop.mask_token], special=True) == "<|mask|>"
    assert "<|im_start|>" in prop.chat_template and prop.chat_template == ver.chat_template
    assert prop.meta("general.file_type") == "0"          # F32: exactness needs unquantized weights
    prop.check_same_vocab(ver)


def test_exact_modes_equal_ar_on_the_shipped_pair(pair):
    prop, _, engine = pair
    for q in QUESTIONS:
        prompt = Conversation(prop).prompt_tokens(q)
        out = {}
        for mode, extra in (("ar", {}), ("lossless", {}), ("spec", {"draft_k": 4}), ("prove", {"theta": 1.01})):
            out[mode] = [t for c in engine.generate(prompt, Settings(mode=mode, max_new=96, **extra)) for t in c.committed]
        assert len(out["ar"]) > 8
        assert out["lossless"] == out["ar"] and out["spec"] == out["ar"] and out["prove"] == out["ar"], q


def test_run_embedded_uses_the_embedded_pair():
    r = subprocess.run([sys.executable, "-m", "prove_local.cli", "run", "embedded", "-p", QUESTIONS[2], "-n", "48", "--json",
                        "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    # the default is --block auto: each cycle a lossless pass pair or a plain ar pass, as the planner chose;
    # n_passes counts llama_decode calls (measured)
    assert out["mode"] == "lossless" and out["settings"]["block"] == "auto"
    assert out["n_cycles"] <= out["n_passes"]["target"] <= 2 * out["n_cycles"]
    assert sum(out["widths"].values()) == out["n_cycles"]
    assert out["token_ids"] and out["text"]
    r = subprocess.run([sys.executable, "-m", "prove_local.cli", "run", "embedded", "-p", QUESTIONS[2], "-n", "48", "--json",
                        "--threads", "1", "--block", "16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    fixed = json.loads(r.stdout)
    assert fixed["n_passes"] == {"target": 2 * fixed["n_cycles"]} and fixed["token_ids"] == out["token_ids"]
    r = subprocess.run([sys.executable, "-m", "prove_local.cli", "run", "embedded", "-p", QUESTIONS[2], "-n", "48", "--json",
                        "--threads", "1", "--mode", "prove", "--block", "16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)["n_passes"]) == {"target", "verifier"}
