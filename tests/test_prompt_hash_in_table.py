"""A prompt added to the request table: its ids copied into the row while its
full blocks are hashed (csrc/request_table_bindings.cpp take_prompt, on SHA-NI
CPUs), on both table kinds: the same ids, the same hashes as
``block_hashes``, the same refusals; ids the chain's fast read does not take
(big ints, bools, int subclasses) hand over to the general path."""

from __future__ import annotations

import pytest

from enginecore import _C as C
from enginecore import block_hashes
from enginecore.sched.block_hash import encode_extra_keys
from enginecore.sched.request_table import PyRequestTable

KINDS = {"native": C.RequestTable, "python": PyRequestTable}


@pytest.fixture(params=["sha-ni", "portable"])
def sha_impl(request):
    """The native table on the CPU's SHA-256 and on the portable one (no SHA-NI:
    the ids are copied first, then hashed)."""
    C.sha256_force_portable(request.param == "portable")
    try:
        yield request.param
    finally:
        C.sha256_force_portable(False)


class _Id(int):
    pass


def add(table, prompt, extra=b"", hash_blocks=True):
    return table.add("r", prompt, 0, 10, 0, -1, False, [], 0, 0.0, extra, hash_blocks)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
@pytest.mark.parametrize("odd", [None, 2**30, 2**32 - 1, True, _Id(11)])
def test_prompt_ids_and_hashes(kind, block_size, odd, sha_impl):
    table = KINDS[kind](None, block_size)
    base = [(i * 7919) % 150000 for i in range(block_size * 7 + 3)]
    for at in (0, block_size * 2 + 1, len(base) - 2):
        prompt = list(base)
        if odd is not None:
            prompt[at] = odd
        for extra in (b"", encode_extra_keys(["salt" * 10])):
            for seq in (prompt, tuple(prompt)):
                slot = add(table, seq, extra)
                assert table.get_token_ids(slot) == [int(t) for t in prompt]
                assert table.get_block_hashes(slot) == block_hashes(
                    [int(t) for t in prompt], block_size,
                    extra_keys=None if not extra else ["salt" * 10])
                # Tokens appended later extend the same chain.
                table.append_token_ids(slot, [5] * block_size)
                assert table.get_block_hashes(slot) == block_hashes(
                    table.get_token_ids(slot), block_size,
                    extra_keys=None if not extra else ["salt" * 10])
                table.release(slot)


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7", None])
def test_bad_prompt_ids_refused_alike(bad, sha_impl):
    errors = {}
    for kind, cls in KINDS.items():
        table = cls(None, 16)
        prompt = [3] * 80
        prompt[37] = bad
        with pytest.raises((TypeError, ValueError, OverflowError)) as e:
            add(table, prompt)
        errors[kind] = e.type
        assert len(table) == 0  # nothing half-added
        # Unhashed rows keep any int (their ids are not hashed).
        if isinstance(bad, int):
            slot = add(table, prompt, hash_blocks=False)
            assert table.get_token_ids(slot)[37] == bad
    assert errors["native"] is errors["python"]


@pytest.mark.parametrize("hash_blocks", [True, False])
@pytest.mark.parametrize("where", [3, 64, 100])
def test_an_index_that_changes_the_prompt_reads_as_python_iterates(sha_impl, hash_blocks, where):
    """An id whose __index__ clears or grows the prompt list while the table reads
    it: the native table reads on as Python's list iteration does (the twin's),
    never from the freed item array."""
    got = {}
    for kind, cls in KINDS.items():
        for change in ("clear", "grow"):
            prompt: list = []

            class Sly:
                def __index__(self, change=change, prompt=prompt):
                    if change == "clear":
                        prompt.clear()
                        _ = [bytearray(4096) for _ in range(20)]  # reuse the freed memory
                    else:
                        prompt.extend([8] * 40)
                    return 5

            prompt.extend([7] * where + [Sly()] + [9] * 300)
            table = cls(None, 16)
            slot = add(table, prompt, hash_blocks=hash_blocks)
            ids = table.get_token_ids(slot)
            got[kind, change] = ids
            if hash_blocks:
                assert table.get_block_hashes(slot) == block_hashes(ids, 16)
    for change in ("clear", "grow"):
        assert got["native", change] == got["python", change]
    assert len(got["native", "clear"]) == where + 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [16, 64, 128])
@pytest.mark.parametrize("salt", [None, "s", "salt" * 60])
def test_decode_appends_hash_each_filled_block(kind, block_size, salt, sha_impl):
    """One token at a time, as decodes append them: each block that fills is
    hashed as ``block_hashes`` hashes it (a small message on the stack on the
    native table; 128-id blocks or a long salt take the chain)."""
    table = KINDS[kind](None, block_size)
    extra = encode_extra_keys([salt]) if salt else b""
    slot = add(table, [(i * 31) % 150000 for i in range(block_size + 5)], extra)
    for i in range(3 * block_size):
        table.append_token_ids(slot, [(i * 7) % 150000])
        ids = table.get_token_ids(slot)
        assert table.get_block_hashes(slot) == block_hashes(
            ids, block_size, extra_keys=[salt] if salt else None)
    with pytest.raises(ValueError):
        table.append_token_ids(slot, [2**32])
    table.release(slot)
