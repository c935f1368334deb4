"""`enginecore proxy` in front of real `enginecore serve` processes (a tiny model): the
answers are those of one server (the openai client, streamed and not), each request
reaches a prefill server with max_tokens=1 and do_remote_decode, round robin skips a
dead server, /health names the side that is down, a dead side is a clear 503 (or, under
the recompute policy, the decode server computes the prompt itself). The P/D connector
(KV actually moving between the two) has its own tests (test_pd_disagg.py)."""

from __future__ import annotations

import socket

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import ServerProcess, make_tiny_chat_model

PROMPTS = ["the quick brown fox", "hello there, how", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat")), seed=7)


def _server(model_dir: str) -> ServerProcess:
    return ServerProcess([model_dir, "--max-model-len", "256", "--kv-cache-memory-bytes",
                          str(16 << 20), "--dtype", "float32", "--served-model-name", "tiny"])


@pytest.fixture(scope="module")
def servers(model_dir):
    prefill, decode = _server(model_dir), _server(model_dir)
    try:
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def dead_url() -> str:
    """A loopback port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def proxy(prefill: list[str], decode: list[str], *extra: str) -> ServerProcess:
    return ServerProcess(["--prefill", *prefill, "--decode", *decode, *extra],
                         command="proxy", startup_timeout_s=60)


@pytest.fixture(scope="module")
def pd(servers):
    prefill, decode = servers
    p = proxy([prefill.url], [decode.url])
    try:
        yield p
    finally:
        p.stop()


def generation_tokens(server: ServerProcess) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == "enginecore:generation_tokens":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    return 0.0  # the labelled counter appears with the first request


def _completion(base_url: str, prompt: str, stream: bool = False) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    if not stream:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                          temperature=0).choices[0].text
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                       temperature=0, stream=True)
    return "".join(c.choices[0].text for c in chunks)


def test_answers_as_one_server_and_prefill_makes_one_token(servers, pd):
    prefill, decode = servers
    before = generation_tokens(prefill)
    for prompt in PROMPTS:
        direct = _completion(decode.base_url, prompt)
        assert direct
        assert _completion(pd.base_url, prompt) == direct
        assert _completion(pd.base_url, prompt, stream=True) == direct
    # Each of the 6 proxied requests cost the prefill side exactly one token.
    assert generation_tokens(prefill) - before == 2 * len(PROMPTS)

    client = openai.OpenAI(base_url=decode.base_url, api_key="none", max_retries=0)
    via = openai.OpenAI(base_url=pd.base_url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "say something"}]
    want = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                          temperature=0).choices[0].message.content
    got = via.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                      temperature=0).choices[0].message.content
    assert got == want
    assert [m.id for m in via.models.list().data] == ["tiny"]


def test_health_and_bad_bodies(pd):
    r = httpx.get(pd.url + "/health", timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert [s["healthy"] for s in body["prefill"] + body["decode"]] == [True, True]
    r = httpx.post(pd.url + "/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = httpx.post(pd.url + "/v1/completions", json=[1, 2], timeout=30)
    assert r.status_code == 400
    # The server's own 400 (here: from the prefill server) comes back as it is.
    r = httpx.post(pd.url + "/v1/completions", json={"model": "tiny", "prompt": "x",
                                                     "temperature": -1}, timeout=30)
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]


def test_round_robin_skips_a_dead_server(servers):
    prefill, decode = servers
    p = proxy([dead_url(), prefill.url], [decode.url, dead_url()])
    try:
        want = _completion(decode.base_url, PROMPTS[0])
        for _ in range(4):
            assert _completion(p.base_url, PROMPTS[0]) == want
        r = httpx.get(p.url + "/health", timeout=30)
        assert r.status_code == 200  # one healthy server on each side is enough
        assert sorted(s["healthy"] for s in r.json()["prefill"]) == [False, True]
    finally:
        p.stop()


def test_a_dead_side(servers):
    prefill, decode = servers
    failing = proxy([dead_url()], [decode.url], "--prefill-failure-policy", "fail")
    recompute = proxy([dead_url()], [decode.url])
    no_decode = proxy([prefill.url], [dead_url()])
    try:
        for p, side in ((failing, "prefill"), (no_decode, "decode")):
            r = httpx.get(p.url + "/health", timeout=30)
            assert r.status_code == 503
            assert f"no healthy {side} server" in r.json()["error"]["message"]
            with pytest.raises(openai.APIStatusError) as err:
                _completion(p.base_url, PROMPTS[1])
            assert err.value.status_code == 503
            assert f"no {side} server could take the request" in str(err.value)
        # recompute: the decode server computes the prompt itself, the same answer.
        assert _completion(recompute.base_url, PROMPTS[1]) == \
            _completion(decode.base_url, PROMPTS[1])
        assert _completion(recompute.base_url, PROMPTS[1], stream=True) == \
            _completion(decode.base_url, PROMPTS[1])
    finally:
        for p in (failing, recompute, no_decode):
            p.stop()
