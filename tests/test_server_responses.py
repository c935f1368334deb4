"""POST /v1/responses through the official openai client (client.responses.create,
streamed and not; text and function-call output items), and
client.chat.completions.parse with a pydantic model (json_schema, strict)."""

from __future__ import annotations

import json

import openai
import pydantic
import pytest

from server_helpers import ServerProcess, make_tiny_chat_model

TOOL = {"type": "function", "name": "get_weather", "description": "the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "maxLength": 8}},
                       "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_chat_model(str(tmp_path_factory.mktemp("resp")), seed=7)
    srv = ServerProcess([folder, "--served-model-name", "tiny", "--max-model-len", "512",
                         "--kv-cache-memory-bytes", str(32 << 20), "--dtype", "float32"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                       timeout=120) as c:
        yield c


def _chat_text(client, messages, n):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=n,
                                          temperature=0, extra_body={"ignore_eos": True})


def test_responses_create_text(client):
    r = client.responses.create(model="tiny", input="Hello", instructions="be brief",
                                max_output_tokens=10, temperature=0,
                                extra_body={"ignore_eos": True})
    same = _chat_text(client, [{"role": "system", "content": "be brief"},
                               {"role": "user", "content": "Hello"}], 10)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == same.choices[0].message.content
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == same.usage.prompt_tokens
    assert r.usage.output_tokens == 10


def test_responses_stream_events(client):
    kwargs = {"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Tell me"}]}], "max_output_tokens": 12, "temperature": 0,
        "extra_body": {"ignore_eos": True}}
    full = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.output_text.delta", "response.output_text.done",
                 "response.content_part.done", "response.output_item.done"):
        assert kind in types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text
    assert events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens == 12


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_responses_function_calls(client, stream, choice):
    kwargs = {"model": "tiny", "input": "weather?", "tools": [TOOL], "tool_choice": choice,
                  "max_output_tokens": 200, "temperature": 0, "parallel_tool_calls": False}
    if not stream:
        r = client.responses.create(**kwargs)
    else:
        events = list(client.responses.create(stream=True, **kwargs))
        assert "response.function_call_arguments.delta" in [e.type for e in events]
        deltas = "".join(e.delta for e in events
                         if e.type == "response.function_call_arguments.delta")
        r = events[-1].response
        calls = [o for o in r.output if o.type == "function_call"]
        assert deltas == "".join(c.arguments for c in calls)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls, r.output
    for call in calls:
        assert call.name == "get_weather" and call.call_id
        args = json.loads(call.arguments)
        assert set(args) == {"city"} and isinstance(args["city"], str)
        assert len(args["city"]) <= 8


def test_function_call_round_trip(client):
    r = client.responses.create(model="tiny", max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
        tools=[TOOL], tool_choice="none")
    assert r.status in ("completed", "incomplete")


def test_responses_bad_input_is_400(client):
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="input item type"):
        client.responses.create(model="tiny", input=[{"type": "image_generation_call"}])


# The random model would pad JSON with whitespace until max_tokens: the byte-level
# tokenizer's whitespace ids (one id per byte) are pushed away.
NO_WHITESPACE = {"logit_bias": {str(b): -100 for b in (9, 10, 13, 32)}}


class Answer(pydantic.BaseModel):
    ok: bool
    mood: str = pydantic.Field(max_length=6)


def test_chat_completions_parse_with_pydantic(client):
    out = client.chat.completions.parse(model="tiny", messages=[
        {"role": "user", "content": "answer"}], response_format=Answer, max_tokens=100,
        temperature=0, extra_body=NO_WHITESPACE)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Answer)
    assert parsed == Answer.model_validate_json(out.choices[0].message.content)


def test_responses_text_format_json_schema(client):
    r = client.responses.create(model="tiny", input="answer", max_output_tokens=100,
                                temperature=0, extra_body=NO_WHITESPACE, text={"format": {
                                    "type": "json_schema", "name": "answer", "strict": True,
                                    "schema": Answer.model_json_schema() | {
                                        "additionalProperties": False}}})
    Answer.model_validate_json(r.output_text)
