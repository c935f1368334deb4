"""KVCacheBlocks: the blocks a request holds, in the shape vLLM's connectors read.

vLLM passes ``KVCacheBlocks`` to ``update_state_after_alloc``; connectors call
``blocks.get_block_ids()`` (one list per KV cache group) or
``get_unhashed_block_ids()``. This engine has one group (full attention)."""

from __future__ import annotations


class KVCacheBlocks:
    __slots__ = ("block_ids", "num_hashed")

    def __init__(self, block_ids: list[int], num_hashed: int = 0) -> None:
        self.block_ids = block_ids
        # How many leading blocks are prefix-cache hits (already hashed and cached).
        self.num_hashed = num_hashed

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.block_ids),)

    def get_unhashed_block_ids(self) -> list[int]:
        return self.block_ids[self.num_hashed:]

    def __len__(self) -> int:
        return len(self.block_ids)
