"""The shape of the P/D fields of a request's ``kv_transfer_params`` (vLLM's names).

They come from the client (the OpenAI body, or ``SamplingParams.extra_args``), so the
front-end checks them before the request reaches the engine (a ValueError, a 400), and the
PD connector checks them again on the engine side: a string port or a nested block id
there would otherwise raise inside the scheduler step and take the engine down with it.
Keys other than these are left to plug-in connectors.
"""

from __future__ import annotations

from typing import Any

_FLAGS = ("do_remote_prefill", "do_remote_decode")
_STRINGS = ("remote_engine_id", "remote_host", "remote_request_id")
_MAX_BLOCK_ID = 2**63 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_kv_transfer_params(params: dict[str, Any]) -> None:
    """Raise ValueError naming the first P/D field of ``params`` of the wrong type or range
    (None is accepted for each: vLLM's proxy sends the unset ones as null)."""
    for key in _FLAGS:
        if params.get(key) is not None and not isinstance(params[key], bool):
            raise ValueError(f"kv_transfer_params.{key} must be a boolean, "
                             f"got {type(params[key]).__name__}")
    for key in _STRINGS:
        if params.get(key) is not None and not isinstance(params[key], str):
            raise ValueError(f"kv_transfer_params.{key} must be a string, "
                             f"got {type(params[key]).__name__}")
    port = params.get("remote_port")
    if port is not None and not (_is_int(port) and 0 <= port <= 65535):
        raise ValueError(f"kv_transfer_params.remote_port must be an integer in "
                         f"[0, 65535], got {str(port)[:40]!r}")
    ids = params.get("remote_block_ids")
    if ids is None:
        return
    if not isinstance(ids, list):
        raise ValueError(f"kv_transfer_params.remote_block_ids must be a list of block ids, "
                         f"got {type(ids).__name__}")
    for i, block_id in enumerate(ids):
        if not (_is_int(block_id) and 0 <= block_id <= _MAX_BLOCK_ID):
            raise ValueError(f"kv_transfer_params.remote_block_ids[{i}] must be an integer "
                             f"in [0, 2**63 - 1], got {str(block_id)[:40]!r}")
