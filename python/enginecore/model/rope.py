"""Rotary position embedding tables (default, linear, llama3 and LongRoPE scaling).

Computed in float32 with the same operations as transformers, so greedy
tokens match the reference bit for bit in float32.
"""

from __future__ import annotations

import math

import torch

from enginecore import _native
from enginecore.model.arch_config import LlamaArchConfig
from enginecore.model.fused_ops import NATIVE_DTYPES


def rope_inv_freq(cfg: LlamaArchConfig) -> torch.Tensor:
    dim = cfg.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    sc = cfg.rope_scaling
    if sc and sc["rope_type"] == "longrope":
        # The short factors: positions within original_max_position_embeddings.
        short = torch.tensor(sc["short_factor"], dtype=torch.float32)
        return 1.0 / (short * cfg.rope_theta**exponents)
    inv = 1.0 / (cfg.rope_theta**exponents)
    if not sc:
        return inv
    factor = float(sc["factor"])
    if sc["rope_type"] == "linear":
        return inv / factor
    low = float(sc.get("low_freq_factor", 1.0))
    high = float(sc.get("high_freq_factor", 4.0))
    old_ctx = float(sc.get("original_max_position_embeddings", 8192))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_attention_factor(cfg: LlamaArchConfig) -> float:
    """LongRoPE scales cos and sin (transformers' attention_factor); 1 otherwise."""
    sc = cfg.rope_scaling
    if not sc or sc["rope_type"] != "longrope":
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    original = float(sc["original_max_position_embeddings"])
    factor = sc.get("factor") or cfg.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_cos_sin(cfg: LlamaArchConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, rotary_dim] in float32 (halves repeated)."""
    inv = rope_inv_freq(cfg)
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = (inv[None, :, None] @ pos[None, None, :]).transpose(1, 2)[0]
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = rope_attention_factor(cfg)
    if factor != 1.0:
        return emb.cos() * factor, emb.sin() * factor
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, rotary_dim] already in x's dtype. With a
    partial rotary (rotary_dim < head_dim) the rest of each head passes through."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)
    half = rd // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class RotaryStep:
    """RoPE for one step's positions, for every layer: native (csrc/fused_ops.cpp
    ``rope``) rotates in place from the model-dtype tables, the same arithmetic
    and roundings as ``apply_rope``; the torch twin gathers the step's cos/sin
    rows once and calls ``apply_rope``."""

    def __init__(self, cos_table: torch.Tensor, sin_table: torch.Tensor,
                 positions: torch.Tensor) -> None:
        self.cos_table, self.sin_table, self.positions = cos_table, sin_table, positions
        self.ext = _native.extension()
        if (self.ext is None or cos_table.device.type != "cpu"
                or cos_table.dtype not in NATIVE_DTYPES or not cos_table.is_contiguous()
                or not sin_table.is_contiguous() or positions.dtype != torch.long):
            self.ext = None
            self.cos = cos_table.index_select(0, positions)
            self.sin = sin_table.index_select(0, positions)
        else:
            self.positions = positions.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] (may be a view of the fused qkv): rotated x (the
        first rotary_dim of each head; the rest passes through), the same tensor
        on the native path."""
        if self.ext is None or x.stride(-1) != 1 or x.dtype != self.cos_table.dtype:
            if self.ext is not None:  # a caller's odd layout: gather for the twin
                return apply_rope(x, self.cos_table.index_select(0, self.positions),
                                  self.sin_table.index_select(0, self.positions))
            return apply_rope(x, self.cos, self.sin)
        self.ext.rope(*rope_args(x, self.positions, self.cos_table, self.sin_table))
        return x


def rope_args(x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
              sin_table: torch.Tensor) -> tuple:
    """What ``_C.rope`` (and ``kernel_twins.rope_py``) take: x [T, heads, head_dim]
    rotated in place at int64 ``positions`` into the model-dtype tables; a table
    narrower than head_dim is a partial rotary (Phi-3)."""
    T, heads, _ = x.shape
    return (x.data_ptr(), x.stride(0), x.stride(1), positions.data_ptr(), cos_table.data_ptr(),
            sin_table.data_ptr(), cos_table.stride(0), T, heads, cos_table.shape[-1],
            NATIVE_DTYPES[x.dtype], torch.get_num_threads())
