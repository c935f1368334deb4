"""Say which top-level fields of a request body the server ignored.

msgspec ignores fields a struct does not declare (so a newer client never breaks
a request); vLLM's server does the same and logs them, and so do we: an
operator whose client sends ``max_completion_token`` (a typo) sees why it had
no effect. The keys are read with the values left unparsed (``msgspec.Raw``),
so a large body (images as base64) costs one extra scan, not a second decode.
Each distinct set of ignored fields is a warning once, then a debug line, so a
client that sends the same unknown field on every request does not flood the log.
"""

from __future__ import annotations

import logging

import msgspec

logger = logging.getLogger(__name__)

_key_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])
_known: dict[type, frozenset[str]] = {}
_warned: set[frozenset[str]] = set()
_MAX_WARNED = 1024  # distinct sets remembered; past that everything is a debug line


def known_fields(kind: type) -> frozenset[str]:
    """The body names a request struct decodes (its fields' encode names)."""
    names = _known.get(kind)
    if names is None:
        names = _known[kind] = frozenset(f.encode_name for f in msgspec.structs.fields(kind))
    return names


def ignored_fields(body: bytes, kind: type) -> list[str]:
    """The top-level keys of a JSON object body that ``kind`` does not declare."""
    try:
        keys = _key_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return []
    known = known_fields(kind)
    return sorted(k for k in keys if k not in known)


def log_ignored_fields(body: bytes, kind: type) -> None:
    extra = ignored_fields(body, kind)
    if not extra:
        return
    fields = frozenset(extra)
    first = fields not in _warned and len(_warned) < _MAX_WARNED
    if first:
        _warned.add(fields)
    logger.log(logging.WARNING if first else logging.DEBUG,
               "The following fields were present in the request but ignored: %s",
               set(extra))
