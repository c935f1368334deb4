"""The offloading connector's index of its second tier (vLLM's OffloadingManager role).

Lives with the scheduler: it knows which block hashes the tier holds and where (a slot
of the host buffer the worker side owns), decides where a new block goes (a free slot,
else the least recently used one that no load is reading), and counts hits. It never
touches bytes: the worker side copies, told by the connector metadata.

A slot's life: ``reserve`` (a store is on its way; not found by lookups yet) ->
``complete_store`` (ready: lookups find it) -> ``pin`` for each load reading it ->
``unpin`` -> evicted by a later ``reserve`` when it is the least recently used ready,
unpinned slot. A store that failed is ``abandon``-ed (the slot is free again).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass
class _Slot:
    slot: int
    ready: bool = False
    pins: int = 0


@dataclass
class TierStats:
    lookups: int = 0  # get_num_new_matched_tokens calls that asked the tier
    hit_blocks: int = 0  # blocks found (what a load then brings back)
    stored_blocks: int = 0  # blocks written to the tier
    evicted_blocks: int = 0  # blocks dropped from the tier to make room

    def as_dict(self, prefix: str) -> dict[str, int]:
        return {f"{prefix}_{k}": v for k, v in vars(self).items()}


class OffloadTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the offload tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        # hash -> slot, least recently used first.
        self._by_hash: OrderedDict[Hashable, _Slot] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, block_hash: Hashable) -> bool:
        return block_hash in self._by_hash

    def lookup(self, block_hashes: Sequence[Hashable]) -> int:
        """How many leading hashes the tier holds, ready (and marks them recently used)."""
        self.stats.lookups += 1
        n = 0
        for h in block_hashes:
            entry = self._by_hash.get(h)
            if entry is None or not entry.ready:
                break
            self._by_hash.move_to_end(h)
            n += 1
        return n

    def pin(self, block_hashes: Sequence[Hashable]) -> list[int]:
        """The slots of ready hashes a load will read; they stay until ``unpin``."""
        slots = []
        for h in block_hashes:
            entry = self._by_hash[h]
            assert entry.ready, "only ready blocks are loaded"
            entry.pins += 1
            slots.append(entry.slot)
        self.stats.hit_blocks += len(slots)
        return slots

    def unpin(self, block_hashes: Sequence[Hashable]) -> None:
        for h in block_hashes:
            entry = self._by_hash.get(h)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1

    def reserve(self, block_hash: Hashable) -> int | None:
        """A slot for a new block (None: already held, or every slot is busy)."""
        if block_hash in self._by_hash:
            self._by_hash.move_to_end(block_hash)
            return None
        slot = self._free.pop() if self._free else self._evict_one()
        if slot is None:
            return None
        self._by_hash[block_hash] = _Slot(slot)
        return slot

    def complete_store(self, block_hashes: Sequence[Hashable]) -> None:
        for h in block_hashes:
            entry = self._by_hash.get(h)
            if entry is not None and not entry.ready:
                entry.ready = True
                self.stats.stored_blocks += 1

    def abandon(self, block_hashes: Sequence[Hashable]) -> None:
        for h in block_hashes:
            entry = self._by_hash.get(h)
            if entry is not None and not entry.ready:
                del self._by_hash[h]
                self._free.append(entry.slot)

    def _evict_one(self) -> int | None:
        for h, entry in self._by_hash.items():  # least recently used first
            if entry.ready and entry.pins == 0:
                del self._by_hash[h]
                self.stats.evicted_blocks += 1
                return entry.slot
        return None
