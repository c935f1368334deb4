"""Say which top-level fields of a request body the server ignored.

msgspec ignores fields a struct does not declare (so a newer client never breaks
a request); vLLM's server does the same and logs them, and so do we: an
operator whose client sends ``max_completion_token`` (a typo) sees why it had
no effect.

What it costs, bounded whatever the body: first one more scan with every known
field's value left unparsed (``msgspec.Raw``) into a shadow struct that forbids
unknown fields, which allocates nothing per unknown key and stops at the first
one. Only then, and only for a body of at most ``FULL_SCAN_MAX_BYTES``, are all
the keys listed (a dict of them; a 32 MiB body of tiny keys would be millions of
entries). Each distinct set of ignored fields is a warning once, then a debug
line, so a client that sends the same unknown field on every request does not
flood the log.
"""

from __future__ import annotations

import logging
import re

import msgspec

logger = logging.getLogger(__name__)

FULL_SCAN_MAX_BYTES = 64 << 10
_MAX_WARNED = 1024  # distinct sets remembered; past that everything is a debug line
_MAX_NAMES = 32  # names logged per request
_MAX_NAME_CHARS = 64  # characters of a name logged (and remembered)
_UNKNOWN = re.compile(r"^Object contains unknown field `(.*)`$", re.S)

_key_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])
_shadows: dict[type, tuple[msgspec.json.Decoder, frozenset[str]]] = {}
_warned: set[frozenset[str]] = set()


def _shadow(kind: type) -> tuple[msgspec.json.Decoder, frozenset[str]]:
    """A decoder of ``kind``'s fields as raw JSON that refuses any other, and the
    names the body uses for them."""
    found = _shadows.get(kind)
    if found is None:
        fields = msgspec.structs.fields(kind)
        shadow = msgspec.defstruct(
            f"_{kind.__name__}Fields", [(f.name, msgspec.Raw, None) for f in fields],
            rename={f.name: f.encode_name for f in fields}, kw_only=True,
            forbid_unknown_fields=True)
        found = _shadows[kind] = (msgspec.json.Decoder(shadow),
                                  frozenset(f.encode_name for f in fields))
    return found


def ignored_fields(body: bytes, kind: type) -> list[str]:
    """The top-level keys of a JSON object body that ``kind`` does not declare
    (only the first one for a body past ``FULL_SCAN_MAX_BYTES``)."""
    decoder, known = _shadow(kind)
    try:
        decoder.decode(body)
        return []
    except msgspec.ValidationError as e:
        first = _UNKNOWN.match(str(e))
    except (msgspec.DecodeError, RecursionError):
        return []
    if first is None:  # not an object, or a shape the real decode refuses anyway
        return []
    if len(body) > FULL_SCAN_MAX_BYTES:
        return [first.group(1)]
    return sorted(k for k in _key_decoder.decode(body) if k not in known)


def _shown(name: str) -> str:
    return name if len(name) <= _MAX_NAME_CHARS else name[:_MAX_NAME_CHARS] + "..."


def log_ignored_fields(body: bytes, kind: type) -> None:
    """Log them; never raises (a log line must not fail the request it is about)."""
    try:
        extra = ignored_fields(body, kind)
    except Exception:  # e.g. RecursionError near the stack's end
        logger.debug("could not list the ignored fields of a request body", exc_info=True)
        return
    if not extra:
        return
    # What is kept and logged is bounded whatever the client sends: names cut
    # to _MAX_NAME_CHARS, at most _MAX_NAMES of them.
    shown = [_shown(k) for k in extra[:_MAX_NAMES]]
    more = len(extra) - len(shown)
    if len(body) > FULL_SCAN_MAX_BYTES:
        more_text = " (and maybe more: only the first is looked for in a body this large)"
    else:
        more_text = f" and {more} more" if more else ""
    fields = frozenset(shown)
    first = fields not in _warned and len(_warned) < _MAX_WARNED
    if first:
        _warned.add(fields)
    logger.log(logging.WARNING if first else logging.DEBUG,
               "The following fields were present in the request but ignored: %s%s",
               set(shown), more_text)
