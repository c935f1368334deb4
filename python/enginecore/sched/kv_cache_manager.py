"""Per-request KV block tables on top of the block pool, with prefix caching."""

from __future__ import annotations

from enginecore.protocol import PrefixCacheStats
from enginecore.request import Request
from enginecore.sched.block_pool import BlockPool, KVCacheBlock


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading blocks of each request already registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Stats since the last call (then reset)."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks, and how many tokens it covers.

        At least the last prompt token is always recomputed: the model needs
        its logits to sample. A request with prompt_logprobs computes every
        prompt position (vLLM: it skips the prefix cache).
        """
        if (not self.enable_caching or request.pooling_params is not None
                or request.sampling_params.prompt_logprobs is not None):
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        get = self.block_pool.get_cached_block
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_hit_blocks]:
            block = get(h)
            if block is None:
                break
            hits.append(block)
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        Returns the newly allocated blocks, or None (changing nothing) when the
        free blocks do not suffice. Blocks that become full of computed tokens
        are registered in the prefix cache.
        """
        if num_new_tokens <= 0 and not new_computed_blocks:
            raise ValueError("num_new_tokens must be positive")
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        bs = self.block_size
        if req_blocks is not None and not new_computed_blocks and not num_lookahead_tokens:
            # Fast path (most decodes): the tokens fit in the blocks the request has.
            end = request.num_computed_tokens + num_new_tokens
            if end <= len(req_blocks) * bs:
                if self.enable_caching:
                    num_full = (end if end < request.num_tokens else request.num_tokens) // bs
                    done = self.num_cached_blocks[req_id]
                    if num_full > done:
                        self.block_pool.cache_full_blocks(
                            req_blocks, request.block_hashes, done, num_full)
                        self.num_cached_blocks[req_id] = num_full
                return []
        new_computed_blocks = new_computed_blocks or []
        if req_blocks is None:
            req_blocks = []
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_needed = min(
            num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        num_new_blocks = -(-num_needed // bs) - len(req_blocks) - len(new_computed_blocks)
        pool = self.block_pool
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > pool.get_num_free_blocks() - num_revived:
            return None
        if req_id not in self.req_to_blocks:
            self.req_to_blocks[req_id] = req_blocks
            self.num_cached_blocks[req_id] = 0
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // bs
            done = self.num_cached_blocks[req_id]
            if num_full > done:
                pool.cache_full_blocks(req_blocks, request.block_hashes, done, num_full)
                self.num_cached_blocks[req_id] = num_full
        return new_blocks

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first so its tail is evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def uncache_from(self, request: Request, num_tokens: int) -> None:
        """The request's tokens from ``num_tokens`` on were never computed (their
        step failed): its blocks past that point leave the prefix cache."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        first = num_tokens // self.block_size
        self.block_pool.uncache(blocks[first:])
        done = self.num_cached_blocks.get(request.request_id)
        if done is not None and done > first:
            self.num_cached_blocks[request.request_id] = first

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self.prefix_cache_stats.reset = True
        return ok
