"""Weights of the model's matmuls, pre-packed once at load for the CPU GEMM.

bfloat16 on the CPU: the weight is reordered once into oneDNN's blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``) and each call runs
``torch.ops.mkldnn._linear_pointwise`` on it, instead of ``F.linear``, which
reorders the plain weight on every call. Same kernel family, same bits (checked
in tests/test_linear.py); faster per call, most at small batches and on the
49k-row LM head (docs/benchmarks.md). The plain weight is not kept: ``dense()``
gives it back (for saving, LoRA shapes, moving devices).
Everything else (float32, where MKL's sgemm measured no steadier gain from
packing, float16, CUDA) calls ``F.linear`` on the plain weight.
``ENGINECORE_PACK_WEIGHTS=0`` keeps every weight plain (to measure the difference).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


@functools.cache
def cpu_packs_bf16() -> bool:
    """oneDNN's bf16 weight reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on
    an AVX2-only CPU it raises, so bf16 weights stay plain there."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return False
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


def packing_enabled(dtype: torch.dtype, device: torch.device) -> bool:
    flag = os.environ.get("ENGINECORE_PACK_WEIGHTS", "1").strip().lower()
    if flag in ("0", "false", "no", "off"):
        return False
    return (device.type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and cpu_packs_bf16())


class Linear:
    """y = x W^T (+ b) for x [tokens, in_features]."""

    __slots__ = ("bias", "in_features", "out_features", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 pack: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight
        if pack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias,
                                                  "none", [], "")

    def dense(self) -> torch.Tensor:
        return self.weight if self.packed is None else self.packed.to_dense()

    def to(self, device: torch.device) -> Linear:
        """A plain copy on `device` (packing is for the CPU only)."""
        bias = None if self.bias is None else self.bias.to(device)
        pack = packing_enabled(self.dense().dtype, device)
        return Linear(self.dense().to(device), bias, pack)

    def nbytes(self) -> int:
        n = self.out_features * self.in_features
        size = (self.packed if self.packed is not None else self.weight).element_size()
        return n * size + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())
