"""Which multimodal items the runner encodes each step (vLLM's
``_try_schedule_encoder_inputs``), under the step's encoder compute budget
(``max_num_encoder_input_tokens``) and the encoder cache's room.

A request's prefill chunk ``[computed, computed + num_new)`` that reaches an
item's placeholder range needs the item's encoder output: cached (a hit; the
request references the entry), or encoded this step (all of it at once, then
cached, so a later chunk can start inside the range). When the budget or the
cache cannot take the item, the chunk stops before the range (or the request
waits for a later step when it starts inside it): a chunk never covers
placeholder tokens whose embeddings are not there. ``disable_chunked_mm_input``
also stops a chunk that would end inside a range it starts before.

The native running loop (csrc/scheduler_loops.cpp) knows nothing of images:
``trim_running`` applies the same rule to what it scheduled, in Python, for the
requests that carry items; text-only requests never reach this file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from enginecore.request import Request
from enginecore.sched.encoder_cache_manager import EncoderCacheManager


@dataclass
class EncoderStep:
    """One step's encoder work: request id -> indices of its ``mm_features`` to
    encode, and the budget left."""

    budget: int
    inputs: dict[str, list[int]] = field(default_factory=dict)
    num_encoder_output_tokens: int = 0


def schedule_encoder_inputs(request: Request, num_computed: int, num_new: int,
                            step: EncoderStep, cache: EncoderCacheManager,
                            disable_chunked_mm_input: bool) -> int:
    """The request's tokens this step (``num_new`` or fewer; 0: not this step),
    with the items it must encode added to ``step`` and allocated in ``cache``."""
    features = request.mm_features
    if not features or num_new <= 0:
        return num_new
    rid = request.request_id
    chosen: list[int] = []
    to_encode = 0  # tokens of the items picked for this request this step
    picked: set[str] = set()
    end = num_computed + num_new
    for i, feature in enumerate(features):
        start, length = feature.mm_position.offset, feature.mm_position.length
        if start >= end:
            break  # the chunk stops before this item (items are in prompt order)
        if start + length <= num_computed:
            continue  # already in the KV cache (an earlier chunk, a prefix hit)
        if disable_chunked_mm_input and num_computed < start and end < start + length:
            num_new = start - num_computed
            break
        identifier = feature.identifier
        if identifier in picked:
            continue  # the same image twice in one prompt: encoded once
        if cache.check_and_update_cache(rid, identifier):
            continue
        if not cache.can_allocate(length, step.budget, to_encode):
            # No room this step: compute the text before the item, or nothing.
            num_new = start - num_computed if num_computed < start else 0
            break
        to_encode += length
        step.budget -= length
        picked.add(identifier)
        chosen.append(i)
    if num_new > 0:
        for i in chosen:
            if features[i].mm_position.offset < num_computed + num_new:
                feature = features[i]
                cache.allocate(rid, feature.identifier, feature.mm_position.length)
                step.inputs.setdefault(rid, []).append(i)
                step.num_encoder_output_tokens += feature.mm_position.length
            else:  # the chunk was cut before it: give its budget back
                step.budget += features[i].mm_position.length
    else:
        for i in chosen:
            step.budget += features[i].mm_position.length
    return num_new


def trim_running(scheduled: list[Request], num_scheduled: dict[str, int],
                 num_computed_before: list[int], step: EncoderStep, cache: EncoderCacheManager,
                 disable_chunked_mm_input: bool) -> int:
    """Apply the encoder rule to the running requests the running loop scheduled
    (their computed counts already include this step's tokens). A request cut
    short gets its count back; one cut to nothing leaves ``num_scheduled`` (it
    stays in the step's cached requests, so the runner still learns its new
    blocks). Returns the tokens given back to the step's budget."""
    given_back = 0
    for request, before in zip(scheduled, num_computed_before):
        if not request.mm_features or before >= request.num_prompt_tokens:
            continue
        rid = request.request_id
        n = num_scheduled[rid]
        kept = schedule_encoder_inputs(request, before, n, step, cache, disable_chunked_mm_input)
        if kept == n:
            continue
        request.num_computed_tokens = before + kept
        given_back += n - kept
        if kept:
            num_scheduled[rid] = kept
        else:
            del num_scheduled[rid]
    return given_back


def free_computed_encoder_inputs(request: Request, cache: EncoderCacheManager) -> None:
    """Drop the request's references to items whose ranges are all in the KV cache."""
    features = request.mm_features
    if not features:
        return
    held = cache.referenced_by(request.request_id)
    if not held:
        return
    computed = request.num_computed_tokens
    still_needed = {f.identifier for f in features
                    if f.mm_position.offset + f.mm_position.length > computed}
    for identifier in held:
        if identifier not in still_needed:
            cache.free_encoder_input(request.request_id, identifier)


def largest_item(request: Request) -> int:
    """Placeholder tokens of the request's largest item (0: none)."""
    return max((f.mm_position.length for f in request.mm_features or ()), default=0)


def encoder_fit_error(request: Request, multimodal: bool, max_encoder_input_tokens: int,
                      encoder_cache_size: int) -> str | None:
    """Why the scheduler could never encode the request's items, or None."""
    if not request.mm_features:
        return None
    if not multimodal:
        return "this model takes no multimodal inputs (mm_features)"
    largest = largest_item(request)
    limit = min(max_encoder_input_tokens, encoder_cache_size)
    if largest > limit:
        return (f"a multimodal item of {largest} placeholder tokens exceeds the encoder budget "
                f"of {limit} tokens (max_num_encoder_input_tokens / encoder_cache_size)")
    return None
