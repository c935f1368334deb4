"""Qwen2-VL's vision encoder (transformers' ``Qwen2VisionTransformerPretrainedModel``).

An image arrives from the HF image processor as flattened patches
``pixel_values [t*h*w, C * temporal_patch_size * patch_size**2]`` and its grid
``(t, h, w)`` in patches; the processor already orders the patches so that each
``spatial_merge_size**2`` neighbours sit next to each other. The encoder:

- patch embed: a Conv3d whose kernel equals its stride (one output per patch);
- ``depth`` pre-norm blocks (LayerNorm, attention with a 2D rotary over the
  patch's row and column, MLP), attention confined to one frame of one image;
- the patch merger: LayerNorm, then each 2x2 group of neighbours concatenated
  and projected by a two-layer GELU MLP to the language model's width.

Output: ``t*h*w / spatial_merge_size**2`` embeddings per image, one per
``<|image_pad|>`` placeholder. Computed with the same ops (and float32 rotary)
as transformers, so float32 outputs match it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from enginecore.model.linear import Linear, packing_enabled


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


VISION_ACTIVATIONS = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}
LAYER_NORM_EPS = 1e-6  # transformers hard-codes it for the blocks and the merger


@dataclass
class Qwen2VisionConfig:
    depth: int = 32
    embed_dim: int = 1280
    hidden_size: int = 3584  # the language model's width: the merger's output
    hidden_act: str = "quick_gelu"
    mlp_ratio: float = 4.0
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Qwen2VisionConfig:
        rope = d.get("rope_parameters") or {}
        cfg = cls(**{k: d[k] for k in ("depth", "embed_dim", "hidden_size", "hidden_act",
                                        "mlp_ratio", "num_heads", "in_channels", "patch_size",
                                        "spatial_merge_size", "temporal_patch_size") if k in d},
                  rope_theta=float(rope.get("rope_theta", 10000.0)))
        if cfg.hidden_act not in VISION_ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {cfg.hidden_act!r}; supported: "
                             f"{sorted(VISION_ACTIVATIONS)}")
        if cfg.embed_dim % cfg.num_heads or (cfg.embed_dim // cfg.num_heads) % 4:
            raise ValueError(f"vision embed_dim {cfg.embed_dim} / num_heads {cfg.num_heads} must "
                             "be a multiple of 4 (the 2D rotary splits each head in quarters)")
        return cfg

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch (what the processor emits per row)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


class VisionBlock:
    __slots__ = ("norm1_w", "norm1_b", "qkv", "proj", "norm2_w", "norm2_b", "fc1", "fc2")


def vision_position_ids(grid_thw: Sequence[Sequence[int]], merge: int) -> torch.Tensor:
    """(row, column) of every patch [patches, 2], in the processor's order: the
    merge x merge neighbours of each merged token together, frames repeated."""
    out = []
    for t, h, w in grid_thw:
        hpos = torch.arange(h)[:, None].expand(h, w)
        wpos = torch.arange(w)[None, :].expand(h, w)
        shape = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(shape).transpose(1, 2).flatten()
        wpos = wpos.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    return torch.cat(out)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Qwen2VisionEncoder:
    def __init__(self, cfg: Qwen2VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.pack = packing_enabled(dtype, device)
        self.act = VISION_ACTIVATIONS[cfg.hidden_act]
        self.scale = cfg.head_dim**-0.5
        spatial = cfg.head_dim // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (
            torch.arange(0, spatial, 2, dtype=torch.float) / spatial)).to(device)
        self.patch_w: torch.Tensor | None = None  # Conv3d weight [E, C, tp, p, p]
        self.blocks: list[VisionBlock] = []
        self.merger_ln_w = self.merger_ln_b = None
        self.merger_fc1: Linear | None = None
        self.merger_fc2: Linear | None = None

    # -- weights ---------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Tensors named as under transformers' ``visual.`` prefix
        (``blocks.0.attn.qkv.weight``)."""
        cfg = self.cfg
        parts: dict[str, torch.Tensor] = {}
        for name, t in weights:
            parts[name] = t.to(device=self.device, dtype=self.dtype)

        def take(key: str) -> torch.Tensor:
            try:
                return parts.pop(key)
            except KeyError:
                raise ValueError(f"checkpoint lacks visual.{key}") from None

        self.patch_w = take("patch_embed.proj.weight")
        want = (cfg.embed_dim, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                cfg.patch_size)
        if tuple(self.patch_w.shape) != want:
            raise ValueError(f"visual.patch_embed.proj.weight is {tuple(self.patch_w.shape)}, "
                             f"the vision config says {want}")
        self.blocks = []
        for i in range(cfg.depth):
            pre = f"blocks.{i}."
            b = VisionBlock()
            b.norm1_w, b.norm1_b = take(pre + "norm1.weight"), take(pre + "norm1.bias")
            b.norm2_w, b.norm2_b = take(pre + "norm2.weight"), take(pre + "norm2.bias")
            b.qkv = Linear(take(pre + "attn.qkv.weight"), take(pre + "attn.qkv.bias"), self.pack)
            b.proj = Linear(take(pre + "attn.proj.weight"), take(pre + "attn.proj.bias"),
                            self.pack)
            b.fc1 = Linear(take(pre + "mlp.fc1.weight"), take(pre + "mlp.fc1.bias"), self.pack)
            b.fc2 = Linear(take(pre + "mlp.fc2.weight"), take(pre + "mlp.fc2.bias"), self.pack)
            self.blocks.append(b)
        self.merger_ln_w, self.merger_ln_b = take("merger.ln_q.weight"), take("merger.ln_q.bias")
        self.merger_fc1 = Linear(take("merger.mlp.0.weight"), take("merger.mlp.0.bias"), self.pack)
        self.merger_fc2 = Linear(take("merger.mlp.2.weight"), take("merger.mlp.2.bias"), self.pack)
        if parts:
            raise ValueError(f"unexpected vision weights: {sorted('visual.' + k for k in parts)}")

    def weight_bytes(self) -> int:
        linears = [self.merger_fc1, self.merger_fc2] + [
            getattr(b, n) for b in self.blocks for n in ("qkv", "proj", "fc1", "fc2")]
        norms = [self.merger_ln_w, self.merger_ln_b] + [
            getattr(b, n) for b in self.blocks
            for n in ("norm1_w", "norm1_b", "norm2_w", "norm2_b")]
        return (sum(x.nbytes() for x in linears) + sum(t.numel() * t.element_size() for t in norms)
                + self.patch_w.numel() * self.patch_w.element_size())

    def to_device(self, device: torch.device) -> None:
        self.patch_w = self.patch_w.to(device)
        for b in self.blocks:
            for name in VisionBlock.__slots__:
                setattr(b, name, getattr(b, name).to(device))
        for name in ("merger_ln_w", "merger_ln_b", "merger_fc1", "merger_fc2"):
            setattr(self, name, getattr(self, name).to(device))
        self.inv_freq = self.inv_freq.to(device)
        self.device = device

    # -- forward -----------------------------------------------------------------------
    def tokens_per_image(self, grid_thw: Sequence[int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.cfg.spatial_merge_size**2

    def check_grid(self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]]) -> None:
        cfg, m = self.cfg, self.cfg.spatial_merge_size
        for t, h, w in grid_thw:
            if t < 1 or h < 1 or w < 1 or h % m or w % m:
                raise ValueError(f"image grid {(t, h, w)} is not a positive multiple of the "
                                 f"spatial merge size {m}")
        patches = sum(t * h * w for t, h, w in grid_thw)
        if pixel_values.dim() != 2 or tuple(pixel_values.shape) != (patches, cfg.patch_dim):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not match the grids "
                             f"{list(map(tuple, grid_thw))}: expected ({patches}, {cfg.patch_dim})")

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor,
                grid_thw: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """pixel_values [patches, patch_dim] of one or more images, their grids
        [(t, h, w), ...]: one [tokens_i, hidden_size] embedding tensor per image."""
        cfg = self.cfg
        grid_thw = [tuple(int(v) for v in g) for g in grid_thw]
        self.check_grid(pixel_values, grid_thw)
        x = pixel_values.to(device=self.device, dtype=self.dtype)
        x = x.view(-1, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        x = F.conv3d(x, self.patch_w, stride=self.patch_w.shape[2:]).view(-1, cfg.embed_dim)
        cos, sin = self._rotary(grid_thw)
        frames = [(t, h * w) for t, h, w in grid_thw]
        E = cfg.embed_dim
        for b in self.blocks:
            y = F.layer_norm(x, (E,), b.norm1_w, b.norm1_b, LAYER_NORM_EPS)
            x = x + b.proj(self._attention(b.qkv(y), cos, sin, frames))
            y = F.layer_norm(x, (E,), b.norm2_w, b.norm2_b, LAYER_NORM_EPS)
            x = x + b.fc2(self.act(b.fc1(y)))
        x = F.layer_norm(x, (E,), self.merger_ln_w, self.merger_ln_b, LAYER_NORM_EPS)
        x = x.view(-1, E * cfg.spatial_merge_size**2)
        x = self.merger_fc2(F.gelu(self.merger_fc1(x)))
        return list(x.split([self.tokens_per_image(g) for g in grid_thw]))

    def _rotary(self, grid_thw) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [patches, head_dim] in float32: a quarter of the head each for the
        row and the column frequencies, the halves repeated."""
        pos = vision_position_ids(grid_thw, self.cfg.spatial_merge_size).to(self.device)
        freqs = pos[..., None].float() * self.inv_freq  # [N, 2, head_dim / 4]
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat([cos[:, 0], cos[:, 1]], dim=-1)
        sin = torch.cat([sin[:, 0], sin[:, 1]], dim=-1)
        return torch.cat([cos, cos], dim=-1)[:, None], torch.cat([sin, sin], dim=-1)[:, None]

    def _attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   frames: list[tuple[int, int]]) -> torch.Tensor:
        """Bidirectional attention within each frame of each image: [N, embed_dim]."""
        N = qkv.shape[0]
        H = self.cfg.num_heads
        q, k, v = qkv.view(N, 3, H, -1).permute(1, 0, 2, 3).unbind(0)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(qkv.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(qkv.dtype)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, N, D]
        outs = []
        start = 0
        for t, n in frames:  # the frames of one image share a length: one batched call
            end = start + t * n
            qs, ks, vs = (x[:, start:end].unflatten(1, (t, n)).transpose(0, 1)
                          for x in (q, k, v))  # [t, H, n, D]
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=self.scale)
            outs.append(o.transpose(1, 2).reshape(t * n, -1))
            start = end
        return torch.cat(outs) if len(outs) > 1 else outs[0]
