"""`enginecore serve` with no model (the default SmolLM2-135M-Instruct), where the
words matter: answers through the openai client (sync and async streaming), a
client that disconnects is aborted in the engine at once, and `enginecore chat`
in process and against the server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import ServerProcess

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20)])
    yield srv
    srv.stop()


def test_answers_with_the_sync_and_async_clients(server):
    with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0) as client:
        [model] = client.models.list().data
        assert model.id == "SmolLM2-135M-Instruct"
        out = client.chat.completions.create(model=model.id, messages=QUESTION, max_tokens=24,
                                             temperature=0)
        assert "Paris" in out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop"
        done = client.completions.create(model=model.id, prompt="The capital of France is",
                                         max_tokens=8, temperature=0)
        assert "Paris" in done.choices[0].text

    async def stream() -> str:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="none",
                                      max_retries=0) as client:
            chunks = await client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=24,
                temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in chunks
                            if c.choices])

    assert asyncio.run(asyncio.wait_for(stream(), 60)) == out.choices[0].message.content


def _running(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "enginecore:num_requests_running")


def _wait(predicate, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if predicate():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s")


@pytest.mark.parametrize("stream", [True, False])
def test_a_disconnected_client_is_aborted_in_the_engine(server, stream):
    """1500 tokens of the default model take tens of seconds here; the engine must
    drop the request within a step of the client leaving (its running count, sent
    with the abort's outputs, goes back to 0)."""
    body = {"prompt": "Write a very long story.", "max_tokens": 1500, "ignore_eos": True,
            "stream": stream}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            assert _running(server) == 1
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    assert _wait(lambda: _running(server) == 0, 5.0) < 5.0
    # and the server goes on serving
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200


def _chat_cli(*args: str, lines: str) -> str:
    done = subprocess.run([sys.executable, "-m", "enginecore.entrypoints.cli", "chat", *args],
                          input=lines, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_chat_command_against_the_server(server):
    out = _chat_cli("--url", server.base_url, "--temperature", "0", "--max-tokens", "12",
                    lines="What is the capital of France?\nAnd of Italy?\n/exit\n")
    assert "Paris" in out and "Rome" in out  # the second turn saw the first


def test_chat_command_in_process(tmp_path):
    """In process (a tiny model: the words are noise, the loop is the same)."""
    from server_helpers import make_tiny_chat_model

    model = make_tiny_chat_model(str(tmp_path / "tiny"))
    out = _chat_cli("--model", model, "--max-tokens", "6", "--seed", "1",
                    lines="hello\n/reset\nagain\n")
    assert out.count("> ") >= 3 and "(conversation cleared)" in out
