"""Chat turns rendered through the chat template stored in the GGUF (jinja, as Hugging Face does)."""
from __future__ import annotations

from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import TemplateMissing
from .llama import Model


def _raise(message):
    raise TemplateError(message)


def render(template: str, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)


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
        bos = self.model.special_text("bos")
        text = render(self.template, self.messages, add_generation_prompt=True,
                      bos_token=bos, eos_token=self.model.special_text("eos"))
        # add the BOS token unless the template wrote it already
        return self.model.tokenize(text, add_special=not (bos and text.startswith(bos)), parse_special=True)

    def add_reply(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})
