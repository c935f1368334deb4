"""What `block_hashes` takes as ids and as a parent, alike on both paths: ids as
array('I', ids) reads them (anything with __index__), bytes refused, a parent as
any 32-byte bytes-like object."""

from array import array

import numpy as np
import pytest

from enginecore import block_hashes
from enginecore.sched.block_hash import tokens_to_bytes

TOKENS = list(range(1000, 1040))


class Index:
    """An id that is not an int but has __index__ (as numpy scalars do)."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value


@pytest.mark.parametrize("kind", ["numpy scalars", "numpy int64 array", "numpy uint32 array",
                                  "__index__ objects", "mixed"])
def test_ids_with_index_hash_as_their_ints(hot_path, kind):
    expected = block_hashes(TOKENS, 16)
    ids = {
        "numpy scalars": [np.int64(t) for t in TOKENS],
        "numpy int64 array": np.array(TOKENS, dtype=np.int64),
        "numpy uint32 array": np.array(TOKENS, dtype=np.uint32),
        "__index__ objects": [Index(t) for t in TOKENS],
        # the first odd id after the first full blocks: the chain stops and starts again
        "mixed": TOKENS[:20] + [np.int32(t) for t in TOKENS[20:]],
    }[kind]
    assert block_hashes(ids, 16) == expected
    assert block_hashes(tuple(ids), 5) == block_hashes(TOKENS, 5)


def test_index_that_mutates_the_list_reads_what_was_there(hot_path):
    tokens = list(TOKENS)

    class Clearing(Index):
        def __index__(self):
            tokens.clear()
            return self.value

    tokens[17] = Clearing(TOKENS[17])
    assert block_hashes(tokens, 16) == block_hashes(TOKENS, 16)


@pytest.mark.parametrize("ids, error", [
    ([Index(-1)] + TOKENS, ValueError),
    ([Index(2**40), "x"] + TOKENS, ValueError),   # the first bad id decides
    (TOKENS + ["x", Index(2**40)], TypeError),
    (TOKENS + [np.float32(1.0)], TypeError),
    ([Index(1)] * 16 + [None], TypeError),
])
def test_bad_ids_raise_the_same_error(hot_path, ids, error):
    with pytest.raises(error, match="token ids"):
        block_hashes(ids, 16)


@pytest.mark.parametrize("raised, error, match", [
    (RuntimeError("broken id"), RuntimeError, "broken id"),  # propagates as it is
    (OverflowError("boom"), ValueError, "token ids must be in"),  # a range error, as array()
])
def test_an_index_that_raises(hot_path, raised, error, match):
    class Raising:
        def __index__(self):
            raise raised

    with pytest.raises(error, match=match):
        block_hashes(TOKENS + [Raising()], 16)


@pytest.mark.parametrize("raw", [bytes(64), bytearray(64)])
def test_bytes_are_not_ids(hot_path, raw):
    with pytest.raises(TypeError, match="not bytes"):
        block_hashes(raw, 16)
    with pytest.raises(TypeError, match="not bytes"):
        tokens_to_bytes(raw)


def test_parent_as_any_32_byte_bytes_like(hot_path):
    full = block_hashes(TOKENS, 8)
    parent = full[0]
    expected = full[1:]
    strided = memoryview(bytes(parent[i // 2] if i % 2 == 0 else 0 for i in range(64)))[::2]
    for p in (parent, bytearray(parent), memoryview(parent), array("B", parent), strided):
        assert block_hashes(TOKENS[8:], 8, parent=p) == expected, type(p)
    with pytest.raises(ValueError, match="32 bytes"):
        block_hashes(TOKENS, 8, parent=bytearray(31))
    for p in ("x" * 32, 32, [0] * 32):
        with pytest.raises(TypeError, match="parent hash must be bytes"):
            block_hashes(TOKENS, 8, parent=p)


def test_extra_must_be_bytes_on_both_paths():
    from enginecore import _C
    from enginecore.sched.block_hash import block_hashes_py

    for extra in (bytearray(b"x"), "x", None):
        for fn in (_C.block_hashes, block_hashes_py):
            with pytest.raises(TypeError):
                fn(TOKENS, 16, None, extra)


def test_uint32_wraps_are_not_taken(hot_path):
    # 2**32 + t is not t: refused, never hashed as its low 32 bits
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([np.uint64(2**32 + 5)] * 16, 16)


def test_str_is_not_ids(hot_path):
    for text in ("", "abcd" * 8):
        with pytest.raises(TypeError, match="not str"):
            block_hashes(text, 4)


def test_block_sizes_past_any_sequence_hash_nothing(hot_path):
    for size in (2**62, 2**63, 2**64, 2**80):
        assert block_hashes(TOKENS, size) == []
    with pytest.raises(ValueError, match="token ids"):
        block_hashes(TOKENS + [-1], 2**64)  # every id is still checked


def test_containers_read_their_own_items_once(hot_path):
    class ListWithOwnIter(list):
        def __iter__(self):
            return iter([7] * len(self))

    class TupleWithOwnGetitem(tuple):
        def __getitem__(self, i):
            return 7

    assert block_hashes(ListWithOwnIter(TOKENS), 16) == block_hashes(TOKENS, 16)
    assert block_hashes(TupleWithOwnGetitem(TOKENS), 16) == block_hashes(TOKENS, 16)

    # a generator whose ids depend on how far it has been drawn: all drawn first
    drawn = []

    class Seen(Index):
        def __index__(self):
            return self.value + len(drawn)

    def gen():
        for t in TOKENS:
            drawn.append(t)
            yield Seen(t)

    expected = [t + len(TOKENS) for t in TOKENS]
    assert block_hashes(gen(), 16) == block_hashes(expected, 16)
