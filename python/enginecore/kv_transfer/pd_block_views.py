"""Byte views of the paged KV cache, block by block, for the P/D transport.

The runner keeps one K and one V tensor per layer, [slots, kv_heads, head_dim], block
``b`` being slots ``b*block_size .. (b+1)*block_size``: a run of consecutive block ids
is one contiguous byte range. On the CPU a run is handed to zmq as a memoryview of the
cache itself (no copy; pyzmq keeps the view alive until libzmq has sent it) and a
received run is copied straight into its blocks. A device cache goes through one host
copy per run each way.
"""

from __future__ import annotations

import numpy as np
import torch

from enginecore.kv_transfer.pd_wire import KVLayout


class CacheBlockBytes:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int
                 ) -> None:
        if not kv_caches:
            raise ValueError("the KV cache is not allocated")
        self.kv_caches = kv_caches
        self.block_size = block_size
        k0 = kv_caches[0][0]
        self.on_host = k0.device.type == "cpu"
        self.block_bytes = block_size * k0.shape[1] * k0.shape[2] * k0.element_size()
        # [blocks, block_bytes] uint8 views of each tensor (host caches only).
        self._rows: list[tuple[np.ndarray, np.ndarray]] = []
        if self.on_host:
            self._rows = [(self._as_rows(k), self._as_rows(v)) for k, v in kv_caches]

    def _as_rows(self, t: torch.Tensor) -> np.ndarray:
        assert t.is_contiguous(), "the KV cache tensors must be contiguous"
        return t.view(torch.uint8).numpy().reshape(-1, self.block_bytes)

    @property
    def num_layers(self) -> int:
        return len(self.kv_caches)

    def layout(self, model: str) -> KVLayout:
        k = self.kv_caches[0][0]
        return KVLayout(self.num_layers, self.block_size, int(k.shape[1]), int(k.shape[2]),
                        str(k.dtype).removeprefix("torch."), model)

    def read(self, layer: int, kv: int, first: int, n: int) -> memoryview:
        """Blocks first .. first+n-1 of one layer's K (kv=0) or V (kv=1), as bytes."""
        if self.on_host:
            return memoryview(self._rows[layer][kv][first:first + n])
        t = self.kv_caches[layer][kv]
        bs = self.block_size
        host = t[first * bs:(first + n) * bs].contiguous().cpu()
        return memoryview(host.view(torch.uint8).numpy())

    def write(self, layer: int, kv: int, first: int, n: int, data: memoryview) -> None:
        """Copy ``data`` (n blocks of bytes) into blocks first .. first+n-1."""
        src = np.frombuffer(data, dtype=np.uint8)
        if src.size != n * self.block_bytes:
            raise ValueError(f"a run of {n} blocks is {n * self.block_bytes} bytes, "
                             f"got {src.size}")
        if self.on_host:
            self._rows[layer][kv][first:first + n] = src.reshape(n, self.block_bytes)
            return
        t = self.kv_caches[layer][kv]
        bs = self.block_size
        host = torch.empty(n * self.block_bytes, dtype=torch.uint8)
        host.numpy()[:] = src
        t[first * bs:(first + n) * bs].view(torch.uint8).view(-1).copy_(host.to(t.device))
