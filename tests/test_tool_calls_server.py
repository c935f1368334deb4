"""Tool calls with the default model through the official openai client:
``tool_choice`` "required" and a named function decode under a schema built from
the tools, so the arguments parse and validate (jsonschema) streamed and not; the
round trip of assistant tool calls and tool answers; bad tools are 400s naming
the problem; "auto" without the flags is vLLM's 400."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from server_helpers import ServerProcess

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 24},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "The weather in a city"}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20)])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0) as c:
        c.model_id = c.models.list().data[0].id
        yield c


def _check_calls(calls, only: str | None = None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in SCHEMAS and (only is None or call.function.name == only)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(client, **kw):
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for piece in choice.delta.tool_calls or ():
            if piece.index not in calls:  # id, type and name come first
                assert piece.id and piece.type == "function" and piece.function.name
                calls[piece.index] = {"id": piece.id, "name": piece.function.name,
                                      "arguments": ""}
            else:
                assert piece.id is None and piece.function.name is None
            calls[piece.index]["arguments"] += piece.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "add"}}])
def test_forced_calls_validate_streamed_and_not(client, choice):
    only = None if choice == "required" else "add"
    kw = {"model": client.model_id, "messages": ASK, "tools": TOOLS, "tool_choice": choice,
          "max_tokens": 120, "temperature": 0}
    out = client.chat.completions.create(**kw)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert not msg.content
    _check_calls(msg.tool_calls, only)
    content, calls, finish = _streamed(client, **kw)
    assert finish == "tool_calls" and content == ""
    # Greedy: the stream's calls are the non-streamed calls, piece by piece.
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_sampled_required_calls_always_validate(client):
    out = client.chat.completions.create(
        model=client.model_id, messages=ASK, tools=TOOLS, tool_choice="required", n=4,
        max_tokens=120, temperature=1.0, seed=7, parallel_tool_calls=False)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1  # parallel_tool_calls=False
        _check_calls(choice.message.tool_calls)


def test_the_tool_round_trip_is_accepted(client):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": '
                                                             '"celsius"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    out = client.chat.completions.create(model=client.model_id, messages=messages,
                                         tools=TOOLS, tool_choice="none", max_tokens=8,
                                         temperature=0)
    assert out.choices[0].message.tool_calls in (None, [])
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("tools,choice,words", [
    ([{"type": "function", "function": {"name": "f", "parameters": "object"}}], "required",
     ["tools[0].function.parameters", "JSON schema object"]),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "required", ["type 'object'"]),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}], "required",
     ["not a valid JSON schema"]),
    ([TOOLS[0], TOOLS[0]], "required", ["'get_weather'", "twice"]),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, ["'nope'", "not in tools"]),
    (TOOLS, "auto", ["--enable-auto-tool-choice", "--tool-call-parser"]),
    (None, "required", ["needs tools"]),
    (TOOLS, "sometimes", ["tool_choice must be"]),
])
def test_bad_tools_are_400s_naming_the_problem(server, tools, choice, words):
    body = {"messages": ASK, "tool_choice": choice, "max_tokens": 4}
    if tools is not None:
        body["tools"] = tools
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    for word in words:
        assert word in message, message


def test_tools_with_a_structured_output_constraint_are_a_400(server):
    r = httpx.post(server.base_url + "/chat/completions", timeout=60, json={
        "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 4,
        "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "structured-output" in r.json()["error"]["message"]
