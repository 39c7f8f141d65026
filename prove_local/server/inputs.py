"""A validated request -> what the engine takes: prompt tokens (chat template or raw prompt),
`engine.Settings` (the server's defaults, the OpenAI fields, the ProVe extensions) and stop strings.
Whatever cannot be served is a 400 naming the field, before any engine is taken."""
from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError

from .. import modes, sampling
from ..chat import chat_tokens
from ..engine import Settings, seed_note
from ..engine import MAX_LOGPROBS
from ..errors import ModeError
from ..grammar import Grammar, GrammarError
from .errors import ApiError

MAX_STOPS = 4                          # as OpenAI's API


def settings_for(state, body, n_prompt: int):
    """engine.Settings from a request: the server defaults, the OpenAI fields, the extensions.
    Returns (settings, notes)."""
    notes = _unsupported(body)
    _check_mode(state, body)
    max_tokens = _max_tokens(state, body, n_prompt)
    d = state.defaults
    s = Settings(
        mode=body.mode or d.mode, max_new=max_tokens,
        block=body.block if body.block is not None else d.block,
        theta=d.theta if body.theta is None else body.theta, tau=d.tau if body.tau is None else body.tau,
        draft_k=d.draft_k if body.draft_k is None else body.draft_k,
        lookup=d.lookup if body.lookup is None else body.lookup,
        recall=d.recall and body.recall is not False,      # (a request may turn it off, not on)
        # (the one rule of the CLI and the UI: a tiny T is greedy, never logits / 1e-310)
        temperature=d.temperature if body.temperature is None else sampling.temperature_of(body.temperature),
        top_k=d.top_k if body.top_k is None else body.top_k, top_p=d.top_p if body.top_p is None else body.top_p,
        min_p=d.min_p if body.min_p is None else body.min_p,
        repeat_penalty=d.repeat_penalty if body.repeat_penalty is None else body.repeat_penalty,
        repeat_last_n=d.repeat_last_n if body.repeat_last_n is None else body.repeat_last_n,
        seed=body.seed, logprobs=logprobs_of(body), grammar=grammar_of(state.pool.loaded.target, body),
        sampler=d.sampler if body.sampler is None else body.sampler, p_tilde=False)
    try:
        state.pool.first.check(s)
    except ModeError as e:
        raise ApiError(400, str(e), param="mode") from None
    note = seed_note(s)
    if note:
        notes.append(note)
    return s, notes


def _unsupported(body) -> list[str]:
    """OpenAI fields we refuse (400) or ignore (a note in the answer)."""
    notes: list[str] = []
    if body.n not in (None, 1):
        raise ApiError(400, f"n={body.n}: only n=1 is supported", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            notes.append(f"{name} is not supported and was ignored (use repeat_penalty)")
    return notes


def logprobs_of(body) -> int | None:
    """Alternatives per token to report, or None: chat's `logprobs: true` + `top_logprobs: N`,
    completions' `logprobs: N` (OpenAI's shapes; N <= 20 as chat's top_logprobs, llama-server's n_probs)."""
    chat = hasattr(body, "messages")
    if chat:
        if body.logprobs is not None and not isinstance(body.logprobs, bool):
            raise ApiError(400, "logprobs: a boolean on chat completions (top_logprobs gives the count)", param="logprobs")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs is not None:
        raise ApiError(400, "top_logprobs: chat completions only (completions take logprobs: N)", param="top_logprobs")
    if body.logprobs is None or body.logprobs is False:
        return None
    if isinstance(body.logprobs, bool) or not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"logprobs: an integer in [0, {MAX_LOGPROBS}] on completions, not {body.logprobs!r}",
                       param="logprobs")
    return body.logprobs


def grammar_of(model, body):
    """The request's grammar (grammar.Grammar) from `grammar` (GBNF), `response_format` (json_object,
    json_schema) or `json_schema`; None without one. A bad one is a 400 with the parser's message."""
    rf = body.response_format if body.response_format is not None and body.response_format.type != "text" else None
    given = [n for n, v in (("grammar", body.grammar), ("response_format", rf), ("json_schema", body.json_schema))
             if v is not None]
    if len(given) > 1:
        raise ApiError(400, f"{' and '.join(given)}: give one constraint per request", param=given[1])
    if not given:
        return None
    where = given[0]
    try:
        if body.grammar is not None:
            return Grammar(model, body.grammar)
        if body.json_schema is not None:
            return Grammar.from_schema(model, body.json_schema)
        if rf.type == "json_object":
            return Grammar.from_schema(model, rf.schema_) if rf.schema_ is not None else Grammar.json_object(model)
        schema = (rf.json_schema or {}).get("schema")
        if schema is None:
            raise ApiError(400, "response_format.json_schema.schema: missing (the JSON schema to follow)",
                           param="response_format")
        return Grammar.from_schema(model, schema)
    except GrammarError as e:
        raise ApiError(400, f"{where}: {e}", param=where) from None


def _check_mode(state, body) -> None:
    if body.mode is not None:
        if body.mode not in modes.MODES:
            raise ApiError(400, f"unknown mode {body.mode!r}; choose from {', '.join(modes.NAMES)}", param="mode")
        if body.mode in state.mode_errors:
            raise ApiError(400, state.mode_errors[body.mode], param="mode")


def _max_tokens(state, body, n_prompt: int) -> int:
    """The request's max_tokens, checked against the context; default: until the context is full."""
    n_ctx = state.pool.first.n_ctx
    if n_prompt >= n_ctx:
        raise ApiError(400, f"the prompt has {n_prompt} tokens; the context holds {n_ctx} (start the server "
                            "with a larger --ctx, or shorten the prompt)", code="context_length_exceeded")
    room = n_ctx - n_prompt
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is not None and max_tokens > room:
        raise ApiError(400, f"max_tokens={max_tokens} is beyond the context: the prompt has {n_prompt} tokens, "
                            f"the context holds {n_ctx}, so at most {room} can be generated",
                       param="max_tokens", code="context_length_exceeded")
    return max_tokens or room


def stop_list(body) -> list[str]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop: at most {MAX_STOPS} stop strings", param="stop")
    return [s for s in stops if s]


def chat_prompt(model, messages) -> list[int]:
    """Messages rendered by the GGUF's chat template and tokenized as the CLI and the UI do
    (chat.chat_tokens: a message cannot forge a turn boundary with "<|im_end|>")."""
    template = model.chat_template
    if not template:
        raise ApiError(400, f"{Path(model.path).name} has no chat template (tokenizer.chat_template): "
                            "use /v1/completions with a raw prompt")
    msgs = []
    for m in messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
        msgs.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    try:      # special-token strings inside message contents stay text (chat.tokenize_chat)
        return chat_tokens(model, template, msgs)
    except TemplateError as e:
        raise ApiError(400, f"the chat template refused the messages: {e}", param="messages") from None


def completion_prompt(model, body) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(400, "prompt: one prompt per request (a list of one string at most)", param="prompt")
        prompt = prompt[0]
    if body.echo:
        raise ApiError(400, "echo is not supported", param="echo")
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if not prompt:
        raise ApiError(400, "prompt is empty", param="prompt")
    return model.tokenize(prompt, add_special=True)
