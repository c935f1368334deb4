"""Data parallel, independent engines (dense models): DP=2 behind one load-
balancing client and the coordinator. Lockstep waves: test_dp_lockstep.py; Ray:
test_dp_ray.py."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest

from enginecore import EngineArgs, EngineCoreRequest, EngineDeadError, FinishReason, SamplingParams
from enginecore.client import make_client
from enginecore.client.sockets import rank_devices
from helpers import run_to_completion, synthetic_engine

N = 100


def reqs():
    return [EngineCoreRequest(f"d{i}", [i % 50 + 1, 7, i % 3 + 2],
                              SamplingParams(max_tokens=5 + i % 9, seed=i)) for i in range(N)]


def reference():
    eng = synthetic_engine(block_size=4)
    for r in reqs():
        eng.add_request(r)
    return {k: v["tokens"] for k, v in run_to_completion(eng).items()}


def drain_by_rank(client, n=N) -> tuple[dict[str, list[int]], list[int]]:
    """Tokens per request and finished requests per rank, until n finish."""
    got: dict[str, list[int]] = {}
    served = [0] * client.config.parallel_config.data_parallel_size
    done = 0
    while done < n:
        outs = client.get_output(timeout=30)
        for o in outs.outputs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                done += 1
                served[outs.engine_index] += 1
    return got, served


def kill_and_expect_dead(client, pid: int, get_timeout: float = 5) -> None:
    """SIGKILL one rank: the client says EngineDeadError within 5 s."""
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError):
        while True:
            client.get_output(timeout=get_timeout)
    assert time.monotonic() - t0 < 5


def config(dp=2, **kw):
    return EngineArgs(model="synthetic", block_size=4, data_parallel_size=dp,
                      **kw).create_engine_config()


def test_dp2_same_tokens_fair_share_nothing_left(hot_path):
    c = make_client(True, False, config(synthetic_step_latency_s=0.002))
    try:
        assert len(c.procs) == 2
        for r in reqs():
            c.add_request(r)
        got, served = drain_by_rank(c)
        assert got == reference()
        assert min(served) >= 0.4 * N, served
        assert c.router.load == [0, 0] and not c.router.live
        assert c.call_utility("get_request_counts") == (0, 0)
    finally:
        c.shutdown()
    assert not any(p.is_alive() for p in c.procs)


def test_dp2_asyncio_and_pause_abort_on_every_rank():
    async def main():
        c = make_client(True, True, config(synthetic_step_latency_s=0.01))
        try:
            for i in range(10):
                await c.add_request_async(EngineCoreRequest(
                    f"p{i}", [1, 2, i], SamplingParams(max_tokens=10**4, ignore_eos=True)))
            await asyncio.sleep(0.2)
            await c.call_utility_async("pause_scheduler", "abort")
            reasons, ranks = {}, set()
            while len(reasons) < 10:
                outs = await asyncio.wait_for(c.get_output_async(), 10)
                for o in outs.outputs:
                    if o.finish_reason is not None:
                        reasons[o.request_id] = o.finish_reason
                        ranks.add(outs.engine_index)
            assert set(reasons.values()) == {FinishReason.ABORT} and ranks == {0, 1}
            assert await c.call_utility_async("is_scheduler_paused") is True
            await c.call_utility_async("resume_scheduler")
        finally:
            c.shutdown()

    asyncio.run(main())


def test_killing_one_rank_is_engine_dead_fast_and_nothing_hangs():
    c = make_client(True, False, config(synthetic_step_latency_s=0.01))
    try:
        for i in range(4):
            c.add_request(EngineCoreRequest(f"k{i}", [1, i], SamplingParams(max_tokens=10**4,
                                                                            ignore_eos=True)))
        c.get_output(timeout=10)
        kill_and_expect_dead(c, c.procs[1].pid)
    finally:
        c.shutdown()
    assert not any(p.is_alive() for p in c.procs)


def test_real_tiny_model_dp2(tmp_path):
    from tiny_models import make_tiny_model

    path = make_tiny_model(str(tmp_path / "m"), seed=4)
    cfg = EngineArgs(model=path, dtype="float32", block_size=4, max_model_len=128,
                     kv_cache_memory_bytes=16 << 20, data_parallel_size=2).create_engine_config()
    single = EngineArgs(model=path, dtype="float32", block_size=4, max_model_len=128,
                        kv_cache_memory_bytes=16 << 20).create_engine_config()
    from enginecore import EngineCore

    requests = [EngineCoreRequest(f"t{i}", [i + 3, 9, 11], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True)) for i in range(12)]
    eng = EngineCore(single)
    for r in requests:
        eng.add_request(r)
    expected = {k: v["tokens"] for k, v in run_to_completion(eng).items()}
    c = make_client(True, False, cfg)
    try:
        for r in requests:
            c.add_request(r)
        got: dict[str, list[int]] = {}
        done = 0
        while done < len(requests):
            for o in c.get_output(timeout=60).outputs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                done += o.finish_reason is not None
    finally:
        c.shutdown()
    assert got == expected


def test_ranks_must_fit_the_visible_devices(monkeypatch):
    cfg = config()
    cfg = dataclasses.replace(cfg, model_config=dataclasses.replace(cfg.model_config,
                                                                    device="cuda"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError, match="needs 2 devices, but only 1"):
        rank_devices(cfg)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    assert rank_devices(cfg) == ["3", "5"]


def test_unsupported_dp_settings_are_clear_errors():
    with pytest.raises(ValueError, match="multiprocess_mode"):
        make_client(False, False, config())
    with pytest.raises(ValueError, match="data_parallel_backend"):
        EngineArgs(model="synthetic", data_parallel_backend="slurm").create_engine_config()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_headless_rank_joins_a_front_end_on_loopback():
    """A second "node" on loopback: rank 1 runs headless and joins the front-end."""
    import subprocess
    import sys

    port = free_port()
    headless = subprocess.Popen(
        [sys.executable, "-m", "enginecore.entrypoints.cli", "engine", "--headless",
         "--model", "synthetic", "--block-size", "4", "--data-parallel-size", "2",
         "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1",
         "--data-parallel-rpc-port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        cfg = EngineArgs(model="synthetic", block_size=4, data_parallel_size=2,
                         data_parallel_size_local=1,
                         data_parallel_rpc_port=port).create_engine_config()
        c = make_client(True, False, cfg, handshake_timeout_s=60)
        try:
            assert len(c.procs) == 1 and c.input_address.startswith("tcp://127.0.0.1:")
            for r in reqs():
                c.add_request(r)
            got, served = drain_by_rank(c)
            assert got == reference() and min(served) > 0  # both ranks served
        finally:
            c.shutdown()
    finally:
        headless.terminate()
        out, _err = headless.communicate(timeout=30)
    assert "joining tcp://127.0.0.1" in out


def test_headless_needs_a_fixed_port():
    with pytest.raises(ValueError, match="data_parallel_rpc_port"):
        EngineArgs(model="synthetic", data_parallel_size=2,
                   data_parallel_size_local=1).create_engine_config()


def test_external_lb_each_front_end_talks_to_its_own_rank():
    clients = []
    try:
        for rank in range(2):
            cfg = EngineArgs(model="synthetic", block_size=4, data_parallel_size=2,
                             data_parallel_rank=rank,
                             data_parallel_external_lb=True).create_engine_config()
            clients.append(make_client(True, False, cfg))
        for rank, c in enumerate(clients):
            assert c.ranks == [rank] and len(c.procs) == 1
            for i in range(5):
                c.add_request(EngineCoreRequest(f"x{rank}-{i}", [rank + 1, i + 1],
                                                SamplingParams(max_tokens=3)))
        for rank, c in enumerate(clients):
            done = 0
            while done < 5:
                outs = c.get_output(timeout=30)
                assert outs.engine_index == rank
                for o in outs.outputs:
                    assert o.request_id.startswith(f"x{rank}-")
                    done += o.finish_reason is not None
            assert c.call_utility("get_request_counts") == (0, 0)
    finally:
        for c in clients:
            c.shutdown()


def child_pids(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(p) for p in f.read().split()]
    engines = []
    for kid in kids:
        with open(f"/proc/{kid}/cmdline", "rb") as f:
            if b"resource_tracker" not in f.read():
                engines.append(kid)
    return engines


def test_headless_rank_death_and_front_end_death_are_noticed():
    """kill -9 of a remote rank is EngineDeadError at the front-end (its connection
    drops); a front-end going away ends the headless engines."""
    import subprocess
    import sys

    def start_headless(port):
        return subprocess.Popen(
            [sys.executable, "-m", "enginecore.entrypoints.cli", "engine", "--headless",
             "--model", "synthetic", "--block-size", "4", "--data-parallel-size", "2",
             "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1",
             "--data-parallel-rpc-port", str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def front_end(port):
        cfg = EngineArgs(model="synthetic", block_size=4, data_parallel_size=2,
                         data_parallel_size_local=1, synthetic_step_latency_s=0.01,
                         data_parallel_rpc_port=port).create_engine_config()
        return make_client(True, False, cfg, handshake_timeout_s=60)

    port = free_port()
    headless = start_headless(port)
    try:
        c = front_end(port)
        try:
            for i in range(4):
                c.add_request(EngineCoreRequest(f"h{i}", [1, i], SamplingParams(
                    max_tokens=10**4, ignore_eos=True)))
            c.get_output(timeout=10)
            kill_and_expect_dead(c, child_pids(headless.pid)[0], get_timeout=10)
        finally:
            c.shutdown()
    finally:
        headless.kill()
        headless.communicate(timeout=30)
    # The other way round: the front-end goes, the headless engine follows.
    port = free_port()
    headless = start_headless(port)
    try:
        c = front_end(port)
        c.shutdown()
        t0 = time.monotonic()
        headless.wait(timeout=15)
        assert time.monotonic() - t0 < 10
    finally:
        if headless.poll() is None:
            headless.kill()
        _out, err = headless.communicate(timeout=30)
    assert "went away" in err, err[-2000:]
