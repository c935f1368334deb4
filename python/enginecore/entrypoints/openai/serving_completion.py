"""/v1/completions: a string, a list of strings, a token-id list or a list of
token-id lists; ``n`` samples per prompt (choice index = prompt * n + sample),
``echo`` (with ``logprobs``: the prompt's logprobs lead, its first token's None,
as vLLM's; not when streaming), ``prompt_logprobs``, logprobs in the completions
shape, SSE streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from enginecore.entrypoints.openai.admission import Ticket
from enginecore.entrypoints.openai.errors import APIError, bad_request, error_body
from enginecore.entrypoints.openai.logprobs import (
    TokenText,
    completion_logprobs,
    echo_logprobs,
)
from enginecore.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    UsageInfo,
    now,
)
from enginecore.entrypoints.openai.request_limits import (
    precompile_structured,
    prepare_prompts,
)
from enginecore.entrypoints.openai.sampling import to_sampling_params
from enginecore.entrypoints.openai.serving_engine import (
    OpenAIServing,
    answer,
    check_finish_errors,
    engine_errors,
    first_event,
)
from enginecore.entrypoints.openai.streaming import SSEResponse, merge_streams, sse_event

_encode = msgspec.json.Encoder().encode


def parse_prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a request: each a str or a token-id list."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) for p in prompt):
        if any(not p for p in prompt):
            raise bad_request("a token-id prompt must not be empty", "prompt")
        return list(prompt)
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a "
                      "list of token-id lists (not a mix)", "prompt")


class _Choice:
    """Per-choice state while streaming: tokens so far and text offset."""

    __slots__ = ("tokens", "offset", "started")

    def __init__(self) -> None:
        self.tokens = 0
        self.offset = 0
        self.started = False


class OpenAIServingCompletion(OpenAIServing):
    request_prefix = "cmpl"

    async def create(self, req: CompletionRequest, request: Request) -> Response | SSEResponse:
        model_name, lora = self.models.resolve(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        echo_logprobs = req.echo and req.logprobs is not None
        if echo_logprobs and req.stream:
            raise bad_request("echo with logprobs is not available when stream=true", "echo")
        prompts = parse_prompts(req.prompt)
        params = to_sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                                    stream=req.stream)
        if echo_logprobs:  # the echoed prompt's logprobs: at least as many as asked
            params = msgspec.structs.replace(
                params, prompt_logprobs=max(req.logprobs, params.prompt_logprobs or 0))
        request_id = self.new_request_id(req.request_id)
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}"
                                                       for i in range(len(prompts))]
        ticket = self.ctx.admission.admit(ids, len(prompts) * params.n)
        try:
            engine_prompts = await prepare_prompts(self, prompts, req.add_special_tokens,
                                                   req.truncate_prompt_tokens, "prompt")
            await precompile_structured(self.engine.input_processor, params)
            streams = [self.engine.generate(ep, params, rid,
                                            lora_request=lora, priority=req.priority,
                                            cache_salt=req.cache_salt)
                       for ep, rid in zip(engine_prompts, ids)]
            merged = merge_streams(streams)
            text_of = TokenText(self.tokenizer, bool(req.return_tokens_as_token_ids))
            if req.stream:
                first = await first_event(request, merged)
                body = self._stream(req, request_id, model_name, params.n, prompts, first,
                                    merged, text_of, ticket)
                ticket = None  # the stream releases it
                return SSEResponse(body)
            finals = await answer(request, self._collect(merged, len(prompts)))
            return self._response(req, request_id, model_name, params.n, prompts, finals,
                                  text_of)
        finally:
            if ticket is not None:
                ticket.release()

    async def _collect(self, merged: AsyncIterator[tuple[int, Any]], count: int) -> list[Any]:
        finals: list[Any] = [None] * count
        try:
            async for i, out in merged:
                finals[i] = out
        finally:
            await merged.aclose()
        return finals

    def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.require_tokenizer().decode(prompt, skip_special_tokens=False)

    def _response(self, req: CompletionRequest, request_id: str, model: str, n: int,
                  prompts: list, finals: list[Any], text_of: TokenText) -> Response:
        choices = []
        prompt_tokens = completion_tokens = 0
        for i, (prompt, out) in enumerate(zip(prompts, finals)):
            if out is None:
                raise APIError(500, "the engine finished a prompt without an output")
            check_finish_errors(out.outputs)
            prompt_tokens += len(out.prompt_token_ids)
            if any(c.finish_reason == "abort" for c in out.outputs) and \
                    self.ctx.admission.draining:
                raise APIError(503, "the server shut down before the request finished")
            head = self._prompt_text(prompt) if req.echo else ""
            for comp in sorted(out.outputs, key=lambda c: c.index):
                completion_tokens += len(comp.token_ids)
                logprobs = None
                if req.logprobs is not None and comp.logprobs is not None:
                    logprobs = completion_logprobs(comp.token_ids, comp.logprobs, req.logprobs,
                                                   text_of, len(head))
                    if req.echo and out.prompt_logprobs is not None:
                        logprobs = echo_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                 req.logprobs, text_of, logprobs)
                choices.append(CompletionChoice(
                    i * n + comp.index, head + comp.text, logprobs, comp.finish_reason,
                    comp.stop_reason,
                    out.prompt_logprobs if req.prompt_logprobs is not None else None))
        body = CompletionResponse(
            id=request_id, created=now(), model=model, choices=choices,
            usage=UsageInfo(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens),
            kv_transfer_params=next((f.kv_transfer_params for f in finals
                                     if f is not None and f.kv_transfer_params), None))
        return Response(_encode(body), media_type="application/json")

    async def _stream(self, req: CompletionRequest, request_id: str, model: str, n: int,
                      prompts: list, first: tuple[int, Any], merged: AsyncIterator,
                      text_of: TokenText, ticket: Ticket) -> AsyncIterator[bytes]:
        created = now()
        states = [_Choice() for _ in range(len(prompts) * n)]
        prompt_tokens = [0] * len(prompts)
        usage_opts = req.stream_options
        include_usage = usage_opts is not None and usage_opts.include_usage
        continuous = include_usage and usage_opts.continuous_usage_stats
        pending: tuple[int, Any] | None = first

        def usage() -> UsageInfo:
            p = sum(prompt_tokens)
            c = sum(s.tokens for s in states)
            return UsageInfo(p, c, p + c)

        try:
            while True:
                if pending is not None:
                    i, out = pending
                    pending = None
                else:
                    try:
                        i, out = await anext(merged)
                    except StopAsyncIteration:
                        break
                prompt_tokens[i] = len(out.prompt_token_ids)
                events = []
                for comp in out.outputs:
                    if comp.finish_reason == "error":
                        raise APIError(400 if not comp.token_ids and not
                                       states[i * n + comp.index].tokens else 500,
                                       str(comp.stop_reason or "the engine failed the request"))
                    state = states[i * n + comp.index]
                    state.tokens += len(comp.token_ids)
                    text = comp.text
                    if not state.started:
                        state.started = True
                        if req.echo:
                            text = self._prompt_text(prompts[i]) + text
                    if not text and comp.finish_reason is None and not comp.token_ids:
                        continue
                    logprobs = None
                    if req.logprobs is not None and comp.logprobs is not None:
                        logprobs = completion_logprobs(comp.token_ids, comp.logprobs,
                                                       req.logprobs, text_of,
                                                       state.offset + len(text) -
                                                       len(comp.text))
                    state.offset += len(text)
                    chunk = CompletionChunk(
                        id=request_id, object="text_completion", created=created, model=model,
                        choices=[CompletionStreamChoice(i * n + comp.index, text, logprobs,
                                                        comp.finish_reason, comp.stop_reason)],
                        usage=usage() if continuous else None)
                    events.append(sse_event(_encode(chunk)))
                if events:
                    yield b"".join(events)
            if include_usage:
                yield sse_event(_encode(CompletionChunk(
                    id=request_id, object="text_completion", created=created, model=model,
                    choices=[], usage=usage())))
        except Exception as e:  # noqa: BLE001 - the stream has started: an error event
            err = engine_errors(e)
            yield sse_event(error_body(err.status, err.message, err.param))
        finally:
            ticket.release()
            await merged.aclose()
