"""The offloading connector's pieces on their own: the tier's index (LRU, pins, only
ready blocks found) and the copier (blocks to host slots and back, byte for byte, in
submission order on its own thread). The connector end to end: test_offloading_connector.py."""

from __future__ import annotations

import time

import pytest
import torch

from enginecore.kv_transfer.offload_copier import LOAD, STORE, CopyJob, OffloadCopier
from enginecore.kv_transfer.offload_tier import OffloadTier


def test_tier_finds_only_ready_leading_blocks():
    tier = OffloadTier(4)
    assert [tier.reserve(h) for h in "abc"] == [0, 1, 2]
    assert tier.reserve("a") is None  # already held
    assert tier.lookup("abc") == 0  # stores not done yet
    tier.complete_store("ab")
    assert tier.lookup("abcd") == 2 and tier.lookup("bc") == 1 and tier.lookup("xa") == 0
    tier.abandon("c")
    assert "c" not in tier and tier.reserve("d") == 2  # the abandoned slot is free again


def test_tier_evicts_least_recently_used_unpinned():
    tier = OffloadTier(2)
    tier.reserve("a"), tier.reserve("b")
    tier.complete_store("ab")
    assert tier.pin("a") == [0]
    tier.lookup("b")
    assert tier.reserve("c") == 1  # "a" is pinned: "b" goes although it was used later
    assert "b" not in tier and tier.stats.evicted_blocks == 1
    assert tier.reserve("d") is None  # "a" pinned, "c" still storing: no room
    tier.unpin("a")
    tier.complete_store("c")
    assert tier.reserve("d") == 0
    assert tier.stats.hit_blocks == 1 and tier.stats.stored_blocks == 3


def wait_jobs(copier: OffloadCopier, n: int) -> list:
    done, deadline = [], time.monotonic() + 30
    while len(done) < n:
        assert time.monotonic() < deadline
        done += copier.take_done()
        time.sleep(0.005)
    return done


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copier_round_trip(dtype):
    layers, blocks, bs, heads, dim = 3, 10, 4, 2, 8
    g = torch.Generator().manual_seed(0)
    kv = [torch.randn(2, blocks + 1, bs, heads, dim, generator=g).to(dtype)
          for _ in range(layers)]
    original = [t.clone() for t in kv]
    copier = OffloadCopier(kv, num_slots=5)
    try:
        copier.submit(CopyJob(STORE, "a", (7, 2, 3), (4, 0, 1)))
        # Submitted after the store: it reads what the store wrote.
        copier.submit(CopyJob(LOAD, "b", (5, 6, 0), (4, 0, 1)))
        done = wait_jobs(copier, 2)
        assert [(j.req_id, ok) for j, ok in done] == [("a", True), ("b", True)]
        for t, o in zip(kv, original):
            assert torch.equal(t[:, [5, 6, 0]], o[:, [7, 2, 3]])
        # The host copy outlives the cache's: blocks overwritten, then loaded back.
        for t in kv:
            t[:, [7, 2, 3]] = 0
        copier.submit(CopyJob(LOAD, "c", (7, 2, 3), (4, 0, 1)))
        wait_jobs(copier, 1)
        for t, o in zip(kv, original):
            assert torch.equal(t[:, [7, 2, 3]], o[:, [7, 2, 3]])
        assert copier.bytes_copied[STORE] == 3 * layers * 2 * bs * heads * dim * \
            kv[0].element_size()
        copier.submit(CopyJob(LOAD, "bad", (99,), (0,)))  # out of range: that job fails
        assert [(j.req_id, ok) for j, ok in wait_jobs(copier, 1)] == [("bad", False)]
        assert copier.wait_idle(5)
    finally:
        copier.close()
