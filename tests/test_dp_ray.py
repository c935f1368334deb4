"""Data parallel on Ray (data_parallel_backend="ray"): DPEngineCoreActor ranks in
placement groups on a local Ray cluster started by this module."""

from __future__ import annotations

import os
import time

import pytest
import ray

from enginecore import EngineArgs, EngineCoreRequest, FinishReason, SamplingParams
from enginecore.client import make_client
from test_data_parallel import N, drain_by_rank, kill_and_expect_dead, reference, reqs
from test_dp_lockstep import dp_states, wait_for


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def ray_config(**kw):
    return EngineArgs(model="synthetic", block_size=4, data_parallel_size=2,
                      data_parallel_backend="ray", **kw).create_engine_config()


@pytest.mark.parametrize("lockstep", [False, True])
def test_ray_dp2_same_tokens_fair_share_wave_ends(lockstep):
    c = make_client(True, False, ray_config(
        data_parallel_lockstep=lockstep, synthetic_step_latency_s=0.001))
    alive_at_close = []
    close_sockets = c._close_sockets

    def recording_close():
        alive_at_close.extend(t.name for t in (c._reader, c.watch.thread) if t.is_alive())
        close_sockets()

    c._close_sockets = recording_close
    try:
        assert len(c.launcher.ray.actors) == 2 and len(c.launcher.ray.placement_groups) == 2
        assert c.input_address.startswith("tcp://127.0.0.1:")
        assert len(set(c.launcher.ray.pids()) | {os.getpid()}) == 3  # two actor processes
        for r in reqs():
            c.add_request(r)
        got, served = drain_by_rank(c)
        assert got == reference()
        assert min(served) >= 0.4 * N, served
        if lockstep:
            assert wait_for(lambda: not c.router.link.engines_running)
            states = dp_states(c)
            assert len({s["current_wave"] for s in states}) == 1
            assert not any(s["engines_running"] for s in states)
        assert c.router.load == [0, 0] and not c.router.live
        assert c.call_utility("get_request_counts") == (0, 0)
    finally:
        c.shutdown()
    # The threads polling the client's sockets were gone before the context
    # closed those sockets (closing a socket another thread polls is undefined
    # in zmq; on the Ray path shutdown has no processes to wait for first).
    assert alive_at_close == []


def test_ray_tiny_real_model_dp2(tmp_path):
    from enginecore import EngineCore
    from helpers import run_to_completion
    from tiny_models import make_tiny_model

    path = make_tiny_model(str(tmp_path / "m"), seed=4)
    common = dict(model=path, dtype="float32", block_size=4, max_model_len=128,
                  kv_cache_memory_bytes=16 << 20)
    requests = [EngineCoreRequest(f"t{i}", [i + 3, 9, 11], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True)) for i in range(12)]
    eng = EngineCore(EngineArgs(**common).create_engine_config())
    for r in requests:
        eng.add_request(r)
    expected = {k: v["tokens"] for k, v in run_to_completion(eng).items()}
    c = make_client(True, False, EngineArgs(
        **common, data_parallel_size=2, data_parallel_backend="ray").create_engine_config())
    try:
        for r in requests:
            c.add_request(r)
        got, served = drain_by_rank(c, len(requests))
    finally:
        c.shutdown()
    assert got == expected and min(served) > 0


def test_killing_a_ray_rank_is_engine_dead_fast():
    c = make_client(True, False, ray_config(
        data_parallel_lockstep=True, synthetic_step_latency_s=0.005))
    try:
        for i in range(4):
            c.add_request(EngineCoreRequest(f"k{i}", [1, i], SamplingParams(
                max_tokens=10**4, ignore_eos=True)))
        c.get_output(timeout=10)
        kill_and_expect_dead(c, c.launcher.ray.pids()[1])
    finally:
        c.shutdown()


def test_ray_pause_abort_on_every_rank_and_resume():
    c = make_client(True, False, ray_config(
        data_parallel_lockstep=True, synthetic_step_latency_s=0.005))
    try:
        for i in range(6):
            c.add_request(EngineCoreRequest(f"p{i}", [1, 2, i], SamplingParams(
                max_tokens=10**4, ignore_eos=True)))
        c.get_output(timeout=10)
        c.call_utility("pause_scheduler", "abort", timeout=30)
        reasons, ranks = {}, set()
        while len(reasons) < 6:
            outs = c.get_output(timeout=10)
            for o in outs.outputs:
                if o.finish_reason is not None:
                    reasons[o.request_id] = o.finish_reason
                    ranks.add(outs.engine_index)
        assert set(reasons.values()) == {FinishReason.ABORT} and ranks == {0, 1}
        c.call_utility("resume_scheduler", timeout=30)
        c.add_request(EngineCoreRequest("after", [3], SamplingParams(max_tokens=2)))
        while not any(o.finish_reason is not None for o in c.get_output(timeout=10).outputs):
            pass
    finally:
        c.shutdown()


def test_ray_scale_2_to_3_to_2_while_serving():
    c = make_client(True, False, ray_config(
        data_parallel_lockstep=True, synthetic_step_latency_s=0.002))
    expected = {f"s{i}": 20 + i % 5 for i in range(45)}
    got: dict[str, int] = {}
    finished: set[str] = set()

    def submit(lo, hi):
        for i in range(lo, hi):
            c.add_request(EngineCoreRequest(f"s{i}", [i + 1, 5], SamplingParams(
                max_tokens=expected[f"s{i}"], ignore_eos=True, seed=i)))

    def drain(n):
        while len(finished) < n:
            for o in c.get_output(timeout=30).outputs:
                got[o.request_id] = got.get(o.request_id, 0) + len(o.new_token_ids)
                if o.finish_reason is not None:
                    finished.add(o.request_id)

    try:
        submit(0, 15)
        c.scale_elastic_ep(3)
        assert c.num_engines == 3 and len(c.launcher.ray.actors) == 3
        submit(15, 30)
        c.scale_elastic_ep(2)
        assert c.num_engines == 2 and len(c.launcher.ray.actors) == 2
        assert len(c.launcher.ray.placement_groups) == 2
        submit(30, 45)
        drain(45)
        assert got == expected
        assert [s["data_parallel_size"] for s in dp_states(c)] == [2, 2]
    finally:
        c.shutdown()


def test_ray_scale_down_not_a_death_when_the_watcher_lags(monkeypatch):
    """The rank-death watcher can see a leaving rank's run() end only after
    scale-down finished (a busy machine): still no death (a CI failure once)."""
    import threading

    real_wait = ray.wait

    def lagging_wait(*args, **kwargs):
        done, rest = real_wait(*args, **kwargs)
        if done and threading.current_thread().name == "enginecore-ray-monitor":
            time.sleep(1.5)  # scale-down completes meanwhile
        return done, rest

    monkeypatch.setattr(ray, "wait", lagging_wait)
    c = make_client(True, False, ray_config(data_parallel_lockstep=True))
    try:
        c.scale_elastic_ep(1)
        assert c.num_engines == 1 and len(c.launcher.ray.actors) == 1
        time.sleep(2.5)  # the watcher has looked at the leaver's end by now
        assert not c._dead
        c.add_request(EngineCoreRequest("after", [1, 2], SamplingParams(max_tokens=3,
                                                                        ignore_eos=True)))
        n = 0
        while True:
            outs = c.get_output(timeout=10).outputs
            n += sum(len(o.new_token_ids) for o in outs)
            if any(o.finish_reason is not None for o in outs):
                break
        assert n == 3
    finally:
        c.shutdown()
