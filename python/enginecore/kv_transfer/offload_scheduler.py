"""The offloading connector's scheduler side (vLLM's OffloadingConnectorScheduler role).

Stores: when a request finishes, its full computed blocks that the tier lacks get a
slot (the tier evicts its least recently used block when full) and a store job; the
request's blocks stay (``delay_free``) until the worker reports the copy done, and only
then do lookups find them. So what the engine's own cache later evicts is still in the
tier. Loads: a waiting request's blocks beyond the local prefix-cache hits are looked up
by hash; the leading run the tier holds is offered asynchronously, pinned, and copied
into the request's new blocks while the engine steps (WAITING_FOR_REMOTE_KVS).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from enginecore.kv_transfer.base import KVConnectorMetadata
from enginecore.kv_transfer.offload_copier import LOAD, STORE, CopyJob
from enginecore.kv_transfer.offload_tier import OffloadTier

# The worker names failed stores in its stats under this key (their blocks are dropped).
FAILED_STORES = "offload_failed_store_reqs"


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    loads: list[CopyJob] = field(default_factory=list)
    stores: list[CopyJob] = field(default_factory=list)


class OffloadScheduler:
    def __init__(self, block_size: int, num_slots: int) -> None:
        self.block_size = block_size
        self.tier = OffloadTier(num_slots)
        self._meta = OffloadingConnectorMetadata()
        self._loading: dict[str, list[bytes]] = {}  # pinned hashes of loads in flight
        self._storing: dict[str, list[bytes]] = {}  # reserved hashes of stores in flight

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        if num_computed_tokens % self.block_size:
            return 0, False
        start = num_computed_tokens // self.block_size
        hits = self.tier.lookup(request.block_hashes[start:])
        return (hits * self.block_size, True) if hits else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        block_ids = blocks.get_block_ids()[0]
        first = getattr(blocks, "num_hashed", 0)
        count = -(-num_external_tokens // self.block_size)
        hashes = list(request.block_hashes[first:first + count])
        slots = self.tier.pin(hashes)
        self._meta.loads.append(CopyJob(LOAD, request.request_id,
                                        tuple(block_ids[first:first + count]), tuple(slots)))
        self._loading[request.request_id] = hashes

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        if rid in self._loading:
            return True, None  # finished mid-load: its blocks go when the load ends
        hashes = request.block_hashes
        n_full = min(len(hashes), request.num_computed_tokens // self.block_size,
                     len(block_ids))
        blocks, slots, stored = [], [], []
        for i in range(n_full):
            slot = self.tier.reserve(hashes[i])
            if slot is not None:
                blocks.append(block_ids[i])
                slots.append(slot)
                stored.append(hashes[i])
        if not slots:
            return False, None
        self._meta.stores.append(CopyJob(STORE, rid, tuple(blocks), tuple(slots)))
        self._storing[rid] = stored
        return True, None

    def build_connector_meta(self, scheduler_output: Any) -> OffloadingConnectorMetadata:
        meta, self._meta = self._meta, OffloadingConnectorMetadata()
        return meta

    def update_connector_output(self, output: Any) -> None:
        failed = set((output.kv_connector_stats or {}).get(FAILED_STORES) or ())
        for rid in output.finished_recving or ():
            self.tier.unpin(self._loading.pop(rid, ()))
        for rid in output.finished_sending or ():
            stored = self._storing.pop(rid, None)
            if stored is not None:
                if rid in failed:
                    self.tier.abandon(stored)
                else:
                    self.tier.complete_store(stored)

    def stats(self) -> dict[str, int]:
        return self.tier.stats.as_dict("offload")
