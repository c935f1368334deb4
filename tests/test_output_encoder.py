"""Native output encoding (csrc/output_encoder.cpp) against msgspec: columns ->
the same bytes as the EngineCoreOutputs the Python path builds; and the process
engine sending the same outputs on both paths."""

from __future__ import annotations

import os
import threading
import time

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enginecore import EngineArgs, EngineCoreRequest, SamplingParams, _native
from enginecore.client import SyncMPClient
from enginecore.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    Logprobs,
    PrefixCacheStats,
    SchedulerStats,
)
from enginecore.sched.columnar_outputs import ColumnarOutputs
from enginecore.serial import OutputEncoder

INT64 = st.integers(-(2**63), 2**63 - 1)
TOKENS = st.lists(st.one_of(st.integers(0, 2**32 - 1), INT64), max_size=40)
IDS = st.text(max_size=300)

special_outputs = st.builds(
    EngineCoreOutput,
    request_id=IDS,
    new_token_ids=TOKENS,
    new_logprobs=st.none() | st.builds(
        Logprobs, st.lists(st.lists(st.integers(0, 10**6), max_size=3), max_size=2),
        st.lists(st.lists(st.floats(allow_nan=False), max_size=3), max_size=2),
        st.lists(st.integers(0, 100), max_size=2)),
    finish_reason=st.none() | st.sampled_from(list(FinishReason)),
    stop_reason=st.none() | st.integers(-5, 10**6) | IDS,
    num_cached_tokens=st.integers(0, 10**6),
    pooling_output=st.none() | st.lists(st.floats(allow_nan=False), max_size=4),
    kv_transfer_params=st.none() | st.fixed_dictionaries(
        {"do_remote_prefill": st.booleans(), "remote_block_ids": st.lists(st.integers(0, 99)),
         "remote_host": st.text(max_size=20), "remote_port": st.integers(0, 65535)}),
)

rows = st.lists(st.one_of(st.tuples(IDS, TOKENS), special_outputs), max_size=70)
stats = st.none() | st.builds(SchedulerStats, num_running_reqs=st.integers(0, 999),
                              kv_cache_usage=st.floats(0, 1),
                              prefix_cache_stats=st.builds(PrefixCacheStats),
                              kv_connector_stats=st.none() | st.dictionaries(
                                  st.text(max_size=10), st.integers(0, 10**6), max_size=3),
                              num_external_computed_tokens=st.integers(0, 10**9))


@settings(max_examples=300, deadline=None)
@given(rows=rows, stats=stats, engine_index=st.integers(0, 0xFFFF),  # 2-byte identities
       timestamp=st.floats(allow_nan=False).filter(bool))  # 0.0 means "now" to the struct
def test_native_columnar_bytes_equal_msgspec(rows, stats, engine_index, timestamp):
    if _native._ext is None:
        pytest.fail("the native extension is not built")
    col = ColumnarOutputs()
    col.engine_index = engine_index
    col.timestamp = timestamp
    col.scheduler_stats = stats
    for row in rows:
        if isinstance(row, EngineCoreOutput):
            col.append_output(row)
        else:
            col.request_ids.append(row[0])
            col.new_token_ids.append(row[1])
    expected = msgspec.msgpack.encode(col.to_struct())
    buf = bytearray(b"stale bytes from an earlier step")
    enc = msgspec.msgpack.Encoder().encode
    _native._ext.encode_columnar(engine_index, col.request_ids, col.new_token_ids,
                                 [enc(o) for o in col.specials],
                                 None if stats is None else enc(stats), timestamp, buf)
    assert bytes(buf) == expected
    decoded = msgspec.msgpack.decode(buf, type=EngineCoreOutputs)
    assert decoded.outputs == col.outputs


def test_encoder_picks_the_path_and_reuses_buffers(hot_path):
    col = ColumnarOutputs()
    col.request_ids.append("a")
    col.new_token_ids.append([1, 2])
    col.append_output(EngineCoreOutput("b", [3], finish_reason=FinishReason.STOP))
    encoder = OutputEncoder()
    buf = encoder.encode(col)
    assert bytes(buf) == msgspec.msgpack.encode(col.to_struct())
    encoder.release(buf)
    assert encoder.encode(col) is buf and encoder.num_allocated == 1


def test_native_encoder_rejects_bad_columns():
    if _native._ext is None:
        pytest.fail("the native extension is not built")
    ext = _native._ext
    with pytest.raises(TypeError, match="token id"):
        ext.encode_columnar(0, ["a"], [["x"]], [], None, 0.0, bytearray())
    with pytest.raises(ValueError, match="differ in length"):
        ext.encode_columnar(0, ["a"], [], [], None, 0.0, bytearray())
    with pytest.raises(ValueError, match="too few special"):
        ext.encode_columnar(0, [None], [None], [], None, 0.0, bytearray())
    with pytest.raises(ValueError, match="64 bits"):
        ext.encode_columnar(0, ["a"], [[2**64]], [], None, 0.0, bytearray())


def columns_with_a_special() -> ColumnarOutputs:
    col = ColumnarOutputs()
    for i in range(300):
        col.request_ids.append(f"cmpl-{i}")
        col.new_token_ids.append([1000 + i])
    col.append_output(EngineCoreOutput("done", [3], finish_reason=FinishReason.LENGTH))
    col.scheduler_stats = SchedulerStats(num_running_reqs=300)
    return col


def test_native_send_uses_pyzmq_libzmq_and_sends_msgspec_bytes():
    """_C.send_columnar: pyzmq's own libzmq (no second copy mapped), and the
    bytes on the wire equal msgspec's encoding of the same outputs."""
    import zmq

    if _native._ext is None:
        pytest.fail("the native extension is not built")
    path = _native._ext.libzmq_path()
    assert path is not None and "libzmq" in path
    with open("/proc/self/maps") as maps:
        mapped = {line.split()[-1] for line in maps if "libzmq" in line}
    assert len(mapped) == 1 and os.path.realpath(path) in {os.path.realpath(m) for m in mapped}
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        pull.bind("inproc://native-send")
        push.connect("inproc://native-send")
        col = columns_with_a_special()
        for _ in range(3):  # the buffer is reused across sends
            _native._ext.send_columnar(push.underlying, *OutputEncoder().columnar_args(col))
            assert pull.recv() == msgspec.msgpack.encode(col.to_struct())
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def test_native_send_releases_the_gil_while_it_blocks():
    """A PUSH socket with no peer blocks the send: another thread must run
    Python meanwhile, and the message arrives once a peer connects."""
    import zmq

    if _native._ext is None:
        pytest.fail("the native extension is not built")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.bind("inproc://blocked-send")
    col = columns_with_a_special()
    args = OutputEncoder().columnar_args(col)
    sent = threading.Event()

    def send():
        _native._ext.send_columnar(push.underlying, *args)
        sent.set()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        spins, deadline = 0, time.monotonic() + 0.3
        while time.monotonic() < deadline:
            spins += 1  # Python bytecode: needs the GIL the sender must not hold
        assert not sent.is_set() and spins > 1000
        pull = ctx.socket(zmq.PULL)
        pull.connect("inproc://blocked-send")
        assert pull.poll(5000) and pull.recv() == msgspec.msgpack.encode(col.to_struct())
        assert sent.wait(5)
        pull.close(linger=0)
    finally:
        push.close(linger=0)
        ctx.term()


def run_through_process(use_native: bool) -> list[list[tuple]]:
    """Every output message of a deterministic run (all requests queued while
    paused, then resumed), without timestamps."""
    config = EngineArgs(model="synthetic", block_size=4, max_num_seqs=16,
                        synthetic_vocab_size=50, synthetic_eos_token_id=7,
                        use_native=use_native).create_engine_config()
    client = SyncMPClient(config, log_stats=True)
    messages = []
    try:
        client.call_utility("pause_scheduler", "keep")
        for i in range(40):
            client.add_request(EngineCoreRequest(f"r{i}", [i % 9 + 1, 2, 3, i % 4 + 1],
                                                 SamplingParams(max_tokens=3 + i % 11, seed=i,
                                                                stop_token_ids=[11])))
        client.abort_requests(["r5"])
        client.call_utility("echo")  # the abort's output leaves before the resume
        client.call_utility("resume_scheduler")
        finished = 0
        while finished < 40:
            outs = client.get_output(timeout=30)
            messages.append([(o.request_id, o.new_token_ids, o.finish_reason, o.stop_reason,
                              o.num_cached_tokens) for o in outs.outputs]
                            + [outs.scheduler_stats is not None])
            finished += sum(o.finish_reason is not None for o in outs.outputs)
    finally:
        client.shutdown()
    return messages


def test_process_engine_sends_the_same_outputs_on_both_paths():
    if _native._ext is None:
        pytest.fail("the native extension is not built")
    native = run_through_process(True)
    python = run_through_process(False)
    assert native == python
    assert any(len(m) > 10 for m in native)  # batches of plain decodes went columnar
