"""Bad input and interrupted output on the command line: one line, a non-zero exit, no traceback."""
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from prove_local.chat import Conversation, clean_text
from prove_local.cli import json_line, main
from prove_local.llama import Model
from tests.signals import default_sigint
from tests.tiny import tiny_gguf


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("cli-models"), seed=0)


PIPE_PAGE = 4096         # the smallest pipe Linux makes (F_SETPIPE_SZ rounds up to a page)
FIRST_BYTES = 64        # the "> " prompt and the start of the answer


def cli(*args, **kw):
    kw.setdefault("capture_output", True)
    return subprocess.run([sys.executable, "-m", "prove_local.cli", *args], timeout=120, **kw)


def one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# ------------------------------------------------------------------ argument values
@pytest.mark.parametrize("argv,message", [
    (["run", "--theta", "nan"], "--theta: 'nan': must be a finite number"),
    (["run", "--tau", "inf"], "--tau: 'inf': must be a finite number"),
    (["run", "--theta", "-1"], "--theta: -1.0 is out of range: must be >= 0"),
    (["run", "--block", "0"], "--block: 0 is out of range: must be between 1 and 512"),
    (["run", "--block", "100000"], "--block: 100000 is out of range"),
    (["run", "-n", "0"], "--max-new: 0 is out of range: must be >= 1"),
    (["run", "--threads", "0"], "--threads: 0 is out of range"),
    (["run", "--threads", "-1"], "--threads: -1 is out of range"),
    (["run", "--threads", "999"], "--threads: 999 is out of range"),
    (["run", "--ctx", "0"], "--ctx: 0 is out of range"),
    (["run", "--draft-k", "x"], "--draft-k: 'x' is not an integer"),
    (["ui", "--port", "99999"], "--port: 99999 is out of range: must be between 0 and 65535"),
    (["ui", "--parallel", "0"], "--parallel: 0 is out of range"),
    (["bench", "--out", "o", "--tau", "nan"], "--tau: 'nan': must be a finite number"),
    (["bench", "--out", "o", "--block", "0"], "--block: 0 is out of range"),
    (["bench", "--out", "o", "--threads", "0"], "--threads: 0 is out of range"),
])
def test_bad_numbers_are_one_argparse_line(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv + ["-p", "hi"] if argv[0] == "run" else argv)
    assert e.value.code == 2
    line = one_line_error(capsys.readouterr().err)
    assert message in line and line.startswith("prove-local ")


def test_bench_theta_list_must_be_finite(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
    assert main(["bench", "--data", str(data), "--out", str(tmp_path / "o"), "--theta", "0.1,nan", "--no-plots"]) == 1
    assert "--theta '0.1,nan'" in one_line_error(capsys.readouterr().err)


def test_block_wider_than_the_context_is_refused(model_path):
    r = cli("run", str(model_path), "-p", "hi", "--ctx", "32", "--block", "64", "--threads", "1", text=True)
    assert r.returncode == 1 and "--block 64 does not fit the 32-token context" in one_line_error(r.stderr)


def test_json_never_prints_nan():
    line = json_line({"a": float("nan"), "b": [float("inf"), 1.5], "c": {"d": float("-inf")}})
    assert json.loads(line) == {"a": None, "b": [None, 1.5], "c": {"d": None}}


# ------------------------------------------------------------------ text that is not UTF-8
def test_clean_text():
    assert clean_text("plain") == "plain"
    assert clean_text("a\udcff\udcfeb") == "a\ufffd\ufffdb"          # argv bytes 0xff 0xfe (surrogateescape)
    assert clean_text("x\ud800y") == "x\ufffdy"                      # a lone high surrogate (JSON "\ud800")
    assert clean_text("caf\udcc3\udca9") == "café"                  # escaped bytes that were UTF-8 after all


def test_non_utf8_prompt_bytes_run(model_path):
    r = cli("run", str(model_path), "-p", b"\xff\xfe", "-n", "8", "--json", "--threads", "1")
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr
    out = json.loads(r.stdout)
    assert 0 < len(out["token_ids"]) <= 8


# ------------------------------------------------------------------ output that cannot be written
def test_broken_pipe_is_quiet(model_path):
    proc = subprocess.Popen([sys.executable, "-m", "prove_local.cli", "run", str(model_path), "-p", "hi", "-n", "64",
                             "--threads", "1", "--no-color"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                         # the reader is gone before the first byte (`| head -c 0`)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and b"Traceback" not in err and b"Exception ignored" not in err, err


def test_full_disk_is_one_line(model_path):
    with open("/dev/full", "w") as full:
        r = cli("run", str(model_path), "-p", "hi", "-n", "16", "--json", "--threads", "1", stdout=full,
                stderr=subprocess.PIPE, capture_output=False, text=True)
    assert r.returncode == 1
    assert "cannot write the output: No space left on device" in one_line_error(r.stderr)


# ------------------------------------------------------------------ interactive chat
def test_a_turn_that_overflows_the_context_is_refused_and_the_chat_goes_on(model_path):
    turns = ["hi", "word " * 80, "ok?"]
    r = cli("run", str(model_path), "--ctx", "64", "-n", "4", "--json", "--threads", "1", "--kv-type", "f32",
            input="\n".join(turns) + "\n\n", text=True)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "this turn does not fit" in r.stderr and "the conversation is kept" in r.stderr
    answers = [json.loads(line[line.index("{"):]) for line in r.stdout.splitlines() if "{" in line]  # after "> "
    assert len(answers) == 2                    # the first and the third turn
    # the third prompt is the first turn, its answer and the third question: the refused turn is gone
    conv = Conversation(Model(model_path))
    conv.prompt_tokens("hi")
    conv.add_reply(answers[0]["text"])
    assert answers[1]["prompt_tokens"] == len(conv.prompt_tokens("ok?"))


def test_interactive_chat_survives_ctrl_c(model_path):
    """Ctrl-C during an answer stops it, keeps what was committed, and the next turn works.

    The Ctrl-C surely falls inside the answer, however fast the machine or loaded the test: the
    answer (3,000 greedy tokens, about 5,200 bytes of text) is longer than what the stdout pipe holds
    (shrunk to one 4,096-byte page) plus the first bytes the test reads, and the test reads nothing
    more until it has sent the signal. So when the signal comes the chat is still decoding or blocked
    writing the answer; it cannot have finished it. Every wait is bounded."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_PAGE)
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "prove_local.cli", "run", str(model_path), "-n", "3000", "--ctx", "4096",
         "--threads", "1", "--no-color"],
        stdin=subprocess.PIPE, stdout=write_end, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=default_sigint)  # (also when run in the background)
    os.close(write_end)
    try:
        started, go_on = threading.Event(), threading.Event()
        out = bytearray()

        def read():                              # unbuffered reads: what the test has not read stays in the pipe
            while len(out) < FIRST_BYTES:
                chunk = os.read(read_end, FIRST_BYTES - len(out))
                if not chunk:
                    break
                out.extend(chunk)
            started.set()
            go_on.wait(timeout=120)
            while chunk := os.read(read_end, 65536):
                out.extend(chunk)
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        proc.stdin.write("Tell me a long story\n")
        proc.stdin.flush()
        assert started.wait(timeout=120), "the answer never streamed"
        assert len(out) == FIRST_BYTES, bytes(out)
        proc.send_signal(signal.SIGINT)
        go_on.set()
        proc.stdin.write("And then?\n\n")
        proc.stdin.flush()
        proc.stdin.close()
        proc.wait(timeout=120)
        reader.join(timeout=30)
        err = proc.stderr.read()                # a few lines: the pipe cannot fill up
    finally:
        go_on.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        os.close(read_end)
    assert proc.returncode == 0, err
    summaries = [line for line in err.splitlines() if line.startswith("[lossless]")]
    assert len(summaries) == 2 and "(interrupted)" in summaries[0] and "(interrupted)" not in summaries[1], err
    assert "Traceback" not in err
