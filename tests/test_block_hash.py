import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enginecore import SamplingParams, block_hashes
from enginecore.request import Request
from enginecore.sched.block_hash import block_hashes_py, encode_extra_keys


def reference(tokens, block_size, extra=b""):
    """The documented encoding, written out independently of the package."""
    prev = bytes(32)
    out = []
    for i in range(len(tokens) // block_size):
        blk = tokens[i * block_size : (i + 1) * block_size]
        prev = hashlib.sha256(prev + struct.pack(f"<{block_size}I", *blk) + extra).digest()
        out.append(prev)
    return out


def test_matches_documented_encoding(hot_path):
    tokens = list(range(100, 150))
    got = block_hashes(tokens, 16)
    assert len(got) == 3 and all(len(h) == 32 for h in got)
    assert got == reference(tokens, 16)


def test_extra_keys_encoding_and_effect(hot_path):
    tokens = [1] * 32
    assert encode_extra_keys([7, "salt", b"\x00"]) == (
        b"i" + struct.pack("<q", 7) + b"s" + struct.pack("<I", 4) + b"salt"
        + b"b" + struct.pack("<I", 1) + b"\x00"
    )
    plain = block_hashes(tokens, 16)
    lora = block_hashes(tokens, 16, extra_keys=[7])
    salted = block_hashes(tokens, 16, extra_keys=["salt"])
    assert lora == reference(tokens, 16, encode_extra_keys([7]))
    assert len({plain[0], lora[0], salted[0]}) == 3


def test_chaining_with_parent(hot_path):
    tokens = list(range(64))
    full = block_hashes(tokens, 16)
    assert block_hashes(tokens[16:], 16, parent=full[0]) == full[1:]
    assert block_hashes(tokens[:15], 16) == []


def test_bad_inputs(hot_path):
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([-1] * 16, 16)
    with pytest.raises(ValueError, match="parent"):
        block_hashes([1] * 16, 16, parent=b"short")
    with pytest.raises(ValueError, match="algo"):
        block_hashes([1] * 16, 16, algo="md5")
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1] * 16, 0)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block_size=st.sampled_from([1, 4, 16]),
    extra=st.one_of(st.none(), st.lists(st.one_of(st.integers(-(2**63), 2**63 - 1), st.text()),
                                        max_size=2)),
)
def test_active_path_equals_python_twin(tokens, block_size, extra):
    assert block_hashes(tokens, block_size, extra_keys=extra) == block_hashes_py(
        tokens, block_size, None, encode_extra_keys(extra)
    )


def test_request_extends_hashes_incrementally(hot_path):
    prompt = list(range(1, 30))
    req = Request("r", prompt, SamplingParams(), None, block_size=16, cache_salt="x")
    assert len(req.block_hashes) == 1
    for t in range(40):
        req.append_output_token_ids([t])
    assert req.block_hashes == block_hashes(req.all_token_ids, 16, extra_keys=["x"])
    assert len(req.block_hashes) == len(req.all_token_ids) // 16


class _Id(int):
    """An int subclass: hashed as its value, as the Python twin does."""


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("odd", [2**30, 2**31 + 5, 2**32 - 1, True, _Id(7)])
def test_ids_off_the_fast_read_mid_chain(hot_path, block_size, odd):
    """The SHA-NI chain reads small ints between rounds and hands over to the
    general path at the first other id: the digests across the hand-over (and
    the chain after it) are the documented ones."""
    tokens = [(i * 7919) % 150000 for i in range(block_size * 9 + 3)]
    for at in (0, block_size * 3 + 1, len(tokens) - 4):
        seq = list(tokens)
        seq[at] = odd
        want = reference([int(t) for t in seq], block_size)
        assert block_hashes(seq, block_size) == want
        assert block_hashes(tuple(seq), block_size) == want
        salted = reference([int(t) for t in seq], block_size, encode_extra_keys(["s" * 40]))
        assert block_hashes(seq, block_size, extra_keys=["s" * 40]) == salted


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (2**32, ValueError),
                                        (1.0, TypeError), ("3", TypeError)])
def test_bad_id_mid_chain_raises_like_the_twin(hot_path, bad, error):
    tokens = [5] * (16 * 6)
    tokens[16 * 4 + 2] = bad
    with pytest.raises(error):
        block_hashes(tokens, 16)
    with pytest.raises(error):
        block_hashes_py(tokens, 16, None, b"")


def test_a_block_size_beyond_the_ids_hashes_nothing_and_allocates_nothing(hot_path):
    # No full block: nothing may be sized by block_size (2**40 ids of scratch).
    assert block_hashes([1, 2, 3], 2**40) == []
    with pytest.raises(ValueError):
        block_hashes([1, -2, 3], 2**40)  # the tail is still validated
