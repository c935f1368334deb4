"""Reading JSON that may still be arriving: where a value ends (or that it has not
ended yet), the fields of an object prefix, and the calls in a prefix of the
usual ``{"name": ..., "arguments": {...}}`` shapes.

Every answer for a prefix is a prefix of the answer for the whole text (what a
stream has sent never has to be taken back), which is what lets the parsers
stream by comparing the state of the text so far with what they already sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = " \t\r\n"
_SCALAR_END = ",}] \t\r\n"


class NotJSON(ValueError):
    """The text cannot be (the start of) the JSON expected."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Index after the string starting at ``text[i] == '"'`` (None: not closed yet)."""
    i += 1
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index after the JSON value starting at ``text[i]`` (None: not ended yet)."""
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth = 0
        n = len(text)
        while i < n:
            c = text[i]
            if c == '"':
                end = string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(text) and text[j] not in _SCALAR_END:
        j += 1
    # A number at the end of the text may go on.
    return j if j < len(text) and j > i else None


@dataclass
class ObjectScan:
    # key -> (start of its value, end of its value or None while it is arriving)
    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None  # index after the closing brace, None while open


def scan_object(text: str, i: int) -> ObjectScan:
    """The fields of the object (prefix) starting at ``text[i] == '{'``."""
    scan = ObjectScan()
    n = len(text)
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= n:
            return scan
        c = text[i]
        if c == "}":
            scan.end = i + 1
            return scan
        if c == ",":
            i += 1
            continue
        if c != '"':
            raise NotJSON(f"expected a key at {i}")
        key_end = string_end(text, i)
        if key_end is None:
            return scan
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= n:
            return scan
        if text[i] != ":":
            raise NotJSON(f"expected ':' at {i}")
        i = skip_ws(text, i + 1)
        if i >= n:
            scan.fields[key] = (i, None)
            return scan
        end = value_end(text, i)
        scan.fields[key] = (i, end)
        if end is None:
            return scan
        i = end


@dataclass
class ParsedCall:
    """A call as far as the text goes: its name (known before any argument is
    reported) and the text of its arguments so far (a JSON object once complete)."""

    name: str
    arguments: str
    complete: bool


def call_of_object(text: str, i: int, final: bool,
                   args_keys: tuple[str, ...] = ("arguments", "parameters"),
                   ) -> tuple[ParsedCall | None, int | None]:
    """(the call in the object starting at ``text[i]``, index after the object).

    The call is None until its name is complete; its arguments are the raw text of
    the arguments value (so the streamed fragments add up to the final value), or
    a JSON-encoded string's content once it is complete; ``{}`` when there is none.
    """
    scan = scan_object(text, i)
    if "name" not in scan.fields or scan.fields["name"][1] is None:
        if final or scan.end is not None:
            raise NotJSON("a call without a complete name")
        return None, None
    start, end = scan.fields["name"]
    name = json.loads(text[start:end])
    if not isinstance(name, str):
        raise NotJSON("a call's name is not a string")
    key = next((k for k in args_keys if k in scan.fields), None)
    complete = scan.end is not None
    if key is None:
        args = "{}" if complete or final else ""
    else:
        a_start, a_end = scan.fields[key]
        if a_start < len(text) and text[a_start] == '"':
            # Arguments sent as a JSON string holding the object.
            args = json.loads(text[a_start:a_end]) if a_end is not None else ""
        else:
            args = text[a_start:a_end if a_end is not None else len(text)]
            if a_end is None and final:
                raise NotJSON("a call's arguments do not end")
    if final:
        if not complete:
            raise NotJSON("a call's object does not end")
        json.loads(args or "{}")  # the arguments must be JSON
        args = args or "{}"
    return ParsedCall(name, args, complete), scan.end


def calls_of_sequence(text: str, i: int, final: bool, separators: str = ",;",
                      closing: str | None = None) -> list[ParsedCall]:
    """The calls in a run of call objects from ``text[i]`` (separated by any of
    ``separators`` or whitespace, up to ``closing`` when given)."""
    calls: list[ParsedCall] = []
    n = len(text)
    while True:
        i = skip_ws(text, i)
        while i < n and text[i] in separators:
            i = skip_ws(text, i + 1)
        if i >= n:
            if final and closing is not None:
                raise NotJSON(f"no closing {closing!r}")
            return calls
        if closing is not None and text[i] == closing:
            return calls
        if text[i] != "{":
            raise NotJSON(f"expected a call object at {i}")
        call, end = call_of_object(text, i, final)
        if call is not None:
            calls.append(call)
        if end is None:
            return calls
        i = end


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``
    (text a stream holds back: it may be the start of the marker)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
