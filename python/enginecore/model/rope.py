"""Rotary position embedding tables (default, linear and llama3 scaling).

Computed in float32 with the same operations as transformers, so greedy
tokens match the reference bit for bit in float32.
"""

from __future__ import annotations

import math

import torch

from enginecore import _native
from enginecore.model.fused_ops import NATIVE_DTYPES
from enginecore.model.arch_config import LlamaArchConfig


def rope_inv_freq(cfg: LlamaArchConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling
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


def rope_cos_sin(cfg: LlamaArchConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, head_dim] in float32 (halves repeated)."""
    inv = rope_inv_freq(cfg)
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = (inv[None, :, None] @ pos[None, None, :]).transpose(1, 2)[0]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim] already in x's dtype."""
    half = x.shape[-1] // 2
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
        """x [T, heads, head_dim] (may be a view of the fused qkv): rotated x,
        the same tensor on the native path."""
        if self.ext is None or x.stride(-1) != 1 or x.dtype != self.cos_table.dtype:
            if self.ext is not None:  # a caller's odd layout: gather for the twin
                return apply_rope(x, self.cos_table.index_select(0, self.positions),
                                  self.sin_table.index_select(0, self.positions))
            return apply_rope(x, self.cos, self.sin)
        T, heads, dim = x.shape
        self.ext.rope(x.data_ptr(), x.stride(0), x.stride(1), self.positions.data_ptr(),
                      self.cos_table.data_ptr(), self.sin_table.data_ptr(),
                      self.cos_table.stride(0), T, heads, dim, NATIVE_DTYPES[x.dtype],
                      torch.get_num_threads())
        return x
