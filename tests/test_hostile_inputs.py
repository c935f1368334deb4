"""A hostile client against one real ``enginecore serve`` (a PD connector in kv_both):
bad kv_transfer_params, Responses API function-call items of the wrong shape, and a
prefill server whose kv_transfer_params are junk behind ``enginecore proxy``. Each bad
input is a 400 naming the field, and the server keeps serving."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import msgspec
import openai
import pytest

from enginecore.kv_transfer.pd_keys import make_keys
from enginecore.kv_transfer.pd_scheduler import PDScheduler
from server_helpers import ServerProcess, make_tiny_chat_model

PROMPT = "x" * 100  # several full blocks: a remote prefill would have blocks to pull
GOOD_REMOTE = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "127.0.0.1",
               "remote_port": 5555, "remote_block_ids": [0, 1, 2]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat")), seed=3)
    key_file = str(tmp_path_factory.mktemp("pd-keys") / "kv.keys")
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(make_keys()))
    kv = {"kv_connector": "PDConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"curve_key_file": key_file,
                                        "transfer_timeout_s": 2.0}}
    srv = ServerProcess([model, "--max-model-len", "256", "--kv-cache-memory-bytes",
                         str(32 << 20), "--dtype", "float32", "--served-model-name", "tiny",
                         "--kv-transfer-config", json.dumps(kv)])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                       timeout=60) as c:
        yield c


def _complete(client, **extra):
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3,
                                     temperature=0, extra_body=extra)


@pytest.mark.parametrize("field,value,match", [
    ("remote_port", "abc", "remote_port must be an integer in"),
    ("remote_port", 1.5, "remote_port must be an integer in"),
    ("remote_port", 99999, "remote_port must be an integer in"),
    ("remote_port", -3, "remote_port must be an integer in"),
    ("remote_host", ["x"], "remote_host must be a string"),
    ("remote_request_id", {"a": 1}, "remote_request_id must be a string"),
    ("do_remote_prefill", "yes", "do_remote_prefill must be a boolean"),
    ("remote_block_ids", "abcdefgh", "remote_block_ids must be a list"),
    ("remote_block_ids", [[1], {"a": 1}, None], r"remote_block_ids\[0\] must be an integer"),
    ("remote_block_ids", [0, -5, 1], r"remote_block_ids\[1\] must be an integer"),
    ("remote_block_ids", [10**30], r"remote_block_ids\[0\] must be an integer"),
])
def test_bad_kv_transfer_params_are_400s(client, field, value, match):
    with pytest.raises(openai.BadRequestError, match=match):
        _complete(client, kv_transfer_params={**GOOD_REMOTE, field: value})
    # The engine is alive: a plain request and a well-formed remote one with nothing
    # behind it (the pull fails, the prompt is computed here) both complete.
    assert _complete(client).choices[0].finish_reason == "length"


def test_remote_prefill_from_nowhere_still_completes(client):
    # Well-formed params naming a producer that does not exist: the pull times out and the
    # default load-failure policy recomputes, so the client still gets its tokens.
    out = _complete(client, kv_transfer_params=GOOD_REMOTE)
    assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("item,match", [
    ({"type": "function_call_output", "output": "42"}, "needs 'call_id'"),
    ({"type": "function_call_output", "call_id": "c1"}, "needs 'output'"),
    ({"type": "function_call_output", "call_id": 7, "output": "42"}, "'call_id' as a string"),
    ({"type": "function_call", "call_id": "c1", "name": "f", "arguments": {"a": 1}},
     "'arguments' as a string, got a dict"),
    ({"type": "function_call", "call_id": "c1", "arguments": "{}"}, "needs 'name'"),
])
def test_bad_responses_function_items_are_400s(client, item, match):
    with pytest.raises(openai.BadRequestError, match=match):
        client.responses.create(model="tiny", input=[item], max_output_tokens=3)
    ok = client.responses.create(model="tiny", max_output_tokens=3, input=[
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"}])
    assert ok.output and ok.output[0].type == "message"


class _JunkPrefill(BaseHTTPRequestHandler):
    """A prefill server that answers 200 with junk kv_transfer_params."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._answer(b"{}")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._answer(json.dumps({"kv_transfer_params": self.server.junk}).encode())

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize("junk,match", [
    ("x", "not an object"), ([1, 2], "not an object"),
    ({**GOOD_REMOTE, "remote_port": "abc"}, "remote_port must be an integer")])
def test_proxy_junk_prefill_params_fall_back_to_decode(server, junk, match):
    prefill = ThreadingHTTPServer(("127.0.0.1", 0), _JunkPrefill)
    prefill.junk = junk
    threading.Thread(target=prefill.serve_forever, daemon=True).start()
    proxy = ServerProcess(["--prefill", f"http://127.0.0.1:{prefill.server_port}",
                           "--decode", server.url], command="proxy", startup_timeout_s=60)
    try:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60)
        # The prefill's junk is the prefill's fault: the decode server computes the
        # prompt itself (policy recompute), not a 400 blaming the client.
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert match in proxy.output()
    finally:
        proxy.stop()
        prefill.shutdown()
        prefill.server_close()


def test_deeply_nested_tool_schema_is_a_400(client):
    schema: dict = {"type": "object"}
    for _ in range(200):  # within the body's nesting limit, past jsonschema's recursion
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    with pytest.raises(openai.BadRequestError, match="nests too deeply"):
        client.chat.completions.create(model="tiny", max_tokens=3, tools=tools,
                                       tool_choice="required",
                                       messages=[{"role": "user", "content": "hi"}])
    assert _complete(client).choices[0].finish_reason == "length"


@pytest.mark.parametrize("bad", [{"remote_port": "abc"}, {"remote_block_ids": [[1], None]},
                                 {"remote_host": ["x"]}, {"remote_port": -3}])
def test_pd_scheduler_computes_locally_on_bad_params(bad):
    # A request that reaches the engine without the front-end's check (a direct
    # EngineCoreRequest) must not raise inside the scheduler step: no remote tokens.
    sched = PDScheduler("e", block_size=4, produce=False, consume=True, host="127.0.0.1",
                        port=0)
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(40)),
                              kv_transfer_params={**GOOD_REMOTE, **bad})
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    good = SimpleNamespace(request_id="g", prompt_token_ids=list(range(40)),
                           kv_transfer_params=GOOD_REMOTE)
    assert sched.get_num_new_matched_tokens(good, 0) == (12, True)
