"""Paged attention: write the step's K/V into the cache by slot, then attend
each sequence's query tokens over its cached prefix plus its new tokens.

One layout describes a step for every layer (``AttentionMetadata``): the
sequences' query tokens are contiguous in the flat batch (``query_start_loc``),
each has a context length after this step (``seq_lens``) and a block table.
Query token ``i`` of a sequence with ``n`` new tokens sits at position
``seq_len - n + i`` and sees positions ``<=`` its own (and, with a sliding
window ``W``, only the last ``W`` of them).

Two implementations behind one switch (``enginecore._native``):
- native (csrc/paged_attention.cpp): one call per layer writes the cache and
  reads K/V in place through the block table, grouped-query heads sharing
  each K/V row, an online softmax; float32 and bfloat16 on the CPU.
- torch (``paged_attention_torch``, the twin; also CUDA and float16): decode
  tokens in ONE batched call over a padded gather of their contexts, prefill
  chunks one call each. GQA folds the query heads of each KV head into the
  query length, so K/V are never repeated.
On the CPU both compute scores, softmax and the weighted sum of V in float64
(bf16 and float32 widen exactly) and round once, to float32 and then the model
dtype: the orders differ, but only by ~1e-16, so the outputs are the same bits
(a float32 rounding tie within that distance is ~1e-8 likely per value) and
native and twin tokens are identical. On CUDA the twin keeps the model dtype.

``sliding_window`` and ``logits_soft_cap`` (``cap * tanh(scores / cap)``,
applied after scaling) are supported by both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from enginecore import _native
from enginecore.model.fused_ops import NATIVE_DTYPES


@dataclass
class PrefillPiece:
    start: int  # first query token in the flat batch
    end: int
    # Slots of the whole context (cached prefix + this chunk) in the flat cache.
    ctx_slots: torch.Tensor
    # [group * n, ctx] bool: query (head-group-major) may attend context position.
    mask: torch.Tensor


@dataclass
class TorchTables:
    """The twin's gather tables for one step (and one sliding window)."""

    decode_token_idx: torch.Tensor | None  # [Bd] positions in the flat batch
    decode_slots: torch.Tensor | None  # [Bd, Ld] context slots, padded with the scratch slot
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Ld] True = attend
    all_decode: bool
    prefills: list[PrefillPiece]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64 slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32 context length including this step's tokens
    block_table: torch.Tensor  # [B, max_blocks] int32, padded with the scratch block
    block_size: int
    scratch_slot: int  # a zeroed slot: what padded reads of the twin see
    num_tokens: int
    # numpy views of the same tables (the twin builds its gathers from them)
    query_start_np: np.ndarray = field(repr=False, default=None)
    seq_lens_np: np.ndarray = field(repr=False, default=None)
    block_table_np: np.ndarray = field(repr=False, default=None)
    _tables: dict = field(repr=False, default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_np)

    def torch_tables(self, group: int, sliding_window: int | None) -> TorchTables:
        key = (group, sliding_window)
        tables = self._tables.get(key)
        if tables is None:
            tables = self._tables[key] = _build_torch_tables(self, group, sliding_window)
        return tables


def make_attention_metadata(slot_mapping: np.ndarray, query_start_loc: np.ndarray,
                            seq_lens: np.ndarray, block_table: np.ndarray, block_size: int,
                            scratch_slot: int, device: torch.device) -> AttentionMetadata:
    """numpy tables -> metadata (the tensors share the arrays' memory on the CPU)."""
    qs = np.ascontiguousarray(query_start_loc, dtype=np.int32)
    sl = np.ascontiguousarray(seq_lens, dtype=np.int32)
    bt = np.ascontiguousarray(block_table, dtype=np.int32)
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(
            np.ascontiguousarray(slot_mapping, dtype=np.int64)).to(device),
        query_start_loc=torch.from_numpy(qs).to(device),
        seq_lens=torch.from_numpy(sl).to(device),
        block_table=torch.from_numpy(bt).to(device),
        block_size=block_size, scratch_slot=scratch_slot, num_tokens=int(qs[-1]),
        query_start_np=qs, seq_lens_np=sl, block_table_np=bt)


def native_attention_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in NATIVE_DTYPES and k_cache.dtype == q.dtype
            and q.stride(-1) == 1 and k_cache.is_contiguous())


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
    ext = _native.extension()
    if ext is not None and native_attention_supported(q, k_cache):
        return paged_attention_native(ext, q, k, v, k_cache, v_cache, meta, scale,
                                      sliding_window, logits_soft_cap)
    return paged_attention_torch(q, k, v, k_cache, v_cache, meta, scale, sliding_window,
                                 logits_soft_cap)


def paged_attention_native(ext, q, k, v, k_cache, v_cache, meta, scale, sliding_window=None,
                           logits_soft_cap=None) -> torch.Tensor:
    T, H, D = q.shape
    out = q.new_empty(T, H, D)
    ext.paged_attention(*paged_attention_args(out, q, k, v, k_cache, v_cache, meta, scale,
                                              sliding_window, logits_soft_cap))
    return out.view(T, H * D)


def paged_attention_args(out, q, k, v, k_cache, v_cache, meta, scale, sliding_window=None,
                         logits_soft_cap=None) -> tuple:
    """What ``_C.paged_attention`` (and its twin ``kernel_twins.paged_attention_py``)
    take for these tensors: addresses, strides in elements, sizes."""
    T, H, D = q.shape
    if k is not None:
        assert k.stride(-1) == 1 and v.stride(-1) == 1 and meta.slot_mapping.is_contiguous()
    return (
        out.data_ptr(), out.stride(0), out.stride(1), q.data_ptr(), q.stride(0), q.stride(1),
        0 if k is None else k.data_ptr(), 0 if k is None else k.stride(0),
        0 if k is None else k.stride(1), 0 if v is None else v.data_ptr(),
        0 if v is None else v.stride(0), 0 if v is None else v.stride(1),
        meta.slot_mapping.data_ptr(), T, k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), k_cache.stride(1), meta.block_table.data_ptr(),
        meta.block_table.stride(0), meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(),
        meta.num_seqs, H, k_cache.shape[1], D, meta.block_size, NATIVE_DTYPES[q.dtype],
        float(scale), float(logits_soft_cap or 0.0), int(sliding_window or 0),
        torch.get_num_threads())


def paged_attention_torch(q, k, v, k_cache, v_cache, meta, scale, sliding_window=None,
                          logits_soft_cap=None) -> torch.Tensor:
    """The twin: gathers each context's K/V by slot, attends with torch ops."""
    T, H, D = q.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    # All new K/V of this layer land in the cache before any query reads it.
    if k is not None:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
    tables = meta.torch_tables(G, sliding_window)
    if tables.all_decode:
        return _decode(q, k_cache, v_cache, tables, scale, Hkv, G,
                       logits_soft_cap).reshape(T, H * D)
    out = q.new_empty(T, H, D)
    if tables.decode_token_idx is not None:
        qd = q.index_select(0, tables.decode_token_idx)
        out.index_copy_(0, tables.decode_token_idx,
                        _decode(qd, k_cache, v_cache, tables, scale, Hkv, G, logits_soft_cap))
    for p in tables.prefills:
        n = p.end - p.start
        qh = q[p.start : p.end].view(n, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * n, D)
        kh = k_cache.index_select(0, p.ctx_slots).transpose(0, 1)
        vh = v_cache.index_select(0, p.ctx_slots).transpose(0, 1)
        if q.device.type == "cpu":
            o = attend_f64(qh, kh, vh, p.mask, scale, logits_soft_cap)
        elif soft_cap_on(logits_soft_cap):
            scores = _soft_cap(torch.matmul(qh, kh.transpose(-1, -2)).float() * scale,
                               logits_soft_cap)
            probs = torch.softmax(scores.masked_fill(~p.mask, float("-inf")), dim=-1)
            o = torch.matmul(probs.to(vh.dtype), vh)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=p.mask, scale=scale)
        out[p.start : p.end] = o.view(Hkv, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
    return out.view(T, H * D)


def _soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(scores / cap) * cap


def soft_cap_on(cap: float | None) -> bool:
    """Whether a logit soft cap applies: a positive one (the kernel ignores <= 0 and NaN)."""
    return cap is not None and cap > 0


# exp of anything below this is 0 in the kernel (exp_f64: doubles go subnormal there).
_EXP_FLOOR = -708.0


def attend_f64(q, k, v, mask, scale, logits_soft_cap=None) -> torch.Tensor:
    """softmax(q k^T * scale (capped), masked) v in float64, rounded to float32 and
    then q's dtype: the native kernel's arithmetic up to the order of its sums, and
    its edges: a visible NaN score or a row with nothing visible gives NaN (torch's
    softmax does too), exp below -708 is 0, and a position whose weight is 0 adds
    nothing even where its V is inf or NaN (0 * NaN would poison the row)."""
    scores = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    if soft_cap_on(logits_soft_cap):
        scores = _soft_cap(scores, logits_soft_cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    shifted = scores - scores.amax(-1, keepdim=True)
    weights = torch.exp(shifted).masked_fill(shifted < _EXP_FLOOR, 0.0)
    # Normalised as the kernel does, the weighted sum times 1 / (sum of weights): with
    # equal weights (a single position, equal scores) the sum is exact in float64 and
    # both sides give the same bits even where it sits on a float32 tie.
    inv = 1.0 / weights.sum(-1, keepdim=True)
    v = v.double()
    finite = v.isfinite()
    if bool(finite.all()):
        return (torch.matmul(weights, v) * inv).float().to(q.dtype)
    out = torch.matmul(weights, torch.where(finite, v, 0.0)) * inv
    # What the V rows with inf / NaN make of the rows that see them (weight > 0).
    seen = (weights > 0).double()
    nan = torch.matmul(seen, v.isnan().double()) > 0
    pos = torch.matmul(seen, (v == float("inf")).double()) > 0
    neg = torch.matmul(seen, (v == float("-inf")).double()) > 0
    out = torch.where(pos, float("inf"), out)
    out = torch.where(neg, float("-inf"), out)
    out = torch.where(nan | (pos & neg) | out.isnan(), float("nan"), out)
    return out.float().to(q.dtype)


def _decode(q, k_cache, v_cache, tables: TorchTables, scale, Hkv, G, logits_soft_cap=None):
    Bd, H, D = q.shape
    slots = tables.decode_slots
    L = slots.shape[1]
    kd = k_cache.index_select(0, slots.reshape(-1)).view(Bd, L, Hkv, D).transpose(1, 2)
    vd = v_cache.index_select(0, slots.reshape(-1)).view(Bd, L, Hkv, D).transpose(1, 2)
    if q.device.type == "cpu":
        return attend_f64(q.view(Bd, Hkv, G, D), kd, vd, tables.decode_mask, scale,
                           logits_soft_cap).reshape(Bd, H, D)
    # Plain batched matmuls: with G query rows per KV head, SDPA's CPU flash kernel
    # (built for long queries) took ~4x longer than this at batch 64 (profiled).
    scores = torch.matmul(q.view(Bd, Hkv, G, D), kd.transpose(-1, -2)).float() * scale
    if soft_cap_on(logits_soft_cap):
        scores = _soft_cap(scores, logits_soft_cap)
    scores = scores.masked_fill(~tables.decode_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(vd.dtype)
    return torch.matmul(probs, vd).reshape(Bd, H, D)


def _build_torch_tables(meta: AttentionMetadata, G: int, window: int | None) -> TorchTables:
    qs, sl, bt, bs = meta.query_start_np, meta.seq_lens_np, meta.block_table_np, meta.block_size
    dev = meta.slot_mapping.device
    qlen = np.diff(qs)
    dec = np.flatnonzero(qlen == 1)
    decode_token_idx = decode_slots = decode_mask = None
    if len(dec):
        ctx = sl[dec].astype(np.int64)
        L = int(ctx.max())
        ar = np.arange(L)
        table = bt[dec][:, ar // bs].astype(np.int64)
        visible = ar[None, :] < ctx[:, None]
        if window:
            visible &= ar[None, :] > (ctx[:, None] - 1 - window)
        # Positions a query must not see read the zeroed scratch slot, not the
        # unwritten tail of its last block: the cache is torch.empty, and a NaN
        # there survives the mask (0 * NaN) and poisons the whole row.
        dslots = np.where(visible, table * bs + ar % bs, meta.scratch_slot)
        decode_slots = torch.from_numpy(np.ascontiguousarray(dslots)).to(dev)
        decode_mask = torch.from_numpy(visible).view(len(dec), 1, 1, L).to(dev)
        decode_token_idx = torch.from_numpy(qs[dec].astype(np.int64)).to(dev)
    prefills = []
    for s in np.flatnonzero(qlen > 1):
        n, c = int(qlen[s]), int(sl[s])
        pos = np.arange(c)
        ctx_slots = bt[s, pos // bs].astype(np.int64) * bs + pos % bs
        q_pos = np.arange(c - n, c)
        mask = pos[None, :] <= q_pos[:, None]
        if window:
            mask &= pos[None, :] > (q_pos[:, None] - window)
        prefills.append(PrefillPiece(int(qs[s]), int(qs[s + 1]),
                                     torch.from_numpy(ctx_slots).to(dev),
                                     torch.from_numpy(mask).repeat(G, 1).to(dev)))
    return TorchTables(decode_token_idx, decode_slots, decode_mask, len(dec) == len(qlen),
                       prefills)
