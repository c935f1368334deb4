"""vLLM's EngineArgs names where enginecore's differ: the one table that maps them.

``EngineArgs(**kwargs)`` and the CLI (config_cli.py adds a flag for each entry)
both go through ``to_field_values``. An entry is one of:

- a rename: ``disable_log_stats`` is ``not log_stats``,
  ``enable_logging_iteration_details`` is ``log_iteration_details``,
  ``async_scheduling`` is ``max_concurrent_batches=2``;
- a dict spelled out into our fields: ``speculative_config`` (a JSON string too);
- a knob that has only vLLM's default value here (``tensor_parallel_size=1``):
  any other value is a clear error saying what to use instead;
- a knob with no effect here (``trust_remote_code``, ``enforce_eager``,
  ``swap_space``): accepted, and a warning when it asks for something we do not do.

vLLM also passes ``None`` for fields it decides itself (``enable_prefix_caching``,
``max_num_seqs``, ``seed``...); for fields that have a fixed default here, ``None``
means that default (``_NONE_MEANS_DEFAULT``).
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

Translate = Callable[[Any, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Alias:
    help: str
    # (value, all keyword arguments) -> our field values it stands for
    translate: Translate
    # argparse keywords of its flag (type or action, metavar)
    cli: dict[str, Any] = field(default_factory=dict)
    flags: tuple[str, ...] = ()


def parse_json_dict(text: str) -> dict[str, Any]:
    """A dict flag's JSON text; a clear ValueError for anything else."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object ({{\"key\": value, ...}}): {text!r}")
    return value


def _json_dict_type(text: str) -> dict[str, Any]:
    try:
        return parse_json_dict(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_NGRAM_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def _speculative_config(value: Any, _: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for the n-gram proposer, with vLLM's fill-in
    rule for the lookup bounds (one given: the other takes its value; none: 5 and 5)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = parse_json_dict(value)
        except ValueError as e:
            raise ValueError(f"speculative_config is {e}") from None
    if not isinstance(value, dict):
        raise TypeError(f"speculative_config must be a dict (or its JSON text), got "
                        f"{type(value).__name__}")
    unknown = sorted(set(value) - set(_NGRAM_KEYS))
    if unknown:
        raise ValueError(f"speculative_config keys {unknown} are not supported: enginecore's "
                         f"proposer is n-gram prompt lookup, which takes {list(_NGRAM_KEYS)}")
    method = value.get("method")
    if method not in ("ngram", "[ngram]"):
        raise ValueError(f"speculative_config method {method!r} is not supported; the only "
                         "proposer is 'ngram' (prompt lookup)")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config needs num_speculative_tokens")
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5
    return {"speculative_method": "ngram",
            "num_speculative_tokens": value["num_speculative_tokens"],
            "prompt_lookup_min": hi if lo is None else lo,
            "prompt_lookup_max": lo if hi is None else hi}


def _rename(name: str, invert: bool = False) -> Translate:
    return lambda value, _: {name: (not value) if invert else value}


def _async_scheduling(value: Any, _: dict[str, Any]) -> dict[str, Any]:
    return {} if value is None else {"max_concurrent_batches": 2 if value else 1}


def _only(allowed: tuple[Any, ...], instead: str) -> Translate:
    """A knob enginecore has at one value only."""
    def translate(value: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        if value not in allowed:
            raise ValueError(f"{instead} (got {value!r})")
        return {}

    return translate


def _no_effect(quiet: tuple[Any, ...], why: str) -> Translate:
    """Accepted; a warning when the value asks for something enginecore does not do."""
    def translate(value: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        if value not in quiet:
            logger.warning("%s; the setting %r has no effect", why, value)
        return {}

    return translate


def _accepted(value: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Accepted as is: enginecore already does what any value asks (or never could)."""
    return {}


def _tokenizer(value: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    if value is not None and value != kwargs.get("model"):
        raise ValueError(f"tokenizer={value!r}: enginecore reads the tokenizer from the model's "
                         "own files (tokenizer.json or the GGUF metadata); a separate tokenizer "
                         "is not supported")
    return {}


_STORE_TRUE = {"action": "store_true"}
_BOOL = {"action": argparse.BooleanOptionalAction}

ALIASES: dict[str, Alias] = {
    "speculative_config": Alias(
        "vLLM's speculative decoding config, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'; "
        "sets the speculative flags", _speculative_config,
        {"type": _json_dict_type, "metavar": "JSON"}),
    "disable_log_stats": Alias("vLLM's spelling of --no-log-stats",
                               _rename("log_stats", invert=True), _STORE_TRUE),
    "enable_logging_iteration_details": Alias("vLLM's spelling of --log-iteration-details",
                                              _rename("log_iteration_details"), _BOOL),
    "async_scheduling": Alias("vLLM's spelling of --max-concurrent-batches 2 (off: 1)",
                              _async_scheduling, _BOOL),
    "enable_sleep_mode": Alias(
        "accepted; sleep / wake_up are always available here",
        _accepted, _BOOL),
    "tensor_parallel_size": Alias(
        "1 only: one model replica per engine process",
        _only((1, None), "tensor_parallel_size must be 1: enginecore runs one whole model per "
              "engine process; scale out with data_parallel_size"), {"type": int},
        ("-tp",)),
    "pipeline_parallel_size": Alias(
        "1 only", _only((1, None), "pipeline_parallel_size must be 1: enginecore runs one whole "
                        "model per engine process; scale out with data_parallel_size"),
        {"type": int}, ("-pp",)),
    "enable_expert_parallel": Alias(
        "off only", _only((False, None), "enable_expert_parallel is not supported: each "
                          "data-parallel rank runs the whole mixture-of-experts model"),
        _STORE_TRUE, ("-ep",)),
    "distributed_executor_backend": Alias(
        "accepted; no tensor/pipeline workers to place (data parallel: --data-parallel-backend)",
        _no_effect((None, "uni", "mp"), "distributed_executor_backend places tensor/pipeline-"
                   "parallel workers, which enginecore does not have (for Ray data parallel "
                   "use data_parallel_backend='ray')"), {"type": str}),
    "kv_cache_dtype": Alias(
        "auto only: the KV cache has the model's dtype",
        _only(("auto", None), "kv_cache_dtype must be 'auto': the KV cache is kept in the "
              "model's dtype"), {"type": str}),
    "quantization": Alias(
        "none only: weights run unquantized (.gguf files are dequantized on load)",
        _only((None,), "quantization is not supported: weights run unquantized (.gguf files "
              "are dequantized on load)"), {"type": str}, ("-q",)),
    "tokenizer": Alias("the model's own tokenizer only", _tokenizer, {"type": str}),
    "trust_remote_code": Alias(
        "accepted; only enginecore's own model code runs",
        _no_effect((False, None), "trust_remote_code: enginecore runs only its own model code "
                   "(Llama, Mistral, Qwen2, BERT), never code from a model directory"),
        _STORE_TRUE),
    "enforce_eager": Alias("accepted; models always run eagerly (no CUDA graphs)",
                           _accepted, _STORE_TRUE),
    "disable_custom_all_reduce": Alias("accepted; there is no tensor-parallel all-reduce",
                                       _accepted, _STORE_TRUE),
    "swap_space": Alias(
        "accepted; no CPU swap (a preempted request recomputes)",
        _no_effect((4, 0, None), "swap_space: there is no CPU swap space; a preempted request "
                   "is recomputed"), {"type": float}),
    "cpu_offload_gb": Alias(
        "0 is the only effective value", _no_effect((0, None), "cpu_offload_gb: weights are not "
                                                    "offloaded to CPU while serving"),
        {"type": float}),
    "max_logprobs": Alias(
        "accepted; requests may ask for up to 20 logprobs",
        _no_effect((20, None), "max_logprobs: SamplingParams.logprobs is capped at 20"),
        {"type": int}),
}

# vLLM passes None for these to mean "decide for me"; ours have fixed defaults.
_NONE_MEANS_DEFAULT = frozenset({
    "seed", "block_size", "max_num_seqs", "enable_prefix_caching", "enable_chunked_prefill",
    "data_parallel_rank", "data_parallel_start_rank", "data_parallel_address",
    "data_parallel_rpc_port",
})


def to_field_values(kwargs: dict[str, Any], fields: Any) -> dict[str, Any]:
    """EngineArgs keywords (ours or vLLM's) -> values of our fields.

    A keyword that is neither is a ``TypeError`` naming the closest one; an alias
    that disagrees with an explicitly given field is a ``ValueError``.
    """
    values: dict[str, Any] = {}
    implied: dict[str, tuple[Any, str]] = {}
    for key, value in kwargs.items():
        if key in fields:
            if not (value is None and key in _NONE_MEANS_DEFAULT):
                values[key] = value
        elif key in ALIASES:
            for name, v in ALIASES[key].translate(value, kwargs).items():
                implied[name] = (v, key)
        else:
            raise TypeError(unknown_keyword_message(key, fields))
    for name, (v, alias) in implied.items():
        if name in values and values[name] != v:
            raise ValueError(f"EngineArgs: {name}={values[name]!r} and {alias}={kwargs[alias]!r} "
                             f"(which means {name}={v!r}) disagree; give one of them")
        values[name] = v
    return values


def unknown_keyword_message(key: str, fields: Any) -> str:
    close = difflib.get_close_matches(key, [*fields, *ALIASES], n=1, cutoff=0.6)
    hint = (f"did you mean {close[0]!r}?" if close else
            "the fields are listed by `enginecore engine --help` and in docs/architecture.md")
    return f"EngineArgs got an unexpected keyword argument {key!r}; {hint}"
