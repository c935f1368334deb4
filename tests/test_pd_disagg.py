"""Disaggregated prefill/decode end to end (issue 20's acceptance): a prefill server
(PDConnector, kv_producer), a decode server (kv_consumer) and `enginecore proxy`, each
its own process on 127.0.0.1. 64 concurrent requests through the proxy answer exactly
as one server does; then the prefill server is killed (-9) with requests in flight:
every request still ends, recomputed on the decode side, and nothing hangs."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal

import httpx
import msgspec
import pytest

from enginecore.transport import make_keys
from server_helpers import ServerProcess, make_tiny_chat_model

rng = random.Random(5)
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]
PROMPTS = [" ".join(rng.choices(WORDS, k=rng.randint(6, 12))) for _ in range(64)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(str(tmp_path_factory.mktemp("pd-chat")), seed=9)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pd-keys") / "kv.keys")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(make_keys()))
    return path


def server(model_dir: str, role: str, key_file: str, **extra) -> ServerProcess:
    kv = {"kv_connector": "PDConnector", "kv_role": role,
          "kv_connector_extra_config": {"curve_key_file": key_file, **extra}}
    return ServerProcess([model_dir, "--max-model-len", "256", "--kv-cache-memory-bytes",
                          str(32 << 20), "--dtype", "float32", "--served-model-name", "tiny",
                          "--kv-transfer-config", json.dumps(kv)])


@pytest.fixture(scope="module")
def trio(model_dir, key_file):
    procs = []
    try:
        prefill = server(model_dir, "kv_producer", key_file)
        procs.append(prefill)
        decode = server(model_dir, "kv_consumer", key_file, transfer_timeout_s=2.0)
        procs.append(decode)
        proxy = ServerProcess(["--prefill", prefill.url, "--decode", decode.url],
                              command="proxy", startup_timeout_s=60)
        procs.append(proxy)
        yield prefill, decode, proxy
    finally:
        for p in reversed(procs):
            p.stop()


async def completions(url: str, prompts: list[str], stream: bool = False) -> list:
    """Every prompt at once: (status, text) each; each request bounded, never a hang."""
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        async def one(prompt: str):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                    "stream": stream}
            if not stream:
                r = await client.post(url + "/v1/completions", json=body)
                return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 \
                    else r.text
            text = ""
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        if "error" in event:
                            return 502, event["error"]["message"]
                        text += event["choices"][0]["text"]
            return r.status_code, text
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 300)


def test_64_concurrent_requests_answer_as_one_server(trio):
    prefill, decode, proxy = trio
    want = asyncio.run(completions(decode.url, PROMPTS))  # one server on its own
    assert all(status == 200 for status, _ in want)
    got = asyncio.run(completions(proxy.url, PROMPTS))
    assert got == want
    streamed = asyncio.run(completions(proxy.url, PROMPTS[:16], stream=True))
    assert streamed == want[:16]
    # The KV came over (no pull failed and fell back to recomputing; nothing refused);
    # the engines' log lines are in these outputs (the connector's start-up line is).
    assert "KV connector PDConnector" in decode.output()
    assert "KV load failed" not in decode.output()
    assert "kv block client" not in decode.output()
    assert "kv block server" not in prefill.output()
    # The prefill server answered with the params (a direct look at one answer).
    r = httpx.post(prefill.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    assert params["remote_host"] == "127.0.0.1"


def test_prefill_server_killed_mid_run(trio):
    prefill, decode, proxy = trio
    want = asyncio.run(completions(decode.url, PROMPTS[:24]))

    async def run_and_kill() -> list:
        task = asyncio.ensure_future(completions(proxy.url, PROMPTS[:24]))
        await asyncio.sleep(0.5)
        for pid in [*prefill.engine_pids(), prefill.proc.pid]:
            os.kill(pid, signal.SIGKILL)
        return await task

    got = asyncio.run(run_and_kill())
    # Every request ended; recomputed on the decode side, the same answers.
    assert got == want
    r = httpx.get(proxy.url + "/health", timeout=30)
    assert r.status_code == 503 and "no healthy prefill server" in r.json()["error"]["message"]
