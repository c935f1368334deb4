"""`enginecore serve` through the official openai client (sync, async, streaming) and
httpx for raw cases: every endpoint and request field, the error table, concurrent
streams, a disconnect mid-stream, /metrics, --api-key, LoRA by model name.

One server per path (native, pure Python) on a tiny random-weight Llama with a
byte-level tokenizer: text is noise, so tests check shapes, counts and agreement
(stream == non-stream, str prompt == token-id prompt), not words
(test_server_default_model.py checks words)."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import ServerProcess, make_tiny_chat_model
from test_lora import make_adapter

API_KEY = "sk-test-key"
MAX_MODEL_LEN = 256
BODY_LIMIT = 200_000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat")), seed=3)


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    return make_adapter(model_dir, str(tmp_path_factory.mktemp("adapter")), 5,
                        ["q_proj", "v_proj", "o_proj"])


@pytest.fixture(scope="module", params=["native", "python"])
def server(request, model_dir, adapter_dir):
    srv = ServerProcess(
        [model_dir, "--served-model-name", "tiny", "tiny-alias", "--api-key", API_KEY,
         "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(64 << 20),
         "--lora-modules", f"tiny-lora={adapter_dir}", "--max-request-body-bytes",
         str(BODY_LIMIT), "--dtype", "float32"],
        env={"ENGINECORE_NATIVE": "1" if request.param == "native" else "0"})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with server.client(headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def greedy(client, prompt, n=12, extra_body=None, **kw):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True, **(extra_body or {})},
                                     **kw)


def sse_events(lines) -> list:
    """The JSON events of an SSE body, and a final "[DONE]"."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric_value(http, name: str, **labels) -> float:
    text = http.get("/metrics").text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


# -- endpoints --------------------------------------------------------------------------------

def test_models_version_health(server, client, http):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny", "tiny-alias", "tiny-lora"]
    assert http.get("/version").json()["version"]
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed


def test_completion_prompt_forms(client, http):
    text = greedy(client, "Hello there").choices[0].text
    ids = http.post("/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    assert greedy(client, ids).choices[0].text == text
    many = greedy(client, ["Hello there", "Bye"])
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == text
    bye_ids = http.post("/tokenize", json={"prompt": "Bye"}).json()["tokens"]
    by_ids = greedy(client, [ids, bye_ids])
    assert [c.text for c in by_ids.choices] == [c.text for c in many.choices]
    assert by_ids.usage.prompt_tokens == len(ids) + len(bye_ids)
    assert by_ids.usage.completion_tokens == 24


def test_completion_echo_n_and_logprobs(client, http):
    echoed = greedy(client, "Echo me", echo=True).choices[0].text
    assert echoed.startswith("Echo me") and echoed[7:] == greedy(client, "Echo me").choices[0].text
    kw = dict(model="tiny", prompt="abc", n=3, max_tokens=6, temperature=1.0, seed=7,
              logprobs=2)
    out = client.completions.create(**kw, extra_body={"ignore_eos": True})
    # The same seeded draws with the tokens as ids (vLLM's return_tokens_as_token_ids).
    as_ids = client.completions.create(
        **kw, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ids_of = {c.index: [int(t.removeprefix("token_id:")) for t in c.logprobs.tokens]
              for c in as_ids.choices}
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        # The text is the ids decoded together; each logprob token is decoded alone,
        # so they join to the text unless a character's bytes span tokens (a byte
        # token alone is U+FFFD, as in vLLM).
        decoded = http.post("/detokenize", json={"model": "tiny", "tokens": ids_of[c.index]})
        assert decoded.json()["prompt"] == c.text
        if "\ufffd" not in "".join(lp.tokens):
            assert "".join(lp.tokens) == c.text
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        assert all(1 <= len(top) <= 2 and all(v <= 0 for v in top.values())
                   for top in lp.top_logprobs)
        assert all(v <= 0 for v in lp.token_logprobs)
    assert out.usage.completion_tokens == 18


def test_completion_stream_matches_non_stream(client):
    want = greedy(client, "Stream this", n=10)
    chunks = list(client.completions.create(
        model="tiny", prompt="Stream this", max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_shapes(client, http):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 8
    with http.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"]
               for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c["choices"][0] for c in chunks[1:-1]]
    assert "".join(c["delta"].get("content", "") for c in content) == \
        full.choices[0].message.content
    assert [c["finish_reason"] for c in content][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == \
        full.usage.total_tokens


def test_chat_logprobs_and_n_stream(client):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        ranked = [x.logprob for x in t.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
        assert t.logprob == pytest.approx(ranked[0])  # greedy: the sampled token is the top
        assert t.bytes == list(t.token.encode())
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4, n=2,
        temperature=1.0, seed=3, stream=True, extra_body={"ignore_eos": True})
    texts, finished, roles = {0: "", 1: ""}, set(), set()
    for chunk in stream:
        for ch in chunk.choices:
            if ch.delta.role:
                roles.add(ch.index)
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert roles == finished == {0, 1}


def test_sampling_fields(client):
    rand = dict(model="tiny", prompt="seeded", max_tokens=8, temperature=1.0,
                extra_body={"ignore_eos": True})
    assert client.completions.create(seed=42, **rand).choices[0].text == \
        client.completions.create(seed=42, **rand).choices[0].text
    base = greedy(client, "stop test", n=16).choices[0]
    assert greedy(client, "stop test", n=16, extra_body={"top_k": 1, "ignore_eos": True}) \
        .choices[0].text == base.text
    stop = base.text[6:8]
    cut = greedy(client, "stop test", n=16, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base.text[:base.text.index(stop)]
    kept = greedy(client, "stop test", n=16,
                  extra_body={"ignore_eos": True, "include_stop_str_in_output": True,
                              "stop": [stop]}).choices[0]
    assert kept.text == base.text[:base.text.index(stop) + len(stop)]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "q"}], max_completion_tokens=3,
        temperature=0.5, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 3,
                    "ignore_eos": True})
    assert chat.usage.completion_tokens == 3
    penalized = greedy(client, "stop test", n=16, extra_body={"repetition_penalty": 2.0,
                                                              "ignore_eos": True})
    assert penalized.choices[0].text != base.text


def test_vllm_request_fields(client, http):
    """logit_bias (string keys), allowed_token_ids, bad_words, prompt_logprobs,
    truncate_prompt_tokens as vLLM's server takes them (extra body fields)."""
    biased = greedy(client, "bias", n=6, logit_bias={"7": 100})
    assert biased.choices[0].logprobs is None
    ids = http.post("/tokenize", json={"prompt": "bias"}).json()["tokens"]
    raw = http.post("/v1/completions", json={
        "model": "tiny", "prompt": "bias", "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "logit_bias": {"7": 100}, "logprobs": 0}).json()
    assert raw["choices"][0]["logprobs"]["tokens"] == [
        http.post("/detokenize", json={"tokens": [7]}).json()["prompt"]] * 6
    allowed = greedy(client, "allowed", n=8, extra_body={
        "allowed_token_ids": [10, 11], "ignore_eos": True}, logprobs=0)
    toks = [t for t in allowed.choices[0].logprobs.tokens]
    texts = {http.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in (10, 11)}
    assert set(toks) <= texts
    # bad_words' semantics: test_request_fields.py; here: the field reaches the engine.
    as_ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    for prompt in ("words", "Hello there", "Bye", "abc", "stop test"):
        first = greedy(client, prompt, n=2, logprobs=0, extra_body=as_ids)
        tid = int(first.choices[0].logprobs.tokens[0].split(":")[1])
        word = http.post("/detokenize", json={"tokens": [tid]}).json()["prompt"]
        if word.strip() and http.post("/tokenize", json={
                "prompt": word, "add_special_tokens": False}).json()["tokens"] == [tid]:
            break
    else:
        pytest.fail("no greedy first token is a word of its own")
    banned = greedy(client, prompt, n=2, logprobs=0,
                    extra_body={"bad_words": [word], **as_ids})
    assert banned.choices[0].logprobs.tokens[0] != f"token_id:{tid}"
    with_plp = http.post("/v1/completions", json={
        "model": "tiny", "prompt": ids, "max_tokens": 2, "prompt_logprobs": 1}).json()
    plp = with_plp["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert all(str(t) in entry for t, entry in zip(ids[1:], plp[1:]))
    assert all({"logprob", "rank", "decoded_token"} <= set(v)
               for entry in plp[1:] for v in entry.values())
    chat = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1
    cut = http.post("/v1/completions", json={
        "model": "tiny", "prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": 1}).json()
    assert cut["usage"]["prompt_tokens"] == 1
    # echo + logprobs: the prompt's logprobs lead (its first token's None), as vLLM's.
    echo = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0,
                                     echo=True, logprobs=1, extra_body={"ignore_eos": True})
    lp = echo.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    for body, param in (({"logit_bias": {"x": 1}}, "logit_bias"),
                        ({"allowed_token_ids": [10 ** 6]}, None),
                        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                        ({"truncate_prompt_tokens": 10 ** 6}, None)):
        err = _error(http.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                         **body}), 400)
        if param is not None:
            assert err["param"] == param


def test_structured_outputs(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "json please"}], max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    assert isinstance(json.loads(out.choices[0].message.content)["ok"], bool)
    choice = greedy(client, "pick", n=10, extra_body={"guided_choice": ["left", "right"]})
    assert choice.choices[0].text in ("left", "right")
    digits = greedy(client, "digits", n=10,
                    extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", digits.choices[0].text)
    obj = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "obj"}], max_tokens=60,
        temperature=0, response_format={"type": "json_object"},
        extra_body={"structured_outputs": None})
    text = obj.choices[0].message.content
    assert text.startswith("{") and (obj.choices[0].finish_reason == "length"
                                     or isinstance(json.loads(text), dict))


def test_tokenize_detokenize(http):
    tok = http.post("/tokenize", json={"prompt": "héllo", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == 6 and tok["max_model_len"] == MAX_MODEL_LEN
    assert len(tok["token_strs"]) == 6
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "héllo"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    text = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert text == "<|user|>hi\n<|assistant|>"


def test_unknown_fields_are_ignored(http):
    r = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x", "extra": 1}],
        "max_tokens": 2, "store": False, "metadata": {"a": "b"}, "parallel_tool_calls": True,
        "service_tier": "auto", "some_future_field": [1, 2]})
    assert r.status_code == 200, r.text


def test_lora_is_a_model(client):
    base = greedy(client, "adapter?", n=10).choices[0].text
    tuned = client.completions.create(model="tiny-lora", prompt="adapter?", max_tokens=10,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert tuned.model == "tiny-lora" and tuned.choices[0].text != base
    assert greedy(client, "adapter?", n=10).choices[0].text == base
    alias = client.completions.create(model="tiny-alias", prompt="adapter?", max_tokens=10,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert alias.model == "tiny-alias" and alias.choices[0].text == base


# -- errors -----------------------------------------------------------------------------------

def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 5}, "top_p"),
    ({"prompt": "x", "n": 100000}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [5] * (MAX_MODEL_LEN + 10)}, None),
    ({"prompt": [999]}, None),
    ({"prompt": "x", "max_tokens": 4 * MAX_MODEL_LEN}, None),
    ({"temperature": 0}, "prompt"),
    ({"prompt": "x", "response_format": {"type": "json_schema",
                                         "json_schema": {"schema": {"type": "nonsense"}}}},
     None),
    ({"prompt": "x", "guided_regex": "(unclosed"}, None),
    ({"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, None),
])
def test_bad_requests_are_400(http, body, param):
    err = _error(http.post("/v1/completions", json={"model": "tiny", **body}), 400)
    assert err["type"] == "BadRequestError" and err["message"]
    if param is not None:
        assert err["param"] == param


def test_error_table(server, client, http):
    _error(http.post("/v1/completions", content=b"{not json"), 400)
    _error(http.post("/v1/chat/completions", json={"model": "tiny", "messages": []}), 400)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert _error(http.post("/v1/completions", json={"model": "nope", "prompt": "x"}),
                  404)["param"] == "model"
    _error(http.get("/v1/nothing-here"), 404)
    _error(http.get("/v1/completions"), 405)
    _error(http.post("/v1/completions", content=b"[" + b"1," * BODY_LIMIT + b"1]",
                     headers={"content-type": "application/json"}), 413)
    with httpx.Client(base_url=server.url) as anon:
        assert _error(anon.get("/v1/models"), 401)["type"] == "AuthenticationError"
        _error(anon.get("/metrics"), 401)
        _error(anon.post("/v1/completions", json={"prompt": "x"},
                         headers={"Authorization": "Bearer wrong"}), 401)
        assert anon.get("/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="bad", max_retries=0).models.list()
    # The server took all of that and still answers.
    assert greedy(client, "still alive", n=2).choices[0].finish_reason == "length"


def test_embeddings_on_a_generation_model_is_400(http):
    _error(http.post("/v1/embeddings", json={"model": "tiny", "input": "x"}), 400)


# -- concurrency, disconnects, metrics ------------------------------------------------------

def test_64_concurrent_streams(server):
    async def main() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY,
                                      max_retries=0, timeout=120) as c:
            async def one(i: int) -> tuple[str, int]:
                stream = await c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"req {i}"}],
                    max_tokens=8, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                text, tokens = "", 0
                async for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                return text, tokens
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), 120)

    results = asyncio.run(main())
    assert [tokens for _, tokens in results] == [8] * 64
    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0) as c:
        one = c.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                 "content": "req 5"}],
                                        max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert results[5][0] == one.choices[0].message.content


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_disconnects_leave_the_server_serving(server, client):
    """(That the engine aborts at once: test_server_default_model.py, where a
    generation is long enough to tell.)"""
    body = {"model": "tiny", "prompt": "long", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    with server.client(headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={**body, "stream": False}, timeout=0.05)
    assert greedy(client, "after", n=3).usage.completion_tokens == 3


def test_metrics_parse(http, client):
    greedy(client, "count me", n=3)
    text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("enginecore:time_to_first_token_seconds", "enginecore:inter_token_latency_seconds",
                 "enginecore:e2e_request_latency_seconds", "enginecore:request_queue_time_seconds",
                 "enginecore:num_requests_running", "enginecore:num_requests_waiting",
                 "enginecore:kv_cache_usage_perc", "enginecore:prompt_tokens",
                 "enginecore:generation_tokens", "enginecore:http_requests"):
        assert name in families, sorted(families)
    assert metric_value(http, "enginecore:generation_tokens_total") >= 3
    assert metric_value(http, "enginecore:http_requests_total", route="/v1/completions",
                        status="200") >= 1


def test_chat_command_against_the_server(server):
    import argparse

    from enginecore.entrypoints.chat import _remote_turn, chat_loop

    args = argparse.Namespace(url=server.base_url, model="tiny", api_key=API_KEY,
                              max_tokens=5, temperature=0.0, top_p=1.0, seed=None)
    seen: list[list[dict]] = []
    remote = _remote_turn(args)

    def turn(messages):
        seen.append([dict(m) for m in messages])
        return remote(messages)

    lines = iter(["hello", "again", "/reset", "fresh"])
    written: list[str] = []

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    chat_loop(turn, "sys", read=read, write=written.append)
    assert [len(m) for m in seen] == [2, 4, 2]  # history kept, then cleared (system stays)
    assert seen[1][2]["role"] == "assistant" and seen[1][2]["content"]
    assert "(conversation cleared)" in "".join(written)
