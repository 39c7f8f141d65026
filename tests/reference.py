"""An independent reference for the tests: greedy decoding by hand on a fresh llama.cpp context, one
token per llama_decode call, without the engine or the decoding rules under test; and the logits a
context's cache gives next (for checks that a cache holds exactly the committed tokens)."""
from __future__ import annotations

import numpy as np

from prove_local.chat import Conversation
from prove_local.llama import Context, Model

F32 = dict(n_ctx=512, n_threads=1, type_k="f32", type_v="f32")


def greedy_ar(model: Model, prompt: list[int], max_new: int, sampler=None, **context_options) -> list[int]:
    """The greedy continuation of `prompt`: up to `max_new` tokens, ending with an end-of-generation
    token if one comes first, or where the context is full (as the engine's stops). With a coupled
    sampler (sampling.CoupledSampler) each token is instead its coupled sample at its absolute
    position, drawn by the sampler from the processed row of a one-token pass: sampled ar by hand,
    what every exact mode must commit for that seed (the chain itself is checked in test_sampling)."""
    opts = {**F32, **context_options}
    ctx = Context(model, **opts)
    try:
        logits = ctx.eval(list(prompt))[0]
        out: list[int] = []
        while len(out) < max_new:
            if sampler is None:
                tok = int(np.argmax(logits))
            else:
                prefix = list(prompt) + out
                tok = int(sampler.draw(sampler.dists(logits[None], prefix)[0], len(prefix)))
            out.append(tok)
            if model.is_eog(tok) or len(prompt) + len(out) >= ctx.n_ctx:
                break
            logits = ctx.eval([tok])[0]
        return out
    finally:
        ctx.close()


def chat_reference(model: Model, turns: list[str], max_new: int, system: str | None = None,
                   **context_options) -> list[list[int]]:
    """Every turn's greedy answer (token ids), each decoded from scratch on the whole conversation so far."""
    conv = Conversation(model, system=system)
    answers = []
    for user in turns:
        ids = greedy_ar(model, conv.prompt_tokens(user), max_new, **context_options)
        answers.append(ids)
        conv.add_reply(model.detokenize([t for t in ids if not model.is_eog(t)]))
    return answers


def next_logits(ctx: Context, tokens: list[int]) -> np.ndarray:
    """The logits after `tokens` from ctx's current cache (which must hold a prefix of them);
    the cache is left as it was."""
    n = ctx.n_past
    assert n <= len(tokens)
    pending = tokens[n:] if n < len(tokens) else tokens[-1:]
    if n == len(tokens):
        ctx.truncate(n - 1)
    row = ctx.eval(pending)[0]
    ctx.truncate(n)
    return row
