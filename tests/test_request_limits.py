"""No client stalls the others: while each hostile request runs (a prompt of tens of
MiB, a large prompt that is tokenized, a large /tokenize, a costly JSON schema, a
body nested 100,000 deep, a request for 256,000 sequences, huge logit_bias / stop
values), an open stream keeps getting chunks with gaps under 0.5 s, and each
hostile request gets its clear answer (a 400/429 naming the limit, or its result)."""

from __future__ import annotations

import itertools
import json
import threading
import time

import httpx
import pytest

from server_helpers import ServerProcess, make_tiny_chat_model
from tiny_models import make_tiny_model

MAX_GAP_S = 0.5
MAX_MODEL_LEN = 32768


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-long"))
    make_tiny_chat_model(path)
    make_tiny_model(path, "llama", max_position_embeddings=MAX_MODEL_LEN)  # long streams
    srv = ServerProcess([path, "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32",
                         "--kv-cache-memory-bytes", str(128 << 20)])
    yield srv
    srv.stop()


class OpenStream(threading.Thread):
    """A long completion stream; the arrival time of each chunk."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.times: list[float] = []
        self.stop = False

    def run(self) -> None:
        body = {"prompt": "x", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True,
                "stream": True, "temperature": 0}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.times.append(time.monotonic())
                if self.stop:
                    return


def _hostile_cases():
    deep = 100_000
    schema_props = {f"field_{i}": {"type": "object", "properties": {
        f"x{j}": {"type": ["string", "integer", "null"], "pattern": "^[a-z]{1,8}$"}
        for j in range(20)}} for i in range(150)}
    schema = {"type": "object", "properties": schema_props, "required": list(schema_props)}
    big = "hello world " * (900_000 // 12)
    return {
        "32 MiB prompt": ("/v1/completions", json.dumps(
            {"prompt": "a" * (30 << 20), "max_tokens": 1}).encode(), {400, 413},
            ["--max-prompt-bytes"]),
        "large prompt, tokenized": ("/v1/completions", json.dumps(
            {"prompt": big, "max_tokens": 1}).encode(), {400}, ["maximum model length"]),
        "large /tokenize": ("/tokenize", json.dumps({"prompt": big}).encode(), {200}, []),
        "costly JSON schema": ("/v1/completions", json.dumps(
            {"prompt": "x", "max_tokens": 2, "structured_outputs": {"json": schema}}).encode(),
            # 400 only if its first mask passes the per-step CPU budget (near it here).
            {200, 400}, []),
        "body nested 100,000 deep": ("/v1/chat/completions", (
            b'{"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": '
            b'{"a": ' + b"[" * deep + b"]" * deep + b"}}"), {400}, ["too deeply"]),
        "256,000 sequences": ("/v1/completions", json.dumps(
            {"prompt": ["Hi"] * 2000, "n": 128, "max_tokens": 1}).encode(), {400, 429},
            ["256000 sequences", "--max-sequences-in-flight"]),
        "huge logit_bias key": ("/v1/completions", json.dumps(
            {"prompt": "x", "max_tokens": 1, "logit_bias": {"k" * 1_000_000: 1}}).encode(),
            {400}, ["logit_bias"]),
        "huge stop list": ("/v1/completions", json.dumps(
            {"prompt": "x", "max_tokens": 1, "stop": ["s" * 100_000, ""]}).encode(),
            {400}, ["stop"]),
    }


@pytest.mark.parametrize("case", list(_hostile_cases()))
def test_a_stream_keeps_flowing_while_a_hostile_request_runs(server, case):
    path, body, statuses, words = _hostile_cases()[case]
    stream = OpenStream(server.url)
    stream.start()
    deadline = time.monotonic() + 60
    while len(stream.times) < 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(stream.times) >= 20, "the stream did not start"
    t0 = time.monotonic()
    r = httpx.post(server.url + path, content=body, timeout=120,
                   headers={"content-type": "application/json"})
    t1 = time.monotonic()
    time.sleep(0.3)  # a chunk after the request too: the gap spanning its end counts
    stream.stop = True
    assert stream.is_alive(), "the stream ended before the hostile request did"
    window = [t for t in stream.times if t0 - 1 <= t <= t1 + 0.3]
    gaps = [b - a for a, b in itertools.pairwise(window)]
    assert r.status_code in statuses, r.text[:500]
    if r.status_code >= 400:
        message = r.json()["error"]["message"]
        assert len(message) < 1000, message[:200]
        for word in words:
            assert word in message, message
    assert len(window) >= 3 and max(gaps) < MAX_GAP_S, (
        f"{case}: took {t1 - t0:.2f} s; the stream's largest gap was {max(gaps):.3f} s")
    stream.join(10)
