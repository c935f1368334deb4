"""``POST /v1/responses`` (the OpenAI Responses API) over the chat pipeline.

A request becomes the equivalent chat completion request (responses_protocol.py),
so templates, tools (function calls through the tool parsers), reasoning and
structured outputs behave as on /v1/chat/completions; the answer is put into the
Responses shape: ``output`` items (``reasoning``, ``message`` with
``output_text`` parts, ``function_call``), ``usage`` with input/output tokens,
``status`` ``completed`` or ``incomplete`` (max_output_tokens). Streamed, the
official event sequence: ``response.created``, ``response.in_progress``, per item
``response.output_item.added`` / ``.done`` (text: ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``; calls: ``response.function_call_arguments.delta`` /
``.done``; reasoning: ``response.reasoning_text.delta`` / ``.done``), then
``response.completed`` (or ``response.incomplete``), each with a
``sequence_number``. Responses are not stored (``store`` is reported false)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from enginecore.entrypoints.openai.protocol import ChatCompletionRequest
from enginecore.entrypoints.openai.responses_protocol import ResponsesRequest, chat_body
from enginecore.entrypoints.openai.serving_engine import decode_body
from enginecore.entrypoints.openai.streaming import SSEResponse

_encode = msgspec.json.Encoder().encode


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    u = usage or {}
    inp, out = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {"input_tokens": inp, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": inp + out}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class OpenAIServingResponses:
    def __init__(self, chat: Any) -> None:
        self.chat = chat

    def _shell(self, req: ResponsesRequest, response_id: str, model: str,
               created: int) -> dict[str, Any]:
        """The response object's fields that do not depend on the output."""
        text = req.text or {"format": {"type": "text"}}
        return {"id": response_id, "object": "response", "created_at": created,
                "model": model, "status": "in_progress", "output": [], "error": None,
                "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": req.reasoning,
                "store": False, "temperature": req.temperature,
                "text": text, "tool_choice": req.tool_choice or "auto",
                "tools": req.tools or [], "top_p": req.top_p,
                "truncation": req.truncation or "disabled", "user": req.user,
                "usage": None}

    def _chat_request(self, req: ResponsesRequest, stream: bool) -> ChatCompletionRequest:
        return decode_body(json.dumps(chat_body(req, stream)).encode(), ChatCompletionRequest)

    async def create(self, req: ResponsesRequest, request: Request) -> Any:
        chat_req = self._chat_request(req, req.stream)
        response_id = _id("resp")
        created = int(time.time())
        answer = await self.chat.create(chat_req, request)
        model = self.chat.models.resolve(req.model)[0]
        shell = self._shell(req, response_id, model, created)
        if not req.stream:
            return Response(_encode(self._from_completion(shell, json.loads(answer.body))),
                            media_type="application/json")
        return SSEResponse(self._events(shell, answer.body))

    # -- non-streamed ---------------------------------------------------------------------
    def _from_completion(self, shell: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        choice = body["choices"][0]
        msg = choice["message"]
        output: list[dict[str, Any]] = []
        if msg.get("reasoning_content"):
            output.append(_reasoning_item(_id("rs"), msg["reasoning_content"]))
        if msg.get("content"):
            output.append(_message_item(_id("msg"), msg["content"]))
        for call in msg.get("tool_calls") or ():
            fn = call["function"]
            output.append(_call_item(_id("fc"), call["id"], fn["name"], fn["arguments"]))
        return {**shell, **self._status(choice.get("finish_reason")), "output": output,
                "usage": _usage(body.get("usage"))}

    @staticmethod
    def _status(finish_reason: str | None) -> dict[str, Any]:
        if finish_reason == "length":
            return {"status": "incomplete",
                    "incomplete_details": {"reason": "max_output_tokens"}}
        return {"status": "completed", "incomplete_details": None}

    # -- streamed -------------------------------------------------------------------------
    async def _events(self, shell: dict[str, Any],
                      chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        stream = _EventStream(shell)
        try:
            yield stream.event("response.created", response=dict(shell))
            yield stream.event("response.in_progress", response=dict(shell))
            async for raw in chunks:
                out = b"".join(stream.on_chunk(c) for c in _sse_payloads(raw))
                if out:
                    yield out
                if stream.failed:
                    return
            yield stream.finish()
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()


def _sse_payloads(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
            out.append(json.loads(line[6:]))
    return out


class _EventStream:
    """Chat chunks in, Responses events out (items opened as their first delta
    arrives, closed at the end or when another kind of item starts)."""

    def __init__(self, shell: dict[str, Any]) -> None:
        self.shell = shell
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished output items
        self.open: dict[str, Any] | None = None  # {"kind", "item", "text"/"args", "index"}
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> open call
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.failed = False

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(payload) + b"\n\n"

    def on_chunk(self, chunk: dict[str, Any]) -> bytes:
        if "error" in chunk:
            self.failed = True
            err = chunk["error"]
            return self.event("error", code=str(err.get("code") or err.get("type")),
                              message=err.get("message", ""), param=err.get("param"))
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out.append(self._text_delta("reasoning", delta["reasoning_content"]))
            if delta.get("content"):
                out.append(self._text_delta("message", delta["content"]))
            for call in delta.get("tool_calls") or ():
                out.append(self._call_delta(call))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return b"".join(out)

    def _open_item(self, kind: str, item: dict[str, Any]) -> bytes:
        out = self._close_open()
        index = len(self.items)
        self.open = {"kind": kind, "item": item, "text": "", "index": index}
        out += self.event("response.output_item.added", output_index=index, item=item)
        if kind == "message":
            out += self.event("response.content_part.added", item_id=item["id"],
                              output_index=index, content_index=0, part=_text_part(""))
        return out

    def _text_delta(self, kind: str, text: str) -> bytes:
        out = b""
        if self.open is None or self.open["kind"] != kind:
            item = (_message_item(_id("msg"), "", "in_progress") if kind == "message" else
                    {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [],
                     "status": "in_progress"})
            out = self._open_item(kind, item)
        assert self.open is not None
        self.open["text"] += text
        item_id, index = self.open["item"]["id"], self.open["index"]
        if kind == "message":
            return out + self.event("response.output_text.delta", item_id=item_id,
                                    output_index=index, content_index=0, delta=text,
                                    logprobs=[])
        return out + self.event("response.reasoning_text.delta", item_id=item_id,
                                output_index=index, content_index=0, delta=text)

    def _call_delta(self, call: dict[str, Any]) -> bytes:
        out = b""
        fn = call.get("function") or {}
        key = call.get("index", 0)
        state = self.calls.get(key)
        if state is None or (self.open is not None and self.open is not state):
            item = _call_item(_id("fc"), call.get("id") or _id("call"), fn.get("name") or "",
                              "", "in_progress")
            out = self._open_item("function_call", item)
            state = self.calls[key] = self.open  # type: ignore[assignment]
        assert state is not None
        args = fn.get("arguments") or ""
        if not args:
            return out
        state["text"] += args
        return out + self.event("response.function_call_arguments.delta",
                                item_id=state["item"]["id"], output_index=state["index"],
                                delta=args)

    def _close_open(self) -> bytes:
        if self.open is None:
            return b""
        kind, item, text, index = (self.open["kind"], self.open["item"], self.open["text"],
                                   self.open["index"])
        self.open = None
        out = b""
        if kind == "message":
            done = _message_item(item["id"], text)
            out += self.event("response.output_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=text, logprobs=[])
            out += self.event("response.content_part.done", item_id=item["id"],
                              output_index=index, content_index=0, part=_text_part(text))
        elif kind == "reasoning":
            done = _reasoning_item(item["id"], text)
            out += self.event("response.reasoning_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=text)
        else:
            done = _call_item(item["id"], item["call_id"], item["name"], text)
            out += self.event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, name=item["name"], arguments=text)
        self.items.append(done)
        return out + self.event("response.output_item.done", output_index=index, item=done)

    def finish(self) -> bytes:
        out = self._close_open()
        status = OpenAIServingResponses._status(self.finish_reason)
        response = {**self.shell, **status, "output": self.items,
                    "usage": _usage(self.usage)}
        kind = "response.completed" if status["status"] == "completed" else \
            "response.incomplete"
        return out + self.event(kind, response=response)
