"""Block pool, request table and KV cache manager: invariants under random
operations on both paths, the native structures against their Python twins in
lockstep, and eviction order."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from enginecore import SamplingParams, _native
from enginecore.request import Request
from enginecore.sched.block_pool import PyBlockPool
from enginecore.sched.kv_cache_manager import KVCacheManager
from enginecore.sched.request_table import PyRequestTable

BLOCK = 4
NUM_BLOCKS = 12


def make_kv(native: bool, num_blocks: int = NUM_BLOCKS) -> KVCacheManager:
    previous = _native._enabled
    _native.set_native(native)
    try:
        return KVCacheManager(num_blocks, BLOCK, max_model_len=64, enable_caching=True)
    finally:
        _native._enabled = previous


def pool_state(kv: KVCacheManager) -> tuple:
    """Everything observable about the pool and the block tables."""
    pool = kv.block_pool
    blocks = range(pool.num_blocks)
    return (pool.free_block_ids(), [pool.ref_cnt(b) for b in blocks],
            [pool.block_hash(b) for b in blocks], pool.num_cached_blocks(),
            pool.get_num_free_blocks(), pool.num_evictions, kv.req_to_blocks)


class KVCacheMachine(RuleBasedStateMachine):
    """Random admissions, decodes, frees and resets on one KV cache manager per
    path, in lockstep: the invariants hold on each, and both agree exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.kvs = [make_kv(False)] + ([make_kv(True)] if _native._ext is not None else [])
        self.live: dict[str, list[Request]] = {}
        self.counter = 0

    @rule(prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=12),
          salt=st.sampled_from([None, "s"]))
    def admit(self, prefix, tail, salt):
        self.counter += 1
        rid = f"r{self.counter}"
        results = []
        reqs = []
        for kv in self.kvs:
            req = Request(rid, prefix + tail, SamplingParams(), None, block_size=BLOCK,
                          cache_salt=salt, table=kv.request_table)
            hits, n_hit = kv.get_computed_blocks(req)
            assert n_hit == len(hits) * BLOCK and n_hit < req.num_tokens
            new = kv.allocate_slots(req, req.num_tokens - n_hit, n_hit, hits)
            results.append((hits, n_hit, new))
            reqs.append(req)
            if new is None:
                assert rid not in kv.req_to_blocks
            else:
                req.num_computed_tokens = req.num_tokens
        assert all(r == results[0] for r in results)
        if results[0][2] is not None:
            self.live[rid] = reqs

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 6))
    def decode(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        for _ in range(n):
            tok = data.draw(st.integers(0, 3))
            got = []
            for kv, req in zip(self.kvs, self.live[rid]):
                new = kv.allocate_slots(req, 1)
                got.append(new)
                if new is not None:
                    req.num_computed_tokens += 1
                    req.append_output_token_ids([tok])
            assert all(g == got[0] for g in got)
            if got[0] is None:
                return

    @precondition(lambda self: self.live)
    @rule(data=st.data(), keep=st.integers(0, 8))
    def uncache(self, data, keep):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        for kv, req in zip(self.kvs, self.live[rid]):
            kv.uncache_from(req, keep)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        for kv, req in zip(self.kvs, self.live.pop(rid)):
            kv.free(req)

    @rule()
    def reset(self):
        oks = [kv.reset_prefix_cache() for kv in self.kvs]
        assert oks == [not self.live] * len(self.kvs)

    @invariant()
    def conserved(self):
        for kv in self.kvs:
            free, refs_seen, hashes, num_cached, num_free, _, tables = pool_state(kv)
            assert len(free) == num_free == len(set(free))
            refs: dict[int, int] = {}
            for blocks in tables.values():
                for b in blocks:
                    refs[b] = refs.get(b, 0) + 1
            for b in range(NUM_BLOCKS):
                assert refs_seen[b] == refs.get(b, 0)
                assert (b in free) == (refs_seen[b] == 0)
            assert len(free) + len(refs) == NUM_BLOCKS
            assert num_cached == sum(h is not None for h in hashes)
            for b, h in enumerate(hashes):
                if h is not None:
                    assert kv.block_pool.get_cached_block(h) == b

    @invariant()
    def paths_agree(self):
        states = [pool_state(kv) for kv in self.kvs]
        assert all(s == states[0] for s in states)
        for reqs in self.live.values():
            views = [(r.all_token_ids, r.block_hashes, r.num_computed_tokens, r.status)
                     for r in reqs]
            assert all(v == views[0] for v in views)


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_freed_chain_evicts_tail_first(hot_path):
    kv = KVCacheManager(8, BLOCK, max_model_len=64)
    req = Request("a", list(range(16)), SamplingParams(), None, block_size=BLOCK)
    kv.allocate_slots(req, 16)
    chain = kv.req_to_blocks["a"]
    kv.free(req)
    # 4 never-used blocks first, then the chain tail before its head.
    order = kv.block_pool.free_block_ids()
    assert order[-4:] == chain[::-1]
    new = kv.block_pool.get_new_blocks(5)
    assert new[-1] == chain[-1]
    assert kv.block_pool.get_cached_block(req.block_hashes[0]) is not None
    assert kv.block_pool.get_cached_block(req.block_hashes[3]) is None
    assert kv.block_pool.num_evictions == 1


def test_prefix_hit_revives_free_blocks_and_counts_stats(hot_path):
    kv = KVCacheManager(16, BLOCK, max_model_len=64)
    a = Request("a", list(range(10)), SamplingParams(), None, block_size=BLOCK)
    kv.allocate_slots(a, 10)
    kv.free(a)
    b = Request("b", list(range(9)) + [99, 98], SamplingParams(), None, block_size=BLOCK)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [kv.block_pool.block_hash(h) for h in hits] == a.block_hashes[:2]
    assert kv.allocate_slots(b, b.num_tokens - n, n, hits) is not None
    assert all(kv.block_pool.ref_cnt(h) == 1 for h in hits)
    stats = kv.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 11, 8)


def test_last_token_is_always_recomputed(hot_path):
    kv = KVCacheManager(16, BLOCK, max_model_len=64)
    a = Request("a", list(range(8)), SamplingParams(), None, block_size=BLOCK)
    kv.allocate_slots(a, 8)
    b = Request("b", list(range(8)), SamplingParams(), None, block_size=BLOCK)
    _, n = kv.get_computed_blocks(b)
    assert n == 4


def test_allocation_failure_changes_nothing(hot_path):
    kv = KVCacheManager(2, BLOCK, max_model_len=64)
    a = Request("a", list(range(12)), SamplingParams(), None, block_size=BLOCK)
    assert kv.allocate_slots(a, 12) is None
    assert kv.block_pool.get_num_free_blocks() == 2
    assert kv.req_to_blocks == {}


def test_pool_rejects_double_free_bad_ids_and_empty_pool(hot_path):
    from enginecore.sched.block_pool import block_pool_class

    cls = block_pool_class()
    pool = cls(2, True)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([blk])
    with pytest.raises(IndexError):
        pool.free_blocks([2])
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    with pytest.raises(ValueError):
        cls(0, True)


def test_a_request_moves_between_tables_of_either_kind(hot_path):
    """A request made on its own (or off the busy loop in another table) keeps its
    tokens, hashes and counts when a scheduler's table adopts it."""
    other = PyRequestTable(PyBlockPool(4, True), BLOCK)
    req = Request("m", list(range(9)), SamplingParams(max_tokens=5, stop_token_ids=[7]), 3,
                  block_size=BLOCK, cache_salt="x", table=other)
    req.append_output_token_ids([1, 2, 3])
    before = (req.all_token_ids, req.output_token_ids, req.block_hashes, req.status)
    kv = KVCacheManager(8, BLOCK, max_model_len=64)
    kv.adopt(req)
    assert req.table is kv.request_table and len(other) == 0
    assert (req.all_token_ids, req.output_token_ids, req.block_hashes, req.status) == before
    assert kv.allocate_slots(req, req.num_tokens) == [0, 1, 2]
    with pytest.raises(ValueError, match="KV blocks"):
        req.move_to(PyRequestTable(None, BLOCK))
    kv.free(req)
    del req
    assert len(kv.request_table) == 0
