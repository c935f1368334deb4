"""EncoderCacheManager (vLLM's semantics): hits take references, freeable
entries stay cached until room is needed (oldest first), the budget and the
cache bound what one step may encode, reset is refused while needed."""

from __future__ import annotations

import pytest

from enginecore.sched.encoder_cache_manager import EncoderCacheManager


def test_reference_counting_and_lru_eviction():
    ec = EncoderCacheManager(10)
    assert not ec.check_and_update_cache("r1", "a")
    assert ec.can_allocate(4, compute_budget=10, num_tokens_to_schedule=0)
    ec.allocate("r1", "a", 4)
    assert ec.check_and_update_cache("r2", "a")  # a second request: a hit
    ec.allocate("r1", "b", 4)
    assert ec.num_free_slots == 2
    # Nothing is freeable: 4 more tokens do not fit.
    assert not ec.can_allocate(4, compute_budget=10, num_tokens_to_schedule=0)
    ec.free("r1")
    assert "a" not in ec.freeable  # r2 still needs it
    assert list(ec.freeable) == ["b"]
    assert ec.can_allocate(4, compute_budget=10, num_tokens_to_schedule=0)  # evicts b
    assert ec.get_freed_mm_hashes() == ["b"] and "b" not in ec.cached
    ec.allocate("r3", "c", 4)
    ec.free("r2")
    assert ec.check_and_update_cache("r4", "a")  # freeable, still cached: reused
    assert "a" not in ec.freeable
    assert (ec.queries, ec.hits) == (3, 2)
    assert ec.make_stats() == (3, 2) and ec.make_stats() == (0, 0)


def test_compute_budget_and_size_bound():
    ec = EncoderCacheManager(8)
    assert not ec.can_allocate(5, compute_budget=4, num_tokens_to_schedule=0)
    assert not ec.can_allocate(5, compute_budget=10, num_tokens_to_schedule=4)
    assert ec.can_allocate(4, compute_budget=10, num_tokens_to_schedule=4)


def test_reset_refused_while_needed():
    ec = EncoderCacheManager(8)
    ec.allocate("r", "a", 3)
    assert ec.reset() is False and "a" in ec.cached
    ec.free("r")
    assert ec.reset() is True
    assert not ec.cached and ec.num_free_slots == 8 and ec.get_freed_mm_hashes() == ["a"]
    assert ec.usage == 0.0


def test_bad_size():
    with pytest.raises(ValueError, match="cache_size"):
        EncoderCacheManager(0)
