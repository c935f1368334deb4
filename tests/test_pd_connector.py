"""PDConnector between two engines in one process (the transport on loopback, CURVE on):
a producer computes the prompt (max_tokens=1, do_remote_decode) and answers with vLLM's
kv_transfer_params; a consumer pulls the full blocks and decodes: transformers' greedy
tokens, and the consumer computes only the last partial block. A dead producer: the
consumer recomputes (kv_load_failure_policy recompute) or fails the request (fail),
never hangs. The servers and the proxy end to end: test_pd_disagg.py."""

from __future__ import annotations

import os
import random
import time

import msgspec
import pytest

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams
from enginecore.protocol import FinishReason
from enginecore.transport import make_keys
from tiny_models import hf_greedy, make_tiny_model

BLOCK = 16
PROMPT = random.Random(3).choices(range(3, 256), k=100)  # 6 full blocks and 4 tokens
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("pd_llama")), "llama")


@pytest.fixture
def keys(tmp_path) -> str:
    path = str(tmp_path / "kv.keys")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(make_keys()))
    return path


def engine(model: str, role: str, keys: str, policy: str = "recompute",
           **extra) -> EngineCore:
    kv = {"kv_connector": "PDConnector", "kv_role": role, "kv_load_failure_policy": policy,
          "kv_connector_extra_config": {"curve_key_file": keys, **extra}}
    args = EngineArgs(model=model, dtype="float32", block_size=BLOCK,
                      num_gpu_blocks_override=64, max_model_len=512,
                      log_iteration_details=True, kv_transfer_config=kv)
    return EngineCore(args.create_engine_config())


def add(core: EngineCore, rid: str, max_tokens: int, params: dict) -> None:
    core.add_request(EngineCoreRequest(rid, PROMPT, SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
        extra_args={"kv_transfer_params": params})))


def drive(target: EngineCore, others: list[EngineCore], timeout_s: float = 60.0) -> dict:
    """Step ``target`` (and ``others``: a producer's block registration rides on its
    steps) until ``target``'s request finished: its tokens, final output, prefill."""
    got = {"tokens": [], "final": None, "prefill_tokens": 0}
    deadline = time.monotonic() + timeout_s
    while got["final"] is None:
        assert time.monotonic() < deadline, "the request did not finish: a hang"
        for other in others:
            if other.scheduler.has_requests() or other.scheduler.has_schedulable_work():
                other.step()
        if not (target.scheduler.has_requests() or target.scheduler.has_schedulable_work()):
            time.sleep(0.005)
            continue
        outputs, _ = target.step()
        details = target.scheduler.last_iteration
        if details is not None:
            got["prefill_tokens"] += details.num_prefill_tokens
            target.scheduler.last_iteration = None
        for outs in outputs.values():
            for o in outs.outputs:
                got["tokens"] += o.new_token_ids
                if o.finished:
                    got["final"] = o
        time.sleep(0.001)
    return got


def test_decode_engine_loads_the_prompt_from_the_prefill_engine(llama, keys, hot_path):
    expected = hf_greedy(llama, PROMPT, MAX_TOKENS)
    producer = engine(llama, "kv_producer", keys)
    consumer = engine(llama, "kv_consumer", keys)
    try:
        add(producer, "p", 1, {"do_remote_decode": True, "do_remote_prefill": False,
                               "remote_engine_id": None, "remote_block_ids": None,
                               "remote_host": None, "remote_port": None})
        first = drive(producer, [])
        params = first["final"].kv_transfer_params
        assert first["tokens"] == expected[:1]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert len(params["remote_block_ids"]) == len(PROMPT) // BLOCK
        assert params["remote_host"] == "127.0.0.1" and params["remote_port"] > 0
        assert params["remote_engine_id"] == \
            producer.config.kv_transfer_config.engine_id
        assert producer.scheduler.kv_hooks.delayed_free == {"p"}  # kept for the pull

        add(consumer, "d", MAX_TOKENS, params)
        second = drive(consumer, [producer])
        assert second["tokens"] == expected
        # Only the last partial block (4 tokens) was computed on the decode side.
        assert second["prefill_tokens"] == len(PROMPT) % BLOCK
        assert second["final"].num_cached_tokens == len(PROMPT) // BLOCK * BLOCK
        deadline = time.monotonic() + 10
        while producer.scheduler.kv_hooks.delayed_free:
            assert time.monotonic() < deadline, "the producer never freed the sent blocks"
            producer.step()
            time.sleep(0.01)
    finally:
        consumer.shutdown()
        producer.shutdown()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_dead_producer(llama, keys, policy):
    expected = hf_greedy(llama, PROMPT, MAX_TOKENS)
    producer = engine(llama, "kv_producer", keys)
    consumer = engine(llama, "kv_consumer", keys, policy, transfer_timeout_s=1.0)
    try:
        add(producer, "p", 1, {"do_remote_decode": True})
        params = drive(producer, [])["final"].kv_transfer_params
        producer.shutdown()  # its block server is gone: the pull hears nothing
        t0 = time.monotonic()
        add(consumer, "d", MAX_TOKENS, params)
        got = drive(consumer, [])
        assert time.monotonic() - t0 < 30
        if policy == "recompute":
            assert got["tokens"] == expected
            assert got["prefill_tokens"] == len(PROMPT)  # all of it, here
        else:
            assert got["final"].finish_reason == FinishReason.ERROR
            assert "could not be loaded" in (got["final"].stop_reason or "")
        assert not consumer.scheduler.kv_hooks.has_pending()
    finally:
        consumer.shutdown()
