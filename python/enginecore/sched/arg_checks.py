"""The argument rules of the native structures' bindings, for their pure-Python twins.

``_C.BlockPool`` / ``_C.RequestTable`` take their scalars through pybind11's
casters: an int argument must be an int (``__index__``) that fits its C type, a
bool argument a bool-like (None is False; a str is refused), a float argument a
number; token lists hold int64s. The twins check the same way so that a bad
argument raises the same exception type on both paths (tests/test_request_table_hostile.py).
Hot loops do not call these: they run on values the table already checked.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import index
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# Block hashing packs every token into 4 bytes.
HASHABLE_MAX = 2**32 - 1
# PyLong_AsLongLong's words, which the native path raises.
OVERFLOW_MESSAGE = "int too big to convert"


def int64(value: Any, name: str) -> int:
    """``value`` as an int64 (TypeError otherwise, as pybind11's int64_t argument)."""
    v = index(value)
    if not INT64_MIN <= v <= INT64_MAX:
        raise TypeError(f"{name} must fit in int64, got {v}")
    return v


def int32(value: Any, name: str) -> int:
    v = index(value)
    if not INT32_MIN <= v <= INT32_MAX:
        raise TypeError(f"{name} must fit in int32, got {v}")
    return v


def boolean(value: Any, name: str) -> bool:
    """pybind11's bool argument: None is False, anything with ``__bool__`` converts."""
    if value is None:
        return False
    if not hasattr(type(value), "__bool__"):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def number(value: Any, name: str) -> float:
    """pybind11's double argument: an int or a float, never a str."""
    t = type(value)
    if not (hasattr(t, "__float__") or hasattr(t, "__index__")):
        raise TypeError(f"{name} must be a number, got {t.__name__}")
    return float(value)


def token_list(token_ids: Iterable[Any]) -> list[int]:
    """Token (or block) ids as ints, each an int64 (TypeError for a non-int,
    OverflowError past int64, as the native list conversion)."""
    tokens = [index(t) for t in token_ids]
    if tokens and (min(tokens) < INT64_MIN or max(tokens) > INT64_MAX):
        raise OverflowError(OVERFLOW_MESSAGE)
    return tokens


def check_hashable(tokens: list[int]) -> None:
    """ValueError unless every token fits block hashing's 4 bytes, [0, 2**32)."""
    if tokens and (min(tokens) < 0 or max(tokens) > HASHABLE_MAX):
        raise ValueError("token ids must be in [0, 2**32)")


def int64_error(value: Any, what: str) -> TypeError | None:
    """The TypeError a bad slot or block id raises natively when it is no int64
    (the binding refuses it), or None when it is merely out of range (IndexError)."""
    try:
        int64(value, what)
    except TypeError as e:
        return e
    return None
