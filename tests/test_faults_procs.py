"""The fault suite, process side (issue 13): SIGSTOP/SIGCONT and kill -9 of each
process (front-end, engine, DP coordinator), the socket directory removed by
whichever side outlives the other, and another user on the TCP links.

These exercise processes and sockets, not the hot paths, and take seconds each:
they run on the path the environment selects (native in the default run, Python
in the ENGINECORE_NATIVE=0 run) instead of twice per run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
import zmq

from enginecore import EngineArgs, EngineCoreRequest, FinishReason, SamplingParams
from enginecore.client import SyncMPClient, make_client
from enginecore.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    HandshakeHello,
)
from helpers import run_to_completion, synthetic_engine
from test_data_parallel import kill_and_expect_dead

pytestmark = pytest.mark.slow


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:  # a zombie has exited: its reaper is slow
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        try:  # reap it if it became our zombie
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.01)
    return False


FRONT_END = textwrap.dedent("""
    import json, sys, time
    from enginecore import EngineArgs, EngineCoreRequest, SamplingParams
    from enginecore.client import SyncMPClient
    if __name__ == "__main__":
        n, tokens, transport = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
        cfg = EngineArgs(model="synthetic", block_size=4, max_model_len=4096,
                         synthetic_step_latency_s=0.01).create_engine_config()
        c = SyncMPClient(cfg, transport=transport)
        print(json.dumps({"engine": c.proc.pid, "dir": c.launcher.addresses.dir}), flush=True)
        for i in range(n):
            c.add_request(EngineCoreRequest(f"s{i}", [i + 1, 5, 9], SamplingParams(
                max_tokens=tokens, seed=i)))
        got, finishes, first = {}, {}, True
        while len(finishes) < n:
            for o in c.get_output(timeout=60).outputs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finishes[o.request_id] = finishes.get(o.request_id, 0) + 1
                if first:
                    print("started", flush=True)
                    first = False
        time.sleep(0.2)
        print(json.dumps({"tokens": got, "finishes": finishes}), flush=True)
        if sys.argv[4] == "shutdown":
            c.shutdown()
        else:
            time.sleep(600)  # killed by the test
""")


def start_front_end(tmp_path, n, tokens, transport="ipc", end="shutdown"):
    script = tmp_path / "front_end.py"
    script.write_text(FRONT_END)
    proc = subprocess.Popen([sys.executable, str(script), str(n), str(tokens), transport, end],
                            stdout=subprocess.PIPE, text=True)
    info = json.loads(proc.stdout.readline())
    return proc, info


def reference(n, tokens):
    eng = synthetic_engine(block_size=4, max_model_len=4096)
    for i in range(n):
        eng.add_request(EngineCoreRequest(f"s{i}", [i + 1, 5, 9], SamplingParams(
            max_tokens=tokens, seed=i)))
    return {k: v["tokens"] for k, v in run_to_completion(eng).items()}


def test_a_5s_stop_of_the_engine_or_the_front_end_loses_nothing(tmp_path):
    """SIGSTOP for 5 s (a frozen VM, swap, a long GC) of the engine, then of the
    front-end, over TCP (heartbeats on, default timeout 60 s): every request
    finishes exactly once with exactly its tokens."""
    n, tokens = 8, 1000
    proc, info = start_front_end(tmp_path, n, tokens, "tcp")
    try:
        assert proc.stdout.readline().strip() == "started"
        # Each side stopped for 5 s, overlapping by 2.5 s (either one alone for 2.5 s).
        os.kill(info["engine"], signal.SIGSTOP)
        time.sleep(2.5)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(2.5)
        os.kill(info["engine"], signal.SIGCONT)
        time.sleep(2.5)
        os.kill(proc.pid, signal.SIGCONT)
        result = json.loads(proc.stdout.readline())
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.kill(info["engine"], signal.SIGCONT)
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
    assert result["finishes"] == {f"s{i}": 1 for i in range(n)}
    assert result["tokens"] == reference(n, tokens)


def test_kill_9_of_the_front_end_ends_its_engine_which_removes_the_socket_dir(tmp_path):
    proc, info = start_front_end(tmp_path, 2, 5000, end="hang")
    try:
        assert proc.stdout.readline().strip() == "started"
        assert os.path.isdir(info["dir"])
        proc.kill()
        killed = time.monotonic()
        proc.wait(10)
        # Well under the parent watch's 5 s hard exit, which a shutdown that blocked on
        # the zmq context used to reach (~4 s); measured: bench/bench_engine_exit.py.
        assert wait_gone(info["engine"], timeout=2.5), "the engine outlived its front-end"
        assert time.monotonic() - killed < 2.5
        deadline = time.monotonic() + 5
        while os.path.exists(info["dir"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(info["dir"])
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


def test_a_front_end_that_exits_without_shutdown_removes_its_socket_dir(tmp_path):
    script = tmp_path / "leaves.py"
    script.write_text(textwrap.dedent("""
        import json
        from enginecore import EngineArgs
        from enginecore.client import SyncMPClient
        if __name__ == "__main__":
            c = SyncMPClient(EngineArgs(model="synthetic").create_engine_config())
            print(json.dumps({"dir": c.launcher.addresses.dir, "engine": c.proc.pid}), flush=True)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    info = json.loads(out.stdout)
    assert wait_gone(info["engine"]) and not os.path.exists(info["dir"])


def test_dp_coordinator_stop_loses_nothing_and_its_death_is_engine_dead():
    cfg = EngineArgs(model="synthetic", block_size=4, data_parallel_size=2,
                     synthetic_step_latency_s=0.005).create_engine_config()
    c = make_client(True, False, cfg)
    try:
        reqs = [EngineCoreRequest(f"d{i}", [i + 1, 3], SamplingParams(max_tokens=300, seed=i))
                for i in range(6)]
        for r in reqs:
            c.add_request(r)
        os.kill(c.coordinator.pid, signal.SIGSTOP)
        time.sleep(5)
        os.kill(c.coordinator.pid, signal.SIGCONT)
        got: dict[str, list[int]] = {}
        finishes = 0
        while finishes < len(reqs):
            for o in c.get_output(timeout=30).outputs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                finishes += o.finish_reason is not None
        ref = synthetic_engine(block_size=4)
        for r in reqs:
            ref.add_request(r)
        assert got == {k: v["tokens"] for k, v in run_to_completion(ref).items()}
        kill_and_expect_dead(c, c.coordinator.pid)
    finally:
        c.shutdown()


# -- another user on the TCP links ---------------------------------------------------------
def as_other_user(fn, *args, uid: int = 65534) -> dict:
    """Run ``fn(*args)`` in a forked child that has become another user (the tests
    run as root); its result comes back through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no threads of ours, a zmq context of its own
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            result = {"uid": os.getuid(), **fn(*args)}
        except BaseException as e:  # noqa: BLE001
            result = {"error": repr(e)}
        os.write(w, json.dumps(result).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))


def attack(output_address: str, input_address: str, identity: bytes) -> dict:
    """Forge outputs and ENGINE_CORE_DEAD into the front-end, and pose as engine 0
    on its request socket, with no keys and with keys of its own."""
    ctx = zmq.Context()
    received = 0
    for keyed in (False, True):
        push = ctx.socket(zmq.PUSH)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, identity)
        for sock in (push, dealer):
            sock.setsockopt(zmq.LINGER, 0)
            if keyed:  # a key pair of its own, and a guess at the server key
                public, secret = zmq.curve_keypair()
                sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
                    public, public, secret)
        push.connect(output_address)
        dealer.connect(input_address)
        forged = msgspec.msgpack.encode(EngineCoreOutputs(outputs=[EngineCoreOutput(
            "victim", [666], finish_reason=FinishReason.STOP)]))
        for _ in range(20):
            for frame in (forged, ENGINE_CORE_DEAD):
                try:
                    push.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    pass
            try:
                dealer.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass
            time.sleep(0.05)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            if dealer.poll(100):
                dealer.recv_multipart()
                received += 1
        push.close()
        dealer.close()
    ctx.destroy(linger=0)
    return {"received": received}


def pose_as_rank(handshake_address: str) -> dict:
    """Answer the fixed-port headless handshake as rank 1, hoping for its INIT
    (the addresses) and then its requests."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, (1).to_bytes(2, "little"))
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(handshake_address)
    hello = msgspec.msgpack.encode(HandshakeHello(1, os.getpid()))
    got = 0
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        try:
            dealer.send(hello, zmq.NOBLOCK)
        except zmq.Again:
            pass
        if dealer.poll(200):
            dealer.recv()
            got += 1
    ctx.destroy(linger=0)
    return {"received": got}


def test_another_user_on_tcp_is_refused_before_it_sees_or_sends_anything():
    c = SyncMPClient(EngineArgs(model="synthetic", block_size=4,
                                synthetic_step_latency_s=0.005).create_engine_config(),
                     transport="tcp")
    try:
        c.add_request(EngineCoreRequest("victim", [1, 2], SamplingParams(max_tokens=200, seed=3)))
        result = as_other_user(attack, c.output_address, c.input_address, c.identity)
        assert result.get("uid") == 65534, result
        assert result["received"] == 0
        got: list[int] = []
        finish = None
        while finish is None:
            for o in c.get_output(timeout=10).outputs:
                assert o.request_id == "victim" and 666 not in o.new_token_ids
                got.extend(o.new_token_ids)
                finish = o.finish_reason
        ref = synthetic_engine(block_size=4)
        ref.add_request(EngineCoreRequest("victim", [1, 2], SamplingParams(max_tokens=200,
                                                                           seed=3)))
        assert finish is FinishReason.LENGTH and got == run_to_completion(ref)["victim"]["tokens"]
        assert not c._dead and c.call_utility("echo", 1) == 1
    finally:
        c.shutdown()


def test_another_user_cannot_join_the_headless_handshake_as_a_rank(tmp_path):
    """The fixed-port handshake waits for rank 1; an impostor answering it gets no
    INIT (the CURVE handshake refuses it), then the real rank joins with the keys
    the front-end wrote (0600) and serves."""
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key_file = str(tmp_path / "keys")
    cfg = EngineArgs(model="synthetic", block_size=4, data_parallel_size=2,
                     data_parallel_size_local=1, data_parallel_rpc_port=port,
                     zmq_curve_key_file=key_file).create_engine_config()
    box: dict = {}

    def start():
        try:
            box["client"] = make_client(True, False, cfg, handshake_timeout_s=60)
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    starter = threading.Thread(target=start)
    starter.start()
    headless = None
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(key_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.stat(key_file).st_mode & 0o777 == 0o600
        result = as_other_user(pose_as_rank, f"tcp://127.0.0.1:{port}")
        assert result.get("uid") == 65534 and result["received"] == 0, result
        headless = subprocess.Popen(
            [sys.executable, "-m", "enginecore.entrypoints.cli", "engine", "--headless",
             "--model", "synthetic", "--block-size", "4", "--data-parallel-size", "2",
             "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1",
             "--data-parallel-rpc-port", str(port), "--zmq-curve-key-file", key_file],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        starter.join(60)
        assert "client" in box, box.get("error")
        c = box["client"]
        try:
            for i in range(8):
                c.add_request(EngineCoreRequest(f"h{i}", [i + 1], SamplingParams(max_tokens=3)))
            done = 0
            while done < 8:
                done += sum(o.finished for o in c.get_output(timeout=20).outputs)
        finally:
            c.shutdown()
        assert not os.path.exists(key_file)  # the launch's keys go with it
    finally:
        starter.join(60)
        if headless is not None:
            headless.terminate()
            headless.communicate(timeout=30)


def _tcp_front_end(handoff, results) -> None:
    """Front-end 1 in another process, over TCP: it binds CURVE servers with the
    keys from its handoff, and its request id "x" is its own."""
    try:
        c = SyncMPClient.connect(handoff)
        try:
            c.add_request(EngineCoreRequest("x", [4, 5], SamplingParams(max_tokens=6, seed=2)))
            got, finish = [], None
            while finish is None:
                for o in c.get_output(timeout=20).outputs:
                    got.extend(o.new_token_ids)
                    finish = o.finish_reason
            results.put((got, int(finish)))
        finally:
            c.shutdown()
    except BaseException as e:  # noqa: BLE001 - the test reads what happened
        results.put(repr(e))


def test_a_front_end_in_another_process_over_tcp_has_the_launch_keys():
    import multiprocessing

    cfg = EngineArgs(model="synthetic", block_size=4).create_engine_config()
    c = SyncMPClient(cfg, transport="tcp", client_count=2, local_client_count=1)
    try:
        assert c.input_address.startswith("tcp://") and c._curve is not None
        c.add_request(EngineCoreRequest("x", [1, 2], SamplingParams(max_tokens=400, seed=1)))
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        proc = ctx.Process(target=_tcp_front_end, args=(c.handoff(1), results))
        proc.start()
        got = results.get(timeout=60)
        proc.join(30)
        ref = synthetic_engine(block_size=4)
        ref.add_request(EngineCoreRequest("x", [4, 5], SamplingParams(max_tokens=6, seed=2)))
        assert got == (run_to_completion(ref)["x"]["tokens"], int(FinishReason.LENGTH))
        mine, finish = [], None
        while finish is None:
            for o in c.get_output(timeout=20).outputs:
                assert o.request_id == "x"
                mine.extend(o.new_token_ids)
                finish = o.finish_reason
        assert finish is FinishReason.LENGTH and len(mine) == 400
    finally:
        c.shutdown()
