"""kv_transfer_params through `enginecore serve` and the official openai client:
``--kv-transfer-config`` JSON, the body's kv_transfer_params in (completions and chat),
the response's kv_transfer_params out, the connector's stats on /metrics, on both paths.

The connector is a plug-in (kv_connector_module_path: test_kv_connector_engine's
DelayedSendConnector, a prefill side on top of the shared store): its answer carries the
request's own params back, so the round trip is visible end to end."""

from __future__ import annotations

import json
import os

import openai
import pytest

from server_helpers import ServerProcess, make_tiny_chat_model
from test_server_api import metric_value

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat")), seed=5)


@pytest.fixture(scope="module", params=["native", "python"])
def server(request, model_dir, tmp_path_factory):
    store = str(tmp_path_factory.mktemp("kv-store"))
    kv = {"kv_connector": "DelayedSendConnector", "kv_role": "kv_both",
          "kv_connector_module_path": "test_kv_connector_engine",
          "kv_connector_extra_config": {"shared_storage_path": store}}
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), TESTS_DIR) if p)
    srv = ServerProcess(
        [model_dir, "--max-model-len", "256", "--kv-cache-memory-bytes", str(32 << 20),
         "--dtype", "float32", "--block-size", "8", "--kv-transfer-config", json.dumps(kv)],
        env={"ENGINECORE_NATIVE": "1" if request.param == "native" else "0",
             "PYTHONPATH": path})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                       timeout=60) as c:
        yield c


PROMPT = "the KV cache of this prompt goes to a decode server " * 3


def test_completion_params_in_and_out(client, server):
    params = {"do_remote_decode": True, "request_tag": "completion-1"}
    first = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                      max_tokens=1, temperature=0,
                                      extra_body={"kv_transfer_params": params})
    out = first.kv_transfer_params
    assert out["request_tag"] == "completion-1" and out["do_remote_prefill"] is True
    assert out["remote_block_ids"] and out["remote_engine_id"]
    # Again: the same answer (its blocks come from the local prefix cache now).
    again = client.completions.create(model=first.model, prompt=PROMPT, max_tokens=1,
                                      temperature=0)
    assert again.choices[0].text == first.choices[0].text
    with server.client() as http:
        assert metric_value(http, "enginecore:kv_connector_stat_total",
                            stat="num_blocks_saved") >= len(out["remote_block_ids"]) - 1


def test_chat_params_in_and_out(client):
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=2, temperature=0,
        messages=[{"role": "user", "content": "hello"}],
        extra_body={"kv_transfer_params": {"do_remote_decode": True, "request_tag": "chat"}})
    assert resp.kv_transfer_params["request_tag"] == "chat"


def test_bad_params_are_a_400(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=client.models.list().data[0].id, prompt="x",
                                  max_tokens=1, extra_body={"kv_transfer_params": [1, 2]})
