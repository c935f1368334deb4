"""Output building + encoding of one step's outputs (batch 1, 64, 256 decodes of
one token each), each path as update_from_output and the output thread run it:

* python: one EngineCoreOutput per request (Scheduler._emit), EngineCoreOutputs
  per client, msgspec into a reused buffer;
* native: two column appends per request (ColumnarOutputs), msgpack written by
  csrc/output_encoder.cpp into a reused buffer. Same bytes (tests/test_output_encoder.py).

The native build above is a Python loop standing in for the two C++ appends
of ``update_decodes``, so it overstates the native cost. ``update_and_encode``
measures what the process engine really runs after the model returns: all of
``update_from_output`` (append, hash extension, stop checks, and the outputs:
objects on the Python path, columns on the native one) plus the encoding.

Run: pytest bench/bench_outputs.py --benchmark-group-by=group
"""

from __future__ import annotations

import pytest

from bench_engine_core import decoding_engine
from enginecore import _native
from enginecore.protocol import EngineCoreOutput, EngineCoreOutputs
from enginecore.sched.columnar_outputs import ColumnarOutputs
from enginecore.sched.scheduler import Scheduler
from enginecore.serial import OutputEncoder


class _Req:
    __slots__ = ("request_id", "client_index")

    def __init__(self, i: int) -> None:
        self.request_id = f"cmpl-{i:08d}-0"
        self.client_index = 0


def build_python(reqs, sampled):
    outputs: dict[int, list[EngineCoreOutput]] = {}
    emit = Scheduler._emit
    for request, new_token_ids in zip(reqs, sampled):
        emit(outputs, request, EngineCoreOutput(request.request_id, new_token_ids, None))
    return {client: EngineCoreOutputs(outputs=outs) for client, outs in outputs.items()}


def build_columnar(reqs, sampled):
    cols: dict[int, ColumnarOutputs] = {}
    last_client = -1
    col_ids: list = []
    col_toks: list = []
    for request, new_token_ids in zip(reqs, sampled):
        client = request.client_index
        if client != last_client:
            col = cols.get(client)
            if col is None:
                col = cols[client] = ColumnarOutputs()
            col_ids, col_toks, last_client = col.request_ids, col.new_token_ids, client
        col_ids.append(request.request_id)
        col_toks.append(new_token_ids)
    return cols


@pytest.mark.parametrize("batch", [1, 64, 256])
def test_encode_outputs(benchmark, path, batch):
    benchmark.group = f"encode_outputs[{batch} outputs]"
    reqs = [_Req(i) for i in range(batch)]
    sampled = [[1000 + i] for i in range(batch)]
    build = build_columnar if path == "native" else build_python
    encoder = OutputEncoder()

    def step() -> int:
        n = 0
        for outs in build(reqs, sampled).values():
            buf = encoder.encode(outs)
            n += len(buf)
            encoder.release(buf)
        return n

    # Both paths write the same bytes (up to the timestamp).
    assert _native.native_available() == (path == "native")
    size = benchmark(step)
    assert size > 20 * batch


@pytest.mark.parametrize("batch", [64, 256])
def test_update_and_encode(benchmark, path, batch):
    benchmark.group = f"update_and_encode[{batch} decodes]"
    eng = decoding_engine(batch)
    scheduler = eng.scheduler
    encoder = OutputEncoder()

    def next_step():  # schedule + model, not timed
        so = scheduler.schedule()
        return (so, eng._execute(so)), {}

    def update_and_encode(so, mo) -> int:
        n = 0
        for outs in scheduler.update_from_output(so, mo).values():
            buf = encoder.encode(outs)
            n += len(buf)
            encoder.release(buf)
        return n

    size = benchmark.pedantic(update_and_encode, setup=next_step, rounds=3000,
                              warmup_rounds=100)
    assert size > 10 * batch  # every request has its output in the bytes
