"""The scheduler's view of the encoder cache (vLLM's EncoderCacheManager).

The runner keeps the vision encoder's output of each multimodal item by its
``identifier`` (the content hash of the processed item); this manager decides
what is in there, in units of embedding tokens (one per placeholder token).

* An entry is *referenced* by every live request whose placeholder range is not
  yet all in the KV cache; a request drops its reference once its computed
  tokens pass the range, and all of them when it finishes or is preempted.
* An entry nobody references is *freeable*: it stays cached (a later request
  with the same image is a hit, and a preempted request comes back to it) until
  a new entry needs its room; then the oldest freeable entries go first (LRU),
  and their identifiers are handed to the runner (``get_freed_mm_hashes``) to
  drop with the next step.

Bookkeeping invariant: ``num_free_slots <= num_freeable_slots <= cache_size``;
``num_freeable_slots - num_free_slots`` is the room held by freeable entries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        if cache_size < 1:
            raise ValueError(f"encoder cache_size must be >= 1, got {cache_size}")
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        # identifier -> ids of the requests that still need it
        self.cached: dict[str, set[str]] = {}
        # identifier -> its size in tokens; entries nobody needs, oldest first
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.sizes: dict[str, int] = {}
        # evicted since the runner was last told
        self.freed: list[str] = []
        # request id -> identifiers it references
        self.refs: dict[str, set[str]] = {}
        # lookups and hits, cumulative and since the last make_stats()
        self.queries = self.hits = 0
        self._stats_queries = self._stats_hits = 0

    # -- lookups and allocation ---------------------------------------------------
    def check_and_update_cache(self, request_id: str, identifier: str) -> bool:
        """Whether ``identifier`` is cached; if so, ``request_id`` now references it
        (a freeable entry is taken back from the freeable list)."""
        self.queries += 1
        holders = self.cached.get(identifier)
        if holders is None:
            return False
        self.hits += 1
        if not holders:
            size = self.freeable.pop(identifier)
            self.num_freeable_slots -= size
        holders.add(request_id)
        self.refs.setdefault(request_id, set()).add(identifier)
        return True

    def can_allocate(self, num_tokens: int, compute_budget: int,
                     num_tokens_to_schedule: int) -> bool:
        """Whether an item of ``num_tokens`` fits this step's encoder compute budget
        and the cache, beside the ``num_tokens_to_schedule`` already picked for this
        request this step; evicts freeable entries (oldest first) to make room."""
        if num_tokens > compute_budget:
            return False
        need = num_tokens + num_tokens_to_schedule
        if need <= self.num_free_slots:
            return True
        if need > self.num_freeable_slots:
            return False
        while self.num_free_slots < need:
            identifier, size = self.freeable.popitem(last=False)
            del self.cached[identifier]
            del self.sizes[identifier]
            self.freed.append(identifier)
            self.num_free_slots += size
        return True

    def allocate(self, request_id: str, identifier: str, num_tokens: int) -> None:
        """Room for an item the runner encodes this step, referenced by ``request_id``."""
        self.cached.setdefault(identifier, set()).add(request_id)
        self.sizes[identifier] = num_tokens
        self.refs.setdefault(request_id, set()).add(identifier)
        self.num_free_slots -= num_tokens
        self.num_freeable_slots -= num_tokens

    # -- references ---------------------------------------------------------------
    def free_encoder_input(self, request_id: str, identifier: str) -> None:
        """``request_id`` needs ``identifier`` no more (its range is in the KV cache)."""
        holders = self.cached.get(identifier)
        mine = self.refs.get(request_id)
        if holders is None or request_id not in holders:
            return
        holders.discard(request_id)
        if mine is not None:
            mine.discard(identifier)
            if not mine:
                del self.refs[request_id]
        if not holders:
            size = self.sizes[identifier]
            self.freeable[identifier] = size
            self.num_freeable_slots += size

    def free(self, request_id: str) -> None:
        """Drop every reference of a finished or preempted request."""
        for identifier in list(self.refs.get(request_id, ())):
            self.free_encoder_input(request_id, identifier)

    def referenced_by(self, request_id: str) -> Iterable[str]:
        return tuple(self.refs.get(request_id, ()))

    def get_freed_mm_hashes(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    # -- the whole cache -------------------------------------------------------------
    @property
    def num_referenced(self) -> int:
        """Entries some live request still needs."""
        return sum(1 for holders in self.cached.values() if holders)

    def reset(self) -> bool:
        """Evict everything, unless a live request still needs an entry (False then)."""
        if self.num_referenced:
            return False
        self.freed.extend(self.cached)
        self.cached.clear()
        self.freeable.clear()
        self.sizes.clear()
        self.num_free_slots = self.num_freeable_slots = self.cache_size
        return True

    def make_stats(self) -> tuple[int, int]:
        """(queries, hits) since the last call, as the prefix cache's stats are."""
        q, h = self.queries - self._stats_queries, self.hits - self._stats_hits
        self._stats_queries, self._stats_hits = self.queries, self.hits
        return q, h

    @property
    def usage(self) -> float:
        """Fraction of the cache holding entries (referenced or freeable)."""
        return 1.0 - self.num_free_slots / self.cache_size
