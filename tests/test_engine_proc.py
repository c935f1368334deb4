"""The engine in its own process: clients, handshake, utilities, failures, bad input."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest

from enginecore import (
    EngineArgs,
    EngineCoreRequest,
    EngineDeadError,
    FinishReason,
    LoRARequest,
    SamplingParams,
)
from enginecore.client import SyncMPClient, make_client
from enginecore.client.utility_calls import PendingCall
from enginecore.protocol import EngineCoreRequestType, SchedulerStats, UtilityRequest
from helpers import run_to_completion, synthetic_engine
from proc_executors import FailAfterExecutor, LogprobsExecutor

N = 200


def synthetic_config(**kw):
    args = dict(model="synthetic", block_size=4)
    args.update(kw)
    return EngineArgs(**args).create_engine_config()


def requests(n=N, max_tokens=None):
    return [
        EngineCoreRequest(f"r{i}", [i % 97 + 1, i % 13 + 2, 3, 4 + i % 5],
                          SamplingParams(max_tokens=max_tokens or (3 + i % 11), seed=i))
        for i in range(n)
    ]


def inproc_reference(n=N):
    eng = synthetic_engine(block_size=4)
    for r in requests(n):
        eng.add_request(r)
    return {rid: r["tokens"] for rid, r in run_to_completion(eng).items()}


def drain(client, want: set[str], timeout=30.0):
    got: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while not want <= {k for k, v in got.items() if v["finish_reason"] is not None}:
        outs = client.get_output(timeout=max(deadline - time.monotonic(), 0.01))
        for o in outs.outputs:
            r = got.setdefault(o.request_id, {"tokens": [], "finish_reason": None})
            r["tokens"].extend(o.new_token_ids)
            if o.finish_reason is not None:
                r["finish_reason"] = o.finish_reason
    return got


@pytest.fixture
def client(hot_path):
    c = make_client(True, False, synthetic_config())
    yield c
    c.shutdown()
    assert not c.proc.is_alive()


def test_200_concurrent_sync_same_as_inprocess(client):
    for r in requests():
        client.add_request(r)
    got = drain(client, {f"r{i}" for i in range(N)})
    assert {k: v["tokens"] for k, v in got.items()} == inproc_reference()


def test_200_concurrent_asyncio_same_as_inprocess(hot_path):
    async def main():
        c = make_client(True, True, synthetic_config())
        try:
            await asyncio.gather(*(c.add_request_async(r) for r in requests()))
            got: dict[str, list[int]] = {}
            finished = 0
            while finished < N:
                outs = await asyncio.wait_for(c.get_output_async(), 30)
                for o in outs.outputs:
                    got.setdefault(o.request_id, []).extend(o.new_token_ids)
                    finished += o.finish_reason is not None
            assert await c.call_utility_async("echo", [1, {"a": None}]) == [1, {"a": None}]
            return got
        finally:
            c.shutdown()

    assert asyncio.run(main()) == inproc_reference()


def test_abort_every_other_in_flight(hot_path):
    c = make_client(True, False, synthetic_config(synthetic_step_latency_s=0.01))
    try:
        reqs = requests(20, max_tokens=200)
        for r in reqs:
            c.add_request(r)
        time.sleep(0.1)
        c.abort_requests([f"r{i}" for i in range(0, 20, 2)] + ["unknown-id"])
        got = drain(c, {f"r{i}" for i in range(20)}, timeout=60)
        for i in range(20):
            r = got[f"r{i}"]
            if i % 2 == 0:
                assert r["finish_reason"] is FinishReason.ABORT and len(r["tokens"]) < 200
            else:
                assert r["finish_reason"] is FinishReason.LENGTH and len(r["tokens"]) == 200
        c.abort_requests(["r1", "r0"])  # finished / already aborted: harmless
        assert c.call_utility("get_request_counts") == (0, 0)
    finally:
        c.shutdown()


def test_utility_calls_values_failures_and_allow_list(client):
    assert client.call_utility("echo") is None
    assert client.call_utility("echo", [1, [2, 3]]) == [1, [2, 3]]
    assert client.call_utility("echo", {"k": {"n": [1.5]}}) == {"k": {"n": [1.5]}}
    stats = client.call_utility("make_stats")
    assert isinstance(stats, SchedulerStats) and stats.prefix_cache_stats.requests == 0
    assert client.call_utility("add_lora", LoRARequest("x", 3)) is True
    assert client.call_utility("list_loras") == {3}
    assert client.call_utility("get_kv_cache_group_metadata")[0]["block_size"] == 4
    with pytest.raises(RuntimeError, match="pin_lora failed.*not loaded"):
        client.call_utility("pin_lora", 99)
    with pytest.raises(PermissionError, match="not allowed"):
        client.call_utility("__init__")
    # Straight at the engine, bypassing the client's own check: refused there too.
    payload = msgspec.msgpack.encode(UtilityRequest(0, 777, "run_busy_loop", []))
    fut = __import__("concurrent.futures").futures.Future()
    # Registered before the reply can arrive.
    client.pending_calls.add(777, PendingCall("echo", fut, replies_due=1, answering_rank=0))
    client.input_socket.send_multipart([client.identity, EngineCoreRequestType.UTILITY.value,
                                        payload])
    with pytest.raises(RuntimeError, match="not allowed"):
        fut.result(timeout=10)
    client.add_request(requests(1)[0])
    assert drain(client, {"r0"})["r0"]["finish_reason"] is FinishReason.LENGTH


@pytest.fixture
def slow_client(hot_path):
    c = make_client(True, False, synthetic_config(synthetic_step_latency_s=0.005))
    yield c
    c.shutdown()


def test_pause_resume_sleep_wake_reset_through_client(slow_client):
    client = slow_client
    client.add_request(EngineCoreRequest("long", [1, 2, 3], SamplingParams(max_tokens=10**4)))
    time.sleep(0.05)
    client.call_utility("pause_scheduler", "abort")
    got = drain(client, {"long"})
    assert got["long"]["finish_reason"] is FinishReason.ABORT
    assert client.call_utility("is_scheduler_paused") is True
    client.add_request(EngineCoreRequest("waits", [5, 6], SamplingParams(max_tokens=3)))
    time.sleep(0.2)
    assert client.call_utility("get_request_counts") == (0, 1)
    client.call_utility("resume_scheduler")
    assert drain(client, {"waits"})["waits"]["finish_reason"] is FinishReason.LENGTH
    client.add_request(EngineCoreRequest("kept", [7, 8], SamplingParams(max_tokens=10**4)))
    time.sleep(0.05)
    client.call_utility("pause_scheduler", "keep")
    assert client.call_utility("get_request_counts")[0] == 1
    client.abort_requests(["kept"])
    assert drain(client, {"kept"})["kept"]["finish_reason"] is FinishReason.ABORT
    client.call_utility("resume_scheduler")
    client.call_utility("sleep", 1)
    assert client.call_utility("is_sleeping") is True
    client.add_request(EngineCoreRequest("asleep", [9, 9], SamplingParams(max_tokens=2)))
    time.sleep(0.2)
    client.call_utility("wake_up", ["weights", "kv_cache"])
    assert drain(client, {"asleep"})["asleep"]["finish_reason"] is FinishReason.LENGTH
    assert client.call_utility("reset_prefix_cache") is True


def test_executor_failure_is_engine_dead_fast():
    c = make_client(True, False, synthetic_config(), FailAfterExecutor)
    try:
        c.add_request(EngineCoreRequest("x", [1, 2], SamplingParams(max_tokens=100)))
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            while True:
                c.get_output(timeout=5)
        assert time.monotonic() - t0 < 5
        with pytest.raises(EngineDeadError):
            c.call_utility("echo", 1)
        with pytest.raises(EngineDeadError):
            c.add_request(EngineCoreRequest("y", [1], SamplingParams()))
        c.proc.join(5)
        assert c.proc.exitcode == 1
    finally:
        c.shutdown()


@pytest.mark.parametrize("mode", ["sync", "asyncio"])
def test_kill_9_is_engine_dead_fast(mode):
    if mode == "sync":
        c = make_client(True, False, synthetic_config(
            synthetic_step_latency_s=0.01))
        c.add_request(EngineCoreRequest("x", [1, 2], SamplingParams(max_tokens=10**5)))
        c.get_output(timeout=5)
        os.kill(c.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            while True:
                c.get_output(timeout=5)
        assert time.monotonic() - t0 < 5
        c.shutdown()
        return

    async def main():
        c = make_client(True, True, synthetic_config(
            synthetic_step_latency_s=0.01))
        try:
            await c.add_request_async(EngineCoreRequest("x", [1], SamplingParams(max_tokens=10**5)))
            await c.get_output_async()
            os.kill(c.proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            waiter = asyncio.ensure_future(c.call_utility_async("echo", 1))
            with pytest.raises(EngineDeadError):
                while True:
                    await asyncio.wait_for(c.get_output_async(), 5)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(waiter, 5)
            assert time.monotonic() - t0 < 5
        finally:
            c.shutdown()

    asyncio.run(main())


def test_killing_the_parent_reaps_the_engine(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from enginecore import EngineArgs
        from enginecore.client import make_client
        if __name__ == "__main__":
            c = make_client(
                True, False, EngineArgs(model="synthetic").create_engine_config())
            print(c.proc.pid, flush=True)
            time.sleep(600)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(engine_pid, 0)
            except ProcessLookupError:
                break
            try:  # reap if it became our zombie (it is not our child: nothing to do)
                os.waitpid(engine_pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.1)
        else:
            os.kill(engine_pid, signal.SIGKILL)
            pytest.fail("engine outlived its parent by 10 s")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        parent.stdout.close()


@pytest.mark.parametrize("frames", [
    [b"\x00", b"\xc1garbage"],  # ADD with invalid msgpack
    [b"\x00", msgspec.msgpack.encode({"request_id": 5})],  # wrong types
    [b"\x09", b"\x90"],  # unknown request type
    [b"\x00", msgspec.msgpack.encode(EngineCoreRequest("t", [1, 2]))[:-3]],  # truncated
    [b"\x01"],  # missing payload
    [b"\x03", msgspec.msgpack.encode([0, 1])],  # UTILITY too short
    [b"\x04", b""],  # EXECUTOR_FAILED from a front-end is not allowed
])
def test_malformed_frames_are_dropped_and_engine_serves(client, frames):
    client.input_socket.send_multipart([client.identity, *frames])
    client.add_request(EngineCoreRequest("after", [1, 2, 3], SamplingParams(max_tokens=3)))
    got = drain(client, {"after"}, timeout=10)
    assert got["after"]["finish_reason"] is FinishReason.LENGTH
    assert client.proc.is_alive()


def test_duplicate_live_id_rejected_without_disturbing_first(client):
    # Long enough that the first is still live when the duplicate comes (at 50
    # synthetic tokens it once finished first on a loaded machine).
    first = EngineCoreRequest("dup", [1, 2, 3], SamplingParams(max_tokens=2000, seed=4))
    client.add_request(first)
    with pytest.raises(ValueError, match="already live"):
        client.add_request(EngineCoreRequest("dup", [9], SamplingParams(max_tokens=1)))
    # Straight at the engine: it drops the duplicate and keeps the first.
    raw = msgspec.msgpack.encode(EngineCoreRequest("dup", [9], SamplingParams(max_tokens=1)))
    client.input_socket.send_multipart([client.identity, b"\x00", raw])
    got = drain(client, {"dup"})
    ref = synthetic_engine(block_size=4)
    ref.add_request(EngineCoreRequest("dup", [1, 2, 3], SamplingParams(max_tokens=2000, seed=4)))
    assert got["dup"]["tokens"] == run_to_completion(ref)["dup"]["tokens"]


def test_two_front_ends_get_only_their_own_outputs(hot_path):
    primary = SyncMPClient(synthetic_config(), client_count=2)
    second = primary.attach(1)
    try:
        for i in range(10):
            primary.add_request(
                EngineCoreRequest(f"p{i}", [1, i + 2], SamplingParams(max_tokens=4)))
            second.add_request(
                EngineCoreRequest(f"s{i}", [2, i + 2], SamplingParams(max_tokens=4)))
        got_p = drain(primary, {f"p{i}" for i in range(10)})
        got_s = drain(second, {f"s{i}" for i in range(10)})
        assert set(got_p) == {f"p{i}" for i in range(10)}
        assert set(got_s) == {f"s{i}" for i in range(10)}
        assert second.call_utility("echo", "from-second") == "from-second"
        assert primary.outputs_queue.empty() and second.outputs_queue.empty()
    finally:
        second.shutdown()
        primary.shutdown()


def test_large_frames_survive_buffer_reuse(hot_path):
    """Steps whose encoded outputs pass 64 KiB go out zero-copy; later steps must
    not corrupt them by reusing their buffers."""
    c = SyncMPClient(synthetic_config(), LogprobsExecutor)
    try:
        n = 300
        for i in range(n):
            c.add_request(EngineCoreRequest(f"q{i}", [i + 1, 2], SamplingParams(
                max_tokens=6, seed=i, logprobs=20)))
        got = drain(c, {f"q{i}" for i in range(n)}, timeout=60)
        ref = synthetic_engine(block_size=4)
        for i in range(n):
            ref.add_request(EngineCoreRequest(f"q{i}", [i + 1, 2], SamplingParams(
                max_tokens=6, seed=i)))
        expected = run_to_completion(ref)
        assert {k: v["tokens"] for k, v in got.items()} == {
            k: v["tokens"] for k, v in expected.items()}
    finally:
        c.shutdown()


def test_handshake_timeout_names_the_engine():
    import zmq

    from enginecore.client.sockets import Addresses
    from enginecore.core.engine_core_proc import EngineCoreProc

    addrs = Addresses("ipc")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    hs = addrs.bind(router, "hs.sock")
    try:
        with pytest.raises(TimeoutError, match="engine 3.*did not send its init message"):
            EngineCoreProc(synthetic_config(), hs, engine_index=3, handshake_timeout_s=0.3)
    finally:
        ctx.destroy(linger=0)
        addrs.cleanup()


def test_tcp_transport_binds_loopback_only():
    c = SyncMPClient(synthetic_config(), transport="tcp")
    try:
        assert c.input_address.startswith("tcp://127.0.0.1:")
        c.add_request(EngineCoreRequest("t", [1], SamplingParams(max_tokens=2)))
        assert drain(c, {"t"})["t"]["finish_reason"] is FinishReason.LENGTH
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from tiny_models import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-proc")), "llama", seed=5)


@pytest.mark.parametrize("asyncio_mode", [False, True])
def test_real_tiny_model_through_the_process(tiny_model_dir, asyncio_mode):
    from enginecore import EngineCore

    cfg = EngineArgs(model=tiny_model_dir, dtype="float32", block_size=4, max_model_len=128,
                     kv_cache_memory_bytes=32 << 20).create_engine_config()
    reqs = [EngineCoreRequest(f"m{i}", [i % 200 + 3, 5, 7, i % 7 + 9],
                              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
            for i in range(200)]
    eng = EngineCore(cfg)
    for r in reqs:
        eng.add_request(r)
    expected = {k: v["tokens"] for k, v in run_to_completion(eng).items()}
    eng.shutdown()
    if not asyncio_mode:
        c = make_client(True, False, cfg)
        try:
            for r in reqs:
                c.add_request(r)
            got = drain(c, set(expected), timeout=120)
        finally:
            c.shutdown()
        assert {k: v["tokens"] for k, v in got.items()} == expected
        return

    async def main():
        c = make_client(True, True, cfg)
        try:
            for r in reqs:
                await c.add_request_async(r)
            got: dict[str, list[int]] = {}
            done = 0
            while done < len(reqs):
                outs = await asyncio.wait_for(c.get_output_async(), 60)
                for o in outs.outputs:
                    got.setdefault(o.request_id, []).extend(o.new_token_ids)
                    done += o.finish_reason is not None
            return got
        finally:
            c.shutdown()

    assert asyncio.run(main()) == expected
