"""Block pool and KV cache manager: invariants under random operations, and eviction order."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from enginecore import SamplingParams
from enginecore.request import Request
from enginecore.sched.block_pool import BlockPool
from enginecore.sched.kv_cache_manager import KVCacheManager

BLOCK = 4
NUM_BLOCKS = 12


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, max_model_len=64, enable_caching=True)
        self.live: dict[str, Request] = {}
        self.counter = 0

    @rule(prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=12))
    def admit(self, prefix, tail):
        self.counter += 1
        req = Request(f"r{self.counter}", prefix + tail, SamplingParams(), None, block_size=BLOCK)
        hits, n_hit = self.kv.get_computed_blocks(req)
        assert n_hit == len(hits) * BLOCK and n_hit < req.num_tokens
        new = self.kv.allocate_slots(req, req.num_tokens - n_hit, n_hit, hits)
        if new is None:
            assert req.request_id not in self.kv.req_to_blocks
            return
        req.num_computed_tokens = req.num_tokens
        self.live[req.request_id] = req

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 6))
    def decode(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[rid]
        for _ in range(n):
            if self.kv.allocate_slots(req, 1) is None:
                return
            req.num_computed_tokens += 1
            req.append_output_token_ids([data.draw(st.integers(0, 3))])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.kv.free(self.live.pop(rid))

    @rule()
    def reset(self):
        ok = self.kv.reset_prefix_cache()
        assert ok == (not self.live)

    @invariant()
    def conserved(self):
        pool = self.kv.block_pool
        free = pool.free_block_queue.get_all_free_blocks()
        assert len(free) == pool.get_num_free_blocks()
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free)
        refs: dict[int, int] = {}
        for blocks in self.kv.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in pool.blocks:
            assert b.ref_cnt >= 0
            assert b.ref_cnt == refs.get(b.block_id, 0)
            assert (b.block_id in free_ids) == (b.ref_cnt == 0)
        assert len(free_ids) + len(refs) == NUM_BLOCKS
        for h, b in pool.cached_block_hash_to_block.items():
            assert b.block_hash == h


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_freed_chain_evicts_tail_first():
    kv = KVCacheManager(8, BLOCK, max_model_len=64)
    req = Request("a", list(range(16)), SamplingParams(), None, block_size=BLOCK)
    kv.allocate_slots(req, 16)
    chain = [b.block_id for b in kv.req_to_blocks["a"]]
    kv.free(req)
    # 4 never-used blocks first, then the chain tail before its head.
    order = [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]
    assert order[-4:] == chain[::-1]
    new = kv.block_pool.get_new_blocks(5)
    assert new[-1].block_id == chain[-1]
    assert kv.block_pool.get_cached_block(req.block_hashes[0]) is not None
    assert kv.block_pool.get_cached_block(req.block_hashes[3]) is None


def test_prefix_hit_revives_free_blocks_and_counts_stats():
    kv = KVCacheManager(16, BLOCK, max_model_len=64)
    a = Request("a", list(range(10)), SamplingParams(), None, block_size=BLOCK)
    kv.allocate_slots(a, 10)
    kv.free(a)
    b = Request("b", list(range(9)) + [99, 98], SamplingParams(), None, block_size=BLOCK)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [h.block_hash for h in hits] == a.block_hashes[:2]
    assert kv.allocate_slots(b, b.num_tokens - n, n, hits) is not None
    assert all(h.ref_cnt == 1 for h in hits)
    stats = kv.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 11, 8)


def test_last_token_is_always_recomputed():
    kv = KVCacheManager(16, BLOCK, max_model_len=64)
    a = Request("a", list(range(8)), SamplingParams(), None, block_size=BLOCK)
    kv.allocate_slots(a, 8)
    b = Request("b", list(range(8)), SamplingParams(), None, block_size=BLOCK)
    _, n = kv.get_computed_blocks(b)
    assert n == 4


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(2, BLOCK, max_model_len=64)
    a = Request("a", list(range(12)), SamplingParams(), None, block_size=BLOCK)
    assert kv.allocate_slots(a, 12) is None
    assert kv.block_pool.get_num_free_blocks() == 2


def test_pool_rejects_double_free_and_empty_pool():
    pool = BlockPool(2, True)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([blk])
    with pytest.raises(ValueError):
        BlockPool(0, True)
