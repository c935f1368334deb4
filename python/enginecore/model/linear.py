"""Weights of the model's matmuls, pre-packed once at load for the CPU GEMM.

bfloat16 on a CPU whose oneDNN has a bf16 path (AVX-512 BW/VL/DQ or
AVX-NE-CONVERT; "onednn"): the weight is reordered once into oneDNN's blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``) and each call runs
``torch.ops.mkldnn._linear_pointwise`` on it, instead of ``F.linear``, which
reorders the plain weight on every call. Same kernel family, same bits (checked
in tests/test_linear.py); faster per call, most at small batches and on the
49k-row LM head (docs/benchmarks.md).

bfloat16 on an AVX2-only CPU ("panels"): oneDNN's reorder refuses to run there and
torch's bf16 matmul measured ~3x slower than its float32 one beyond one row, so
the weight is laid out in 16-feature panels (``pack_panels``) for the native
``_C.bf16_linear``: bf16 weights (half the bytes float32 moves), widened in
registers, float64 sums, one rounding to float32 and bf16 (``bf16_linear_torch``
is that arithmetic in torch, which the Python path runs on the same weights: the
same bits, so the same tokens).

Decode-sized calls (at most ``GEMV_MAX_ROWS`` rows) on a CPU with AVX512_BF16 run
``_C.bf16_gemv`` on the plain weight instead: one front-to-back stream of each weight
row, which oneDNN's packed GEMM read at 40 % of the memory rate (docs/benchmarks.md).
Its summation order is fixed, and the Python path replays it (``bf16_gemv_torch``)
on the same calls: native and twin give the same bits.
That needs the plain weight beside the packed one, so a model keeps both only while
its projections total at most ``GEMV_COPY_LIMIT_BYTES`` (``ENGINECORE_BF16_GEMV=0``:
never; ``=1``: whatever the size); a tied LM head's plain weight is the embedding.

Otherwise the plain weight is not kept: ``dense()`` gives it back (for saving, LoRA
shapes, moving devices). Everything else (float32, where MKL's sgemm measured no steadier
gain from packing, float16, CUDA) calls ``F.linear`` on the plain weight.
``ENGINECORE_PACK_WEIGHTS=0`` keeps every weight plain (to measure the difference).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from enginecore import _native
from enginecore.model.cpu_flags import cpu_flags

# Output features per panel of _C.bf16_linear's weight layout (csrc/bf16_gemm.cpp kNR).
PANEL = 16
# Rows up to which a call runs _C.bf16_gemv (csrc/bf16_gemv.cpp takes 1-4; its two
# exact float32 FMAs per 32 weights and row made 3-4 rows slower than oneDNN).
GEMV_MAX_ROWS = 2
# Projections up to this size keep their plain bf16 weight beside the packed one.
GEMV_COPY_LIMIT_BYTES = 2 << 30
GEMV_ENV = "ENGINECORE_BF16_GEMV"


def cpu_packs_bf16() -> bool:
    """oneDNN's bf16 weight reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on
    an AVX2-only CPU it raises."""
    flags = cpu_flags()
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


def packing_enabled(dtype: torch.dtype, device: torch.device) -> str | None:
    """How this dtype's weights are packed on this device: "onednn", "panels" or
    None (plain)."""
    flag = os.environ.get("ENGINECORE_PACK_WEIGHTS", "1").strip().lower()
    if flag in ("0", "false", "no", "off") or device.type != "cpu" or dtype != torch.bfloat16:
        return None
    if cpu_packs_bf16():
        if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            return "onednn"
        return None
    # By the CPU's flags, not the switch: the Python path runs the panels' twin
    # (bf16_linear_torch) where the native one runs _C.bf16_linear, for the same bits.
    if {"avx2", "fma"} <= cpu_flags():
        return "panels"
    return None


def gemv_enabled(pack: str | None, weight_bytes: int) -> bool:
    """Whether oneDNN-packed bf16 weights of a model whose projections total
    ``weight_bytes`` also keep their plain copy for ``_C.bf16_gemv``."""
    if pack != "onednn":
        return False
    flag = os.environ.get(GEMV_ENV, "auto").strip().lower()
    if flag in ("0", "false", "no", "off"):
        return False
    # By the CPU's flags, not the switch: the Python path runs the same GEMV's
    # arithmetic (bf16_gemv_torch) where the native one would, for the same bits.
    if not gemv_cpu_supported():
        return False
    return flag in ("1", "true", "yes", "on") or weight_bytes <= GEMV_COPY_LIMIT_BYTES


def gemv_cpu_supported() -> bool:
    """Whether this CPU runs ``_C.bf16_gemv`` (AVX-512 F/BW/VL and AVX512_BF16)."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16]: panel p holds features 16p..16p+15 (zeros past N)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """``pack_panels``' inverse: the plain [N, K] weight."""
    count, k, _ = panels.shape
    return panels.transpose(1, 2).reshape(count * PANEL, k)[:out_features].contiguous()


def bf16_linear_torch(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """``_C.bf16_linear``'s arithmetic in torch: exact products summed in float64 (in
    MKL's order: ~1e-16 from the kernel's, the same float32 after rounding), the bias
    added in float32, one rounding to bfloat16."""
    y = (x.double() @ weight.double().T).float()
    if bias is not None:
        y += bias.float()
    return y.to(torch.bfloat16)


def bf16_gemv_torch(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """``_C.bf16_gemv``'s arithmetic in torch, bit for bit (csrc/bf16_gemv.cpp): the
    bf16 products of each 32-element chunk fused-multiply-added, chunk after chunk,
    into 32 float32 accumulators (lane l: elements 2l and 2l + 1); then even + odd per
    lane, the 16 lanes by hsum16's tree, the bias in float32, one rounding.
    The FMA is replayed in float64: the product is exact there, the sum with the
    float32 accumulator exact or off by less than float32 can see, so one rounding to
    float32 is the FMA's (also for products past float32's range, which a float32
    product would round first). A few torch ops per chunk: slower than the kernel,
    the same bits."""
    rows, k = x.shape
    xd = x.double()
    acc = x.new_zeros(rows, weight.shape[0], 32, dtype=torch.float32)
    for c0 in range(0, k, 32):
        width = min(32, k - c0)
        prod = xd[:, None, c0 : c0 + width] * weight[:, c0 : c0 + width].double()
        if width < 32:  # the kernel's zero padding adds +0 to the other lanes
            prod = F.pad(prod, (0, 32 - width))
        acc = (acc.double() + prod).float()
    lanes = (acc[..., 0::2] + acc[..., 1::2]).view(rows, -1, 4, 4)
    blocks = (lanes[..., 0] + lanes[..., 2]) + (lanes[..., 1] + lanes[..., 3])
    y = (blocks[..., 0] + blocks[..., 1]) + (blocks[..., 2] + blocks[..., 3])
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16)


def bf16_linear_args(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                     out: torch.Tensor) -> tuple:
    """What ``_C.bf16_linear`` (and ``kernel_twins.bf16_linear_py``) take."""
    return (x.data_ptr(), x.stride(0), x.shape[0], panels.data_ptr(),
            0 if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
            x.shape[1], out.shape[1], torch.get_num_threads())


class Linear:
    """y = x W^T (+ b) for x [tokens, in_features]."""

    __slots__ = ("bias", "gemv", "in_features", "kind", "out_features", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 pack: str | bool | None = None, gemv: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.kind = "onednn" if pack is True else (pack or None)
        if weight.numel() == 0:
            self.kind = None  # nothing to pack; F.linear handles the empty shapes
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight
        if self.kind == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        elif self.kind == "panels":
            if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
                raise ValueError(f"panels are bfloat16 CPU weights, not {weight.dtype} on "
                                 f"{weight.device}")
            if bias is not None and (bias.dtype != weight.dtype
                                     or tuple(bias.shape) != (self.out_features,)):
                raise ValueError(f"bias must be bfloat16 [{self.out_features}], "
                                 f"not {bias.dtype} {list(bias.shape)}")
            self.packed = pack_panels(weight)
            if bias is not None:
                self.bias = bias.contiguous()
        elif self.kind is not None:
            raise ValueError(f"unknown weight packing {pack!r}")
        # Decode-sized calls on the plain weight (kept beside oneDNN's copy).
        self.gemv = bool(gemv) and self.kind == "onednn" and weight.dtype == torch.bfloat16
        if self.gemv and bias is not None:
            if bias.dtype != torch.bfloat16 or tuple(bias.shape) != (self.out_features,):
                self.gemv = False
            else:
                self.bias = bias.contiguous()
        if self.gemv:
            self.weight = weight.contiguous()
        if self.packed is not None and not self.gemv:
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is None:
            return F.linear(x, self.weight, self.bias)
        # Packed kernels take [tokens, in_features]; leading dims (an encoder's
        # [batch, length]) are folded into tokens and restored.
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the weight takes "
                             f"{self.in_features}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.gemv and 0 < x2.shape[0] <= GEMV_MAX_ROWS and x2.dtype == torch.bfloat16:
            out = self._gemv(x2)
            if out is not None:
                return out if len(lead) == 1 else out.view(*lead, self.out_features)
        if self.kind == "panels":
            out = self._panels(x2)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.packed, self.bias,
                                                     "none", [], "")
        return out if len(lead) == 1 else out.view(*lead, self.out_features)

    def _panels(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise ValueError(f"a CPU-packed weight got input on {x.device}")
        if x.dtype != torch.bfloat16:
            raise ValueError(f"a bfloat16 weight got {x.dtype} input")
        if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) < self.in_features):
            x = x.contiguous()  # broadcast or overlapping rows: the kernel reads rows
        ext = _native.extension()
        if ext is None:  # the native path was switched off after load: same arithmetic
            return bf16_linear_torch(x, self.dense(), self.bias)
        out = x.new_empty(x.shape[0], self.out_features)
        ext.bf16_linear(*bf16_linear_args(x, self.packed, self.bias, out))
        return out

    def _gemv(self, x: torch.Tensor) -> torch.Tensor | None:
        """``_C.bf16_gemv`` on the plain weight (on the Python path its twin,
        ``bf16_gemv_torch``); None: the packed path runs instead (input off the CPU)."""
        if x.device.type != "cpu":
            return None
        assert self.weight is not None
        ext = _native.extension()
        if ext is None:
            return bf16_gemv_torch(x, self.weight, self.bias)
        if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) < self.in_features):
            x = x.contiguous()
        out = x.new_empty(x.shape[0], self.out_features)
        ext.bf16_gemv(x.data_ptr(), x.stride(0), x.shape[0], self.weight.data_ptr(),
                      0 if self.bias is None else self.bias.data_ptr(), out.data_ptr(),
                      out.stride(0), self.in_features, self.out_features,
                      torch.get_num_threads())
        return out

    def dense(self) -> torch.Tensor:
        if self.kind == "panels":
            return unpack_panels(self.packed, self.out_features)
        if self.weight is not None:
            return self.weight
        return self.packed.to_dense()

    def to(self, device: torch.device) -> Linear:
        """A plain copy on `device` (packing is for the CPU only)."""
        bias = None if self.bias is None else self.bias.to(device)
        dense = self.dense()
        return Linear(dense.to(device), bias, packing_enabled(dense.dtype, device), self.gemv)

    def nbytes(self) -> int:
        """Bytes held: the weight as stored (panels with their padding) and the bias."""
        held = self.packed if self.packed is not None else self.weight
        # oneDNN's blocked tensor reports its logical shape; panels are counted padded
        n = held.numel() if self.kind == "panels" else self.out_features * self.in_features
        if self.gemv:  # the plain copy beside the packed one
            n += self.out_features * self.in_features
        return (n * held.element_size()
                + (0 if self.bias is None else self.bias.numel() * self.bias.element_size()))
