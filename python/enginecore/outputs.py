"""User-facing results, shaped like vLLM's ``RequestOutput`` (offline ``LLM`` and
``AsyncLLM`` streams alike).

msgspec Structs rather than dataclasses: the front-end's per-step loop makes one
``RequestOutput`` and one ``CompletionOutput`` per stream per step, and a
Struct's constructor and attributes are C (a dataclass ``__init__`` is a Python
frame per object). They are mutable, compare by value and have the same fields.
"""

from __future__ import annotations

from typing import Any

import msgspec

from enginecore.protocol import FinishReason, LoRARequest


class Logprob(msgspec.Struct, gc=False):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionOutput(msgspec.Struct, gc=False):
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # One dict per generated token: token id -> Logprob (sampled token + top-N).
    logprobs: list[dict[int, Logprob]] | None = None
    # "stop" | "length" | "abort" | "error" | None (still running)
    finish_reason: str | None = None
    # The stop string or stop token id that ended it; for "error", why.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestMetrics(msgspec.Struct, gc=False):
    """Timing of one request. ``arrival_time`` is wall-clock (``time.time()``); the
    ``*_ts`` fields are ``time.monotonic()`` (queued / scheduled come from the engine
    process, whose monotonic clock is the same on one machine; they are set only
    when the engine runs with ``log_stats``)."""

    arrival_time: float
    arrival_ts: float
    queued_ts: float | None = None
    scheduled_ts: float | None = None
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    finished_ts: float | None = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_ts is None else self.first_token_ts - self.arrival_ts

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_ts is None else self.finished_ts - self.arrival_ts

    @property
    def queue_time(self) -> float | None:
        if self.queued_ts is None or self.scheduled_ts is None:
            return None
        return self.scheduled_ts - self.queued_ts


class RequestOutput(msgspec.Struct, gc=False):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = []
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    lora_request: LoRARequest | None = None
    # prompt_logprobs (vLLM's shape): None for the first prompt token, then per
    # position token id -> Logprob (the prompt's token + the top-N). DELTA outputs
    # carry it once, in the first output.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # KV transfer: what the engine's KV connector returned when the request finished
    # (vLLM's field; a P/D prefill server's answer carries it to the decode server).
    kv_transfer_params: dict[str, Any] | None = None

    def add(self, other: RequestOutput, aggregate: bool) -> None:
        """Fold a later output of the same request into this one (a consumer that
        fell behind gets one merged output): with ``aggregate`` (DELTA) the texts,
        tokens and logprobs of each index are concatenated, otherwise the later
        completion of an index replaces the earlier."""
        self.finished = other.finished
        self.metrics = other.metrics
        self.num_cached_tokens = other.num_cached_tokens
        if other.prompt_logprobs is not None:
            self.prompt_logprobs = other.prompt_logprobs
        if other.kv_transfer_params is not None:
            self.kv_transfer_params = other.kv_transfer_params
        by_index = {c.index: i for i, c in enumerate(self.outputs)}
        for comp in other.outputs:
            i = by_index.get(comp.index)
            if i is None:
                by_index[comp.index] = len(self.outputs)
                self.outputs.append(comp)
            elif not aggregate:
                self.outputs[i] = comp
            else:
                mine = self.outputs[i]
                mine.text += comp.text
                mine.token_ids = mine.token_ids + comp.token_ids
                if comp.logprobs is not None:
                    mine.logprobs = (mine.logprobs or []) + comp.logprobs
                mine.cumulative_logprob = comp.cumulative_logprob
                mine.finish_reason = comp.finish_reason
                mine.stop_reason = comp.stop_reason
        self.outputs.sort(key=lambda c: c.index)


class EmbeddingOutput(msgspec.Struct, gc=False):
    embedding: list[float]


class EmbeddingRequestOutput(msgspec.Struct, gc=False):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None = None
    finished: bool = False
    # "stop" when pooled; "abort" / "error" otherwise (``error`` says why).
    finish_reason: str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None


def finish_reason_str(reason: FinishReason | None) -> str | None:
    return None if reason is None else str(reason)
