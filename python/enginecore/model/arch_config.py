"""The architecture facts of a Llama-family decoder, read from an HF config.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> whether q/k/v carry a bias by construction.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class LlamaArchConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that this module (and transformers) reads back."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        return {
            "architectures": [self.architecture],
            "model_type": {"Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}.get(
                self.architecture, "llama"),
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1
            else self.eos_token_ids,
            "hidden_act": "silu",
        }


def load_arch_config(model_dir: str) -> LlamaArchConfig:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{model_dir} has no config.json: not an HF model directory") from None
    return arch_config_from_hf(cfg, source=path)


def arch_config_from_hf(cfg: dict[str, Any], source: str = "config.json") -> LlamaArchConfig:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r} in {source}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} in {source}; need silu")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or None
    if scaling:
        rope.update(scaling)
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r} in {source}; supported: {SUPPORTED_ROPE_TYPES}"
        )
    rope["rope_type"] = rope_type
    eos = cfg.get("eos_token_id")
    eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    qkv_bias = SUPPORTED_ARCHITECTURES[arch] or bool(cfg.get("attention_bias", False))
    return LlamaArchConfig(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(cfg["vocab_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=rope if rope_type != "default" else None,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
    )
