"""KV cache blocks: reference counts, the LRU free-block queue and the hash-to-block map."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class KVCacheBlock:
    """One block of KV cache. ``block_hash`` is set once the block is full and cached."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, in eviction order (front is evicted first).

    Freed blocks go to the back, so the least recently used are evicted first;
    ``KVCacheManager.free`` appends a request's blocks tail-first, so within a
    freed chain the tail (least likely to be shared) goes before its prefix.
    Removal from the middle (a cache hit on a free block) is O(1).
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = self._tail
        self._tail.prev_free = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise ValueError("no free blocks left")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, {self.num_free_blocks} left")
        out = []
        block = self._head.next_free
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        self._head.next_free = block
        assert block is not None
        block.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        self._unlink(block)

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free
        return out


class BlockPool:
    """Owns every KV block: hands out free ones, shares cached ones, takes them back.

    A block is in exactly one of two states: referenced (``ref_cnt > 0``, not
    in the free queue) or free (``ref_cnt == 0``, in the free queue). A free
    block may still carry its hash and be revived by a cache hit until it is
    evicted for reuse.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the front of the free queue, evicting their hashes."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        cached = self.cached_block_hash_to_block
        for block in blocks:
            if block.block_hash is not None:
                if cached.get(block.block_hash) is block:
                    del cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, reviving free ones."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those that reach zero join the
        free queue in the given order (first given is evicted first)."""
        append = self.free_block_queue.append
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                append(block)

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes], start: int, end: int
    ) -> None:
        """Register blocks[start:end], now full, under their hashes.

        When another block already holds the same hash (two requests computed
        the same prefix at once), the later one stays uncached: lookups find
        the first, and the duplicate is freed normally.
        """
        cached = self.cached_block_hash_to_block
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None:
                continue
            h = block_hashes[i]
            if h not in cached:
                block.block_hash = h
                cached[h] = block

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forget these blocks' hashes (their contents are not what the hash says)."""
        cached = self.cached_block_hash_to_block
        for block in blocks:
            h = block.block_hash
            if h is not None:
                if cached.get(h) is block:
                    del cached[h]
                block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
