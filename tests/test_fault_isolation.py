"""Per-request fault isolation (issue 13, item 9) and per-request failure of the
native/Python update loops (item 1): one request that makes the executor or a
loop raise ends with ERROR; every other request finishes exactly as without it."""

from __future__ import annotations

import pytest

from enginecore import EngineArgs, EngineCore, FinishReason
from enginecore.core.fault_isolation import ExecutorFailed
from helpers import collect, make_request, run_to_completion, synthetic_engine
from proc_executors import (
    LATE_AFTER,
    LATE_POISON,
    POISON,
    FaultInjectingExecutor,
    LostDeviceExecutor,
    TransientFaultExecutor,
)


def faulty_engine(executor=FaultInjectingExecutor, **kw) -> EngineCore:
    args = dict(model="synthetic", block_size=4)
    args.update(kw)
    return EngineCore(EngineArgs(**args).create_engine_config(), executor)


def good_requests(n=10):
    return [make_request(f"g{i}", [i + 1, 7, 9, i % 3 + 2, 5], max_tokens=12 + i, seed=i)
            for i in range(n)]


def reference(n=10, **kw) -> dict[str, list[int]]:
    eng = synthetic_engine(block_size=4, **kw)
    for r in good_requests(n):
        eng.add_request(r)
    return {k: v["tokens"] for k, v in run_to_completion(eng).items()}


@pytest.mark.parametrize("batches", [1, 2])
def test_poisoned_requests_end_with_error_and_the_rest_finish_exactly(hot_path, batches):
    kw = dict(max_concurrent_batches=batches,
              synthetic_step_latency_s=0.001 if batches > 1 else 0.0)
    eng = faulty_engine(**kw)
    for i, r in enumerate(good_requests()):
        eng.add_request(r)
        if i == 3:  # culprits in the middle of the batch: one fails at once, one later
            eng.add_request(make_request("poison", [3, POISON, 4], max_tokens=20, seed=1))
            eng.add_request(make_request("late", [5, LATE_POISON], max_tokens=30, seed=2))
    res = run_to_completion(eng)
    for rid in ("poison", "late"):
        assert res[rid]["finish_reason"] is FinishReason.ERROR
        assert f"injected fault: poisoned request {rid}" in res[rid]["stop_reason"]
        assert "model runner failed on this request" in res[rid]["stop_reason"]
    # The late one ran fine for a while: it got its tokens up to the fault, then ERROR.
    assert 0 < len(res["late"]["tokens"]) <= LATE_AFTER
    assert res["poison"]["tokens"] == []
    good = {k: v["tokens"] for k, v in res.items() if k.startswith("g")}
    assert good == reference(**kw)
    assert all(res[k]["finish_reason"] is FinishReason.LENGTH for k in good)
    iso = eng.fault_isolation
    assert iso.num_culprits == 2 and not iso.active and eng.scheduler.probe is None
    # The engine serves on, and the prefix cache holds nothing the failed steps were to fill.
    eng.add_request(make_request("after", [1, 2, 3], max_tokens=3))
    assert run_to_completion(eng)["after"]["finish_reason"] is FinishReason.LENGTH


def test_transient_faults_blame_nobody(hot_path):
    """A batch that fails once for no request's fault: the probes all pass, nobody
    is ended, every request finishes as without the fault."""
    eng = faulty_engine(TransientFaultExecutor)
    for r in good_requests(16):
        eng.add_request(r)
    res = run_to_completion(eng)
    assert eng.model_executor.num_faults >= 1 and eng.fault_isolation.num_rounds >= 1
    assert eng.fault_isolation.num_culprits == 0
    assert {k: v["tokens"] for k, v in res.items()} == reference(16)


def test_lost_device_is_executor_failed(hot_path):
    eng = faulty_engine(LostDeviceExecutor)
    for r in good_requests(4):
        eng.add_request(r)
    with pytest.raises(ExecutorFailed, match="EXECUTOR_FAILED.*dummy batch"):
        run_to_completion(eng)


def test_a_native_or_python_loop_that_raises_fails_only_that_request(hot_path):
    """Bounds keep every value a loop reads in range; should a loop still raise
    for one request (here the runner hands back a token that is not an int for it,
    once), that request ends with ERROR and the others go on, on both paths."""
    eng = synthetic_engine(block_size=4)
    for r in good_requests(6):
        eng.add_request(r)
    first: dict[str, dict] = {}
    collect(eng.step()[0], first)
    execute = eng.model_executor.execute_model

    def garbled_once(so, *args, **kwargs):
        out = execute(so, *args, **kwargs)
        if "g2" in out.req_id_to_index and not garbled:
            out.sampled_token_ids[out.req_id_to_index["g2"]] = ["many"]
            garbled.append(True)
        return out

    garbled: list[bool] = []
    eng.model_executor.execute_model = garbled_once
    res = run_to_completion(eng)
    for rid, r in first.items():
        res[rid]["tokens"][:0] = r["tokens"]
    assert res["g2"]["finish_reason"] is FinishReason.ERROR
    assert "TypeError" in res["g2"]["stop_reason"]
    ref = reference(6)
    assert {k: v["tokens"] for k, v in res.items() if k != "g2"} == {
        k: v for k, v in ref.items() if k != "g2"}
    assert not eng.scheduler.requests and not eng.scheduler.running
