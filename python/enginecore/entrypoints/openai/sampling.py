"""OpenAI / vLLM request fields -> ``SamplingParams``.

Shared by /v1/completions and /v1/chat/completions. Values are range-checked by
``SamplingParams`` itself (its ``ValueError`` becomes a 400 naming the field);
this module only maps names, applies OpenAI's defaults and refuses what the
engine cannot honour (beam search, two constraints at once) instead of silently
ignoring it. ``logit_bias`` comes with string keys (OpenAI's JSON) and biases
clamped to [-100, 100], as vLLM does; vLLM's extra fields ``allowed_token_ids``,
``bad_words``, ``prompt_logprobs`` and ``truncate_prompt_tokens`` pass through.
"""

from __future__ import annotations

from typing import Any

from enginecore.entrypoints.openai.errors import bad_request, value_error
from enginecore.entrypoints.openai.protocol import SamplingFields
from enginecore.errors import short_repr
from enginecore.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

# OpenAI's sampling defaults where the request leaves a field out.
_DEFAULT_TEMPERATURE = 1.0


def structured_outputs_of(req: SamplingFields) -> StructuredOutputsParams | None:
    """The one constraint of a request: ``structured_outputs``, vLLM's legacy
    ``guided_*`` fields or ``response_format``; more than one is a 400."""
    found: list[tuple[str, dict[str, Any]]] = []
    so = req.structured_outputs
    if so is not None:
        if so.structural_tag is not None:
            raise bad_request("structured_outputs.structural_tag is not supported",
                              "structured_outputs")
        kinds = {k: v for k, v in (("json", so.json), ("regex", so.regex),
                                   ("choice", so.choice), ("grammar", so.grammar))
                 if v is not None}
        if so.json_object:
            kinds.setdefault("json", {"type": "object"})
        if len(kinds) != 1:
            raise bad_request("structured_outputs needs exactly one of json, regex, choice, "
                              f"grammar, json_object; got {sorted(kinds) or 'none'}",
                              "structured_outputs")
        found.append(("structured_outputs", kinds))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, {kind: value}))
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", {"json": {"type": "object"}}))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema is None:
                raise bad_request("response_format json_schema needs json_schema.schema",
                                  "response_format")
            found.append(("response_format", {"json": rf.json_schema.schema}))
        else:
            raise bad_request(f"response_format type {rf.type!r} is not supported",
                              "response_format")
    if not found:
        return None
    if len(found) > 1:
        raise bad_request("give one structured-output constraint; got "
                          + ", ".join(name for name, _ in found), found[1][0])
    name, kinds = found[0]
    kind, value = next(iter(kinds.items()))
    if kind == "choice" and not value:
        raise bad_request(f"{name}: the choice list is empty", name)
    return StructuredOutputsParams(**{kind: value})


def to_sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    stream: bool,
) -> SamplingParams:
    """The request's sampling parameters (raises ``APIError`` / ``ValueError``)."""
    if req.use_beam_search:
        raise bad_request("beam search is not supported", "use_beam_search")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported", "best_of")
    if stream and req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs are not available when stream=true",
                          "prompt_logprobs")
    try:
        return _sampling_params(req, max_tokens, logprobs, stream)
    except (ValueError, TypeError) as e:
        raise value_error(e) from None


def _sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                     stream: bool) -> SamplingParams:
    return SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        temperature=_DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=list(req.stop_token_ids or ()),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        structured_outputs=structured_outputs_of(req),
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        logit_bias=logit_bias_of(req.logit_bias),
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words or None,
        prompt_logprobs=req.prompt_logprobs,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        extra_args=({"kv_transfer_params": req.kv_transfer_params}
                    if req.kv_transfer_params is not None else None),
    )


def logit_bias_of(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as strings) as token id -> bias in [-100, 100]."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {short_repr(key)} is not a token id (an "
                              "integer as a string)", "logit_bias") from None
        out[token_id] = min(100.0, max(-100.0, float(value)))
    return out
