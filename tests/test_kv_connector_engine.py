"""The KV connector API inside the engine: asynchronous loads (WAITING_FOR_REMOTE_KVS),
delayed block freeing while a send is in flight, kv_transfer_params in and out, and
abort_immediately. The connectors here are plug-ins (kv_connector_module_path = this
module) built on SharedStorageConnector, so the bytes they move are real KV; tokens are
checked against transformers."""

from __future__ import annotations

import logging
import random

import pytest

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams
from enginecore.kv_transfer.shared_storage_connector import SharedStorageConnector
from enginecore.protocol import FinishReason
from enginecore.request import RequestStatus
from tiny_models import hf_greedy, make_tiny_model

BLOCK = 8
PROMPT = random.Random(3).choices(range(3, 256), k=70)


class AsyncStorageConnector(SharedStorageConnector):
    """Loads as a remote transfer would: the request waits in WAITING_FOR_REMOTE_KVS
    while its blocks arrive, and the worker reports them received a step later."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._received: set[str] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return n, n > 0

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        # Loads of requests still waiting for their KV (not scheduled this step).
        for rid, (ids, hashes) in list(self._pending_loads.items()):
            meta.loads.append((rid, ids, hashes))
            del self._pending_loads[rid]
        return meta

    def start_load_kv(self, forward_context, **kwargs):
        report, self._received = self._received, set()
        super().start_load_kv(forward_context, **kwargs)
        self._report = report
        self._received |= {rid for rid, _, _ in self._connector_metadata.loads}

    def get_finished(self, finished_req_ids):
        return None, self._report or None


class DelayedSendConnector(SharedStorageConnector):
    """A prefill side: a finished request's blocks are "sent" for two more steps, and
    its kv_transfer_params tell the decode side where they are."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sending: dict[str, int] = {}

    def request_finished(self, request, block_ids):
        super().request_finished(request, block_ids)
        params = dict(request.kv_transfer_params or {})
        params.update(do_remote_prefill=True, do_remote_decode=False,
                      remote_block_ids=list(block_ids),
                      remote_engine_id=self.kv_transfer_config.engine_id,
                      remote_host="127.0.0.1", remote_port=0)
        return True, params

    def get_finished(self, finished_req_ids):
        for rid in finished_req_ids:
            self._sending[rid] = 2
        done = set()
        for rid in list(self._sending):
            self._sending[rid] -= 1
            if self._sending[rid] < 0:
                done.add(rid)
                del self._sending[rid]
        return done or None, None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("llama")), "llama")


def engine(model: str, store: str | None, connector: str = "SharedStorageConnector",
           **kv) -> EngineCore:
    config = None
    if store is not None:
        config = {"kv_connector": connector, "kv_role": kv.pop("kv_role", "kv_both"),
                  "kv_connector_extra_config": {"shared_storage_path": store}}
        if connector != "SharedStorageConnector":
            config["kv_connector_module_path"] = __name__
    return EngineCore(EngineArgs(model=model, dtype="float32", block_size=BLOCK,
                                 num_gpu_blocks_override=64, kv_transfer_config=config,
                                 **kv).create_engine_config())


def greedy(max_tokens: int = 5, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def drain(eng: EngineCore, steps: int = 500) -> dict[str, dict]:
    results: dict[str, dict] = {}
    for _ in range(steps):
        if not eng.scheduler.has_requests():
            return results
        outputs, _ = eng.step()
        for outs in outputs.values():
            for o in outs.outputs:
                r = results.setdefault(o.request_id, {"tokens": [], "final": None})
                r["tokens"] += o.new_token_ids
                if o.finished:
                    r["final"] = o
    raise AssertionError("engine did not finish")


def fill(eng: EngineCore) -> None:
    """Compute PROMPT once on ``eng``: its blocks go to the store."""
    eng.add_request(EngineCoreRequest("fill", PROMPT, greedy(1)))
    assert drain(eng)["fill"]["final"].num_cached_tokens == 0


def test_async_load_waits_for_remote_kvs(tiny, tmp_path, hot_path):
    store = str(tmp_path / "kv")
    expected = hf_greedy(tiny, PROMPT, 5)
    fill(engine(tiny, store))
    eng = engine(tiny, store, "AsyncStorageConnector")
    eng.add_request(EngineCoreRequest("a", PROMPT, greedy()))
    eng.step()
    request = eng.scheduler.requests["a"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert eng.scheduler.kv_hooks.has_pending()
    got = drain(eng)["a"]
    assert got["tokens"] == expected
    assert got["final"].num_cached_tokens == (len(PROMPT) - 1) // BLOCK * BLOCK


def test_delayed_free_until_sent_and_params_out(tiny, tmp_path, hot_path):
    eng = engine(tiny, str(tmp_path / "kv"), "DelayedSendConnector", kv_role="kv_producer")
    params_in = {"do_remote_decode": True, "request_tag": "t1"}
    eng.add_request(EngineCoreRequest("p", PROMPT, greedy(1), kv_transfer_params=params_in))
    final = None
    held_after_finish = None
    for _ in range(50):
        outputs, _ = eng.step()
        for outs in outputs.values():
            for o in outs.outputs:
                if o.finished:
                    final = o
                    held_after_finish = eng.scheduler.kv_cache_manager.get_block_ids(
                        eng.scheduler.requests["p"])
        if final is not None and not eng.scheduler.has_requests():
            break
    assert final.finish_reason == FinishReason.LENGTH
    assert final.new_token_ids == hf_greedy(tiny, PROMPT, 1)
    params = final.kv_transfer_params
    # The connector saw the request's params (the tag) and answered for the decode side.
    assert params["request_tag"] == "t1"
    assert params["do_remote_decode"] is False and params["do_remote_prefill"] is True
    assert params["remote_block_ids"] == held_after_finish and len(held_after_finish) == \
        -(-len(PROMPT) // BLOCK)
    assert params["remote_engine_id"] == eng.config.kv_transfer_config.engine_id
    # Freed once the send finished: nothing held, nothing left.
    assert "p" not in eng.scheduler.requests
    assert eng.scheduler.kv_cache_manager.usage == 0.0


def test_extra_args_params_and_abort_immediately(tiny, tmp_path, hot_path):
    eng = engine(tiny, str(tmp_path / "kv"), "DelayedSendConnector", kv_role="kv_producer")
    sp = greedy(2, extra_args={"kv_transfer_params": {"remote_host": "ignored"}})
    eng.add_request(EngineCoreRequest("x", PROMPT, sp, abort_immediately=True))
    got = drain(eng)["x"]
    assert got["final"].finish_reason == FinishReason.ABORT and got["tokens"] == []
    assert got["final"].kv_transfer_params["do_remote_prefill"] is True


def test_params_without_connector_warn_and_run(tiny, caplog, hot_path):
    eng = engine(tiny, None)
    assert eng.scheduler.get_kv_connector() is None
    with caplog.at_level(logging.WARNING):
        eng.add_request(EngineCoreRequest("n", PROMPT, greedy(3),
                                          kv_transfer_params={"do_remote_prefill": True}))
    assert "no KV connector" in caplog.text
    got = drain(eng)["n"]
    assert got["tokens"] == hf_greedy(tiny, PROMPT, 3)
    assert got["final"].kv_transfer_params is None


def test_block_hashes_on_with_a_connector_without_prefix_caching(tiny, tmp_path, hot_path):
    store = str(tmp_path / "kv")
    fill(engine(tiny, store, enable_prefix_caching=False))
    eng = engine(tiny, store, enable_prefix_caching=False)
    eng.add_request(EngineCoreRequest("h", PROMPT, greedy(3)))
    got = drain(eng)["h"]
    assert got["tokens"] == hf_greedy(tiny, PROMPT, 3)
    assert got["final"].num_cached_tokens == (len(PROMPT) - 1) // BLOCK * BLOCK
