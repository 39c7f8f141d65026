"""Hugging Face Qwen2 / Qwen3 / MARS checkpoints -> GGUF for llama.cpp (`prove-local convert`)."""
from .errors import ConvertError
from .export import OUTTYPES, convert_checkpoint

__all__ = ["ConvertError", "OUTTYPES", "convert_checkpoint"]
