"""AsyncLLM on a tiny random model with a byte-level tokenizer, engine in its own
process, on both paths: streams of every output kind, n > 1 with seeds, stop
strings (aborted in the engine), abort and cancellation, validation before
sending, concurrency, metrics, utilities, a front-end attached from another
process, data parallel and a dead engine."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import pytest
from prometheus_client import REGISTRY

from enginecore import AsyncLLM, EngineArgs, EngineDeadError, SamplingParams, _native
from enginecore.outputs import RequestOutput
from enginecore.protocol import LoRARequest, PoolingParams
from enginecore.sampling_params import RequestOutputKind

pytestmark = pytest.mark.slow

CUM, DELTA, FINAL = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA,
                     RequestOutputKind.FINAL_ONLY)
GREEDY = dict(temperature=0, ignore_eos=True)


def engine_args(model: str, **kw) -> EngineArgs:
    return EngineArgs(model=model, max_model_len=256, kv_cache_memory_bytes=16 << 20,
                      max_num_seqs=64, **kw)


def make_engine(aloop, path: str, args: EngineArgs, **kw) -> AsyncLLM:
    """An AsyncLLM made on the background loop, with its engines on ``path``."""
    previous = _native._enabled
    _native.set_native(path == "native")

    async def make():
        return AsyncLLM.from_engine_args(args, **kw)

    try:
        return aloop.run(make(), timeout=120)
    finally:
        _native._enabled = previous


def shutdown(aloop, eng: AsyncLLM) -> None:
    """On the loop's thread: its tasks are cancelled where they run."""
    async def stop():
        eng.shutdown()

    aloop.run(stop())


@pytest.fixture(scope="module", params=["native", "python"])
def engine(request, aloop, tiny_chat_model):
    eng = make_engine(aloop, request.param, engine_args(tiny_chat_model), client_count=2)
    assert eng.output_processor.uses_native_loop == (request.param == "native")
    yield eng
    shutdown(aloop, eng)


async def collect(engine: AsyncLLM, prompt, sp: SamplingParams, rid: str) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, sp, rid)]


async def engine_idle(engine: AsyncLLM, timeout: float = 10.0) -> bool:
    """The engine holds no requests (aborts reached it) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await engine.engine_core.call_utility_async("get_request_counts") == (0, 0):
            return True
        await asyncio.sleep(0.02)
    return False


def test_output_kinds_agree_and_text_is_decode(engine, aloop):
    tok = engine.tokenizer

    async def run():
        res = {}
        for kind in (CUM, DELTA, FINAL):
            res[kind] = await collect(engine, "héllo wörld",
                                      SamplingParams(max_tokens=24, output_kind=kind, **GREEDY),
                                      f"kinds-{kind.name}")
        return res

    res = aloop.run(run())
    final = res[FINAL]
    assert len(final) == 1 and final[0].finished
    ids = final[0].outputs[0].token_ids
    assert len(ids) == 24 and final[0].outputs[0].finish_reason == "length"
    assert final[0].prompt == "héllo wörld" and final[0].prompt_token_ids == tok.encode(
        "héllo wörld")
    text = tok.decode(ids)
    assert final[0].outputs[0].text == text
    assert res[CUM][-1].outputs[0].text == text and res[CUM][-1].outputs[0].token_ids == ids
    assert "".join(o.outputs[0].text for o in res[DELTA]) == text
    assert [t for o in res[DELTA] for t in o.outputs[0].token_ids] == ids
    assert [o.finished for o in res[DELTA]][-1] and not any(o.finished for o in res[DELTA][:-1])
    m = final[0].metrics
    # The engine runs with log_stats: its queue and schedule times come through.
    assert m.arrival_ts <= m.queued_ts <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts
    assert m.num_generation_tokens == 24


def test_n_children_are_seeded_and_reproducible(engine, aloop):
    sp = SamplingParams(n=3, seed=1234, max_tokens=12, ignore_eos=True, output_kind=FINAL)

    async def run():
        a = await collect(engine, "The capital", sp, "n-a")
        b = await collect(engine, "The capital", sp, "n-b")
        streamed = await collect(engine, "The capital",
                                 SamplingParams(n=3, seed=1234, max_tokens=12, ignore_eos=True,
                                                output_kind=DELTA), "n-c")
        return a, b, streamed

    a, b, streamed = aloop.run(run())
    assert len(a) == 1 and [c.index for c in a[0].outputs] == [0, 1, 2]
    first = [c.token_ids for c in a[0].outputs]
    assert first == [c.token_ids for c in b[0].outputs]
    assert len({tuple(t) for t in first}) == 3  # different seeds, different samples
    merged = {}
    for out in streamed:
        assert out.request_id == "n-c"
        for c in out.outputs:
            merged.setdefault(c.index, []).extend(c.token_ids)
    assert [merged[i] for i in range(3)] == first
    assert streamed[-1].finished


def test_stop_string_is_cut_and_aborted_in_the_engine(engine, aloop):
    tok = engine.tokenizer

    async def run():
        (ref,) = await collect(engine, "abc", SamplingParams(max_tokens=40, output_kind=FINAL,
                                                             **GREEDY), "stop-ref")
        text = ref.outputs[0].text
        # A stop string made of the text of two tokens in the middle of the answer.
        ids = ref.outputs[0].token_ids
        stop = tok.decode(ids[10:12])
        outs = await collect(engine, "abc", SamplingParams(max_tokens=40, stop=stop,
                                                           output_kind=DELTA, **GREEDY), "stop")
        return text, stop, outs, await engine_idle(engine)

    text, stop, outs, idle = aloop.run(run())
    streamed = "".join(o.outputs[0].text for o in outs)
    assert streamed == text[: text.index(stop)]
    assert (outs[-1].outputs[0].finish_reason, outs[-1].outputs[0].stop_reason) == ("stop", stop)
    assert idle  # the front-end found the stop string and aborted the request there


def test_abort_and_cancel_end_the_request_in_the_engine(engine, aloop):
    long = SamplingParams(max_tokens=200, output_kind=DELTA, **GREEDY)

    async def run():
        outs = []
        async for out in engine.generate("x", long, "abort-me"):
            outs.append(out)
            if len(outs) == 3:
                await engine.abort("abort-me")
        assert await engine_idle(engine)

        streaming, never = asyncio.Event(), asyncio.Event()

        async def consume():
            async for _ in engine.generate("y", long, "cancel-me"):
                streaming.set()
                await never.wait()  # cancelled here, mid-stream: the request is running

        task = asyncio.get_running_loop().create_task(consume())
        await asyncio.wait_for(streaming.wait(), 60)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        cancelled_idle = await engine_idle(engine)
        # A stream closed early (break) is aborted too.
        gen = engine.generate("z", long, "close-me")
        await gen.__anext__()
        await gen.aclose()
        return outs, cancelled_idle, await engine_idle(engine)

    outs, cancelled_idle, closed_idle = aloop.run(run())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs) < 50
    assert cancelled_idle and closed_idle
    assert not engine.output_processor.has_unfinished_requests()


@pytest.mark.parametrize("prompt, sp, error", [
    ({"prompt_token_ids": [5, 10_000]}, SamplingParams(), "vocabulary"),
    ({"prompt_token_ids": []}, SamplingParams(), "empty"),
    ({"prompt_token_ids": [1, "2"]}, SamplingParams(), "ints"),
    (123, SamplingParams(), "a prompt is a str"),
    ({"text": "hi"}, SamplingParams(), "unknown prompt fields"),
    ("hi", SamplingParams(max_tokens=300), "maximum context length"),
    ({"prompt_token_ids": [5] * 256}, SamplingParams(max_tokens=None), "leaves no room"),
    ("hi", SamplingParams(stop_token_ids=[999]), "stop_token_ids"),
    ("hi", PoolingParams(), "does not support the 'embed' task"),
])
def test_invalid_requests_fail_before_sending(engine, aloop, prompt, sp, error):
    async def run():
        if isinstance(sp, PoolingParams):
            return await anext(engine.encode(prompt, sp, "bad"))
        return await collect(engine, prompt, sp, "bad")

    with pytest.raises((ValueError, TypeError), match=error):
        aloop.run(run())
    assert not engine.output_processor.has_unfinished_requests()
    assert aloop.run(engine.engine_core.call_utility_async("get_request_counts")) == (0, 0)


def test_other_validation(engine, aloop):
    async def first(*args, **kw):
        return await anext(engine.generate(*args, **kw))

    with pytest.raises(ValueError, match="LoRA is not enabled"):
        aloop.run(first("hi", SamplingParams(), "l", lora_request=LoRARequest("a", 1, "/x")))
    with pytest.raises(ValueError, match="priority"):
        aloop.run(first("hi", SamplingParams(), "p", priority=3))
    with pytest.raises(ValueError, match="data_parallel_rank"):
        aloop.run(first("hi", SamplingParams(), "d", data_parallel_rank=1))
    with pytest.raises(ValueError, match="SamplingParams.n"):
        SamplingParams(n=1000)

    async def duplicate():
        gen = engine.generate("x", SamplingParams(max_tokens=100, **GREEDY), "dup")
        await anext(gen)
        try:
            await anext(engine.generate("x", SamplingParams(), "dup"))
        finally:
            await gen.aclose()

    with pytest.raises(ValueError, match="already running"):
        aloop.run(duplicate())


def test_many_concurrent_streams(engine, aloop):
    tok = engine.tokenizer

    async def run():
        sp = SamplingParams(max_tokens=16, output_kind=DELTA, **GREEDY)
        results = await asyncio.gather(*(collect(engine, f"prompt {i} é", sp, f"c{i}")
                                         for i in range(48)))
        return results

    for outs in aloop.run(run()):
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        assert len(ids) == 16 and "".join(o.outputs[0].text for o in outs) == tok.decode(ids)


def _sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_metrics_reach_the_registry(engine, aloop):
    model = engine.model_config.model
    before = {n: _sample(n, model_name=model) for n in (
        "enginecore:time_to_first_token_seconds_count",
        "enginecore:request_queue_time_seconds_count",
        "enginecore:e2e_request_latency_seconds_count", "enginecore:generation_tokens_total",
        "enginecore:inter_token_latency_seconds_count")}
    aloop.run(collect(engine, "metrics", SamplingParams(max_tokens=8, **GREEDY), "m1"))
    after = {n: _sample(n, model_name=model) for n in before}
    assert after["enginecore:time_to_first_token_seconds_count"] == before[
        "enginecore:time_to_first_token_seconds_count"] + 1
    assert after["enginecore:request_queue_time_seconds_count"] > before[
        "enginecore:request_queue_time_seconds_count"]
    assert after["enginecore:e2e_request_latency_seconds_count"] > before[
        "enginecore:e2e_request_latency_seconds_count"]
    assert after["enginecore:generation_tokens_total"] >= before[
        "enginecore:generation_tokens_total"] + 8
    assert after["enginecore:inter_token_latency_seconds_count"] >= before[
        "enginecore:inter_token_latency_seconds_count"] + 7
    assert REGISTRY.get_sample_value("enginecore:kv_cache_usage_perc",
                                     {"model_name": model, "engine": "0"}) is not None
    assert _sample("enginecore:request_success_total", model_name=model,
                   finished_reason="length") >= 1


def test_health_and_utilities(engine, aloop):
    async def run():
        await engine.check_health(timeout_s=10)
        assert await engine.reset_prefix_cache() is True
        assert await engine.is_sleeping() is False
        await engine.sleep(1)
        assert await engine.is_sleeping() is True
        await engine.wake_up()
        assert await engine.is_sleeping() is False
        outs = await collect(engine, "after sleep", SamplingParams(max_tokens=4, **GREEDY), "s")
        return outs[-1].outputs[0].finish_reason

    assert aloop.run(run()) == "length"
    assert engine.is_running and not engine.errored


def _remote_front_end(handoff, prompt: str, results) -> None:
    """Front-end 1 in another process: attach, generate greedily, report the text."""
    async def run():
        eng = AsyncLLM.from_handoff(handoff)
        try:
            out = None
            # Only the last output is wanted (hence B007's noqa).
            async for out in eng.generate(prompt, SamplingParams(max_tokens=12, **GREEDY), "r"):  # noqa: B007
                pass
            return out.outputs[0].token_ids, out.outputs[0].text
        finally:
            eng.shutdown()

    try:
        results.put(asyncio.run(asyncio.wait_for(run(), 60)))
    except BaseException as e:  # noqa: BLE001 - the test reads what happened
        results.put(repr(e))


def test_front_end_attached_from_another_process(engine, aloop):
    prompt = "another process"
    (own,) = aloop.run(collect(engine, prompt, SamplingParams(max_tokens=12, output_kind=FINAL,
                                                              **GREEDY), "own"))
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_remote_front_end, args=(engine.handoff(1), prompt, results))
    proc.start()
    try:
        got = results.get(timeout=90)
    finally:
        proc.join(timeout=30)
    assert got == (own.outputs[0].token_ids, own.outputs[0].text)
    assert proc.exitcode == 0
    # Front-end 0 still works after front-end 1 left.
    assert aloop.run(collect(engine, prompt, SamplingParams(max_tokens=12, output_kind=FINAL,
                                                           **GREEDY), "own2"))[0].outputs[
        0].token_ids == own.outputs[0].token_ids


def test_data_parallel_then_a_dead_rank(aloop, tiny_chat_model, hot_path):
    eng = make_engine(aloop, hot_path, engine_args(tiny_chat_model, data_parallel_size=2))
    try:
        async def run():
            sp = SamplingParams(max_tokens=10, output_kind=FINAL, **GREEDY)
            outs = await asyncio.gather(*(collect(eng, "same prompt", sp, f"dp{i}")
                                          for i in range(8)))
            return [o[-1].outputs[0].token_ids for o in outs]

        results = aloop.run(run())
        assert all(r == results[0] for r in results) and len(results[0]) == 10
        # Both ranks ran steps (an independent rank steps only when it has requests).
        steps = [aloop.run(eng.engine_core.call_utility_on_async(i, "make_stats")).step_counter
                 for i in range(2)]
        assert min(steps) > 0, steps

        async def dies():
            gen = eng.generate("x", SamplingParams(max_tokens=200, **GREEDY), "doomed")
            await anext(gen)
            os.kill(eng.engine_core.procs[1].pid, signal.SIGKILL)
            async for _ in gen:
                pass

        with pytest.raises(EngineDeadError):
            aloop.run(dies(), timeout=30)
        assert eng.errored and not eng.is_running
        with pytest.raises(EngineDeadError):
            aloop.run(eng.check_health())
    finally:
        shutdown(aloop, eng)


def test_a_failed_engine_start_raises_its_own_error(monkeypatch):
    """A start that fails (an engine exiting before HELLO) shuts the client down
    half-built; the caller gets that failure, not an error of the shutdown."""
    from enginecore.client.engine_launcher import EngineLauncher
    from enginecore.client.mp_client import AsyncMPClient

    def engine_exits(self, *args, **kwargs):
        raise RuntimeError("engine 0 exited with code 1 before sending HELLO")

    monkeypatch.setattr(EngineLauncher, "_start_processes", engine_exits)
    cfg = EngineArgs(model="synthetic").create_engine_config()
    with pytest.raises(RuntimeError, match="before sending HELLO"):
        AsyncMPClient(cfg, None, False)
