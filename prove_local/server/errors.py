"""The server's error answers: every failure becomes an OpenAI-style `{"error": {...}}` object with
a 4xx/5xx status (never a traceback)."""
from __future__ import annotations

from ..errors import ContextFull, EngineBusy, LlamaError, ModeError, TemplateMissing, UsageError
from ..pool import Cancelled, QueueFull


class ApiError(Exception):
    """An OpenAI-style error answer: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def api_error_of(e: BaseException) -> ApiError:
    """The answer to an exception raised while serving a request."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, QueueFull):
        return ApiError(503, f"server busy: {e}", "unavailable_error", code="queue_full")
    if isinstance(e, Cancelled):
        return ApiError(499, str(e), "cancelled")
    if isinstance(e, ContextFull):
        return ApiError(400, str(e), code="context_length_exceeded")
    if isinstance(e, (ModeError, TemplateMissing, UsageError)):
        return ApiError(400, str(e))
    if isinstance(e, EngineBusy):
        return ApiError(503, str(e), "unavailable_error")
    if isinstance(e, LlamaError):
        return ApiError(500, f"llama.cpp error: {e}", "server_error")
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")
