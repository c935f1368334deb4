"""Per-request KV block tables on top of the block pool, with prefix caching.

The block pool and the request table (with each request's block table) are the
native structures or their Python twins, picked once here by the native switch;
this class holds the policy (what a hit is, what is counted) over them.
"""

from __future__ import annotations

from typing import Any

from enginecore.protocol import PrefixCacheStats
from enginecore.request import Request
from enginecore.sched.block_pool import block_pool_class
from enginecore.sched.request_table import request_table_class


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool: Any = block_pool_class()(num_blocks, enable_caching)
        self.request_table: Any = request_table_class()(self.block_pool, block_size)
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def req_to_blocks(self) -> dict[str, list[int]]:
        """Every request's block ids, for requests that hold blocks (a snapshot)."""
        return self.request_table.block_tables()

    def adopt(self, request: Request) -> None:
        """Bring a request made outside this manager into its table."""
        if request.table is not self.request_table:
            request.move_to(self.request_table)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Stats since the last call (then reset)."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The block ids of the longest cached prefix of full blocks, and how many
        tokens it covers.

        At least the last prompt token is always recomputed: the model needs
        its logits to sample. A request with prompt_logprobs computes every
        prompt position (vLLM: it skips the prefix cache).
        """
        if (not self.enable_caching or request.pooling_params is not None
                or request.sampling_params.prompt_logprobs is not None):
            return [], 0
        self.adopt(request)
        num_tokens = request.num_tokens
        hits = self.request_table.get_computed_blocks(
            request.slot, (num_tokens - 1) // self.block_size)
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += num_tokens
        stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[int] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        Returns the newly allocated block ids, or None (changing nothing) when
        the free blocks do not suffice. Blocks that become full of computed
        tokens are registered in the prefix cache.
        """
        self.adopt(request)
        return self.request_table.allocate_slots(
            request.slot, num_new_tokens, num_new_computed_tokens, new_computed_blocks or [],
            num_lookahead_tokens, self.max_model_len)

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first so its tail is evicted first."""
        if request.table is self.request_table:
            self.request_table.free_blocks(request.slot)

    def uncache_from(self, request: Request, num_tokens: int) -> None:
        """The request's tokens from ``num_tokens`` on were never computed (their
        step failed): its blocks past that point leave the prefix cache."""
        if request.table is self.request_table:
            self.request_table.uncache_from(request.slot, num_tokens)

    def get_block_ids(self, request: Request) -> list[int]:
        if request.table is not self.request_table:
            return []
        return self.request_table.get_block_ids(request.slot)

    def reset_prefix_cache(self) -> bool:
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self.prefix_cache_stats.reset = True
        return ok
