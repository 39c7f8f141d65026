"""The server features clients rely on (issue 25): llama-server's `timings` object and
`llamacpp:spec_decode_*` metrics, logprobs, and grammar / JSON-schema constrained output, against a
real `prove-local serve` process on the embedded pair with the official `openai` client. References
are computed here, in this process, on a fresh llama.cpp context (no engine, no decoding rule)."""
import json
import math

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from prove_local.loading import EMBEDDED_PROPOSER  # noqa: E402
from prove_local.llama import Context, Model  # noqa: E402
from prove_local.chat import Conversation  # noqa: E402
from tests.test_server import Server, metrics, raw  # noqa: E402

BLOCK = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("structured")
    s = Server(["--threads", "1", "--ctx", "1024", "--block", str(BLOCK), "--lookup", "0"], d / "server.log")
    yield s
    s.stop()
    assert "Traceback" not in s.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model():
    return Model(EMBEDDED_PROPOSER)


def chat(user):
    return [{"role": "user", "content": user}]


# ------------------------------------------------------------------------------ timings and metrics
def test_timings_follow_llama_server(client):
    msgs = chat("Natalia sold clips to 48 of her friends in April. How many clips did she sell?")
    r = client.chat.completions.create(model="any", messages=msgs, max_tokens=40, temperature=0)
    t, p = r.model_extra["timings"], r.model_extra["prove"]
    assert t["predicted_n"] == r.usage.completion_tokens
    assert t["prompt_n"] == r.usage.prompt_tokens            # nothing cached yet for this prompt
    assert t["predicted_ms"] == pytest.approx(p["seconds"] * 1e3, abs=1e-2)
    assert t["predicted_per_second"] == pytest.approx(p["tokens_per_second"], rel=1e-3)
    assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / t["predicted_n"], abs=1e-3)
    assert t["prompt_ms"] == pytest.approx(p["prefill"]["seconds"] * 1e3, abs=1e-2) and t["prompt_ms"] > 0
    assert t["prompt_per_second"] == pytest.approx(t["prompt_n"] / t["prompt_ms"] * 1e3, rel=1e-3)
    assert (t["draft_n"], t["draft_n_accepted"]) == (p["draft_n"], p["draft_n_accepted"]) and t["draft_n"] > 0
    # the same prompt again: its tokens are in the KV cache, only the last one is evaluated anew
    again = client.chat.completions.create(model="any", messages=msgs, max_tokens=4, temperature=0)
    assert again.model_extra["timings"]["prompt_n"] == 1
    # ar proposes nothing: no draft fields, as llama-server without a draft model
    ar = client.chat.completions.create(model="any", messages=msgs, max_tokens=4, extra_body={"mode": "ar"})
    assert "draft_n" not in ar.model_extra["timings"]
    # streamed: on the chunk with finish_reason, and on the usage chunk
    chunks = list(client.chat.completions.create(model="any", messages=chat("hello"), max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}))
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert last.model_extra["timings"]["predicted_n"] == chunks[-1].usage.completion_tokens
    assert chunks[-1].model_extra["timings"] == last.model_extra["timings"]


def test_spec_decode_metrics(server, client):
    before = metrics(server)
    r = client.completions.create(model="any", prompt="Question: 3 + 4 = ?\nAnswer:", max_tokens=48)
    after = metrics(server)
    p = r.model_extra["prove"]

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = p["n_cycles"] - p["widths"].get("ar", 0)
    assert delta("llamacpp:spec_decode_num_drafts_total") == drafts > 0
    assert delta("llamacpp:spec_decode_num_draft_tokens_total") == p["draft_n"] == drafts * BLOCK
    assert delta("llamacpp:spec_decode_num_accepted_tokens_total") == p["draft_n_accepted"]
    per_pos = [delta(f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}')
               for i in range(BLOCK)]
    assert sum(per_pos) == p["draft_n_accepted"]
    # slot 1 of a lossless block is the proposer's own token: accepted in every draft; a later
    # position is accepted only after every position before it
    assert per_pos[0] == drafts and all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert delta("prove_draft_n_total") == p["draft_n"]                 # the existing names stay
    _, _, text = raw(server, "GET", "/metrics")
    assert "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter" in text.decode()
