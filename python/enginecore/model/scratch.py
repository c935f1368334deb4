"""One tensor's memory reused step after step, for the sampler's per-step logits.

Why: the float32 logits of a step (64 rows x 49k vocabulary: 12.6 MB) and their
temperature-scaled copy are freshly allocated every step. glibc hands blocks that
large back to the kernel when they are freed (mmap, or the heap top trimmed past
twice the mmap threshold), so each step faulted ~6,300 new pages: ~10 ms of system
time a step at batch 64 on the AVX-512 EPYC (docs/benchmarks.md, round 11). Kept
here, the pages stay mapped.

A view handed out by ``take`` is valid until the next ``take``: callers use it
within one step and keep nothing that aliases it.
"""

from __future__ import annotations

import math

import torch


class ScratchTensor:
    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device | str = "cpu") -> torch.Tensor:
        """An uninitialised tensor of ``shape`` over the reused memory (grown, never
        shrunk; a new one when the dtype or the device changes)."""
        n = math.prod(shape)
        buf = self._buf
        if (buf is None or buf.dtype != dtype or buf.device != torch.device(device)
                or buf.numel() < n):
            buf = self._buf = torch.empty(n, dtype=dtype, device=device)
        return buf[:n].view(shape)

    def release(self) -> None:
        self._buf = None
