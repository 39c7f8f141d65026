"""Chat turns rendered through the chat template stored in the GGUF (jinja, as Hugging Face does).

Message text is data, never markup: a user who types `<|im_end|>` gets those characters, not the
control token that ends a turn. The template's own markers stay special. (Tokenizing the rendered
string with special-token parsing, as transformers' `apply_chat_template(tokenize=True)` does, lets
message text forge turn boundaries.)
"""
from __future__ import annotations

import functools
import re
import secrets
import threading
import weakref
from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import TemplateMissing
from .llama import Model


def _raise(message):
    raise TemplateError(message)


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    """The template compiled once per template text (compiling SmolLM2's took 3.5 ms, twice per chat
    request: `tokenize_chat` renders it twice); jinja templates render concurrently, each call with a
    context of its own, and `strftime_now` reads the clock at each render."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render(template: str, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
    return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)


def clean_text(text: str) -> str:
    """Text that encodes to UTF-8. Command-line bytes that are not UTF-8 reach Python as lone
    surrogates (PEP 383 surrogateescape): they become U+FFFD, as do other lone surrogates."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:      # surrogates outside U+DC80..U+DCFF (e.g. from JSON "\ud800")
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def tokenize_chat(model: Model, template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                  **extra) -> list[int]:
    """Render `messages` and tokenize the result, special-token strings inside message contents as
    plain text and the template's own ones as control tokens.

    Each content is rendered as a unique placeholder; the template text around the placeholders is
    split at its special tokens (found by tokenizing it with special parsing), then every run of
    plain text, template text and contents together, is tokenized without special parsing. That is
    what llama.cpp's tokenizer does with `parse_special=True` (split at special tokens, then tokenize
    each piece of text), so a conversation without special-token strings in its messages gets the
    very tokens it got before; only strings inside contents are no longer parsed.
    """
    real = render(template, messages, add_generation_prompt=add_generation_prompt, **extra)
    marker = f"\ue000{secrets.token_hex(6)}"          # private-use character + random tag
    holders = [dict(m, content=f"{marker}{i}\ue001") if isinstance(m.get("content"), str) else m
               for i, m in enumerate(messages)]
    parts = re.split(f"{re.escape(marker)}(\\d+)\ue001",
                     render(template, holders, add_generation_prompt=add_generation_prompt, **extra))
    segments = [(messages[int(x)]["content"], True) if i % 2 else (x, False) for i, x in enumerate(parts)]
    if "".join(t for t, _ in segments) != real:
        segments = _find_contents(real, messages)       # the template rewrites message text
    pieces: list[tuple[str, bool]] = []                # (text, is_special_token)
    for text, is_content in segments:
        specials = set() if is_content else _special_strings(model, text)
        if not specials:
            pieces.append((text, False))
            continue
        pattern = "(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")"
        for j, frag in enumerate(re.split(pattern, text)):
            if frag:
                pieces.append((frag, j % 2 == 1))
    ids: list[int] = []
    plain = ""
    for frag, special in pieces:
        if special:
            if plain:
                ids += model.tokenize(plain, parse_special=False)
                plain = ""
            ids += model.tokenize(frag, parse_special=True)
        else:
            plain += frag
    if plain:
        ids += model.tokenize(plain, parse_special=False)
    return ids


def _find_contents(text: str, messages: list[dict]) -> list[tuple[str, bool]]:
    """Segments of a rendering whose template edits message text (Qwen3 drops an assistant's
    <think> part, some templates strip whitespace): each content, or what is left of it after its
    last "</think>", stripped, is looked for in order after the previous one."""
    segments, pos = [], 0
    for m in messages:
        c = m.get("content")
        if not isinstance(c, str) or not c:
            continue
        for cand in (c, c.strip(), c.split("</think>")[-1].strip()):
            k = text.find(cand, pos) if cand else -1
            if k >= 0:
                segments += [(text[pos:k], False), (cand, True)]
                pos = k + len(cand)
                break
    return segments + [(text[pos:], False)]


SPECIAL_STRINGS_KEPT = 256       # template texts per model whose special-token strings are kept (_special_strings)
_special_kept: "weakref.WeakKeyDictionary[Model, dict[str, frozenset[str]]]" = weakref.WeakKeyDictionary()
_special_lock = threading.Lock()


def _special_strings(model: Model, text: str) -> frozenset[str]:
    """The special-token strings in template text: tokens that special parsing makes of `text`
    whose own text does not tokenize to them without it. Kept per model and text: the template's
    text between messages repeats from request to request, and finding them is a tokenize call per
    distinct token (1.2 of a SmolLM2 chat request's 1.5 ms of tokenizing, 40 calls, on this CPU)."""
    if not text:
        return frozenset()
    with _special_lock:
        kept = _special_kept.setdefault(model, {})
        found = kept.get(text)
    if found is not None:
        return found
    found = set()
    for tok in set(model.tokenize(text, parse_special=True)):
        piece = model.piece(tok, special=True).decode("utf-8", "replace")
        if piece and piece in text and model.tokenize(piece, parse_special=False) != [tok]:
            found.add(piece)
    found = frozenset(found)
    with _special_lock:
        if len(kept) >= SPECIAL_STRINGS_KEPT:
            kept.clear()
        kept[text] = found
    return found


def chat_tokens(model: Model, template: str, messages: list[dict]) -> list[int]:
    """Messages rendered with the generation prompt and tokenized (`tokenize_chat`: message text stays
    text), with the BOS token added as llama_tokenize's add_special would, unless the template wrote
    it already. The chat of `run`, the UI and the server's /v1/chat/completions all tokenize here."""
    bos = model.special_text("bos")
    ids = tokenize_chat(model, template, messages, add_generation_prompt=True,
                        bos_token=bos, eos_token=model.special_text("eos"))
    head = model.tokenize("", add_special=True)
    bos_id = model.tokenize(bos, parse_special=True) if bos else []
    if head and bos_id and head[0] == bos_id[0] and ids[:1] != bos_id:
        ids = bos_id + ids
    return ids


class Conversation:
    """Messages so far; `prompt_tokens()` renders and tokenizes the whole conversation. The engine
    reuses the KV cache of the longest common token prefix, so only new tokens are evaluated."""

    def __init__(self, model: Model, system: str | None = None):
        self.model = model
        self.template = model.chat_template
        if not self.template:
            raise TemplateMissing(f"{model.path}: the GGUF has no chat template (tokenizer.chat_template); use --raw")
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []

    def prompt_tokens(self, user: str) -> list[int]:
        self.messages.append({"role": "user", "content": user})
        return self.tokens()

    def tokens(self) -> list[int]:
        """The conversation so far, rendered with the generation prompt, tokenized."""
        return chat_tokens(self.model, self.template, self.messages)

    def forget_last_user(self) -> None:
        """Undo `prompt_tokens` (a turn that was refused)."""
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()

    def add_reply(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})
