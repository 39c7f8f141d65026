"""`prove-local serve` as a real process on a free loopback port, driven by the official `openai`
client (and curl / http.client for the raw wire format), on tiny random-weight F32 models.

One server process for the whole module (--parallel 2 --queue 2, an API key file); the answers are
checked against greedy decoding by hand in this process on the same GGUF (tests/reference.py, no
engine), so the server is tested for exactness, not only for shape.
"""
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from prove_local.chat import Conversation  # noqa: E402
from prove_local.llama import Model  # noqa: E402
from tests.reference import greedy_ar  # noqa: E402
from tests.tiny import tiny_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-0123456789"
CTX = 4096
MAX_BODY = 64 * 1024
HOLD_TOKENS = 3000
HOLD_CANDIDATES = ["hold B", "The quick brown fox", "Hello world", "keep going", "abc", "more text here"]


def cli(*args, timeout=60, **kw):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "prove_local.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT, **kw)


class Server:
    """A `prove-local serve` process; its stderr goes to a file (no pipe to fill up)."""

    def __init__(self, args, log: Path):
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.log = log
        self._f = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "prove_local.cli", "serve", "--port", "0", *args],
                                     stdout=self._f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + 90
        while True:
            text = log.read_text()
            if "ready (" in text:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{text}")
            time.sleep(0.1)
        self.port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", text).group(1))
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._f.close()


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("server-models")
    return tiny_gguf(d, seed=0), tiny_gguf(d, seed=1, hidden=32, role="verifier")


@pytest.fixture(scope="module")
def local(paths):
    """The same proposer in this process: the reference answers, greedy decoding by hand on a fresh
    context (tests/reference.py: no engine, no decoding rule)."""
    model = Model(paths[0])

    runs: dict[tuple, tuple[list[int], int]] = {}       # prompt -> (its longest greedy run, max_new asked)

    def greedy(tokens, max_new):
        # a greedy run is a prefix of every longer one: a longer run, or one that ended early, answers
        key = tuple(tokens)
        run, asked = runs.get(key, ([], 0))
        if asked < max_new and len(run) == asked:
            run, asked = greedy_ar(model, tokens, max_new, n_ctx=CTX), max_new
            runs[key] = (run, asked)
        out = run[:max_new]
        return out, model.detokenize([t for t in out if not model.is_eog(t)])

    def chat(user, max_new):
        return greedy(Conversation(model).prompt_tokens(user), max_new)

    def complete(prompt, max_new):
        return greedy(model.tokenize(prompt, add_special=True), max_new)

    # two prompts that run HOLD_TOKENS tokens without an end-of-generation token (long streams)
    holds = [p for p in HOLD_CANDIDATES if len(complete(p, HOLD_TOKENS)[0]) == HOLD_TOKENS][:2]
    assert len(holds) == 2
    return SimpleNamespace(model=model, chat=chat, complete=complete, holds=holds)


@pytest.fixture(scope="module")
def server(paths, tmp_path_factory):
    d = tmp_path_factory.mktemp("server")
    (d / "keys.txt").write_text(f"sk-other-key\n{KEY}\n")
    s = Server([str(paths[0]), "--verifier", str(paths[1]), "--threads", "1", "--ctx", str(CTX),
                "--parallel", "2", "--queue", "2", "--api-key-file", str(d / "keys.txt"),
                "--max-body", str(MAX_BODY)], d / "server.log")
    yield s
    s.stop()
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal (exit status -15)
    assert s.proc.returncode in (0, -signal.SIGTERM), s.log.read_text()
    assert "Traceback" not in s.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def raw(server, method, path, body=None, key=KEY, headers=None):
    """(status, headers, bytes) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=h)
    r = conn.getresponse()
    out = r.status, dict(r.getheaders()), r.read()
    conn.close()
    return out


def metrics(server) -> dict:
    status, _, body = raw(server, "GET", "/metrics")
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_for(predicate, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def check_stats(resp, mode="lossless"):
    p = resp.model_extra["prove"]
    n = resp.usage.completion_tokens
    assert p["mode"] == mode and p["n_cycles"] >= 1
    assert p["tokens_per_cycle"] == pytest.approx(n / p["n_cycles"], abs=1e-3)
    assert p["passes"]["target"] >= p["n_cycles"] and 0 <= p["draft_n_accepted"] <= p["draft_n"]
    assert set(p["decode_seconds"]) == set(p["passes"]) and p["seconds"] > 0
    return p


# ------------------------------------------------------------------------------ the OpenAI client
def test_health_and_models(server, client):
    assert raw(server, "GET", "/health", key=None)[:1] == (200,)
    assert json.loads(raw(server, "GET", "/health", key=None)[2]) == {"status": "ok"}
    models = client.models.list().data
    assert [m.model_extra["prove"]["role"] for m in models] == ["target", "verifier"]
    assert len({m.id for m in models}) == 2 and models[0].object == "model"
    assert "lossless" in models[0].model_extra["prove"]["modes"]
    assert "spec" not in models[0].model_extra["prove"]["modes"]        # no draft model given


def test_chat_plain_streamed_and_exact(client, local):
    ref_tokens, ref = local.chat("What is 7 times 8?", 48)
    msgs = [{"role": "user", "content": "What is 7 times 8?"}]
    plain = client.chat.completions.create(model="any", messages=msgs, max_tokens=48, temperature=0)
    assert plain.choices[0].message.content == ref                        # lossless == greedy ar
    assert plain.usage.completion_tokens == len(ref_tokens)
    assert plain.choices[0].finish_reason == ("stop" if len(ref_tokens) < 48 else "length")
    p = check_stats(plain)
    # --block auto: each cycle a lossless pass pair or a plain ar pass, as the planner chose
    assert p["block"] == "auto" and p["n_cycles"] <= p["passes"]["target"] <= 2 * p["n_cycles"]
    assert sum(p["widths"].values()) == p["n_cycles"]
    assert p["draft_n_accepted"] <= p["draft_n"] <= 16 * p["n_cycles"] and p["notes"] == []

    chunks = list(client.chat.completions.create(model="any", messages=msgs, max_tokens=48, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    check_stats(chunks[-1])

    # max_completion_tokens, content parts, an unknown field (ignored, as OpenAI clients expect)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 7 times"}, {"type": "text", "text": " 8?"}]}]
    ar = client.chat.completions.create(model="any", messages=parts, max_completion_tokens=48,
                                        extra_body={"mode": "ar", "frobnicate": {"x": 1}})
    assert ar.choices[0].message.content == ref
    p = check_stats(ar, mode="ar")
    assert p["passes"] == {"target": p["n_cycles"]} and p["draft_n"] == 0 and p["block"] is None


def test_completions_and_prove_mode(client, local):
    ref_tokens, ref = local.complete("Hello world", 40)
    r = client.completions.create(model="any", prompt="Hello world", max_tokens=40)
    assert r.choices[0].text == ref and r.usage.completion_tokens == 40
    assert r.usage.prompt_tokens == len(local.model.tokenize("Hello world", add_special=True))
    check_stats(r)
    streamed = list(client.completions.create(model="any", prompt="Hello world", max_tokens=40, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == ref
    # ProVe with the verifier, a gate that never passes: one token per cycle, greedy ar's tokens
    pv = client.completions.create(model="any", prompt="Hello world", max_tokens=20,
                                   extra_body={"mode": "prove", "theta": 1.01, "block": 8})
    p = check_stats(pv, mode="prove")
    assert pv.choices[0].text == local.complete("Hello world", 20)[1]
    assert p["n_cycles"] == 20 and p["block"] == 8 and set(p["passes"]) == {"target", "verifier"}
    assert p["draft_n"] == 7 * 20 and p["draft_n_accepted"] == 0      # slot 1 of each block is no draft


def test_a_repeated_request_is_drafted_from_the_earlier_answer(client, local):
    """The same request again goes to the engine that answered it (the slot with its prompt) and its
    lookup drafts copy that answer (lookup.NgramIndex's history): greedy ar's text, most tokens drafted
    and accepted; `recall: false` copies only the request's own tokens."""
    prompt = "Betty is saving money for a new wallet which costs one hundred dollars, and her parents help."
    _, ref = local.complete(prompt, 32)
    body = {"mode": "lookup", "lookup": 4}
    got = []
    for extra in (body, body, dict(body, recall=False)):
        r = client.completions.create(model="any", prompt=prompt, max_tokens=32, extra_body=extra)
        assert r.choices[0].text == ref
        got.append(check_stats(r, mode="lookup")["drafts"].get("lookup", {}).get("accepted", 0))
    assert got[1] >= 20 and got[2] < got[1], got


def test_lookup_drafts_over_the_api(client, local, server):
    """mode lookup with a fixed lookup length: greedy ar's text, the drafts per source in the `prove`
    object and in /metrics."""
    prompt = "a b c a b c a b c a b"
    _, ref = local.complete(prompt, 24)
    r = client.completions.create(model="any", prompt=prompt, max_tokens=24, extra_body={"mode": "lookup", "lookup": 3})
    p = check_stats(r, mode="lookup")
    assert r.choices[0].text == ref and p["lookup"] == 3 and p["drafts"]["lookup"]["drafted"] >= 3
    assert p["draft_n"] == sum(d["drafted"] for d in p["drafts"].values())
    assert any(k.startswith("L=") for k in p["widths"])
    assert metrics(server)['prove_drafts_total{source="lookup"}'] >= p["drafts"]["lookup"]["drafted"]
    bad = raw(server, "POST", "/v1/completions", {"prompt": "hi", "lookup": -1})
    assert bad[0] == 400 and "lookup" in json.loads(bad[2])["error"]["message"]


def test_stop_strings_plain_and_streamed(client, local):
    _, ref = local.complete("Hello world", 60)
    start = next(i for i in range(12, len(ref) - 3) if ref[i:i + 2].isprintable() and "\ufffd" not in ref[i:i + 2])
    stop = ref[start:start + 2]
    expected = ref[:ref.find(stop)]
    r = client.completions.create(model="any", prompt="Hello world", max_tokens=60, stop=[stop, "never-seen"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.model_extra["prove"]["stop"] == "stop_string"
    streamed = list(client.completions.create(model="any", prompt="Hello world", max_tokens=60, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_sampling_fields(client, local):
    """temperature > 0: sampled; the seed repeats the answer under the server's --block auto (the
    coupled sampler: noise keyed by position, so the planner's widths do not matter) and gives ar's
    text in lossless; without a seed one is drawn and reported in `prove.seed`, and sending it back
    replays the answer. Or answered greedily with a note if sampling were unavailable (never silently)."""
    kw = dict(model="any", prompt="Hello world", max_tokens=24, temperature=0.8, top_p=0.9, seed=7,
              extra_body={"top_k": 20, "min_p": 0.05})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    notes = a.model_extra["prove"]["notes"]
    if any("greedy" in n for n in notes):
        assert a.choices[0].text == local.complete("Hello world", 24)[1]
        return
    assert a.choices[0].text == b.choices[0].text and not notes
    assert a.model_extra["prove"]["seed"] == 7 and a.model_extra["prove"]["sampler"] == "coupled"
    ar = client.completions.create(**{**kw, "extra_body": {"top_k": 20, "min_p": 0.05, "mode": "ar"}})
    assert ar.choices[0].text == a.choices[0].text
    fresh = client.completions.create(**{**kw, "seed": None})
    seed = fresh.model_extra["prove"]["seed"]
    assert isinstance(seed, int)
    assert client.completions.create(**{**kw, "seed": seed}).choices[0].text == fresh.choices[0].text
    rej = client.completions.create(**{**kw, "extra_body": {"top_k": 20, "min_p": 0.05, "sampler": "rejection", "block": 4}})
    assert rej.model_extra["prove"]["sampler"] == "rejection"


def test_raw_sse_format(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}
    if shutil.which("curl"):
        r = subprocess.run(["curl", "-sS", "-N", "-i", "-H", f"Authorization: Bearer {KEY}", "-H",
                            "Content-Type: application/json", "-d", json.dumps(body),
                            f"{server.url}/v1/chat/completions"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        head, _, payload = r.stdout.replace("\r\n", "\n").partition("\n\n")
    else:                                                       # pragma: no cover - no curl on this machine
        status, headers, data = raw(server, "POST", "/v1/chat/completions", body)
        head = "\n".join(f"{k}: {v}" for k, v in headers.items())
        payload = data.decode()
    assert re.search(r"(?im)^content-type: text/event-stream", head)
    events = payload.strip("\n").split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and "prove" in chunks[-2]


# ------------------------------------------------------------------------------ concurrency
def test_parallel_requests_equal_alone(server, client, local):
    """Four requests on two batched slots each equal their answer alone; the batch counters of
    /metrics count the steps that decoded them (a step: one llama_decode per model and adapter state)."""
    prompts = ["The cat sat on the mat.", "def f(x): return x * 2", "12345 + 678 = ?", "Natalia sold clips"]
    alone = [local.complete(p, 120)[1] for p in prompts]
    before = metrics(server)

    def one(p):
        return client.completions.create(model="any", prompt=p, max_tokens=120)

    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(one, prompts))
    assert [r.choices[0].text for r in results] == alone
    m = metrics(server)
    grew = {k: m[f"prove_batch_{k}"] - before[f"prove_batch_{k}"]
            for k in ("steps_total", "decodes_total", "tokens_total", "decode_seconds_total", "step_seconds_total")}
    generated = m["prove_tokens_generated_total"] - before["prove_tokens_generated_total"]
    assert 0 < grew["steps_total"] <= grew["decodes_total"]
    assert grew["tokens_total"] >= generated      # each prompt's new tokens, then all but its last committed token
    assert 0 < grew["decode_seconds_total"] <= grew["step_seconds_total"]
    # the third and fourth requests took slots holding another prompt and its 120 tokens: those were
    # saved to the pool's prompt cache before they were dropped (batching.PromptCache)
    assert m["prove_prompt_cache_entries"] >= 1 and m["prove_prompt_cache_bytes"] > 0
    assert m["prove_prompt_cache_hits_total"] >= before["prove_prompt_cache_hits_total"]


def test_both_slots_decode_at_once(server, local):
    """--parallel 2: two long streams hold both engines at the same moment: the server's gauge says 2
    while both are open (the pool gives each request an engine of its own, so they are on the two
    slots), each stream's text so far is its answer alone, and after they are cut each slot has
    decoded more tokens. Nothing is left to thread timing: a hold runs for minutes at block 128."""
    before = metrics(server)
    holds = [_hold(server, p) for p in local.holds]            # both have sent their first chunk
    assert metrics(server)["prove_slots_busy"] == 2
    for (conn, r), prompt in zip(holds, local.holds):
        text = r.first_text
        while len(text) < 200:
            line = r.readline()
            if line.startswith(b"data: {"):
                text += json.loads(line[len(b"data: "):])["choices"][0]["text"]
        assert local.complete(prompt, HOLD_TOKENS)[1].startswith(text)
    assert metrics(server)["prove_slots_busy"] == 2               # both still decoding
    for conn, r in holds:
        r.close()
        conn.close()
    key = 'prove_generations_total{finish="cancelled"}'
    wait_for(lambda: metrics(server).get(key, 0) == before.get(key, 0) + 2, "the long streams to stop")
    after = metrics(server)
    for slot in (0, 1):
        name = f'prove_slot_tokens_total{{slot="{slot}"}}'
        assert after[name] > before.get(name, 0), (slot, before, after)


def _hold(server, prompt):
    """A long stream: returns the open connection once its first text chunk arrived (its text in
    `first_text`). Block 128 makes every cycle slow: it runs far longer than it takes to start another."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"prompt": prompt, "max_tokens": HOLD_TOKENS, "stream": True, "block": 128}
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    line = r.readline()
    assert line.startswith(b"data: {"), line
    r.first_text = json.loads(line[len(b"data: "):])["choices"][0]["text"]
    return conn, r


def test_queue_full_then_disconnect_then_clean_engines(server, client, local):
    before = metrics(server)
    holds = [_hold(server, p) for p in local.holds]            # both engines busy
    assert metrics(server)["prove_slots_busy"] == 2
    queued = ThreadPoolExecutor(2)
    prompts = ["Once upon a time", "x = [1, 2, 3]"]
    futures = [queued.submit(client.completions.create, model="any", prompt=p, max_tokens=30) for p in prompts]
    wait_for(lambda: metrics(server)["prove_queue_length"] == 2, "two queued requests")
    status, _, body = raw(server, "POST", "/v1/completions", {"prompt": "one more", "max_tokens": 4})
    err = json.loads(body)["error"]
    assert status == 503 and err["code"] == "queue_full" and err["type"] == "unavailable_error"
    with pytest.raises(openai.InternalServerError):             # the client sees the 503 too
        client.completions.create(model="any", prompt="one more", max_tokens=4)
    for conn, r in holds:                                       # disconnect mid-stream
        r.close()
        conn.close()
    key = 'prove_generations_total{finish="cancelled"}'
    wait_for(lambda: metrics(server).get(key, 0) == before.get(key, 0) + 2, "the long streams to stop")
    texts = [f.result(timeout=60).choices[0].text for f in futures]
    queued.shutdown()
    assert texts == [local.complete(p, 30)[1] for p in prompts]
    # the engines that ran the interrupted streams answer exactly again
    after = [client.completions.create(model="any", prompt=p, max_tokens=30).choices[0].text for p in local.holds]
    assert after == [local.complete(p, 30)[1] for p in local.holds]
    m = metrics(server)
    assert m["prove_slots_busy"] == 0 and m["prove_queue_length"] == 0 and m["prove_queue_peak"] >= 2
    assert m["prove_requests_rejected_total"] >= before["prove_requests_rejected_total"] + 2
    tokens = m["prove_tokens_generated_total"] - before["prove_tokens_generated_total"]
    assert tokens < 2 * HOLD_TOKENS                              # the long streams were cut short


def test_client_gone_before_a_plain_answer_stops_it(server, client, local):
    """A non-streamed request whose client hangs up: the server notices and stops decoding."""
    before = metrics(server)
    key = 'prove_generations_total{finish="cancelled"}'
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": local.holds[0], "max_tokens": HOLD_TOKENS,
                                                             "block": 128}),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    wait_for(lambda: metrics(server)["prove_slots_busy"] == 1, "the request to start")
    conn.close()
    wait_for(lambda: metrics(server).get(key, 0) == before.get(key, 0) + 1, "the generation to stop")
    wait_for(lambda: metrics(server)["prove_slots_busy"] == 0, "the engine to be free")
    r = client.completions.create(model="any", prompt=local.holds[0], max_tokens=30)
    assert r.choices[0].text == local.complete(local.holds[0], 30)[1]


# ------------------------------------------------------------------------------ security, bad requests
def test_api_key(server, paths):
    status, headers, body = raw(server, "GET", "/v1/models", key=None)
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    assert raw(server, "GET", "/v1/models", key="sk-wrong")[0] == 401
    assert raw(server, "GET", "/metrics", key=None)[0] == 401
    assert raw(server, "GET", "/v1/models", key="sk-other-key")[0] == 200     # every key of the file
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


LONG_PROMPT = " ".join(str(i) for i in range(1200))       # > 4096 tokens (digits are single tokens)
BAD = [
    ("malformed JSON", b'{"prompt": "hi", "max_tokens": 3', 400, "malformed JSON"),
    ("not an object", b'["hi"]', 400, "JSON object"),
    ("prompt missing", {"max_tokens": 3}, 400, "prompt"),
    ("max_tokens a string", {"prompt": "hi", "max_tokens": "3"}, 400, "max_tokens"),
    ("max_tokens zero", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("temperature too high", {"prompt": "hi", "temperature": 7}, 400, "temperature"),
    ("stream not a bool", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("unknown mode", {"prompt": "hi", "mode": "turbo"}, 400, "unknown mode"),
    ("mode without its model", {"prompt": "hi", "mode": "spec"}, 400, "draft"),
    ("n = 2", {"prompt": "hi", "n": 2}, 400, "n=1"),
    ("too many stops", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("prompt longer than the context", {"prompt": LONG_PROMPT, "max_tokens": 3}, 400, "context holds"),
    ("max_tokens beyond the context", {"prompt": "hi", "max_tokens": CTX}, 400, "beyond the context"),
    ("body over the limit", {"prompt": "x" * (MAX_BODY + 10)}, 413, "limit"),
]
BAD_CHAT = [
    ("messages empty", {"messages": []}, 400, "messages"),
    ("bad role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("image content", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages"),
    ("stream long prompt", {"messages": [{"role": "user", "content": LONG_PROMPT}], "stream": True}, 400, "context"),
]


@pytest.mark.parametrize("path,cases", [("/v1/completions", BAD), ("/v1/chat/completions", BAD_CHAT)])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, client, path, cases):
    for name, body, want, words in cases:
        status, headers, data = raw(server, "POST", path, body)
        assert status == want, (name, status, data)
        assert headers["content-type"].startswith("application/json"), name
        err = json.loads(data)["error"]
        assert words in err["message"] and err["type"] == "invalid_request_error", (name, err)
    for method, p, want in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)]:
        status, _, data = raw(server, method, p)
        assert status == want and "error" in json.loads(data)
    assert client.completions.create(model="any", prompt="hi", max_tokens=3).usage.completion_tokens == 3


def test_metrics_text(server):
    status, headers, body = raw(server, "GET", "/metrics")
    text = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ("requests_total", "tokens_generated_total", "cycles_total", "tokens_per_cycle",
                 "accepted_tokens_total", "passes_total", "queue_length", "draft_n_total"):
        assert f"# TYPE prove_{name} " in text
    m = metrics(server)
    assert m["prove_slots"] == 2 and m["prove_queue_capacity"] == 2
    assert m["prove_tokens_per_cycle"] == pytest.approx(m["prove_tokens_generated_total"] / m["prove_cycles_total"])


# ------------------------------------------------------------------------------ start-up errors
def test_missing_extra_is_one_line():
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['fastapi'] = None\n"
                        "from prove_local.cli import main; sys.exit(main(['serve']))"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "pip install 'prove-local[server]'" in r.stderr


def test_startup_errors_are_one_line(tmp_path, paths):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        r = cli("serve", str(paths[0]), "--port", str(s.getsockname()[1]))
    assert r.returncode == 1 and "cannot listen on 127.0.0.1" in r.stderr and "Traceback" not in r.stderr
    r = cli("serve", str(paths[0]), "--api-key-file", str(tmp_path / "none.txt"))
    assert r.returncode == 1 and "--api-key-file" in r.stderr and r.stderr.count("\n") == 1
    r = cli("serve", str(tmp_path / "missing.gguf"), "--port", "0")
    assert r.returncode == 1 and "missing.gguf" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ------------------------------------------------------------------------------ units
def test_stop_text_holds_back_prefixes():
    from prove_local.server import StopText

    s = StopText(["</end>", "STOP"])
    out = [s.feed(t) for t in ["abc<", "/e", "nx", "yS", "TO", "P tail"]]
    assert out == ["abc", "", "</enx", "y", "", ""] and s.stopped
    assert "".join(out) == "abc</enxy"
    s = StopText(["##"])
    assert s.feed("a#") == "a" and s.flush() == "#"
    assert StopText([]).feed("x") == "x"


def test_loopback_detection_and_warning():
    from prove_local.server import exposure_warning, is_loopback

    assert exposure_warning("127.0.0.1", 8080, []) is None and exposure_warning("0.0.0.0", 8080, ["k"]) is None
    assert "without an API key" in exposure_warning("0.0.0.0", 8080, [])

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("example.org")


def test_pool_queue_is_bounded_fifo_and_cancellable():
    from prove_local.pool import Cancelled, EnginePool, QueueFull

    class Loaded:
        def engine(self):
            return object()

    pool = EnginePool(Loaded(), 1, max_queue=2)
    order, gone = [], threading.Event()

    def waiter(name, abandoned=None):
        try:
            with pool.engine(abandoned=abandoned):
                order.append(name)
        except Cancelled:
            order.append(name + " cancelled")

    with pool.engine():
        a = threading.Thread(target=waiter, args=("a",))
        a.start()
        wait_for(lambda: pool.n_waiting == 1, "a waiting", 10)
        c = threading.Thread(target=waiter, args=("c", gone.is_set))
        c.start()
        wait_for(lambda: pool.n_waiting == 2, "c waiting", 10)
        with pytest.raises(QueueFull):
            with pool.engine():
                pass
        gone.set()
        c.join(10)
        b = threading.Thread(target=waiter, args=("b",))
        b.start()
        wait_for(lambda: pool.n_waiting == 2, "b waiting", 10)
    a.join(10)
    b.join(10)
    assert order == ["c cancelled", "a", "b"]
    assert pool.stats() == {"slots": 1, "busy": 0, "waiting": 0, "queue_capacity": 2, "peak_waiting": 2,
                            "rejected": 1, "prompt_cache": {"entries": 0, "bytes": 0, "saved": 0, "hits": 0,
                                                            "tokens_restored": 0}}


def test_health_is_503_while_loading():
    from fastapi.testclient import TestClient

    from prove_local.server import State
    from prove_local.server.app import create_app

    with TestClient(create_app(State(keys=[KEY])), base_url="http://127.0.0.1") as c:   # (a loopback Host)
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
        r = c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"


def test_draft_counts_leave_out_the_planners_ar_cycles():
    from prove_local.rules import Cycle, Plan
    from prove_local.modes import draft_counts
    block = Cycle([1, 2, 3, 4], [.9] * 4, [.9] * 4, [1, 2, 7], 2, {"target": 2}, widths={"target": [4, 4]},
                  plan=Plan("lossless", 4))
    ar = Cycle([5], [.9], None, [5], 1, {"target": 1}, widths={"target": [1]})    # (plan: ar)
    d = draft_counts([block, ar, ar])
    assert (d.drafted, d.accepted, d.n_drafts) == (3, 1, 1)        # slots 2..4 drafted, slot 2 accepted
    d = draft_counts([ar])
    assert (d.drafted, d.accepted, d.n_drafts) == (0, 0, 0)



@pytest.mark.parametrize("collect", [True, False])
def test_a_collected_job_hands_its_text_to_the_event_loop_once(collect):
    """A non-streamed answer's job gathers its text events in its own thread and hands them over as
    one event before "done" (each hand-off wakes the event loop, Python work beside llama.cpp's
    threads); a streamed one hands over every cycle's piece. The text and logprob entries are the same."""
    import asyncio

    from prove_local.server.jobs import Job

    async def run():
        job = Job(SimpleNamespace(request_timeout=0), [1, 2], None, [], [], collect=collect)
        job._emit("start", 0)
        job._emit("text", ("Hel", [("Hel", -0.1, [])]))
        job._emit("text", ("lo", [("lo", -0.2, [])]))
        job._emit("done")
        await asyncio.sleep(0)
        events = []
        while not job.events.empty():
            events.append(job.events.get_nowait())
        return events

    events = asyncio.run(run())
    texts = [v for k, v in events if k == "text"]
    assert [k for k, _ in events] == ["start"] + ["text"] * (1 if collect else 2) + ["done"]
    assert "".join(t for t, _ in texts) == "Hello"
    assert [e for _, es in texts for e in es] == [("Hel", -0.1, []), ("lo", -0.2, [])]


def test_job_threads_are_reused_and_never_shared():
    """server.jobs.Workers: a job runs on a thread that an earlier, finished job ran on (no thread start
    per request), jobs at the same time each get a thread of their own, and a job that raises leaves
    its thread serving."""
    from prove_local.server.jobs import Workers
    w = Workers(name="test-worker")
    ran, lock = [], threading.Lock()

    def job(tag, gate=None, fail=False):
        def run():
            with lock:
                ran.append((tag, threading.get_ident()))
            if gate is not None:
                assert gate.wait(10)
            if fail:
                raise RuntimeError("a job that fails")
        return run

    def idle(n):
        deadline = time.monotonic() + 10
        while w.idle < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.idle == n

    w.submit(job("a", fail=True))
    idle(1)                                   # job a failed; its thread waits for the next
    gate = threading.Event()
    w.submit(job("b", gate=gate))             # no new thread: a's takes it, and blocks
    assert w.threads == 1
    w.submit(job("c"))                        # b still runs: a thread of its own
    assert w.threads == 2
    idle(1)                                   # c is over
    w.submit(job("d"))                        # c's thread
    idle(1)
    gate.set()
    idle(2)
    assert w.threads == 2 and len({t for _, t in ran}) == 2 and sorted(tag for tag, _ in ran) == ["a", "b", "c", "d"]
    few, gate = Workers(name="test-keep", keep=1), threading.Event()
    for _ in range(3):                        # three at once: three threads; once over, one stays
        few.submit(job("e", gate=gate))
    assert few.threads == 3
    gate.set()
    deadline = time.monotonic() + 10
    while few.threads > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert few.threads == 1 and few.idle == 1
