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
    s = Server(["embedded", "--threads", "1", "--ctx", "1024", "--block", str(BLOCK), "--lookup", "0", "--kv-type", "f32"],
               d / "server.log")
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
    # slot 1 of a lossless block is the proposer's own token, not a draft (llama-server counts drafted
    # tokens only): each block drafts its BLOCK - 1 mask slots
    assert delta("llamacpp:spec_decode_num_draft_tokens_total") == p["draft_n"] == drafts * (BLOCK - 1)
    assert delta("llamacpp:spec_decode_num_accepted_tokens_total") == p["draft_n_accepted"] > 0
    per_pos = [delta(f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}')
               for i in range(BLOCK)]
    assert sum(per_pos) == p["draft_n_accepted"] and per_pos[BLOCK - 1] == 0
    # a position is accepted only after every position before it
    assert drafts >= per_pos[0] > 0 and all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert delta("prove_draft_n_total") == p["draft_n"]                 # the existing names stay
    _, _, text = raw(server, "GET", "/metrics")
    assert "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter" in text.decode()


# ------------------------------------------------------------------------------ references
F32 = dict(n_ctx=1024, n_threads=1, type_k="f32", type_v="f32")


def log_softmax(row, allowed=None):
    z = np.asarray(row, dtype=np.float64).copy()
    if allowed is not None:
        z[~allowed] = -np.inf
    m = z.max()
    return z - (m + np.log(np.exp(z - m).sum()))


def reference(model, prompt, max_new, grammar=None):
    """Greedy decoding by hand on a fresh F32 context, one token per pass: (tokens, log-softmax row of
    each), the rows masked by llama.cpp's grammar sampler (grammar.Grammar states) when given."""
    ctx = Context(model, **F32)
    try:
        row = ctx.eval(list(prompt))[0]
        state = grammar.start() if grammar is not None else None
        out, rows = [], []
        while len(out) < max_new:
            lp = log_softmax(row, state.mask() if state is not None else None)
            tok = int(np.argmax(lp))
            out.append(tok)
            rows.append(lp)
            if model.is_eog(tok):
                break
            if state is not None:
                state = state.then(tok)
            row = ctx.eval([tok])[0]
        return out, rows
    finally:
        ctx.close()


def visible(model, tokens):
    return [t for t in tokens if not model.is_eog(t)]


# ------------------------------------------------------------------------------ logprobs
@pytest.mark.parametrize("mode", ["lossless", "ar"])
def test_chat_logprobs_against_reference(client, model, mode):
    user = "Tom has 3 apples and buys 5 more. How many apples does he have?"
    want, rows = reference(model, Conversation(model).prompt_tokens(user), 24)
    r = client.chat.completions.create(model="any", messages=chat(user), max_tokens=24, logprobs=True,
                                       top_logprobs=5, extra_body={"mode": mode})
    content = r.choices[0].logprobs.content
    vis = visible(model, want)
    assert len(content) == len(vis) and r.choices[0].message.content == model.detokenize(vis)
    for item, tok, lp in zip(content, want, rows):
        assert bytes(item.bytes) == model.piece(tok)
        assert item.logprob == pytest.approx(lp[tok], abs=2e-4)
        assert len(item.top_logprobs) == 5
        top = np.argsort(-lp, kind="stable")[:5]
        assert [bytes(t.bytes) for t in item.top_logprobs] == [model.piece(int(i)) for i in top]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(lp[top], abs=2e-4)
    # streamed: the same entries, spread over the chunks
    chunks = list(client.chat.completions.create(model="any", messages=chat(user), max_tokens=24, logprobs=True,
                                                 top_logprobs=2, stream=True, extra_body={"mode": mode}))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    # (flat lists: pytest >= 9.2 refuses approx of nested structures such as a list of tuples)
    assert [x.token for x in streamed] == [x.token for x in content]
    assert [x.logprob for x in streamed] == pytest.approx([x.logprob for x in content])
    # without logprobs: none
    plain = client.chat.completions.create(model="any", messages=chat(user), max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_shape_and_modes(client, model):
    prompt = "Question: 2 + 2 = ?\nAnswer:"
    want, rows = reference(model, model.tokenize(prompt, add_special=True), 16)
    r = client.completions.create(model="any", prompt=prompt, max_tokens=16, logprobs=3)
    lp = r.choices[0].logprobs
    vis = visible(model, want)
    assert lp.tokens == [model.piece(t).decode("utf-8", "replace") for t in vis]
    assert lp.token_logprobs == pytest.approx([row[t] for t, row in zip(want, rows)], abs=2e-4)
    assert all(len(d) <= 3 and max(d.values()) == pytest.approx(v, abs=1e-6)      # greedy: the top one
               for d, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # mars: the number is the proposer's probability in the slot it committed from (its p̃): the
    # committed token is that row's argmax, so it heads its own top list
    m = client.completions.create(model="any", prompt=prompt, max_tokens=16, logprobs=2,
                                  extra_body={"mode": "mars", "tau": 0.3})
    ml = m.choices[0].logprobs
    assert len(ml.tokens) == len(ml.token_logprobs) == len(ml.top_logprobs) > 0
    assert all(list(d)[0] == t and d[t] == pytest.approx(v) for d, t, v in
               zip(ml.top_logprobs, ml.tokens, ml.token_logprobs))
    # sampled: the processed distribution (top_k 3: at most three tokens carry probability)
    s = client.completions.create(model="any", prompt=prompt, max_tokens=16, logprobs=5, temperature=0.9, seed=1,
                                  extra_body={"top_k": 3, "top_p": 1.0, "min_p": 0.0})
    for d, v in zip(s.choices[0].logprobs.top_logprobs, s.choices[0].logprobs.token_logprobs):
        assert 1 <= len(d) <= 3 and sum(math.exp(x) for x in d.values()) == pytest.approx(1.0, abs=1e-5)
        assert any(v == pytest.approx(x) for x in d.values())


@pytest.mark.parametrize("path,body,words", [
    ("/v1/chat/completions", {"messages": chat("hi"), "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": chat("hi"), "top_logprobs": 2}, "needs logprobs"),
    ("/v1/chat/completions", {"messages": chat("hi"), "logprobs": 3}, "boolean"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "grammar": 'root ::= "a" | foo'}, "Undefined rule identifier 'foo'"),
    ("/v1/completions", {"prompt": "hi", "grammar": ""}, "empty"),
    ("/v1/chat/completions", {"messages": chat("hi"), "response_format": {"type": "json_schema", "json_schema": {
        "name": "x"}}}, "schema: missing"),
    ("/v1/chat/completions", {"messages": chat("hi"), "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "minItems": 10 ** 9}}}}, "limit is"),
    ("/v1/completions", {"prompt": "hi", "json_schema": {"type": "string", "pattern": "^a{100000000}$"}},
     "over the limit"),
    ("/v1/chat/completions", {"messages": chat("hi"), "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/definitions/nowhere"}}}}, "invalid JSON schema"),
    ("/v1/chat/completions", {"messages": chat("hi"), "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "grammar": 'root ::= "a"', "json_schema": {"type": "string"}}, "one constraint"),
])
def test_bad_logprobs_and_constraints_are_400(server, client, path, body, words):
    status, _, data = raw(server, "POST", path, body)
    err = json.loads(data)["error"]
    assert status == 400 and words in err["message"] and "\n" not in err["message"], err
    assert client.completions.create(model="any", prompt="hi", max_tokens=2).usage.completion_tokens == 2


# ------------------------------------------------------------------------------ structured output
SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "integer"},
    "unit": {"enum": ["apples", "dollars", "hours"]},
    "sure": {"type": "boolean"},
    "note": {"type": "string", "maxLength": 12}},
    "required": ["answer", "unit", "sure", "note"]}
QUESTION = "Tom has 3 apples and buys 5 more. How many apples does he have? Answer in JSON."


def schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_gives_valid_json_and_lossless_equals_ar(client, model):
    """The embedded model knows no JSON (without the schema it answers in prose): only the grammar
    makes the answer valid. lossless == ar == greedy decoding by hand under llama.cpp's grammar."""
    import jsonschema                    # the test extra pins it: this test must not skip
    from prove_local.grammar import Grammar

    free = client.chat.completions.create(model="any", messages=chat(QUESTION), max_tokens=60)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)
    answers = {}
    for mode in ("ar", "lossless", "mars"):
        r = client.chat.completions.create(model="any", messages=chat(QUESTION), max_tokens=200,
                                           response_format=schema_format(), extra_body={"mode": mode, "tau": 0.5})
        assert r.choices[0].finish_reason == "stop", (mode, r.choices[0].message.content)
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        answers[mode] = r
    assert answers["lossless"].choices[0].message.content == answers["ar"].choices[0].message.content
    # the planner's widths and lookup drafts (filled proposals, lookup verify cycles) under the schema
    auto = client.chat.completions.create(model="any", messages=chat(QUESTION), max_tokens=200,
                                          response_format=schema_format(), extra_body={"block": "auto", "lookup": "auto"})
    assert auto.choices[0].message.content == answers["ar"].choices[0].message.content
    p = answers["lossless"].model_extra["prove"]
    assert p["draft_n_accepted"] > 0 and p["tokens_per_cycle"] > 1
    want, _ = reference(model, Conversation(model).prompt_tokens(QUESTION), 200,
                        grammar=Grammar.from_schema(model, SCHEMA))
    assert answers["ar"].choices[0].message.content == model.detokenize(visible(model, want))
    assert answers["ar"].usage.completion_tokens == len(want)
    # streamed, with logprobs: the same text; every token's logprob is under the masked distribution
    chunks = list(client.chat.completions.create(model="any", messages=chat(QUESTION), max_tokens=200, stream=True,
                                                 response_format=schema_format(), logprobs=True, top_logprobs=3))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        answers["lossless"].choices[0].message.content
    items = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    _, rows = reference(model, Conversation(model).prompt_tokens(QUESTION), 200,
                        grammar=Grammar.from_schema(model, SCHEMA))
    # one entry per visible token (end-of-generation tokens have none): its bytes, and its logprob
    # under the grammar-masked reference row (an answer without logprobs fails here)
    vis = [(t, row) for t, row in zip(want, rows) if not model.is_eog(t)]
    assert len(items) == len(vis) > 0
    assert [bytes(x.bytes) for x in items] == [model.piece(t) for t, _ in vis]
    assert [x.logprob for x in items] == pytest.approx([row[t] for t, row in vis], abs=2e-4)


def test_json_object_and_gbnf_grammar(client):
    r = client.chat.completions.create(model="any", messages=chat(QUESTION), max_tokens=300,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:                                        # cut by max_tokens: still the start of a JSON object
        assert r.choices[0].message.content.lstrip().startswith("{")
    grammar = 'root ::= ("yes" | "no") " because " [a-z ]{1,20} "."'
    a = client.completions.create(model="any", prompt="Is 7 a prime number?", max_tokens=40,
                                  extra_body={"grammar": grammar})
    text = a.choices[0].text
    assert a.choices[0].finish_reason == "stop"
    import re
    assert re.fullmatch(r"(yes|no) because [a-z ]{1,20}\.", text), text
    streamed = list(client.completions.create(model="any", prompt="Is 7 a prime number?", max_tokens=40, stream=True,
                                              extra_body={"grammar": grammar, "mode": "ar"}))
    assert "".join(c.choices[0].text for c in streamed) == text
    # llama-server's json_schema field
    js = client.completions.create(model="any", prompt="Is 7 a prime number?", max_tokens=40,
                                   extra_body={"json_schema": {"type": "boolean"}})
    assert json.loads(js.choices[0].text) in (True, False)


def test_grammar_dead_end_stops_with_finish_reason(client):
    """After "ok" the grammar requires a NUL byte, which no token may spell (llama.cpp rejects
    such pieces): a dead end, answered with what came before it."""
    r = client.completions.create(model="any", prompt="Say ok.", max_tokens=30,
                                  extra_body={"grammar": 'root ::= "ok" "\\x00"'})
    assert r.choices[0].text == "ok" and r.choices[0].finish_reason == "grammar"
    assert r.model_extra["prove"]["stop"] == "grammar"
    chunks = list(client.completions.create(model="any", prompt="Say ok.", max_tokens=30, stream=True,
                                            extra_body={"grammar": 'root ::= "ok" "\\x00"', "mode": "ar"}))
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["grammar"]


def test_run_takes_a_json_schema_and_a_grammar(tmp_path):
    from tests.test_server import cli

    (tmp_path / "s.json").write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                 "required": ["ok"]}))
    r = cli("run", "embedded", "-p", "Is it ok?", "--json-schema", str(tmp_path / "s.json"), "-n", "40", "--json",
            "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(json.loads(r.stdout)["text"])["ok"], bool)
    (tmp_path / "bad.gbnf").write_text('root ::= "a" | foo\n')
    r = cli("run", "embedded", "-p", "x", "--grammar", str(tmp_path / "bad.gbnf"))
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0
    assert "bad.gbnf: invalid grammar: Undefined rule identifier 'foo'" in r.stderr
