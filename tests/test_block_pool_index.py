"""The native pool's hash -> block index (csrc/hash_index.h, open addressing
with backward-shift deletion) against the Python twin's dict, under many random
cache / uncache / evict / reset operations: past its first growths, with hashes
that share their home slot (long probe chains across the wrap-around), and with
the same hash offered by two blocks."""

import random

import pytest

from enginecore import _C
from enginecore.sched.block_pool import PyBlockPool


def colliding_hash(rng: random.Random, homes: int) -> bytes:
    # the index homes a hash by its first 8 bytes: few distinct values force
    # chains (negative: the last slots, so chains wrap around the table's end);
    # the tag bytes (8-12) sometimes equal too, so full keys decide
    value = rng.randrange(homes) if homes > 0 else (1 << 64) - 1 - rng.randrange(-homes)
    head = value.to_bytes(8, "little")
    tag = rng.randrange(4).to_bytes(4, "little")
    return head + tag + rng.randbytes(20)


def same_state(native, twin, num_blocks, hashes):
    assert native.num_cached_blocks() == twin.num_cached_blocks()
    assert native.get_num_free_blocks() == twin.get_num_free_blocks()
    for h in hashes:
        assert native.get_cached_block(h) == twin.get_cached_block(h)
    for b in range(0, num_blocks, 7):
        assert native.block_hash(b) == twin.block_hash(b)


@pytest.mark.parametrize("homes", [3, -3, 64, 1 << 62])
@pytest.mark.parametrize("seed", range(3))
def test_index_agrees_with_the_twin(homes, seed):
    if _C is None:
        pytest.fail("the native extension is not built")
    rng = random.Random(seed)
    num_blocks = 6000  # > 1024 / 2 cached: the index grows several times
    native, twin = _C.BlockPool(num_blocks, True), PyBlockPool(num_blocks, True)
    pool_hashes = [colliding_hash(rng, homes) for _ in range(900)]
    held: list[int] = []
    for step in range(400):
        op = rng.random()
        if op < 0.45 and native.get_num_free_blocks() >= 64:
            n = rng.randrange(1, 64)
            got = native.get_new_blocks(n)  # evicts the front's hashes
            assert got == twin.get_new_blocks(n)
            hs = [rng.choice(pool_hashes) for _ in got]
            native.cache_full_blocks(got, hs, 0, len(got))
            twin.cache_full_blocks(got, hs, 0, len(got))
            held.extend(got)
        elif op < 0.75 and held:
            rng.shuffle(held)
            k = rng.randrange(1, len(held) + 1)
            freed, held = held[:k], held[k:]
            native.free_blocks(freed)
            twin.free_blocks(freed)
        elif op < 0.95 and held:
            gone = rng.sample(held, min(len(held), rng.randrange(1, 40)))
            native.uncache(gone)
            twin.uncache(gone)
        elif not held:
            assert native.reset_prefix_cache() == twin.reset_prefix_cache()
        if step % 25 == 0:
            same_state(native, twin, num_blocks, pool_hashes)
    same_state(native, twin, num_blocks, pool_hashes)
