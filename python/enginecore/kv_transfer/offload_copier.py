"""The offloading connector's worker side: the host buffer and the copies in and out of it.

The host buffer is ``[num_slots, num_layers, 2, block_size, kv_heads, head_dim]`` in the
cache's dtype (pinned when the cache is on a device). Copies run on one thread of their
own, in the order they were submitted (a load of a slot always follows the store that
filled it), so they overlap with the model's step: the busy loop only submits and later
collects what finished. Each layer's blocks go in one gather/scatter per job.

The cache is vLLM's connector layout (kv_transfer/worker_hooks.py): per layer
``[2, num_blocks + 1, block_size, kv_heads, head_dim]``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

STORE = "store"
LOAD = "load"


@dataclass(frozen=True)
class CopyJob:
    kind: str  # STORE: cache blocks -> host slots; LOAD: host slots -> cache blocks
    req_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]


class OffloadCopier:
    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int) -> None:
        if not kv_caches:
            raise ValueError("the KV cache is not allocated")
        self.kv_caches = kv_caches
        first = kv_caches[0]
        self.device = first.device
        shape = (num_slots, len(kv_caches), *first.shape[:1], *first.shape[2:])
        self.host = torch.empty(shape, dtype=first.dtype,
                                pin_memory=first.device.type == "cuda")
        self.block_bytes = first[:, 0].numel() * first.element_size()  # K and V of a layer
        self._stream = torch.cuda.Stream(first.device) if first.device.type == "cuda" else None
        self._jobs: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done: list[tuple[CopyJob, bool]] = []
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self.bytes_copied = {STORE: 0, LOAD: 0}
        self._thread = threading.Thread(target=self._run, name="kv-offload-copier",
                                        daemon=True)
        self._thread.start()

    @property
    def host_bytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def submit(self, job: CopyJob) -> None:
        if len(job.block_ids) != len(job.slots):
            raise ValueError("a copy job needs one slot per block")
        with self._lock:
            self._pending += 1
        self._jobs.put(job)

    def take_done(self) -> list[tuple[CopyJob, bool]]:
        """Jobs finished since the last call, with whether they succeeded."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Until every submitted job has run (preemptions, shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            ok = True
            try:
                self._copy(job)
            except Exception:  # a failed copy fails its job (load: recompute), not the engine
                logger.exception("kv offload: a %s of %d blocks failed", job.kind,
                                 len(job.block_ids))
                ok = False
            with self._idle:
                self._done.append((job, ok))
                self._pending -= 1
                self._idle.notify_all()

    @torch.inference_mode()
    def _copy(self, job: CopyJob) -> None:
        blocks = torch.tensor(job.block_ids, dtype=torch.long, device=self.device)
        slots = torch.tensor(job.slots, dtype=torch.long)
        ctx = (torch.cuda.stream(self._stream) if self._stream is not None
               else contextlib.nullcontext())
        with ctx:
            for layer, kv in enumerate(self.kv_caches):
                if job.kind == STORE:
                    # [2, n, ...] -> [n, 2, ...] into the slots.
                    data = kv.index_select(1, blocks).transpose(0, 1)
                    self.host[slots, layer] = data.to("cpu")
                else:
                    data = self.host[slots, layer].transpose(0, 1)
                    kv.index_copy_(1, blocks, data.to(self.device))
            if self._stream is not None:
                self._stream.synchronize()
        self.bytes_copied[job.kind] += len(job.block_ids) * len(self.kv_caches) * \
            self.block_bytes
