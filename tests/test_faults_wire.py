"""The fault suite, wire side (issue 13): bounds, malformed requests answered,
readers that survive bad frames, hypothesis fuzzing both ways, exactly one finish
per request, front-ends scoped, utilities validated first, shutdown wakes
waiters, message caps. Every test runs on the native and the Python path."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enginecore import (
    EngineArgs,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDeadError,
    FinishReason,
    SamplingParams,
    _native,
)
from enginecore.client import SyncMPClient, make_client
from enginecore.client.utility_calls import PendingCall
from enginecore.protocol import EngineCoreRequestType, UtilityRequest, readable_request_id
from enginecore.sampling_params import StructuredOutputsParams
from helpers import make_request, run_to_completion, synthetic_engine
from proc_executors import LogprobsExecutor

ADD = EngineCoreRequestType.ADD.value


def cfg(**kw):
    args = dict(model="synthetic", block_size=4, max_model_len=64)
    args.update(kw)
    return EngineArgs(**args).create_engine_config()


@pytest.fixture(scope="module", params=["native", "python"])
def client(request):
    """One engine per path for the module (the engine follows the client's path)."""
    previous = _native._enabled
    _native.set_native(request.param == "native")
    c = SyncMPClient(cfg(), client_count=2)
    _native._enabled = previous
    yield c
    c.shutdown()


def drain(client, want: set[str], timeout=20.0) -> dict[str, dict]:
    """Outputs until every id in ``want`` finished; counts finishes per id."""
    got: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while not want <= {k for k, v in got.items() if v["finishes"]}:
        outs = client.get_output(timeout=max(deadline - time.monotonic(), 0.01))
        for o in outs.outputs:
            r = got.setdefault(o.request_id, {"tokens": [], "finishes": 0})
            r["tokens"].extend(o.new_token_ids)
            if o.finish_reason is not None:
                r["finishes"] += 1
                r["finish_reason"], r["stop_reason"] = o.finish_reason, o.stop_reason
    return got


def serves(client, rid="probe") -> None:
    client.add_request(make_request(rid, [1, 2, 3], max_tokens=3, seed=1))
    assert drain(client, {rid})[rid]["finish_reason"] is FinishReason.LENGTH
    assert client.proc.is_alive() and rid not in client.router.live


def send_raw(client, payload: bytes, rid: str | None = None) -> None:
    """An ADD straight onto the wire (what a buggy or hostile front-end could send),
    the id tracked as live as the client would."""
    if rid is not None:
        client.router.register(EngineCoreRequest(rid, [1]))
    client._send([client.identity, ADD, payload])


# -- item 1: one set of bounds ----------------------------------------------------------
def test_bounds_hold_at_construction_decode_and_send(client):
    big = 2**63
    with pytest.raises(ValueError, match="SamplingParams.max_tokens"):
        SamplingParams(max_tokens=big)
    SamplingParams(max_tokens=big - 1)  # int64: what the C++ loops read
    sp = SamplingParams(max_tokens=4)
    sp.max_tokens = big  # mutated after construction
    with pytest.raises(ValueError, match=r"sampling_params\.max_tokens"):
        client.add_request(EngineCoreRequest("m", [1, 2], sp))
    with pytest.raises(ValueError, match=r"sampling_params\.max_tokens"):
        synthetic_engine().add_request(EngineCoreRequest("m", [1, 2], sp))
    # Straight on the wire: answered with ERROR naming the field.
    raw = msgspec.msgpack.encode(["w", [1, 2], [big]])
    send_raw(client, raw, "w")
    got = drain(client, {"w"})["w"]
    assert got["finish_reason"] is FinishReason.ERROR and "max_tokens" in got["stop_reason"]
    assert got["finishes"] == 1 and "w" not in client.router.live
    # The largest int64 is served (to max_model_len) on both paths.
    client.add_request(EngineCoreRequest("m", [1, 2], SamplingParams(max_tokens=big - 1)))
    got = drain(client, {"m"})["m"]
    assert got["finish_reason"] is FinishReason.LENGTH and len(got["tokens"]) == 62
    serves(client)


# -- item 3: the client refuses what the engine would ------------------------------------
@pytest.mark.parametrize("make", [
    lambda: EngineCoreRequest("x", [1.0, 2.5]),
    lambda: EngineCoreRequest("x", [True, 2]),
    lambda: EngineCoreRequest("x", [1, 2**64]),
    lambda: EngineCoreRequest("x", [1], SamplingParams(), arrival_time=math.nan),
    lambda: EngineCoreRequest("x", [1], SamplingParams(), priority=2**63),
    lambda: EngineCoreRequest("x", [1], mutated(temperature=math.nan)),
    lambda: EngineCoreRequest("x", [1], mutated(stop_token_ids=[-1])),
    lambda: EngineCoreRequest("x", [1], mutated(logprobs=True)),
    lambda: EngineCoreRequest("x", [1], mutated(structured_outputs=schema_with_int_keys())),
    lambda: EngineCoreRequest("\x00x", [1]),
], ids=["float-ids", "bool-ids", "uint64-id", "nan-time", "priority", "nan-temperature",
        "stop-id", "bool-logprobs", "schema-keys", "nul-id"])
def test_client_refuses_before_sending_and_frees_the_id(client, make):
    req = make()
    with pytest.raises((ValueError, TypeError)):
        client.add_request(req)
    assert not client.router.live
    serves(client)


def mutated(**fields) -> SamplingParams:
    sp = SamplingParams(max_tokens=3)
    for k, v in fields.items():
        setattr(sp, k, v)
    return sp


def schema_with_int_keys() -> StructuredOutputsParams:
    so = StructuredOutputsParams(json={"type": "object"})
    so.json = {1: "object"}  # after construction
    return so


# -- items 2 and 3: the engine answers malformed ADDs ---------------------------------------
@pytest.mark.parametrize("payload", [
    ["e1", [1, 2], [2**63]],  # max_tokens past int64
    ["e1", [1, 2.5]],  # a float token id
    ["e1", [1], [3, 0, 1.0, 1.0, 0, 0.0, None, [], False, None, 0.0, 0.0, 1.0, [{1: "x"}]]],
    ["e1", [1], None, 0.0, ["lora", 0]],  # lora_int_id must be >= 1
    ["e1", "not a list"],
    ["e1", [1], None, 0.0, None, None, None, 70000],  # client_index past 16 bits
], ids=["max_tokens", "float", "schema-keys", "lora-id", "prompt-type", "client-index"])
def test_engine_answers_a_malformed_add_with_error_to_its_sender(client, payload):
    send_raw(client, msgspec.msgpack.encode(payload), "e1")
    got = drain(client, {"e1"})["e1"]
    assert got["finish_reason"] is FinishReason.ERROR and got["finishes"] == 1
    assert got["stop_reason"].startswith("malformed request: EngineCoreRequest")
    assert "e1" not in client.router.live
    serves(client)


def test_an_add_naming_another_front_end_is_served_to_its_sender(client):
    """Outputs go back on the connection the request came in on: a client_index
    that names no front-end (or another one) cannot kill or misroute anything."""
    for index in (1, 65535):
        raw = msgspec.msgpack.encode(EngineCoreRequest(
            "ci", [4, 5], SamplingParams(max_tokens=2), client_index=index))
        send_raw(client, raw, "ci")
        assert drain(client, {"ci"})["ci"]["finish_reason"] is FinishReason.LENGTH
    serves(client)


# -- item 4: readers drop bad frames and keep going -----------------------------------------
BAD_FRAMES = [b"", b"\xc1", b"\x93\x00", msgspec.msgpack.encode({"a": 1}),
              msgspec.msgpack.encode(EngineCoreOutputs(outputs=[EngineCoreOutput("z", [1])]))[:-2],
              msgspec.msgpack.encode([0, [["y", [1.5]]]]), b"ENGINE_CORE_DEAD!"]


def push_to(address: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(address)
    return ctx, push


def test_sync_reader_drops_bad_frames(client):
    ctx, push = push_to(client.output_address)
    try:
        for frame in BAD_FRAMES:
            push.send(frame)
        push.send_multipart([b"a", b"b"])
        serves(client)
        assert client.call_utility("echo", 5) == 5
        assert client._reader.is_alive() and not client._dead
    finally:
        ctx.destroy(linger=1000)


def test_asyncio_reader_drops_bad_frames(hot_path):
    async def main():
        c = make_client(True, True, cfg())
        ctx, push = push_to(c.output_address)
        try:
            await c.call_utility_async("echo", 1)  # the reader task runs
            for frame in BAD_FRAMES:
                push.send(frame)
            push.send_multipart([b"a", b"b"])
            await c.add_request_async(make_request("a", [1, 2], max_tokens=2))
            done = False
            while not done:
                outs = await asyncio.wait_for(c.get_output_async(), 10)
                done = any(o.request_id == "a" and o.finished for o in outs.outputs)
            assert await c.call_utility_async("echo", 2) == 2
            assert not c._reader_task.done()
        finally:
            ctx.destroy(linger=1000)
            c.shutdown()

    asyncio.run(main())


# -- hypothesis: fuzzing the wire both ways -------------------------------------------------
VALID_ADD = msgspec.msgpack.encode(EngineCoreRequest(
    "fz", [5, 6, 7], SamplingParams(max_tokens=3, seed=2, stop_token_ids=[9], logprobs=1),
    priority=1))
VALID_OUT = msgspec.msgpack.encode(EngineCoreOutputs(outputs=[
    EngineCoreOutput("nobody", [3], finish_reason=FinishReason.STOP, stop_reason=3)]))


def mutations(valid: bytes):
    """Random bytes, and structure-aware mutations of a valid message: a byte
    flipped or set to a msgpack marker, truncated, spliced, a field replaced by
    random msgpack."""
    pos = st.integers(0, len(valid) - 1)
    marker = st.sampled_from([0xc0, 0xc1, 0xc2, 0xcf, 0xd3, 0xcb, 0xdd, 0xdf, 0x90, 0x80, 0xff])
    return st.one_of(
        st.binary(max_size=64),
        st.tuples(pos, st.integers(0, 255)).map(lambda t: valid[:t[0]] + bytes([t[1]])
                                               + valid[t[0] + 1:]),
        st.tuples(pos, marker).map(lambda t: valid[:t[0]] + bytes([t[1]]) + valid[t[0] + 1:]),
        pos.map(lambda n: valid[:n]),
        st.tuples(pos, st.binary(max_size=16)).map(lambda t: valid[:t[0]] + t[1] + valid[t[0]:]),
        st.tuples(st.integers(0, 9), st.from_type(int) | st.floats() | st.text(max_size=4)
                  | st.booleans() | st.none() | st.lists(st.integers(), max_size=3)).map(
            lambda t: replace_field(valid, *t)),
    )


def replace_field(valid: bytes, index: int, value) -> bytes:
    fields = msgspec.msgpack.decode(valid)
    fields[index % len(fields)] = value
    try:
        return msgspec.msgpack.encode(fields)
    except OverflowError:
        return valid[:-1]


FUZZ = settings(max_examples=80, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


def test_fuzz_front_end_to_engine(client):
    """Whatever arrives, the engine stays up and every ADD whose id it can read
    gets exactly one finish (an ERROR or its real end)."""
    sent: dict[str, int] = {}

    @FUZZ
    @given(payload=mutations(VALID_ADD), kind=st.sampled_from([b"\x00", b"\x00", b"\x01",
                                                               b"\x03", b"\x09"]))
    def fuzz(payload, kind):
        n = len(sent)
        payload = payload.replace(b"fz", f"{n:02d}"[-2:].encode()) if kind == b"\x00" else payload
        rid = readable_request_id(payload) if kind == b"\x00" else None
        if rid is not None and (rid in sent or rid in client.router.live or rid.startswith("\x00")):
            return
        if rid is not None:
            sent[rid] = n
            client.router.register(EngineCoreRequest(rid, [1]))
        client._send([client.identity, kind, payload])

    fuzz()
    got = drain(client, set(sent), timeout=30)
    assert all(got[rid]["finishes"] == 1 for rid in sent), {
        rid: got[rid]["finishes"] for rid in sent if got[rid]["finishes"] != 1}
    assert not client.router.live
    serves(client)


def test_fuzz_engine_to_front_end(client):
    ctx, push = push_to(client.output_address)
    try:
        @FUZZ
        @given(frame=mutations(VALID_OUT))
        def fuzz(frame):
            push.send(frame)

        fuzz()
        time.sleep(0.2)
        serves(client)
        assert client.call_utility("echo", "ok") == "ok" and client._reader.is_alive()
    finally:
        ctx.destroy(linger=1000)
    while not client.outputs_queue.empty():  # what the fuzzer pushed that decoded
        client.outputs_queue.get_nowait()


# -- item 7: exactly one finish per request -------------------------------------------------
def test_duplicate_ids_in_one_abort_give_one_finish(client):
    eng = synthetic_engine(block_size=4)
    eng.add_request(make_request("a", [1, 2], max_tokens=50))
    eng.add_request(make_request("w", [1, 2], max_tokens=50))
    eng.step()
    eng.abort_requests(["a", "a", "w", "a", "nope", "w"])
    eng.abort_requests(["a"])
    finishes = []
    while eng.scheduler.has_requests():
        for outs in eng.step()[0].values():
            finishes += [(o.request_id, o.finish_reason) for o in outs.outputs if o.finished]
    assert sorted(finishes) == [("a", FinishReason.ABORT), ("w", FinishReason.ABORT)]
    client.add_request(make_request("b", [1, 2], max_tokens=10**6))
    client.abort_requests(["b", "b", "b"])
    client.abort_requests(["b"])
    got = drain(client, {"b"})
    time.sleep(0.1)
    assert got["b"]["finishes"] == 1 and client.outputs_queue.empty()


# -- item 8: front-ends sharing an engine ---------------------------------------------------
def test_front_ends_have_their_own_request_ids_and_aborts(hot_path):
    """Two front-ends on one engine use the same request id: each gets its own
    request's outputs, and an abort from one never touches the other's."""
    first = SyncMPClient(cfg(synthetic_step_latency_s=0.01), client_count=2)
    second = first.attach(1)
    try:
        first.add_request(make_request("same", [1, 2], max_tokens=40, seed=1))
        second.add_request(make_request("same", [3, 4], max_tokens=10**6))
        time.sleep(0.05)
        second.abort_requests(["same"])  # aborts only its own
        got2 = drain(second, {"same"})["same"]
        assert got2["finish_reason"] is FinishReason.ABORT and got2["finishes"] == 1
        second.add_request(make_request("same", [3, 4], max_tokens=5, seed=3))
        got1 = drain(first, {"same"})["same"]
        got2 = drain(second, {"same"})["same"]
        ref = synthetic_engine(block_size=4, max_model_len=64)
        ref.add_request(make_request("same", [1, 2], max_tokens=40, seed=1))
        ref.add_request(make_request("s2", [3, 4], max_tokens=5, seed=3))
        expected = run_to_completion(ref)
        assert got1["finish_reason"] is FinishReason.LENGTH and got1["finishes"] == 1
        assert got1["tokens"] == expected["same"]["tokens"]
        assert got2["tokens"] == expected["s2"]["tokens"] and got2["finishes"] == 1
        # A utility call that claims to come from front-end 0 is answered to its sender.
        raw = msgspec.msgpack.encode(UtilityRequest(0, 4242, "echo", ["theirs"]))
        fut = concurrent.futures.Future()
        second.pending_calls.add(4242, PendingCall("echo", fut, replies_due=1, answering_rank=0))
        second._send([second.identity, EngineCoreRequestType.UTILITY.value, raw])
        assert fut.result(timeout=10) == "theirs"
        time.sleep(0.1)
        assert first.outputs_queue.empty() and second.outputs_queue.empty()
    finally:
        second.shutdown()
        first.shutdown()


# -- item 10, the smaller ones ------------------------------------------------------------
def test_a_bad_utility_argument_is_refused_before_any_side_effect(client):
    client.add_request(make_request("runs", [1, 2], max_tokens=10**6))
    time.sleep(0.05)
    before = client.call_utility("make_stats").num_preempted_total
    for method, args in [("sleep", (7,)), ("wake_up", (["everything"],)),
                         ("pause_scheduler", ("later",)), ("reinitialize_distributed", (0, 1)),
                         ("pin_lora", (0,)), ("collective_rpc", ("echo", -1.0))]:
        with pytest.raises(RuntimeError, match=f"{method} failed: TypeError"):
            client.call_utility(method, *args)
    assert client.call_utility("make_stats").num_preempted_total == before
    assert client.call_utility("is_sleeping") is False
    assert client.call_utility("is_scheduler_paused") is False
    got = drain(client, {"runs"})["runs"]  # ran on to max_model_len, never preempted
    assert got["finish_reason"] is FinishReason.LENGTH and len(got["tokens"]) == 62


@pytest.mark.parametrize("mode", ["sync", "asyncio"])
def test_shutdown_wakes_a_blocked_get_output(hot_path, mode):
    if mode == "sync":
        c = SyncMPClient(cfg())
        result: list[BaseException] = []

        def wait():
            try:
                c.get_output(timeout=30)
            except BaseException as e:  # noqa: BLE001
                result.append(e)

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        c.shutdown()
        t.join(5)
        assert not t.is_alive() and isinstance(result[0], EngineDeadError)
        assert time.monotonic() - t0 < 5
        with pytest.raises(EngineDeadError):
            c.get_output(timeout=1)
        return

    async def main():
        c = make_client(True, True, cfg())
        waiter = asyncio.ensure_future(c.get_output_async())
        call = asyncio.ensure_future(c.call_utility_async("echo", 1))
        await call
        await asyncio.sleep(0.1)
        c.shutdown()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(waiter, 5)

    asyncio.run(main())


def test_message_caps_refuse_large_requests_and_split_large_outputs(hot_path):
    """ZMQ_MAXMSGSIZE on every socket: the client refuses a request over the cap
    before sending it; the engine splits a step whose outputs would pass it, and
    an output that alone passes it becomes its request's ERROR."""
    c = SyncMPClient(cfg(zmq_max_message_bytes=4096, max_model_len=4096), LogprobsExecutor)
    try:
        with pytest.raises(ValueError, match="message cap"):
            c.add_request(make_request("huge", list(range(1, 2000)), max_tokens=2))
        assert not c.router.live
        n = 40  # ~40 x 300 bytes of logprobs per step: over 4 KiB, split per output
        for i in range(n):
            c.add_request(EngineCoreRequest(f"q{i}", [i + 1, 2], SamplingParams(
                max_tokens=4, seed=i, logprobs=20)))
        got = drain(c, {f"q{i}" for i in range(n)})
        assert all(v["finishes"] == 1 and v["finish_reason"] is FinishReason.LENGTH
                   and len(v["tokens"]) == 4 for v in got.values())
        with pytest.raises(ValueError, match="message cap"):
            c.call_utility("echo", "x" * 5000)
        assert c.call_utility("echo", "x" * 3000) == "x" * 3000
        serves(c)
    finally:
        c.shutdown()
