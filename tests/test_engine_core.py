"""EngineCore with the synthetic executor: batch queue, validation, utilities, failures."""

from __future__ import annotations

import logging

import pytest

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, FinishReason, LoRARequest
from enginecore.executor import SyntheticExecutor
from helpers import make_request, run_to_completion, synthetic_engine


def add_many(eng, n=40, max_tokens=12):
    for i in range(n):
        eng.add_request(make_request(f"r{i}", list(range(i + 1, i + 3 + i % 17)),
                                     max_tokens=max_tokens + i % 5, seed=i))


@pytest.mark.parametrize("latency", [0.0, 0.002])
def test_batch_queue_gives_same_tokens_as_single_batch(hot_path, latency):
    single = synthetic_engine(block_size=4, max_num_batched_tokens=64,
                              synthetic_step_latency_s=latency)
    double = synthetic_engine(block_size=4, max_num_batched_tokens=64,
                              synthetic_step_latency_s=latency, max_concurrent_batches=2)
    assert double.batch_queue is not None and single.batch_queue is None
    add_many(single)
    add_many(double)
    a, b = run_to_completion(single), run_to_completion(double)
    assert a == b and len(a) == 40
    assert double.scheduler.in_flight == set()


def test_batch_queue_fills_before_blocking():
    eng = synthetic_engine(block_size=4, max_concurrent_batches=2, synthetic_step_latency_s=0.05,
                           max_num_seqs=1)
    eng.add_request(make_request("a", [1, 2, 3], max_tokens=3))
    eng.add_request(make_request("b", [4, 5, 6], max_tokens=3))
    out, executed = eng.step_with_batch_queue()
    # First call launches a batch and returns at once: the queue has room.
    assert (out, executed) == ({}, True) and len(eng.batch_queue) == 1


def test_request_id_must_be_str_and_engine_keeps_working(hot_path):
    eng = synthetic_engine(block_size=4)
    with pytest.raises(TypeError, match="request_id must be a str"):
        eng.add_request(EngineCoreRequest(123, [1, 2]))  # type: ignore[arg-type]
    eng.add_request(make_request("ok", [1, 2], max_tokens=2))
    assert run_to_completion(eng)["ok"]["finish_reason"] is FinishReason.LENGTH


def test_duplicate_live_id_rejected_first_undisturbed(hot_path):
    eng = synthetic_engine(block_size=4)
    eng.add_request(make_request("x", [1, 2, 3], max_tokens=5, seed=1))
    eng.step()
    with pytest.raises(ValueError, match="already live"):
        eng.add_request(make_request("x", [9, 9], max_tokens=1))
    res = run_to_completion(eng)
    ref = synthetic_engine(block_size=4)
    ref.add_request(make_request("x", [1, 2, 3], max_tokens=5, seed=1))
    full = run_to_completion(ref)["x"]["tokens"]
    assert full[1:] == res["x"]["tokens"] and len(full) == 5
    # Once finished, the id may be used again.
    eng.add_request(make_request("x", [1, 2, 3], max_tokens=5, seed=1))
    assert run_to_completion(eng)["x"]["tokens"] == full


@pytest.mark.parametrize(
    "prompt, match",
    [(list(range(1, 40)), "max_model_len"), ([], "empty"), ([1, 99999], r"\[0, 32000\)"),
     ([-4, 2], r"\[0, 32000\)")],
)
def test_unrunnable_prompt_is_answered_with_error(hot_path, prompt, match):
    eng = synthetic_engine(block_size=4, max_model_len=32)
    eng.add_request(make_request("bad", prompt))
    eng.add_request(make_request("good", [1, 2], max_tokens=2))
    res = run_to_completion(eng)
    assert res["bad"]["finish_reason"] is FinishReason.ERROR
    assert res["bad"]["tokens"] == []
    import re

    assert re.search(match, res["bad"]["stop_reason"])
    assert len(res["good"]["tokens"]) == 2


def test_aborts_queued_during_a_step_apply_before_its_outputs():
    class AbortingExecutor(SyntheticExecutor):
        engine: EngineCore

        def execute_model(self, so, non_block=False):
            out = super().execute_model(so, non_block)
            self.engine.aborts_queue.put(["victim"])
            return out

    cfg = EngineArgs(model="synthetic", block_size=4).create_engine_config()
    eng = EngineCore(cfg, AbortingExecutor)
    eng.model_executor.engine = eng
    eng.add_request(make_request("victim", [1, 2, 3], max_tokens=5))
    outs, _ = eng.step()
    (only,) = outs[0].outputs
    assert only.request_id == "victim" and only.new_token_ids == []
    assert only.finish_reason is FinishReason.ABORT


def test_kv_cache_sized_from_available_memory():
    eng = synthetic_engine(block_size=16, kv_cache_memory_bytes=64 * 2**20)
    page = eng.model_executor.get_kv_cache_specs().page_size_bytes
    assert page == 2 * 2 * 16 * 2 * 64 * 4
    assert eng.config.cache_config.num_gpu_blocks == 64 * 2**20 // page
    meta = eng.get_kv_cache_group_metadata()
    assert meta[0]["num_blocks"] == eng.config.cache_config.num_gpu_blocks
    with pytest.raises(ValueError, match="no room for the KV cache"):
        synthetic_engine(kv_cache_memory_bytes=10)


def test_small_cache_caps_max_model_len(caplog):
    with caplog.at_level(logging.WARNING):
        eng = synthetic_engine(block_size=4, num_gpu_blocks_override=3, max_model_len=64)
    assert eng.scheduler.max_model_len == 12 and "capped" in caplog.text
    eng.add_request(make_request("a", [1, 2, 3], max_tokens=100))
    res = run_to_completion(eng)
    assert res["a"]["finish_reason"] is FinishReason.LENGTH and len(res["a"]["tokens"]) == 9


def test_utility_methods():
    eng = synthetic_engine(block_size=4, max_loras=2)
    eng.add_request(make_request("a", list(range(1, 10)), max_tokens=3))
    eng.step()
    assert eng.reset_prefix_cache() is False  # blocks in use
    run_to_completion(eng)
    assert eng.reset_prefix_cache() is True
    assert eng.collective_rpc("echo", args=({"k": [1]},)) == [{"k": [1]}]
    with pytest.raises(ValueError, match="not allowed"):
        eng.collective_rpc("__init__")
    assert eng.add_lora(LoRARequest("l1", 1)) and eng.add_lora(LoRARequest("l2", 2))
    assert eng.pin_lora(1) and eng.list_loras() == {1, 2}
    assert eng.remove_lora(2) and eng.list_loras() == {1}
    eng.set_weight_version("v7")
    assert eng.get_weight_version() == "v7"
    assert eng.get_supported_tasks() == ("generate",)
    eng.execute_dummy_batch()
    assert eng.model_executor.num_dummy_batches == 1
    eng.profile(True)
    eng.profile(False)


def test_sleep_preempts_and_requests_wait_until_wake(hot_path):
    ref = synthetic_engine(block_size=4)
    eng = synthetic_engine(block_size=4)
    for e in (ref, eng):
        e.add_request(make_request("a", list(range(1, 10)), max_tokens=6, seed=3))
    expected = run_to_completion(ref)
    res: dict = {}
    from helpers import collect

    collect(eng.step()[0], res)
    eng.sleep(level=1)
    assert eng.is_sleeping()
    eng.add_request(make_request("b", [4, 5, 6], max_tokens=2))
    for _ in range(3):
        assert eng.step() == ({}, False)
    assert eng.scheduler.kv_cache_manager.usage == 0.0
    eng.wake_up(None)
    assert not eng.is_sleeping()
    while eng.scheduler.has_requests():
        collect(eng.step()[0], res)
    assert res["a"] == expected["a"] and len(res["b"]["tokens"]) == 2


def test_executor_failure_logs_scheduler_state_then_raises(caplog):
    """An executor that fails even for a dummy batch (a lost device) is fatal."""
    class Broken(SyntheticExecutor):
        def execute_model(self, so, non_block=False):
            raise RuntimeError("device fell over")

        def execute_dummy_batch(self):
            raise RuntimeError("device fell over")

    cfg = EngineArgs(model="synthetic").create_engine_config()
    eng = EngineCore(cfg, Broken)
    eng.add_request(make_request("a", [1, 2], max_tokens=2))
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="fell over"):
        for _ in range(10):  # it fails, is retried alone, fails again: the device is probed
            eng.step()
    assert "scheduler state" in caplog.text and "'a'" in caplog.text


def test_engine_args_validation():
    with pytest.raises(ValueError, match="block_size"):
        EngineArgs(model="synthetic", block_size=3).create_engine_config()
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineArgs(model="synthetic", scheduling_policy="lifo").create_engine_config()
    with pytest.raises(ValueError, match="synthetic"):
        EngineArgs(model="synthetic", executor_backend="uniproc").create_engine_config()
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        EngineArgs(model="synthetic", max_model_len=4096, max_num_batched_tokens=100,
                   enable_chunked_prefill=False).create_engine_config()
