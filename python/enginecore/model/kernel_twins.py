"""The Python twins of the CPU model kernels, at the kernels' own boundary.

Each ``name_py`` takes exactly what ``_C.name`` takes (buffer addresses, strides,
sizes, a dtype code, a thread count), views that memory as torch tensors and does
the work with the tensor-level references (``*_torch`` in attention.py, fused_ops.py,
rope.py, sampler.py), writing where the kernel writes. So ``_C.name(**args)`` and
``name_py(**args)`` can be run on the same buffers and compared, and a room that
marshals tensors for ``_C`` calls the tensor-level reference directly on the Python
path (it also covers CUDA and float16, which have no raw twin).

Addresses are host memory the caller owns for the duration of the call, as for the
kernels. ``num_threads`` is taken for the signature; torch splits work itself.
"""

from __future__ import annotations

import ctypes

import torch

from enginecore import _native
from enginecore.loaded_libraries import loaded_library_path
from enginecore.model.attention import attend_f64
from enginecore.model.cpu_flags import cpu_flags
from enginecore.model.fused_ops import rms_norm_torch, silu_and_mul_torch
from enginecore.model.linear import (
    PANEL,
    bf16_gemv_torch,
    bf16_linear_torch,
    gemv_cpu_supported,
    unpack_panels,
)
from enginecore.model.rope import apply_rope
from enginecore.model.sampler import logprob_rows_torch, sample_rows_torch, top_p_rows_torch

# The kernels' dtype codes (csrc/cpu_kernels.h DType).
_DTYPES = {0: torch.float32, 1: torch.bfloat16}


def _dtype(code: int, kernel: str) -> torch.dtype:
    try:
        return _DTYPES[code]
    except (KeyError, TypeError):
        raise ValueError(f"{kernel}: dtype must be float32 or bfloat16") from None


def _view(addr: int, dtype: torch.dtype, shape: tuple[int, ...],
          strides: tuple[int, ...]) -> torch.Tensor:
    """The memory at ``addr`` as a tensor of ``shape`` and ``strides`` (elements)."""
    if any(n <= 0 for n in shape):
        return torch.empty(tuple(max(n, 0) for n in shape), dtype=dtype)
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
    raw = (ctypes.c_char * (extent * dtype.itemsize)).from_address(addr)
    return torch.frombuffer(raw, dtype=dtype, count=extent).as_strided(shape, strides)


def paged_attention_py(out: int, out_st: int, out_sh: int, q: int, q_st: int, q_sh: int,
                       k_new: int, k_st: int, k_sh: int, v_new: int, v_st: int, v_sh: int,
                       slot_mapping: int, num_tokens: int, k_cache: int, v_cache: int,
                       c_ss: int, c_sh: int, block_table: int, bt_stride: int,
                       query_start: int, seq_lens: int, num_seqs: int, num_heads: int,
                       num_kv_heads: int, head_dim: int, block_size: int, dtype: int,
                       scale: float, soft_cap: float, sliding_window: int,
                       num_threads: int) -> None:
    """The twin of ``_C.paged_attention``: write the step's K/V into the paged cache
    (``k_new == 0``: skip), then attend every sequence's query tokens over its
    context (causal, optional sliding window and logit soft cap), in float64 rounded
    once to float32 and the model dtype, as the kernel: the same bits."""
    dt = _dtype(dtype, "paged_attention")
    if (num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads != 0 or head_dim <= 0
            or block_size <= 0 or num_seqs < 0):
        raise ValueError("paged_attention: bad head or block sizes")
    hkv, group, d, bs = num_kv_heads, num_heads // num_kv_heads, head_dim, block_size
    qs = _view(query_start, torch.int32, (num_seqs + 1,), (1,)).tolist()
    lens = _view(seq_lens, torch.int32, (num_seqs,), (1,)).tolist()
    if any(qs[s + 1] - qs[s] < 0 or lens[s] < qs[s + 1] - qs[s] for s in range(num_seqs)):
        raise ValueError(
            "paged_attention: a sequence has fewer context positions than query tokens")
    width = max(((n + bs - 1) // bs for n in lens), default=0)
    table = _view(block_table, torch.int32, (num_seqs, width), (bt_stride, 1)).long()
    slots = _view(slot_mapping, torch.int64, (num_tokens,), (1,))
    # The cache is as long as the furthest slot this call touches.
    used = [int(slots.max()) if k_new and num_tokens else -1]
    used += [int(table[s, : (n + bs - 1) // bs].max()) * bs + bs - 1
             for s, n in enumerate(lens) if n > 0]
    cache_shape, cache_strides = (max(used) + 1, hkv, d), (c_ss, c_sh, 1)
    kc = _view(k_cache, dt, cache_shape, cache_strides)
    vc = _view(v_cache, dt, cache_shape, cache_strides)
    if k_new:
        keep = (slots >= 0).nonzero().flatten()  # a negative slot is padding
        kc.index_copy_(0, slots[keep], _view(k_new, dt, (num_tokens, hkv, d),
                                             (k_st, k_sh, 1)).index_select(0, keep))
        vc.index_copy_(0, slots[keep], _view(v_new, dt, (num_tokens, hkv, d),
                                             (v_st, v_sh, 1)).index_select(0, keep))
    total = qs[-1] if num_seqs else 0
    q_all = _view(q, dt, (total, num_heads, d), (q_st, q_sh, 1))
    out_all = _view(out, dt, (total, num_heads, d), (out_st, out_sh, 1))
    for s in range(num_seqs):
        start, end, ctx = qs[s], qs[s + 1], lens[s]
        n = end - start
        if n <= 0:
            continue
        pos = torch.arange(ctx)
        ctx_slots = table[s, pos // bs] * bs + pos % bs
        q_pos = torch.arange(ctx - n, ctx)
        visible = pos[None, :] <= q_pos[:, None]
        if sliding_window > 0:
            visible &= pos[None, :] > (q_pos[:, None] - sliding_window)
        # [hkv, group, n, d] against [hkv, 1, ctx, d]: attention's float64 twin, rounded
        # once at the end (the kernel's arithmetic and edges)
        attended = attend_f64(q_all[start:end].view(n, hkv, group, d).permute(1, 2, 0, 3),
                               kc.index_select(0, ctx_slots).transpose(0, 1).unsqueeze(1),
                               vc.index_select(0, ctx_slots).transpose(0, 1).unsqueeze(1),
                               visible, scale, soft_cap)
        out_all[start:end] = attended.permute(2, 0, 1, 3).reshape(n, num_heads, d)


def rms_norm_py(x: int, x_stride: int, delta: int, delta_stride: int, weight: int, out: int,
                out_stride: int, rows: int, hidden: int, eps: float, dtype: int,
                num_threads: int) -> None:
    """The twin of ``_C.rms_norm``: out = weight * rmsnorm(x) per row; with
    ``delta != 0``, x += delta first (in place, in the model dtype)."""
    dt = _dtype(dtype, "rms_norm")
    xs = _view(x, dt, (rows, hidden), (x_stride, 1))
    if delta:
        xs.add_(_view(delta, dt, (rows, hidden), (delta_stride, 1)))
    w = _view(weight, dt, (hidden,), (1,))
    _view(out, dt, (rows, hidden), (out_stride, 1)).copy_(rms_norm_torch(xs, w, eps))


def rope_py(x: int, x_st: int, x_sh: int, positions: int, cos: int, sin: int,
            table_stride: int, tokens: int, num_heads: int, rotary_dim: int, dtype: int,
            num_threads: int) -> None:
    """The twin of ``_C.rope``: rotate-half RoPE in place on the first ``rotary_dim``
    of each head of [tokens, heads, head_dim], at int64 positions into the cos/sin
    tables (rows of ``table_stride`` elements, in the model dtype)."""
    dt = _dtype(dtype, "rope")
    xs = _view(x, dt, (tokens, num_heads, rotary_dim), (x_st, x_sh, 1))
    pos = _view(positions, torch.int64, (tokens,), (1,))
    rows = int(pos.max()) + 1 if tokens > 0 else 0
    cos_rows = _view(cos, dt, (rows, rotary_dim), (table_stride, 1)).index_select(0, pos)
    sin_rows = _view(sin, dt, (rows, rotary_dim), (table_stride, 1)).index_select(0, pos)
    xs.copy_(apply_rope(xs, cos_rows, sin_rows))


def silu_and_mul_py(x: int, x_stride: int, out: int, out_stride: int, rows: int, width: int,
                    dtype: int, num_threads: int) -> None:
    """The twin of ``_C.silu_and_mul``: out = silu(gate) * up for rows of [gate | up]."""
    dt = _dtype(dtype, "silu_and_mul")
    gate_up = _view(x, dt, (rows, 2 * width), (x_stride, 1))
    _view(out, dt, (rows, width), (out_stride, 1)).copy_(silu_and_mul_torch(gate_up))


def greedy_argmax_py(logits: int, row_stride: int, rows: int, cols: int, out: int, dtype: int,
                     num_threads: int) -> None:
    """The twin of ``_C.greedy_argmax``: out[r] (int64) = the first index of the
    maximum of row r, a NaN counting as the maximum (torch.argmax's rule)."""
    dt = _dtype(dtype, "greedy_argmax")
    if cols <= 0:
        raise ValueError("greedy_argmax: a row needs at least one column")
    scores = _view(logits, dt, (rows, cols), (row_stride, 1))
    _view(out, torch.int64, (rows,), (1,)).copy_(scores.argmax(dim=-1))


def _no_rows(kernel: str, rows: int, cols: int, row_stride: int) -> bool:
    """The row kernels' shape checks (ValueError, as theirs); True: nothing to do."""
    if rows < 0 or cols <= 0:
        raise ValueError(f"{kernel}: need rows >= 0 and cols > 0")
    if rows > 1 and row_stride < cols:
        raise ValueError(f"{kernel}: row_stride is shorter than a row")
    return rows == 0


def sample_rows_py(logits: int, row_stride: int, rows: int, cols: int, dtype: int,
                   temperature: int, keys: int, out: int, num_threads: int) -> None:
    """The twin of ``_C.sample_rows``: out[r] (int64) = the exponential race's draw from
    logits row r (float32, or bf16 for dtype 1) in float32, divided by float32
    temperature[r] unless its address is 0, with the Exp(1) variables of int64 keys[r]
    (``sampler.sample_rows_torch``)."""
    empty = _no_rows("sample_rows", rows, cols, row_stride)
    dt = _dtype(dtype, "sample_rows")
    if empty:
        return
    scores = _view(logits, dt, (rows, cols), (row_stride, 1))
    temps = _view(temperature, torch.float32, (rows,), (1,)) if temperature else None
    row_keys = _view(keys, torch.int64, (rows,), (1,))
    _view(out, torch.int64, (rows,), (1,)).copy_(sample_rows_torch(scores, row_keys, temps))


def logprob_rows_py(logits: int, row_stride: int, rows: int, cols: int, dtype: int,
                    tokens: int, n: int, token_lp: int, rank: int, top_ids: int, top_lp: int,
                    num_threads: int) -> None:
    """The twin of ``_C.logprob_rows``: per row of logits (float32, or bf16 for dtype 1)
    the logprob (float32) and rank (int64) of int64 tokens[r], and the top n ids
    (int64) and logprobs (float32) (``sampler.logprob_rows_torch``)."""
    empty = _no_rows("logprob_rows", rows, cols, row_stride)
    dt = _dtype(dtype, "logprob_rows")
    if not 0 <= n <= cols:
        raise ValueError("logprob_rows: n must be in [0, cols]")
    if empty:
        return
    scores = _view(logits, dt, (rows, cols), (row_stride, 1))
    toks = _view(tokens, torch.int64, (rows,), (1,))
    got = logprob_rows_torch(scores, toks, n)
    _view(token_lp, torch.float32, (rows,), (1,)).copy_(got[0])
    _view(rank, torch.int64, (rows,), (1,)).copy_(got[1])
    if n:
        _view(top_ids, torch.int64, (rows, n), (n, 1)).copy_(got[2])
        _view(top_lp, torch.float32, (rows, n), (n, 1)).copy_(got[3])


def top_p_rows_py(logits: int, row_stride: int, rows: int, cols: int, top_p: int,
                  num_threads: int) -> None:
    """The twin of ``_C.top_p_rows``: in place, -inf for every token of float32 logits
    row r outside its top_p[r] nucleus (``sampler.top_p_rows_torch``)."""
    if _no_rows("top_p_rows", rows, cols, row_stride):
        return
    p = _view(top_p, torch.float64, (rows,), (1,))
    if not bool(((p > 0) & (p <= 1)).all()):
        raise ValueError("top_p_rows: every top_p must be in (0, 1]")
    scores = _view(logits, torch.float32, (rows, cols), (row_stride, 1))
    scores.copy_(top_p_rows_torch(scores, p))


def cpu_kernels_info_py() -> dict[str, str | bool | int]:
    """The twin of ``_C.cpu_kernels_info``: on the Python path torch runs the model ops
    (``isa`` "torch"; ``openmp`` the OpenMP runtime mapped, torch's); the CPU's
    features as /proc/cpuinfo lists them (Linux lists only what the OS enabled)."""
    flags = cpu_flags()
    openmp = next(filter(None, map(loaded_library_path, ("libgomp", "libiomp", "libomp"))), "")
    return {"isa": "torch", "openmp": openmp,
            "avx2": "avx2" in flags, "avx512f": "avx512f" in flags,
            "avx512_bf16": "avx512_bf16" in flags,
            "amx": {"amx_bf16", "amx_tile"} <= flags,
            "amx_permission": "not requested",
            "bf16_linear": "torch",
            "attention_decode": "torch",
            "bf16_gemv": "torch",
            "amx_kernels": "none (the Python path runs torch's own ops)",
            "starved_team_spells": 0}


def cpu_kernels_info() -> dict[str, str | bool | int]:
    """What the CPU model kernels run with (``enginecore.cpu_kernels_info``): the
    instruction set picked, the decode attention path, the bf16 GEMM / GEMV, the
    OpenMP runtime, the CPU's AVX-512 / AMX features; ``_C.cpu_kernels_info``, or on
    the Python path its twin."""
    ext = _native.extension()
    return dict(ext.cpu_kernels_info()) if ext is not None else cpu_kernels_info_py()


def bf16_linear_py(x: int, x_stride: int, rows: int, panels: int, bias: int, out: int,
                   out_stride: int, in_features: int, out_features: int,
                   num_threads: int) -> None:
    """The twin of ``_C.bf16_linear``: out = x W^T (+ bias) in bfloat16, float64 sums
    inside (``linear.bf16_linear_torch``: the kernel's bits), W in
    ``linear.pack_panels``' layout (bias 0: none)."""
    if rows < 0 or in_features <= 0 or out_features <= 0:
        raise ValueError("bf16_linear: rows >= 0, in_features > 0, out_features > 0")
    if x_stride < in_features or out_stride < out_features:
        raise ValueError("bf16_linear: a row stride is shorter than its row")
    if rows == 0:
        return
    if not (x and panels and out):
        raise ValueError("bf16_linear: null buffer")
    count = -(-out_features // PANEL)
    bf = torch.bfloat16
    w = unpack_panels(_view(panels, bf, (count, in_features, PANEL),
                            (in_features * PANEL, PANEL, 1)), out_features)
    b = _view(bias, bf, (out_features,), (1,)) if bias else None
    xs = _view(x, bf, (rows, in_features), (x_stride, 1))
    _view(out, bf, (rows, out_features), (out_stride, 1)).copy_(bf16_linear_torch(xs, w, b))


def bf16_gemv_py(x: int, x_stride: int, rows: int, weight: int, bias: int, out: int,
                 out_stride: int, in_features: int, out_features: int,
                 num_threads: int) -> None:
    """The twin of ``_C.bf16_gemv``: out = x W^T (+ bias) for 1-4 rows of bfloat16 x
    and the plain [out_features, in_features] bfloat16 W, the kernel's float32
    order replayed (``bf16_gemv_torch``): the same bits."""
    if rows < 1 or rows > 4 or in_features <= 0 or out_features <= 0:
        raise ValueError("bf16_gemv: 1 <= rows <= 4, in_features > 0, out_features > 0")
    if rows > 1 and (x_stride < in_features or out_stride < out_features):
        raise ValueError("bf16_gemv: a row stride is shorter than its row")
    if not (x and weight and out):
        raise ValueError("bf16_gemv: null buffer")
    bf = torch.bfloat16
    w = _view(weight, bf, (out_features, in_features), (in_features, 1))
    b = _view(bias, bf, (out_features,), (1,)) if bias else None
    xs = _view(x, bf, (rows, in_features), (x_stride, 1))
    _view(out, bf, (rows, out_features), (out_stride, 1)).copy_(bf16_gemv_torch(xs, w, b))


def bf16_gemv_available_py() -> bool:
    """The twin of ``_C.bf16_gemv_available``: whether this CPU runs the GEMV (the
    Python path runs its twin on the same calls)."""
    return gemv_cpu_supported()
