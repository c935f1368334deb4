"""Element-wise model ops with a native twin each (csrc/fused_ops.cpp):
RMSNorm (with the residual add before it) and SiLU-and-mul.

The torch versions are the reference, written as transformers computes them;
the native ones do the same arithmetic in one pass over memory and one call
(the torch versions are 5-8 small ops each, which is what a batch-1 step is
made of) and round to the model dtype at the same places. On the CPU both
compute the sum of squares and SiLU's exp in float64, so an order or an exp
implementation moves nothing that survives the rounding: the same bits in
bfloat16 and float32. Native: float32/bfloat16 on the CPU; anything else takes torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from enginecore import _native

# dtype codes of the native kernels (csrc/cpu_kernels.h DType)
NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _native_for(x: torch.Tensor):
    ext = _native.extension()
    if ext is None or x.device.type != "cpu" or x.dtype not in NATIVE_DTYPES:
        return None
    return ext


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   plus_one: bool = False) -> torch.Tensor:
    # As transformers does: normalise in float32 (on the CPU in float64, as the
    # kernel, then rounded to float32: the same bits whatever the order of the sum),
    # scale in the model dtype; Gemma scales by (1 + w) in float32 and casts last.
    dtype = x.dtype
    if x.device.type == "cpu":
        x64 = x.double()
        xf = (x64 * (1.0 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps))).float()
    else:
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (xf * (1.0 + weight.float())).to(dtype)
    return weight * xf.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             plus_one: bool = False) -> torch.Tensor:
    """weight * RMSNorm(x) over the last dimension. Native for [rows, hidden] with
    one weight row; per-head weights (Qwen3's q/k norms) and Gemma's (1 + w)
    take the torch version."""
    ext = _native_for(x)
    if (ext is None or plus_one or x.dim() != 2 or x.stride(-1) != 1 or weight.dim() != 1
            or weight.dtype != x.dtype or not weight.is_contiguous()):
        return rms_norm_torch(x, weight, eps, plus_one)
    out = torch.empty_like(x)
    ext.rms_norm(*rms_norm_args(x, None, weight, out, eps))
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 plus_one: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, weight * RMSNorm(h + delta)): a decoder layer's residual add and
    the norm after it. The native path adds into ``h`` in place (the residual
    stream is the model's own buffer)."""
    ext = _native_for(h)
    if (ext is None or plus_one or h.dim() != 2 or not h.is_contiguous() or delta.stride(-1) != 1
            or delta.dtype != h.dtype or weight.dtype != h.dtype or h.shape != delta.shape
            or weight.dim() != 1 or not weight.is_contiguous()):
        h = h + delta
        return h, rms_norm_torch(h, weight, eps, plus_one)
    out = torch.empty_like(h)
    ext.rms_norm(*rms_norm_args(h, delta, weight, out, eps))
    return h, out


def rms_norm_args(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                  out: torch.Tensor, eps: float) -> tuple:
    """What ``_C.rms_norm`` (and ``kernel_twins.rms_norm_py``) take for these tensors.
    ``weight`` must be contiguous (the callers' checks leave nothing else)."""
    return (x.data_ptr(), x.stride(0), 0 if delta is None else delta.data_ptr(),
            0 if delta is None else delta.stride(0), weight.data_ptr(), out.data_ptr(),
            out.stride(0), x.shape[0], x.shape[1], eps, NATIVE_DTYPES[x.dtype],
            torch.get_num_threads())


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if gate_up.device.type != "cpu":
        return F.silu(gate) * up
    # On the CPU silu in float64 rounded to float32 and the model dtype, as the
    # kernel: exp implementations differ in the last float32 bit, not in float64's.
    g = gate.double()
    return (g / (1.0 + torch.exp(-g))).float().to(gate.dtype) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows of [gate | up] (the fused gate_up projection)."""
    if gate_up.shape[-1] % 2:  # both paths refuse alike (the kernel would drop a column)
        raise ValueError("silu_and_mul needs [gate | up] of an even width, got "
                         f"{gate_up.shape[-1]}")
    ext = _native_for(gate_up)
    if ext is None or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        return silu_and_mul_torch(gate_up)
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    ext.silu_and_mul(*silu_and_mul_args(gate_up, out))
    return out


def silu_and_mul_args(gate_up: torch.Tensor, out: torch.Tensor) -> tuple:
    """What ``_C.silu_and_mul`` (and ``kernel_twins.silu_and_mul_py``) take."""
    return (gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), out.shape[0],
            out.shape[1], NATIVE_DTYPES[gate_up.dtype], torch.get_num_threads())
