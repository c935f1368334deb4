"""The allow-list of EngineCore methods front-ends may call, and the typed
conversion of their arguments and results (msgspec, never pickle)."""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass
from typing import Any

import msgspec

# Methods a utility call may run; anything else is refused with a message.
UTILITY_METHODS: frozenset[str] = frozenset({
    "profile", "reset_prefix_cache", "pause_scheduler", "resume_scheduler",
    "is_scheduler_paused", "sleep", "wake_up", "is_sleeping", "execute_dummy_batch",
    "add_lora", "remove_lora", "list_loras", "pin_lora", "collective_rpc",
    "save_sharded_state", "set_weight_version", "get_weight_version",
    "get_kv_cache_group_metadata", "get_supported_tasks", "make_stats", "get_request_counts",
    "echo", "reset_mm_cache", "reset_encoder_cache", "barrier", "reinitialize_distributed",
    "get_dp_state",
})


@dataclass(frozen=True)
class UtilitySignature:
    params: list[tuple[str, Any, Any]]  # (name, type hint, default or inspect._empty)
    return_type: Any


_signatures: dict[str, UtilitySignature] = {}


def signature_of(method: str) -> UtilitySignature:
    if method not in UTILITY_METHODS:
        raise PermissionError(
            f"utility method {method!r} is not allowed; allowed: {sorted(UTILITY_METHODS)}"
        )
    sig = _signatures.get(method)
    if sig is None:
        from enginecore.core.engine_core import EngineCore

        fn = getattr(EngineCore, method)
        hints = typing.get_type_hints(fn, include_extras=True)  # keeps the bounds
        params = [
            (p.name, hints.get(p.name, Any), p.default)
            for p in list(inspect.signature(fn).parameters.values())[1:]
        ]
        sig = _signatures[method] = UtilitySignature(params, hints.get("return", Any))
    return sig


def convert_args(method: str, args: list[Any]) -> list[Any]:
    """Wire arguments -> the method's annotated types (raises with the reason)."""
    sig = signature_of(method)
    if len(args) > len(sig.params):
        raise TypeError(f"{method}() takes {len(sig.params)} arguments, got {len(args)}")
    out = []
    for value, (name, hint, _) in zip(args, sig.params):
        try:
            out.append(msgspec.convert(value, hint, strict=False))
        except msgspec.ValidationError as e:
            raise TypeError(f"{method}() argument {name!r}: {e}") from None
    return out


def convert_result(method: str, value: Any) -> Any:
    """Wire result -> the method's declared return type."""
    hint = signature_of(method).return_type
    if hint is Any or value is None:
        return value
    return msgspec.convert(value, hint, strict=False)


__all__ = ["UTILITY_METHODS", "convert_args", "convert_result", "signature_of"]
