"""/v1/chat/completions: the model's chat template over the messages, ``n``
choices, logprobs in the chat shape, SSE streaming in OpenAI's chunk shapes
(a first chunk with the role per choice, content deltas, the finish reason,
``stream_options.include_usage`` as a last chunk with no choices, ``[DONE]``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from enginecore.entrypoints.openai.admission import Ticket
from enginecore.entrypoints.openai.errors import APIError, bad_request, error_body
from enginecore.entrypoints.openai.logprobs import TokenText, chat_logprobs
from enginecore.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
    now,
)
from enginecore.entrypoints.openai.sampling import to_sampling_params
from enginecore.entrypoints.openai.serving_engine import (
    OpenAIServing,
    check_finish_errors,
    collect_final,
    engine_errors,
    until_disconnect,
)
from enginecore.entrypoints.openai.streaming import SSEResponse, sse_event

_encode = msgspec.json.Encoder().encode
_MAX_TOP_LOGPROBS = 20


def message_text(msg: ChatMessage, index: int) -> str:
    """A message's text: a string, or its text parts joined by newlines."""
    content = msg.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type")
        if kind not in ("text", "input_text") or not isinstance(part.get("text"), str):
            raise bad_request(f"messages[{index}]: only text content parts are supported, "
                              f"got type {kind!r}", f"messages[{index}].content")
        texts.append(part["text"])
    return "\n".join(texts)


def render_chat(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool) -> str:
    """The prompt text of a conversation (the model's template, sandboxed jinja2)."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be "
                          "true", "continue_final_message")
    convo = [{"role": m.role, "content": message_text(m, i)} for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(convo, add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    except Exception as e:  # noqa: BLE001 - a template error is the request's problem
        raise bad_request(f"the chat template failed: {type(e).__name__}: {e}",
                          "messages") from None
    if continue_final_message:
        # Cut after the last message's content: the model continues it.
        last = convo[-1]["content"]
        cut = text.rfind(last) if last else -1
        if cut < 0:
            raise bad_request("continue_final_message: the final message is not in the "
                              "rendered prompt", "continue_final_message")
        text = text[:cut + len(last)]
    return text


class OpenAIServingChat(OpenAIServing):
    request_prefix = "chatcmpl"

    async def create(self, req: ChatCompletionRequest,
                     request: Request) -> Response | SSEResponse:
        model_name, lora = self.models.resolve(req.model)
        if req.tools and req.tool_choice != "none":
            raise bad_request("tool calling is not supported", "tools")
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
            if not 0 <= req.top_logprobs <= _MAX_TOP_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {_MAX_TOP_LOGPROBS}]",
                                  "top_logprobs")
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        tokenizer = self.require_tokenizer()
        text = render_chat(tokenizer, req.messages, req.add_generation_prompt,
                           req.continue_final_message)
        ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        params = to_sampling_params(req, max_tokens=max_tokens, logprobs=num_top,
                                    stream=req.stream)
        request_id = self.new_request_id(req.request_id)
        ticket = self.ctx.admission.admit([request_id], params.n)
        try:
            stream = self.engine.generate({"prompt": text, "prompt_token_ids": ids}, params,
                                          request_id, lora_request=lora,
                                          priority=req.priority, cache_salt=req.cache_salt)
            text_of = TokenText(tokenizer, bool(req.return_tokens_as_token_ids))
            last = req.messages[-1]
            # vLLM's echo: the last message, when it is the assistant's, leads the answer.
            echo = (message_text(last, len(req.messages) - 1)
                    if req.echo and last.role == "assistant" else "")
            if req.stream:
                try:
                    first = await until_disconnect(request, anext(stream))
                except BaseException as e:
                    await stream.aclose()
                    raise engine_errors(e) from None
                body = self._stream(req, request_id, model_name, params.n, num_top, echo,
                                    first, stream, text_of, ticket)
                ticket = None  # the stream releases it
                return SSEResponse(body)
            try:
                final = await until_disconnect(request, collect_final(stream))
            except BaseException as e:
                raise engine_errors(e) from None
            return self._response(request_id, model_name, num_top, echo, final, text_of)
        finally:
            if ticket is not None:
                ticket.release()

    def _response(self, request_id: str, model: str, num_top: int | None, echo: str,
                  final: Any, text_of: TokenText) -> Response:
        check_finish_errors(final.outputs)
        if any(c.finish_reason == "abort" for c in final.outputs) and \
                self.ctx.admission.draining:
            raise APIError(503, "the server shut down before the request finished")
        choices = []
        completion_tokens = 0
        for comp in sorted(final.outputs, key=lambda c: c.index):
            completion_tokens += len(comp.token_ids)
            logprobs = None
            if num_top is not None and comp.logprobs is not None:
                logprobs = chat_logprobs(comp.token_ids, comp.logprobs, num_top, text_of)
            choices.append(ChatChoice(comp.index, AssistantMessage("assistant",
                                                                   echo + comp.text),
                                      logprobs, comp.finish_reason, comp.stop_reason))
        prompt_tokens = len(final.prompt_token_ids)
        body = ChatCompletionResponse(
            id=request_id, created=now(), model=model, choices=choices,
            usage=UsageInfo(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens))
        return Response(_encode(body), media_type="application/json")

    async def _stream(self, req: ChatCompletionRequest, request_id: str, model: str, n: int,
                      num_top: int | None, echo: str, first: Any, stream: AsyncIterator,
                      text_of: TokenText, ticket: Ticket) -> AsyncIterator[bytes]:
        created = now()
        tokens = [0] * n
        opts = req.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous = include_usage and opts.continuous_usage_stats
        prompt_tokens = len(first.prompt_token_ids)

        def usage() -> UsageInfo:
            c = sum(tokens)
            return UsageInfo(prompt_tokens, c, prompt_tokens + c)

        def chunk(index: int, delta: DeltaMessage, logprobs: Any = None,
                  finish: str | None = None, stop_reason: Any = None) -> bytes:
            return sse_event(_encode(ChatCompletionChunk(
                id=request_id, object="chat.completion.chunk", created=created, model=model,
                choices=[ChatStreamChoice(index, delta, logprobs, finish, stop_reason)],
                usage=usage() if continuous else None)))

        try:
            # The role first, for every choice (with the echoed message, if asked).
            yield b"".join(chunk(i, DeltaMessage(role="assistant", content=echo))
                           for i in range(n))
            out: Any = first
            while True:
                events = []
                for comp in out.outputs:
                    if comp.finish_reason == "error":
                        raise APIError(400 if not comp.token_ids and not tokens[comp.index]
                                       else 500,
                                       str(comp.stop_reason or "the engine failed the request"))
                    tokens[comp.index] += len(comp.token_ids)
                    if not comp.text and comp.finish_reason is None and not comp.token_ids:
                        continue
                    logprobs = None
                    if num_top is not None and comp.logprobs is not None:
                        logprobs = chat_logprobs(comp.token_ids, comp.logprobs, num_top,
                                                 text_of)
                    events.append(chunk(comp.index, DeltaMessage(content=comp.text), logprobs,
                                        comp.finish_reason, comp.stop_reason))
                if events:
                    yield b"".join(events)
                try:
                    out = await anext(stream)
                except StopAsyncIteration:
                    break
            if include_usage:
                yield sse_event(_encode(ChatCompletionChunk(
                    id=request_id, object="chat.completion.chunk", created=created, model=model, choices=[], usage=usage())))
        except Exception as e:  # noqa: BLE001 - the stream has started: an error event
            err = engine_errors(e)
            yield sse_event(error_body(err.status, err.message, err.param))
        finally:
            ticket.release()
            await stream.aclose()
