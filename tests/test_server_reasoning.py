"""`enginecore serve --reasoning-parser qwen3` through the openai client: the
thinking as reasoning_content beside content (non-streamed and streamed alike),
chat_template_kwargs enable_thinking passing through to the template, structured
outputs applying to the answer after the thinking; and --metrics-prefix vllm."""

from __future__ import annotations

import json
import os

import openai
import pytest

from server_helpers import ServerProcess, make_tiny_chat_model

# Qwen3-Thinking-style: the generation prompt opens <think>, unless thinking is off
# (then an empty, closed think block, as Qwen3's template renders it).
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% else %}<think>\n{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_chat_model(str(tmp_path_factory.mktemp("reason")), seed=5)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    srv = ServerProcess([folder, "--served-model-name", "tiny", "--max-model-len", "512",
                         "--kv-cache-memory-bytes", str(32 << 20), "--dtype", "float32",
                         "--reasoning-parser", "qwen3", "--metrics-prefix", "vllm"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as c:
        yield c


def _raw_text(client, prompt: str, n: int) -> str:
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_thinking_is_reasoning_content(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True})
    msg = out.choices[0].message
    raw = _raw_text(client, "<|user|>hi\n<|assistant|><think>\n", 12)
    # the random model never writes </think>: everything is (cut-off) thinking
    assert "</think>" not in raw
    assert msg.reasoning_content == raw
    assert msg.content is None
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    reasoning, content = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (msg.reasoning_content, "")


def test_enable_thinking_false_passes_through(client):
    off = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    on = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + len("\n</think>\n\n")
    msg = off.choices[0].message
    assert msg.reasoning_content is None
    assert msg.content == _raw_text(client, "<|user|>hi\n<|assistant|><think>\n\n</think>\n\n",
                                    8)


def test_structured_output_is_the_answer(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "n", "schema": schema, "strict": True}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert isinstance(json.loads(out.choices[0].message.content)["n"], int)


def test_metrics_prefix_vllm(server, client):
    import httpx

    text = httpx.get(server.url + "/metrics").text
    assert "vllm:prompt_tokens_total" in text and "vllm:num_requests_running" in text
    assert "enginecore:prompt_tokens_total" not in text
