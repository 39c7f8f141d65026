"""The errors every front end answers with one line (no traceback). Import-light on purpose: the
command line, the UI and the server catch `ProveError` without loading llama.cpp."""
from __future__ import annotations


class ProveError(Exception):
    """Anything a user can cause and fix: the message names the file, key or value."""


class UsageError(ProveError):
    """A command line (or request) that cannot be carried out as given."""


class ModeError(ProveError, ValueError):
    """A mode was asked for that these models cannot run, or settings out of range."""


class EngineBusy(ProveError):
    """A second generation was started on an engine while an earlier one is still open."""


class TemplateMissing(ProveError, ValueError):
    """The GGUF has no chat template."""


class LlamaError(ProveError, RuntimeError):
    """A llama.cpp call failed; the message names the file or the value involved."""


class ContextFull(LlamaError):
    """The tokens do not fit into the context window."""


class MissingExtra(UsageError):
    """A command needs an optional dependency that is not installed."""

    def __init__(self, extra: str, module: str):
        super().__init__(f"this command needs the '{extra}' extra ({module} is not installed): "
                         f"pip install 'prove-local[{extra}]'")


class DeadlineExceeded(ProveError):
    """A request ran past its deadline (`serve --request-timeout`); checked between cycles and between
    grammar steps, so that its engine is freed."""
