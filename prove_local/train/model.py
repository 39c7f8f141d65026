"""A Qwen2-architecture causal LM in plain torch, with Hugging Face Qwen2 parameter names.

RMSNorm, NEOX-style RoPE (rotate_half), grouped-query attention with q/k/v biases through
`F.scaled_dot_product_attention` with an explicit boolean mask and explicit position ids,
SwiGLU MLP, tied embeddings. Saved as `model.safetensors` + `config.json` so that the project's
converter (and Hugging Face) read it as `Qwen2ForCausalLM`.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Qwen2Config:
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def n_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = self.num_key_value_heads * self.head_dim
        layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
        return v * h + self.num_hidden_layers * layer + h + (0 if self.tie_word_embeddings else v * h)

    def to_hf(self, model_type: str = "qwen2") -> dict:
        d = asdict(self)
        d.update({
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": model_type,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
        })
        return d

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen2Config":
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: d[k] for k in names if k in d})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float):
    """cos/sin of shape [B, T, head_dim] for integer positions [B, T] (HF Qwen2 layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = position_ids.to(torch.float64)[..., None] * inv_freq  # [B, T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(torch.float32), emb.sin().to(torch.float32)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.nh * hd, bias=True)
        self.k_proj = nn.Linear(h, self.nkv * hd, bias=True)
        self.v_proj = nn.Linear(h, self.nkv * hd, bias=True)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)

    def forward(self, x, cos, sin, attn_mask):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        c, s = cos[:, None], sin[:, None]
        q = q * c + rotate_half(q) * s
        k = k * c + rotate_half(k) * s
        rep = self.nh // self.nkv
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if torch.is_autocast_enabled("cpu"):
            # Under CPU bf16 autocast, SDPA with an explicit mask takes a slow path: run it in f32.
            with torch.autocast("cpu", enabled=False):
                y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=attn_mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attn_mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Inner(nn.Module):
    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def causal_mask(T: int) -> torch.Tensor:
    """Boolean [T, T] mask, True where attention is allowed (j <= i)."""
    return torch.ones(T, T, dtype=torch.bool).tril()


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.config = cfg
        self.model = Qwen2Inner(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(self._init)
        # GPT-2 style scaled init of the residual output projections.
        for layer in self.model.layers:
            std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
            nn.init.normal_(layer.self_attn.o_proj.weight, std=std)
            nn.init.normal_(layer.mlp.down_proj.weight, std=std)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def hidden(self, input_ids, position_ids=None, attn_mask=None):
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T).expand(B, T)
        if attn_mask is None:
            attn_mask = causal_mask(T)
        if attn_mask.dim() == 2:
            attn_mask = attn_mask[None, None]
        elif attn_mask.dim() == 3:
            attn_mask = attn_mask[:, None]
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn_mask)
        return self.model.norm(x)

    def logits(self, h):
        w = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return h @ w.t()

    def forward(self, input_ids, position_ids=None, attn_mask=None):
        """Logits [B, T, V]. attn_mask: bool [T,T], [B,T,T] or [B,1,T,T], True = may attend."""
        return self.logits(self.hidden(input_ids, position_ids, attn_mask))


def save_hf(model: Qwen2ForCausalLM, out_dir: str | os.PathLike, model_type: str = "qwen2",
            extra_config: dict | None = None) -> None:
    """Write model.safetensors + config.json (+ generation_config.json) into out_dir."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_hf(model_type)
    if extra_config:
        cfg.update(extra_config)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def load_hf(path: str | os.PathLike) -> Qwen2ForCausalLM:
    from safetensors.torch import load_file

    p = Path(path)
    cfg = Qwen2Config.from_hf(json.loads((p / "config.json").read_text()))
    model = Qwen2ForCausalLM(cfg)
    model.load_state_dict(load_file(str(p / "model.safetensors")), strict=True)
    return model
