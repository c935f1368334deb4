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
from enginecore.entrypoints.openai.chat_reasoning import RequestReasoning
from enginecore.entrypoints.openai.chat_templating import (
    off_loop,
    request_template,
    without_template_kwarg,
)
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
from enginecore.entrypoints.openai.request_limits import messages_size, precompile_structured
from enginecore.entrypoints.openai.sampling import to_sampling_params
from enginecore.entrypoints.openai.serving_engine import (
    OpenAIServing,
    answer,
    check_finish_errors,
    collect_final,
    engine_errors,
    first_event,
)
from enginecore.entrypoints.openai.streaming import SSEResponse, sse_event
from enginecore.entrypoints.openai.tool_calls import (
    ToolPlan,
    ToolStream,
    plan_tools,
    template_message,
    tool_message,
)

_encode = msgspec.json.Encoder().encode
_MAX_TOP_LOGPROBS = 20


def render_chat(input_processor: Any, messages: list[ChatMessage], *,
                add_generation_prompt: bool, continue_final_message: bool,
                tools: list | None = None, documents: list | None = None,
                chat_template: str | None = None,
                chat_template_kwargs: dict | None = None,
                untrusted_template: bool = False) -> dict[str, Any]:
    """{"prompt": text, "prompt_token_ids": ids} of a conversation, rendered by the
    front-end (the model's template in jinja2's sandbox); its refusals are 400s."""
    convo = [template_message(m) for m in messages]
    try:
        return input_processor.render_chat(
            convo, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools, documents=documents,
            chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
            untrusted_template=untrusted_template)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), "messages") from None
    except Exception as e:  # noqa: BLE001 - a template that fails is the request's problem
        raise bad_request(f"the chat template failed: {type(e).__name__}: {e}",
                          "messages") from None


def _with_reasoning(delta: DeltaMessage | None, thought: str | None) -> DeltaMessage | None:
    if not thought:
        return delta
    if delta is None:
        return DeltaMessage(reasoning_content=thought)
    delta.reasoning_content = thought
    return delta


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(str(p.get("text", "")) for p in content or ())


class OpenAIServingChat(OpenAIServing):
    request_prefix = "chatcmpl"

    async def create(self, req: ChatCompletionRequest,
                     request: Request) -> Response | SSEResponse:
        model_name, lora = self.models.resolve(req.model)
        tools = plan_tools(req, self.ctx.tool_config)
        if tools.parser_cls is not None:
            req = tools.parser_cls(self.tokenizer).adjust_request(req)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
            if not 0 <= req.top_logprobs <= _MAX_TOP_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {_MAX_TOP_LOGPROBS}]",
                                  "top_logprobs")
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        tokenizer = self.require_tokenizer()
        self.ctx.limits.check_text(messages_size(req.messages), "the messages' text",
                                   "messages")
        template = request_template(req.chat_template, req.chat_template_kwargs,
                                    self.ctx.trust_request_chat_template)

        def render() -> dict[str, Any]:
            prompt = render_chat(self.engine.input_processor, req.messages,
                                 add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message,
                                 tools=req.tools, documents=req.documents,
                                 chat_template=template, untrusted_template=True,
                                 chat_template_kwargs=without_template_kwarg(
                                     req.chat_template_kwargs))
            if req.add_special_tokens:
                prompt["prompt_token_ids"] = tokenizer.encode(prompt["prompt"])
            return prompt

        # The template and the tokenizer: in a worker thread, not on the event loop.
        prompt = await off_loop(render)
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        params = to_sampling_params(req, max_tokens=max_tokens, logprobs=num_top,
                                    stream=req.stream)
        if tools.structured is not None:
            if params.structured_outputs is not None:
                raise bad_request(f'tool_choice {tools.mode!r} decodes under its own schema; '
                                  "it cannot be combined with another structured-output "
                                  "constraint", "tool_choice")
            params = msgspec.structs.replace(params, structured_outputs=tools.structured)
        reasoning = RequestReasoning.of(self.ctx, tokenizer, prompt)
        if reasoning is not None:
            params = reasoning.constrain(params)  # the constraint starts after the thinking
        request_id = self.new_request_id(req.request_id)
        ticket = self.ctx.admission.admit([request_id], params.n)
        try:
            await precompile_structured(self.engine.input_processor, params)
            stream = self.engine.generate(prompt, params,
                                          request_id, lora_request=lora,
                                          priority=req.priority, cache_salt=req.cache_salt)
            text_of = TokenText(tokenizer, bool(req.return_tokens_as_token_ids))
            last = req.messages[-1]
            # vLLM's echo: the last message, when it is the assistant's, leads the answer.
            echo = _text_of(last.content) if req.echo and last.role == "assistant" else ""
            if req.stream:
                first = await first_event(request, stream)
                body = self._stream(req, request_id, model_name, params.n, num_top, echo,
                                    first, stream, text_of, ticket, tools, reasoning)
                ticket = None  # the stream releases it
                return SSEResponse(body)
            final = await answer(request, collect_final(stream))
            return self._response(request_id, model_name, num_top, echo, final, text_of,
                                  req.prompt_logprobs is not None, tools, req, reasoning)
        finally:
            if ticket is not None:
                ticket.release()

    def _response(self, request_id: str, model: str, num_top: int | None, echo: str,
                  final: Any, text_of: TokenText, prompt_logprobs: bool = False,
                  tools: ToolPlan | None = None, req: Any = None,
                  reasoning: RequestReasoning | None = None) -> Response:
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
            parser = tools.parser(self.tokenizer) if tools is not None else None
            thought, text = (None, comp.text) if reasoning is None else \
                reasoning.split(comp.text)
            content, calls, finish = tool_message(tools, parser, echo + text, req,
                                                  comp.finish_reason)
            if thought is not None and not content:
                content = None
            choices.append(ChatChoice(comp.index, AssistantMessage("assistant", content, calls,
                                                                   thought),
                                      logprobs, finish, comp.stop_reason))
        prompt_tokens = len(final.prompt_token_ids)
        body = ChatCompletionResponse(
            id=request_id, created=now(), model=model, choices=choices,
            usage=UsageInfo(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens),
            prompt_logprobs=final.prompt_logprobs if prompt_logprobs else None,
            kv_transfer_params=final.kv_transfer_params)
        return Response(_encode(body), media_type="application/json")

    async def _stream(self, req: ChatCompletionRequest, request_id: str, model: str, n: int,
                      num_top: int | None, echo: str, first: Any, stream: AsyncIterator,
                      text_of: TokenText, ticket: Ticket, tools: ToolPlan | None = None,
                      reasoning: RequestReasoning | None = None) -> AsyncIterator[bytes]:
        created = now()
        thinking = [reasoning.stream() if reasoning is not None else None for _ in range(n)]
        parsers = [tools.parser(self.tokenizer) if tools is not None else None
                   for _ in range(n)]
        tool_streams = [ToolStream(tools, p, req) if p is not None else None for p in parsers]
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
                    text, thought = comp.text, None
                    finish = comp.finish_reason
                    rs = thinking[comp.index]
                    if rs is not None:  # the thinking apart, tool calls in the answer only
                        thought, text = rs.delta(comp.text, finish is not None)
                        if not thought and not text and finish is None and logprobs is None:
                            continue
                    delta: DeltaMessage | None = DeltaMessage(
                        content=text if rs is None or text else None,
                        reasoning_content=thought or None)
                    ts = tool_streams[comp.index]
                    if ts is not None:
                        delta = _with_reasoning(ts.delta(text, finish is not None), thought)
                        finish = ts.finish_reason(finish)
                        if delta is None and finish is None and logprobs is None:
                            continue
                    events.append(chunk(comp.index, delta or DeltaMessage(), logprobs,
                                        finish, comp.stop_reason))
                if events:
                    yield b"".join(events)
                try:
                    out = await anext(stream)
                except StopAsyncIteration:
                    break
            if include_usage:
                yield sse_event(_encode(ChatCompletionChunk(
                    id=request_id, object="chat.completion.chunk", created=created,
                    model=model, choices=[], usage=usage())))
        except Exception as e:  # noqa: BLE001 - the stream has started: an error event
            err = engine_errors(e)
            yield sse_event(error_body(err.status, err.message, err.param))
        finally:
            ticket.release()
            await stream.aclose()
