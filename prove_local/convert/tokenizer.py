"""The tokenizer part of a Qwen GGUF: byte-level BPE as llama.cpp expects it (gpt2 model, qwen2 pre-tokenizer).

Read from tokenizer.json / tokenizer_config.json directly (no `tokenizers` or `transformers` needed).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gguf

from .errors import ConvertError
from .hf import read_json


@dataclass
class Vocab:
    tokens: list[str]
    types: list[int]
    special: gguf.SpecialVocab      # merges, bos/eos/pad/mask ids, add-bos flag, chat template
    mask_id: int | None

    def add_to_gguf(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(self.tokens)
        w.add_token_types(self.types)
        self.special.add_to_gguf(w, quiet=True)


def _looks_special(text: str) -> bool:
    return text.startswith("<|") and text.endswith("|>")


def _token_id(text: str, vocab: dict[str, int], added: list[dict]) -> int | None:
    for a in added:
        if a.get("content") == text:
            return a.get("id")
    return vocab.get(text)


def _find_mask(hf_dir: Path, tok_config: dict, vocab: dict[str, int], added: list[dict]) -> int | None:
    """The mask token id: tokenizer_config.json `mask_token`, special_tokens_map.json, or config.json `mask_token_id`."""
    sources = [(hf_dir / "tokenizer_config.json", tok_config)]
    if (hf_dir / "special_tokens_map.json").is_file():
        sources.append((hf_dir / "special_tokens_map.json", read_json(hf_dir / "special_tokens_map.json")))
    for path, data in sources:
        entry = data.get("mask_token")
        if isinstance(entry, dict):
            entry = entry.get("content")
        if isinstance(entry, str) and entry:
            tid = _token_id(entry, vocab, added)
            if tid is None:
                raise ConvertError(f"{path}: mask_token {entry!r} is not in the vocabulary (tokenizer.json)")
            return tid
    tid = read_json(hf_dir / "config.json").get("mask_token_id")
    return tid if isinstance(tid, int) and not isinstance(tid, bool) else None


def read_vocab(hf_dir: Path, n_rows: int, embed_name: str = "model.embed_tokens.weight") -> Vocab:
    """Token list padded to the embedding's `n_rows` ([PAD{i}] typed UNUSED), token types, specials."""
    tok_path = hf_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise ConvertError(f"{tok_path}: tokenizer not found (the checkpoint needs tokenizer.json and tokenizer_config.json)")
    tok = read_json(tok_path)
    tok_config = read_json(hf_dir / "tokenizer_config.json")
    model = tok.get("model") or {}
    if model.get("type", "BPE") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ConvertError(f"{tok_path}: expected a byte-level BPE model, got {model.get('type')!r}")
    vocab: dict[str, int] = model["vocab"]
    added: list[dict] = tok.get("added_tokens") or []

    ids = list(vocab.values()) + [a.get("id") for a in added]
    if any(not isinstance(i, int) or i < 0 for i in ids):
        raise ConvertError(f"{tok_path}: token ids must be non-negative integers")
    size = max(ids, default=-1) + 1
    if size > n_rows:
        raise ConvertError(
            f"{tok_path}: vocabulary has {size} tokens but the embedding {embed_name} has only {n_rows} rows")

    tokens = [f"[PAD{i}]" for i in range(n_rows)]
    types = [gguf.TokenType.UNUSED] * n_rows
    for text, i in vocab.items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for a in added:
        text = a.get("content")
        if not isinstance(text, str) or not text:
            raise ConvertError(f"{tok_path}: added token {a.get('id')} has no content")
        special = a.get("special") or _looks_special(text)
        tokens[a["id"]] = text
        types[a["id"]] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED

    try:
        special = gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=n_rows)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        raise ConvertError(f"{tok_path}: cannot read merges or special tokens ({e})") from None
    if not special.merges:
        raise ConvertError(f"{tok_path}: no BPE merges found")
    mask_id = _find_mask(hf_dir, tok_config, vocab, added)
    if mask_id is not None:
        if mask_id >= n_rows:
            raise ConvertError(f"{hf_dir}: mask token id {mask_id} is outside the embedding ({n_rows} rows)")
        special.special_token_ids["mask"] = mask_id
    special.add_special_token.setdefault("bos", False)  # Qwen never prepends a BOS
    return Vocab(tokens, [int(t) for t in types], special, mask_id)
