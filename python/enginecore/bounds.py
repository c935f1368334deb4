"""One set of numeric bounds for every numeric field a caller or a peer can set.

The bounds live in the field annotations of the wire structs
(``msgspec.Meta``): msgspec enforces them when the engine decodes a message,
and ``check_bounds`` enforces the same annotations when a struct is built in
Python (``SamplingParams.__post_init__``). Ints that the C++ loops read as
``long long`` are bounded to int64, so no value that passes here can make a
native loop raise ``OverflowError``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from msgspec import inspect as mi

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
NonNegInt64 = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
PositiveInt64 = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
# Engine and front-end indexes: an engine's identity is its index in 2 bytes.
Index16 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF)]
# Finite floats (no NaN, no infinities) within a range; ``finite()`` alone: any finite.
_FLOAT_MAX = sys.float_info.max


def finite(ge: float = -_FLOAT_MAX, le: float = _FLOAT_MAX, gt: float | None = None) -> Any:
    """A float annotation: finite, ``>= ge`` (or ``> gt``), ``<= le``."""
    if gt is not None:
        return Annotated[float, msgspec.Meta(gt=gt, le=le)]
    return Annotated[float, msgspec.Meta(ge=ge, le=le)]


Checker = Callable[[Any], str | None]


def _int_checker(t: mi.IntType) -> Checker:
    def check(v: Any) -> str | None:
        # bool is an int subclass, but the wire has a separate type for it.
        if type(v) is not int:
            return f"an int, got {type(v).__name__}"
        if (t.ge is not None and v < t.ge) or (t.gt is not None and v <= t.gt) or (
                t.le is not None and v > t.le) or (t.lt is not None and v >= t.lt):
            return f"an int in {_range(t)}, got {v!r}"
        return None
    return check


def _float_checker(t: mi.FloatType) -> Checker:
    def check(v: Any) -> str | None:
        if type(v) not in (float, int):
            return f"a number, got {type(v).__name__}"
        # NaN fails every comparison, so "not (v >= ge)" rejects it too.
        if (t.ge is not None and not v >= t.ge) or (t.gt is not None and not v > t.gt) or (
                t.le is not None and not v <= t.le) or (t.lt is not None and not v < t.lt):
            return f"a finite number in {_range(t)}, got {v!r}"
        return None
    return check


def _range(t: mi.IntType | mi.FloatType) -> str:
    lo = ("(-inf" if (t.ge is None and t.gt is None) or t.ge == -_FLOAT_MAX
          else f"[{t.ge!r}" if t.ge is not None else f"({t.gt!r}")
    hi = ("inf)" if (t.le is None and t.lt is None) or t.le == _FLOAT_MAX
          else f"{t.le!r}]" if t.le is not None else f"{t.lt!r})")
    return f"{lo}, {hi}"


def _checker(t: mi.Type) -> Checker | None:
    """A check for values of type ``t``, or None when it has no numeric bound to check
    (structs check themselves in their own ``__post_init__``)."""
    if isinstance(t, mi.IntType):
        return _int_checker(t)
    if isinstance(t, mi.FloatType):
        return _float_checker(t)
    if isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType)):
        item = _checker(t.item_type)
        if item is None:
            return None

        def check_items(v: Any) -> str | None:
            if not isinstance(v, (list, tuple, set, frozenset)):
                return f"a list, got {type(v).__name__}"
            for x in v:
                why = item(x)
                if why is not None:
                    return f"a list whose every item is {why}"
            return None
        return check_items
    if isinstance(t, mi.UnionType):
        options = [(o, _checker(o)) for o in t.types]
        if all(c is None for _, c in options):
            return None
        allows_none = any(isinstance(o, mi.NoneType) for o, _ in options)
        numeric = [c for o, c in options if c is not None]

        def check_union(v: Any) -> str | None:
            if v is None and allows_none:
                return None
            why = None
            for c in numeric:
                why = c(v)
                if why is None:
                    return None
            return (why or "") + (" (or None)" if allows_none else "")
        return check_union
    return None


_CHECKS: dict[type, list[tuple[str, Checker]]] = {}


def check_bounds(obj: msgspec.Struct) -> None:
    """Raise ``ValueError`` naming the first field of ``obj`` outside its annotated
    bounds (or of the wrong type): the same annotations msgspec enforces on decode."""
    cls = type(obj)
    checks = _CHECKS.get(cls)
    if checks is None:
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        checks = _CHECKS[cls] = [(f.name, c) for f in info.fields
                                 if (c := _checker(f.type)) is not None]
    for name, check in checks:
        why = check(getattr(obj, name))
        if why is not None:
            raise ValueError(f"{cls.__name__}.{name} must be {why}")


_PATH = re.compile(r" - at (`[^`]*` in )?`\$((?:\[[^\]]*\])*)`$")


def _struct_of(t: mi.Type) -> mi.StructType | None:
    if isinstance(t, mi.StructType):
        return t
    if isinstance(t, mi.UnionType):
        for o in t.types:
            if isinstance(o, mi.StructType):
                return o
    return None


def name_fields(error: Exception, cls: type) -> str:
    """msgspec reports a bad field of an array-like struct by position
    (``... - at `$[2][0]```); say which field it is (``sampling_params.max_tokens``)."""
    text = str(error)
    m = _PATH.search(text)
    if m is None:
        return text
    t: mi.Type = mi.type_info(cls)
    names = [cls.__name__]
    for part in re.findall(r"\[([^\]]*)\]", m.group(2)):
        st = _struct_of(t)
        if st is not None and part.isdigit() and int(part) < len(st.fields):
            field = st.fields[int(part)]
            names.append(field.name)
            t = field.type
        else:
            names.append(f"[{part}]")
            inner = t.types if isinstance(t, mi.UnionType) else (t,)
            items = [getattr(o, "item_type", None) for o in inner]
            t = next((i for i in items if i is not None), mi.AnyType())
    where = ".".join(names).replace(".[", "[")
    return f"{where}: {text[:m.start()]}{' (a key)' if m.group(1) else ''}"


__all__ = ["INT64_MAX", "INT64_MIN", "Index16", "Int64", "NonNegInt64", "PositiveInt64",
           "check_bounds", "finite", "name_fields"]
