"""``tool_choice: "auto"`` with ``--tool-call-parser hermes`` end to end, on a tiny
random Qwen-style model (Qwen2 weights, ChatML tokens, a Qwen-like template) whose
output is forced with a regex: the calls are parsed exactly, streamed and not, through
the official openai client; the conversation round trip renders the calls and the tool
answers."""

from __future__ import annotations

import json
import os
import re

import httpx
import openai
import pytest

from server_helpers import ServerProcess
from tiny_models import make_tiny_model

QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["What is the weather in Paris?", '{"name": "get_weather", "arguments": {}}',
          "<tool_call>\n</tool_call>", "<tool_response>\n</tool_response>",
          "tool call arguments city unit celsius"]
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "UTC"})]
TEXT = "Checking.\n" + "\n".join(
    f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in CALLS)
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {k: {"type": "string"} for k in a}}}} for n, a in CALLS]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def make_tiny_qwen(path: str) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # <tool_call> is spelt by BPE merges here: llguidance reads added tokens as
    # special ones, which a regex cannot force.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|im_start|>", "<|im_end|>")])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>",
                   "chat_template": QWEN_LIKE_TEMPLATE}, f)
    return make_tiny_model(path, "qwen2", vocab_size=tok.get_vocab_size())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_qwen(str(tmp_path_factory.mktemp("tiny-qwen")))
    srv = ServerProcess([model, "--max-model-len", "512", "--enable-auto-tool-choice",
                         "--tool-call-parser", "hermes"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0) as c:
        c.model_id = c.models.list().data[0].id
        yield c


def _forced(client, **kw):
    return client.chat.completions.create(
        model=client.model_id, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
        extra_body={"structured_outputs": {"regex": re.escape(TEXT)}}, **kw)


def test_auto_hermes_calls_non_streamed(client):
    out = _forced(client)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking.\n"
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == CALLS
    assert all(c.type == "function" and c.id.startswith("chatcmpl-tool-")
               for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2


def test_auto_hermes_calls_streamed(client):
    content, calls, finish, chunks = "", {}, None, 0
    for chunk in _forced(client, stream=True):
        chunks += 1
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        assert "<tool_call>" not in (choice.delta.content or "")
        finish = choice.finish_reason or finish
        for piece in choice.delta.tool_calls or ():
            if piece.index not in calls:
                assert piece.id and piece.function.name and piece.type == "function"
                calls[piece.index] = [piece.function.name, ""]
            calls[piece.index][1] += piece.function.arguments or ""
    assert chunks > 10  # one token per step: many pieces
    assert content == "Checking.\n" and finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))] == CALLS


def test_text_without_calls_is_content(client):
    out = client.chat.completions.create(
        model=client.model_id, messages=ASK, tools=TOOLS, max_tokens=50, temperature=0,
        extra_body={"structured_outputs": {"regex": re.escape("It is sunny in Paris.")}})
    assert out.choices[0].message.content == "It is sunny in Paris."
    assert not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"


def test_the_round_trip_renders_calls_and_answers(server):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(CALLS[0][1])}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    r = httpx.post(server.url + "/tokenize", timeout=60,
                   json={"messages": messages, "tools": TOOLS})
    assert r.status_code == 200, r.text
    text = httpx.post(server.url + "/detokenize", timeout=60,
                      json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}\n</tool_call>') in text
    assert "<tool_response>\n21 C\n</tool_response>" in text and '"get_time"' in text
