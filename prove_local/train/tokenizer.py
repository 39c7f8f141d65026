"""A small byte-level BPE that llama.cpp tokenizes exactly like Hugging Face `tokenizers`.

Same pre-tokenizer regex and byte-level alphabet as Qwen2, so a GGUF written with
`tokenizer.ggml.pre = "qwen2"` splits text identically (checked in tests/test_convert.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

# Qwen2's pre-tokenizer pattern (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Special tokens, in id order after the BPE vocabulary. <|mask|> is the MARS placeholder.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
USER_TOKENS = ["<think>", "</think>"]  # added, not special (like Qwen3)

# ChatML, as Qwen2.5 renders it, without the tool-calling branches.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_byte_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a Qwen2-style byte-level BPE on `texts`; specials are appended after the BPE ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    n_added = len(SPECIAL_TOKENS) + len(USER_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(USER_TOKENS)
    return tok


def save_hf_tokenizer(tok: Tokenizer, out_dir: str | os.PathLike, mask_token: str | None = "<|mask|>") -> None:
    """Write tokenizer.json and tokenizer_config.json the way Qwen checkpoints carry them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    decoder = {}
    for name in SPECIAL_TOKENS + USER_TOKENS:
        decoder[str(tok.token_to_id(name))] = {
            "content": name, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": name in SPECIAL_TOKENS,
        }
    config = {
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 32768,
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
    }
    if mask_token is not None:
        config["mask_token"] = mask_token
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
