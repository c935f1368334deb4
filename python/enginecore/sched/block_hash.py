"""Chained prefix-cache hashes of full KV blocks (the Python twin of csrc/block_hash.cpp).

The bytes fed to the hash for block ``i`` are defined in docs/architecture.md
("Block hash encoding"):

    parent (32 bytes; 32 zero bytes for the first block)
    || the block's token ids, each as uint32 little endian
    || the block's multimodal keys: the identifiers of the items whose
       placeholder overlaps the block, as str extra keys (``mm_block_extra_keys``)
    || extra keys, only when there are any (see ``encode_extra_keys``)

and the block hash is ``sha256`` of those bytes (32 bytes).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

HASH_ALGOS = ("sha256",)
ROOT_PARENT = bytes(32)

ExtraKey = int | str | bytes

_LITTLE = sys.byteorder == "little"


def encode_extra_keys(extra_keys: Sequence[ExtraKey] | None) -> bytes:
    """Encode extra keys: per key a tag byte then its value.

    int -> b"i" + int64 LE; str -> b"s" + uint32 LE length + UTF-8; bytes -> b"b" + uint32 LE
    length + raw. ``None`` or empty -> b"" (no suffix, so a plain block hashes 32 + 4*B bytes).
    """
    if not extra_keys:
        return b""
    out = bytearray()
    for key in extra_keys:
        if isinstance(key, bool):  # bool is an int subclass; refuse the ambiguity
            raise TypeError("block hash extra keys must be int, str or bytes, not bool")
        if isinstance(key, int):
            out += b"i" + struct.pack("<q", key)
        elif isinstance(key, str):
            raw = key.encode("utf-8")
            out += b"s" + struct.pack("<I", len(raw)) + raw
        elif isinstance(key, bytes):
            out += b"b" + struct.pack("<I", len(key)) + key
        else:
            raise TypeError(f"block hash extra keys must be int, str or bytes, got {type(key)}")
    return bytes(out)


def tokens_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as uint32 little endian; negative or >= 2**32 ids raise ``ValueError``."""
    if isinstance(token_ids, (bytes, bytearray)):  # one id per byte, or raw uint32s?
        raise TypeError("token ids must be a sequence of ints, not bytes")
    if isinstance(token_ids, str):
        raise TypeError("token ids must be ints, not str")
    token_ids = _snapshot(token_ids)
    try:
        arr = array("I", token_ids)
    except OverflowError as e:
        raise ValueError(f"token ids must be in [0, 2**32): {e}") from None
    except TypeError as e:
        raise TypeError(f"token ids must be ints: {e}") from None
    if not _LITTLE:  # pragma: no cover - no big-endian machines here
        arr.byteswap()
    return arr.tobytes()


def _snapshot(token_ids):
    """The ids as the native path reads them, before any id's ``__index__`` runs:
    a list's or tuple's own items (not a subclass's ``__iter__``), a buffer as it
    is, any other iterable drawn once (so an id that changes the container, or a
    generator whose ids depend on its progress, reads as there)."""
    if isinstance(token_ids, list):
        return tuple(list.__iter__(token_ids))
    if isinstance(token_ids, tuple):
        return token_ids if type(token_ids) is tuple else tuple(tuple.__iter__(token_ids))
    try:
        memoryview(token_ids).release()
        return token_ids  # a buffer (array('I'), numpy): array() reads it alike
    except TypeError:
        return tuple(token_ids)


def check_algo(algo: str) -> None:
    if algo not in HASH_ALGOS:
        raise ValueError(f"unknown prefix caching hash algo {algo!r}; supported: {HASH_ALGOS}")


# No sequence has more ids than this: a larger block size hashes nothing, the
# same as this one (the native path takes a size_t).
_MAX_BLOCK_SIZE = 1 << 62


def check_block_size(block_size: int) -> int:
    """``block_size`` as both paths take it: positive (ValueError), at most 2**62."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return min(block_size, _MAX_BLOCK_SIZE)


def parent_bytes(parent: bytes | bytearray | memoryview | None) -> bytes | None:
    """The parent hash as bytes: None (the root) or 32 bytes of any bytes-like object."""
    if parent is None or isinstance(parent, bytes):
        raw = parent
    else:
        try:  # not bytes(parent): bytes(5) is five zero bytes
            raw = bytes(memoryview(parent))
        except TypeError:
            raise TypeError(f"parent hash must be bytes, got {type(parent).__name__}") from None
    if raw is not None and len(raw) != 32:
        raise ValueError(f"parent hash must be 32 bytes, got {len(raw)}")
    return raw


def block_hashes_py(token_ids: Sequence[int], block_size: int, parent: bytes | None,
                    extra: bytes) -> list[bytes]:
    """The twin of ``_C.block_hashes``: the chained hash of every full block of
    ``token_ids``, with the extra keys already encoded (``encode_extra_keys``)."""
    block_size = check_block_size(block_size)
    if not isinstance(extra, bytes):  # as the binding's bytes argument
        raise TypeError(f"extra must be bytes, got {type(extra).__name__}")
    return chain_hashes_py(token_ids, block_size, parent_bytes(parent), extra)


def mm_block_extra_keys(mm_positions: Sequence[tuple[int, int, str]],
                        block_size: int) -> list[bytes]:
    """Per block of a prompt, the encoded identifiers of the multimodal items
    whose placeholder ``(offset, length, identifier)`` overlaps it (vLLM's mm
    extra keys), in placeholder order; b"" for a block without any. The list
    ends at the last block an item touches."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    ordered = sorted(mm_positions)
    if not ordered:
        return []
    num_blocks = max((offset + length + block_size - 1) // block_size
                     for offset, length, _ in ordered)
    keys: list[list[str]] = [[] for _ in range(num_blocks)]
    for offset, length, identifier in ordered:
        for block in range(offset // block_size, (offset + length - 1) // block_size + 1):
            keys[block].append(identifier)
    return [encode_extra_keys(ids) for ids in keys]


def chain_hashes_py(token_ids: Sequence[int], block_size: int, parent: bytes | None,
                    extra: bytes, block_extras: Sequence[bytes] = ()) -> list[bytes]:
    """``block_hashes_py`` without its argument checks, and with per-block keys:
    block ``i`` hashes ``block_extras[i]`` (when there is
    one) before ``extra``."""
    prev = ROOT_PARENT if parent is None else parent
    data = tokens_to_bytes(token_ids)
    step = 4 * block_size
    sha = hashlib.sha256
    out: list[bytes] = []
    append = out.append
    end = (len(data) // step) * step  # not len(token_ids): an id's __index__ may change it
    if block_extras:
        num_keyed = min(len(block_extras), end // step)
        for i in range(num_keyed):
            start = i * step
            prev = sha(prev + data[start : start + step] + block_extras[i] + extra).digest()
            append(prev)
        data = data[num_keyed * step:]
        end -= num_keyed * step
    if extra:
        for start in range(0, end, step):
            prev = sha(prev + data[start : start + step] + extra).digest()
            append(prev)
    else:
        for start in range(0, end, step):
            prev = sha(prev + data[start : start + step]).digest()
            append(prev)
    return out


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: bytes | None = None,
    extra_keys: Sequence[ExtraKey] | None = None,
    algo: str = "sha256",
) -> list[bytes]:
    """The prefix-cache hash of every full block, on whichever path is active."""
    from enginecore import _native

    check_algo(algo)
    # Here too, so both paths refuse alike (pybind11 would raise TypeError for a
    # negative block size, the twin ValueError).
    block_size = check_block_size(block_size)
    hashes = _native.twin("block_hashes", block_hashes_py)
    return hashes(token_ids, block_size, parent, encode_extra_keys(extra_keys))


def sha256_py(data: bytes) -> bytes:
    """The twin of ``_C.sha256``: one-shot SHA-256."""
    return hashlib.sha256(data).digest()


def sha256_impl_py() -> str:
    """The twin of ``_C.sha256_impl``: the Python path hashes with hashlib (OpenSSL)."""
    return "hashlib"


def sha256_force_portable_py(force: bool) -> None:
    """The twin of ``_C.sha256_force_portable``: hashlib has one implementation, so
    there is nothing to switch (the argument is checked as the binding does)."""
    if not isinstance(force, bool):
        raise TypeError(f"force must be a bool, got {type(force).__name__}")
