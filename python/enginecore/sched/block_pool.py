"""KV cache blocks: reference counts, the LRU free-block queue and the hash-to-block map.

``PyBlockPool`` is the pure-Python twin of ``_C.BlockPool`` (csrc/block_pool.cpp):
the same interface over int block ids, the same results. ``block_pool_class()``
picks the pair by the native switch; the scheduler never knows which it has.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import index

from enginecore import _native
from enginecore.sched.arg_checks import boolean, int64, int64_error

# The native pool's ids are int32 (csrc/block_pool.h); a pool this large is an
# operator's typo, refused before it allocates (the lists below are 40 bytes a block).
MAX_BLOCKS = 1 << 30


class PyBlockPool:
    """Owns every KV block: hands out free ones, shares cached ones, takes them back.

    A block is in exactly one of two states: referenced (``ref_cnt > 0``, not
    in the free queue) or free (``ref_cnt == 0``, in the free queue). A free
    block may still carry its hash and be revived by a cache hit until it is
    evicted for reuse. The free queue is a doubly linked list over block ids
    (front is evicted first; freed blocks go to the back); removal from the
    middle, a cache hit on a free block, is O(1).
    """

    __slots__ = ("num_blocks", "enable_caching", "num_evictions", "num_free_blocks",
                 "_ref_cnt", "_hash", "_prev", "_next", "_head", "_tail", "_cached")

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        num_blocks = int64(num_blocks, "num_blocks")
        enable_caching = boolean(enable_caching, "enable_caching")
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        if num_blocks > MAX_BLOCKS:
            raise ValueError("too many KV blocks")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.num_evictions = 0
        self.num_free_blocks = num_blocks
        self._ref_cnt = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        # Links over ids; num_blocks is the head sentinel, num_blocks + 1 the tail.
        self._head, self._tail = num_blocks, num_blocks + 1
        self._next = list(range(1, num_blocks + 1)) + [self._tail, -1]
        self._next[num_blocks - 1] = self._tail
        self._next[self._head] = 0
        self._prev = [self._head] + list(range(num_blocks - 1)) + [-1, num_blocks - 1]
        self._cached: dict[bytes, int] = {}

    # -- reading ---------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> int | None:
        """The block holding ``block_hash``, or None."""
        block = self._cached.get(block_hash)
        if block is None:
            _check_hash(block_hash)
        return block

    def ref_cnt(self, block_id: int) -> int:
        self._check(block_id)
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        self._check(block_id)
        return self._hash[block_id]

    def num_cached_blocks(self) -> int:
        """How many blocks are registered under a hash."""
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free queue, front (evicted first) to back."""
        out = []
        block = self._next[self._head]
        while block != self._tail:
            out.append(block)
            block = self._next[block]
        return out

    # -- changing --------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` from the front of the free queue, evicting their hashes."""
        num_blocks = int64(num_blocks, "num_blocks")
        if num_blocks < 0:
            raise ValueError(f"asked for {num_blocks} blocks")
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} free blocks, {self.num_free_blocks} left")
        nxt, prev, hashes, ref, cached = (self._next, self._prev, self._hash, self._ref_cnt,
                                          self._cached)
        out = []
        block = nxt[self._head]
        for _ in range(num_blocks):
            out.append(block)
            following = nxt[block]
            nxt[block] = prev[block] = -1
            h = hashes[block]
            if h is not None:
                if cached.get(h) == block:
                    del cached[h]
                hashes[block] = None
                self.num_evictions += 1
            ref[block] = 1
            block = following
        nxt[self._head] = block
        prev[block] = self._head
        self.num_free_blocks -= num_blocks
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cache-hit blocks, reviving free ones."""
        ref = self._ref_cnt
        # Every id checked first: a bad one changes nothing (as the native pool).
        for block in self._checked(block_ids):
            if ref[block] == 0:
                self._unlink(block)
            ref[block] += 1

    def free_blocks(self, ordered_block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; those that reach zero join the
        back of the free queue in the given order (first given is evicted first)."""
        ref, nxt, prev, tail = self._ref_cnt, self._next, self._prev, self._tail
        for block in self._checked(ordered_block_ids):
            if ref[block] <= 0:
                raise RuntimeError(f"double free of block {block}")
            ref[block] -= 1
            if ref[block] == 0:
                last = prev[tail]
                nxt[last] = block
                prev[block] = last
                nxt[block] = tail
                prev[tail] = block
                self.num_free_blocks += 1

    def cache_full_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[bytes],
                          start: int, end: int) -> None:
        """Register block_ids[start:end], now full, under their hashes.

        When another block already holds the same hash (two requests computed
        the same prefix at once), the later one stays uncached: lookups find
        the first, and the duplicate is freed normally.
        """
        start, end = int64(start, "start"), int64(end, "end")
        if start < 0 or end > len(block_ids) or end > len(block_hashes):
            raise IndexError(f"blocks [{start}, {end}) out of range")
        hashes, cached = self._hash, self._cached
        for i in range(start, end):
            block = block_ids[i]
            self._check(block)
            if hashes[block] is not None:
                continue
            h = block_hashes[i]
            _check_hash(h)
            if h not in cached:
                hashes[block] = h
                cached[h] = block

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Forget these blocks' hashes (their contents are not what the hash says)."""
        hashes, cached = self._hash, self._cached
        for block in self._checked(block_ids):
            h = hashes[block]
            if h is not None:
                if cached.get(h) == block:
                    del cached[h]
                hashes[block] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self._hash = [None] * self.num_blocks
        self._cached.clear()
        return True

    def _unlink(self, block: int) -> None:
        prev, nxt = self._prev[block], self._next[block]
        if prev < 0 or nxt < 0:
            raise RuntimeError(f"block {block} is not in the free queue")
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._prev[block] = self._next[block] = -1
        self.num_free_blocks -= 1

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise (int64_error(block_id, "block id")
                   or IndexError(f"block id {block_id} out of range [0, {self.num_blocks})"))

    def _checked(self, block_ids: Iterable[int]) -> list[int]:
        ids = [index(b) for b in block_ids]
        n = self.num_blocks
        for block in ids:
            if not 0 <= block < n:
                self._check(block)
        return ids


def _check_hash(block_hash: object) -> None:
    if not isinstance(block_hash, bytes):
        raise TypeError("block hashes are bytes")
    if len(block_hash) != 32:
        raise ValueError(f"block hashes are 32 bytes, got {len(block_hash)}")


def block_pool_class() -> type:
    """``_C.BlockPool`` on the native path, ``PyBlockPool`` otherwise."""
    return _native.twin("BlockPool", PyBlockPool)
