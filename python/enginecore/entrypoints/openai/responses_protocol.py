"""The OpenAI Responses API request (``POST /v1/responses``) and how it maps onto
a chat completion request: ``input`` items become chat messages (``message``,
``function_call``, ``function_call_output``), ``instructions`` the system message,
function ``tools`` / ``tool_choice`` the chat ones, ``text.format`` the
``response_format``, ``max_output_tokens`` ``max_tokens``."""

from __future__ import annotations

from typing import Any

import msgspec

from enginecore.entrypoints.openai.errors import bad_request


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    truncation: str | None = None
    user: str | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    # vLLM's extras, as on the chat endpoint
    request_id: str | None = None
    seed: int | None = None
    top_k: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None


_TEXT_PARTS = ("input_text", "output_text", "text")


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"{where}: content part {kind!r} is not supported (text "
                                  "only)", "input")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise bad_request(f"{where}: content must be a string or a list of parts", "input")


def _field_str(item: dict[str, Any], key: str, where: str, empty_ok: bool = False) -> str:
    """A function call item's required string field (the Responses API's types)."""
    value = item.get(key)
    if not isinstance(value, str) or not (value or empty_ok):
        got = "missing" if value is None else f"a {type(value).__name__}"
        raise bad_request(f"{where}: a {item.get('type')} item needs {key!r} as a "
                          f"string, got {got}", "input")
    return value


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}: role must be user, system, developer or "
                                  f"assistant, got {str(role)[:40]!r}", "input")
            messages.append({"role": role, "content": _content_text(item.get("content"),
                                                                    where)})
        elif kind == "function_call":
            arguments = _field_str(item, "arguments", where, empty_ok=True)
            call = {"id": _field_str(item, "call_id", where), "type": "function",
                    "function": {"name": _field_str(item, "name", where),
                                 "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _field_str(item, "call_id", where)
            output = item.get("output")
            if output is None:
                raise bad_request(f"{where}: a function_call_output needs 'output'", "input")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": output if isinstance(output, str)
                             else _content_text(output, where)})
        elif kind == "reasoning":
            continue  # earlier thinking is not sent back to the model
        else:
            raise bad_request(f"{where}: input item type {str(kind)[:40]!r} is not supported",
                              "input")
    if not messages:
        raise bad_request("input must not be empty", "input")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported, got "
                              f"{str(tool.get('type'))[:40]!r}", "tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema"),
            "strict": fmt.get("strict"), "description": fmt.get("description")}}
    raise bad_request(f"text.format type {str(fmt.get('type'))[:40]!r} is not supported",
                      "text")


def chat_body(req: ResponsesRequest, stream: bool) -> dict[str, Any]:
    """The equivalent /v1/chat/completions body."""
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: responses are not "
                          "stored; send the conversation in input", "previous_response_id")
    body: dict[str, Any] = {"messages": input_messages(req), "stream": stream}
    for name, value in (("model", req.model), ("max_tokens", req.max_output_tokens),
                        ("temperature", req.temperature), ("top_p", req.top_p),
                        ("tools", chat_tools(req.tools)),
                        ("tool_choice", chat_tool_choice(req.tool_choice)),
                        ("parallel_tool_calls", req.parallel_tool_calls),
                        ("response_format", response_format(req.text)),
                        ("user", req.user), ("seed", req.seed), ("top_k", req.top_k),
                        ("request_id", req.request_id),
                        ("chat_template_kwargs", req.chat_template_kwargs),
                        ("logit_bias", req.logit_bias), ("ignore_eos", req.ignore_eos)):
        if value is not None:
            body[name] = value
    if req.top_logprobs:
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body
