"""Paged attention in torch: write the step's K/V into the cache by slot, then
attend over each request's cached prefix plus its new tokens.

Decode tokens (one query token per request) are attended in ONE batched call
over a padded gather of their contexts; prefill chunks (several query tokens)
are attended one request at a time, each as one call. The tables that drive
both are built once per step (``AttentionMetadata``) and shared by all layers.
Grouped-query attention folds the query heads of each KV head into the query
length, so K/V are never repeated.

A layer with a sliding window (Mistral, Gemma 2, ...) sees only the last
``sliding_window`` positions up to its own (key position > query position -
window, as transformers' mask); its masks are derived once per step and window.
``logits_soft_cap`` (Gemma 2) caps the scaled scores with cap * tanh(s / cap)
before the mask, which SDPA cannot do, so prefill then takes the explicit path.
The whole context stays in the cache either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # window -> (decode mask, prefill masks) with the window applied (built on first use).
    windowed: dict[int, tuple] = field(default_factory=dict)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Returns [T, H * D]."""
    T, H, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    # All new K/V of this layer land in the cache before any query reads it.
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    decode_mask, prefill_masks = meta.decode_mask, [p.mask for p in meta.prefills]
    if sliding_window is not None:
        decode_mask, prefill_masks = _windowed_masks(meta, sliding_window, G)
    if meta.all_decode:
        return _decode(q, k_cache, v_cache, meta.decode_slots, decode_mask, scale, Hkv, G,
                       logits_soft_cap).reshape(T, H * D)
    out = q.new_empty(T, H, D)
    if meta.decode_token_idx is not None:
        qd = q.index_select(0, meta.decode_token_idx)
        out.index_copy_(0, meta.decode_token_idx, _decode(
            qd, k_cache, v_cache, meta.decode_slots, decode_mask, scale, Hkv, G, logits_soft_cap))
    for p, mask in zip(meta.prefills, prefill_masks):
        n = p.end - p.start
        qh = q[p.start : p.end].view(n, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * n, D)
        kh = k_cache.index_select(0, p.ctx_slots).transpose(0, 1)
        vh = v_cache.index_select(0, p.ctx_slots).transpose(0, 1)
        if logits_soft_cap is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        else:
            o = _explicit(qh, kh, vh, mask, scale, logits_soft_cap)
        out[p.start : p.end] = o.view(Hkv, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
    return out.view(T, H * D)


def _explicit(q, k, v, mask, scale, soft_cap):
    """Attention with the scores in float32: scale, soft-cap, mask, softmax."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def _windowed_masks(meta: AttentionMetadata, window: int, G: int):
    cached = meta.windowed.get(window)
    if cached is not None:
        return cached
    decode_mask = meta.decode_mask
    if decode_mask is not None:  # [Bd, 1, 1, L]: context length = count of True
        ctx = decode_mask.sum(-1, keepdim=True)
        pos = torch.arange(decode_mask.shape[-1], device=decode_mask.device)
        decode_mask = decode_mask & (pos > ctx - 1 - window)
    prefill_masks = []
    for p in meta.prefills:  # queries are the last n of the ctx positions, G groups
        n, ctx = p.end - p.start, p.mask.shape[1]
        kpos = torch.arange(ctx, device=p.mask.device)
        qpos = kpos[ctx - n :]
        prefill_masks.append(p.mask & (kpos[None, :] > qpos[:, None] - window).repeat(G, 1))
    meta.windowed[window] = (decode_mask, prefill_masks)
    return decode_mask, prefill_masks


def _decode(q, k_cache, v_cache, slots, mask, scale, Hkv, G, soft_cap=None):
    Bd, H, D = q.shape
    L = slots.shape[1]
    kd = k_cache.index_select(0, slots.reshape(-1)).view(Bd, L, Hkv, D).transpose(1, 2)
    vd = v_cache.index_select(0, slots.reshape(-1)).view(Bd, L, Hkv, D).transpose(1, 2)
    # Plain batched matmuls: with G query rows per KV head, SDPA's CPU flash kernel
    # (built for long queries) took ~4x longer than this at batch 64 (profiled).
    return _explicit(q.view(Bd, Hkv, G, D), kd, vd, mask, scale, soft_cap).reshape(Bd, H, D)
