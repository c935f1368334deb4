"""Paged attention in torch: write the step's K/V into the cache by slot, then
attend over each request's cached prefix plus its new tokens.

Decode tokens (one query token per request) are attended in ONE batched call
over a padded gather of their contexts; prefill chunks (several query tokens)
are attended one request at a time, each as one call. The tables that drive
both are built once per step (``AttentionMetadata``) and shared by all layers.
Grouped-query attention folds the query heads of each KV head into the query
length, so K/V are never repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillPiece:
    start: int  # first query token in the flat batch
    end: int
    # Slots of the whole context (cached prefix + this chunk) in the flat cache.
    ctx_slots: torch.Tensor
    # [group * n, ctx] bool: query (head-group-major) may attend context position.
    mask: torch.Tensor


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot of each new token
    num_tokens: int
    decode_token_idx: torch.Tensor | None  # [Bd] positions in the flat batch
    decode_slots: torch.Tensor | None  # [Bd, Ld] context slots, padded
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Ld] True = attend
    all_decode: bool
    prefills: list[PrefillPiece]


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Returns [T, H * D]."""
    T, H, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    # All new K/V of this layer land in the cache before any query reads it.
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if meta.all_decode:
        return _decode(q, k_cache, v_cache, meta, scale, Hkv, G).reshape(T, H * D)
    out = q.new_empty(T, H, D)
    if meta.decode_token_idx is not None:
        qd = q.index_select(0, meta.decode_token_idx)
        out.index_copy_(0, meta.decode_token_idx, _decode(qd, k_cache, v_cache, meta, scale, Hkv, G))
    for p in meta.prefills:
        n = p.end - p.start
        qh = q[p.start : p.end].view(n, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * n, D)
        kh = k_cache.index_select(0, p.ctx_slots).transpose(0, 1)
        vh = v_cache.index_select(0, p.ctx_slots).transpose(0, 1)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=p.mask, scale=scale)
        out[p.start : p.end] = o.view(Hkv, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
    return out.view(T, H * D)


def _decode(q, k_cache, v_cache, meta, scale, Hkv, G):
    Bd, H, D = q.shape
    slots = meta.decode_slots
    L = slots.shape[1]
    kd = k_cache.index_select(0, slots.reshape(-1)).view(Bd, L, Hkv, D).transpose(1, 2)
    vd = v_cache.index_select(0, slots.reshape(-1)).view(Bd, L, Hkv, D).transpose(1, 2)
    # Plain batched matmuls: with G query rows per KV head, SDPA's CPU flash kernel
    # (built for long queries) took ~4x longer than this at batch 64 (profiled).
    scores = torch.matmul(q.view(Bd, Hkv, G, D), kd.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~meta.decode_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(vd.dtype)
    return torch.matmul(probs, vd).reshape(Bd, H, D)
