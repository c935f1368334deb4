"""Data parallel in lockstep waves (MoE-style): DPEngineCoreProc, the coordinator,
the every-32-steps all-reduce, agreed pause/barrier calls, prefill throttling."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec
import pytest

from enginecore import EngineArgs, EngineCoreRequest, EngineDeadError, FinishReason, SamplingParams
from enginecore.client import make_client
from enginecore.core.dp_coordinator import DPCoordinator
from enginecore.protocol import (
    EngineCoreOutputs,
    EngineCoreRequestType,
    SchedulerStats,
    StartDPWave,
    WaveStartRequest,
)
from test_data_parallel import N, drain_by_rank, reference, reqs


def lockstep_config(**kw):
    kw.setdefault("data_parallel_lockstep", True)
    return EngineArgs(model="synthetic", block_size=4, data_parallel_size=2,
                      **kw).create_engine_config()


def wait_for(predicate, timeout=60.0, every=0.05):
    """Poll until true; the bound is generous (a busy 2-core machine is slow, not wrong)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    return predicate()


def dp_states(c):
    return [c.call_utility_on(e, "get_dp_state", timeout=10) for e in range(c.num_engines)]


def test_lockstep_is_the_default_for_moe_only():
    assert not EngineArgs(model="synthetic", data_parallel_size=2).create_engine_config(
    ).parallel_config.data_parallel_lockstep
    assert EngineArgs(model="synthetic", data_parallel_size=2, synthetic_moe=True
                      ).create_engine_config().parallel_config.data_parallel_lockstep
    with pytest.raises(ValueError, match="internal load balancer"):
        EngineArgs(model="synthetic", data_parallel_size=2, data_parallel_lockstep=True,
                   data_parallel_external_lb=True).create_engine_config()


def test_lockstep_dp2_same_tokens_fair_share_and_the_wave_ends(hot_path):
    c = make_client(True, False, lockstep_config(
        synthetic_step_latency_s=0.001, synthetic_moe=True, data_parallel_lockstep=None))
    try:
        for r in reqs():
            c.add_request(r)
        got, served = drain_by_rank(c)
        finished_at = time.monotonic()
        assert got == reference()
        assert min(served) >= 0.4 * N, served
        # The wave ends (the coordinator hears it) within 5 s of the last finish ...
        assert wait_for(lambda: not c.router.link.engines_running, timeout=5)
        assert time.monotonic() - finished_at < 5
        # ... and both ranks stopped stepping, in the same wave, with nothing in flight.
        first = dp_states(c)
        time.sleep(0.3)
        second = dp_states(c)
        assert first == second
        assert {s["current_wave"] for s in second} == {c.router.link.current_wave}
        assert not any(s["engines_running"] for s in second)
        assert c.router.load == [0, 0] and not c.router.live
        assert c.call_utility("get_request_counts") == (0, 0)
    finally:
        c.shutdown()
    assert not any(p.is_alive() for p in c.procs)
    assert not c.coordinator.is_alive()


def test_one_request_on_one_rank_wakes_the_other():
    c = make_client(True, False, lockstep_config())
    try:
        before = dp_states(c)
        assert [s["num_dummy_batches"] for s in before] == [0, 0]
        c.add_request(EngineCoreRequest("solo", [1, 2, 3], SamplingParams(max_tokens=4),
                                        data_parallel_rank=0))
        done = False
        while not done:
            for o in c.get_output(timeout=10).outputs:
                done = o.finish_reason is not None
        assert wait_for(lambda: not c.router.link.engines_running)
        after = dp_states(c)
        # Rank 1 had nothing: it ran dummy batches until the all-reduce agreed;
        # rank 0 ran its 4 steps and dummies for the rest of the 32-step window.
        # (Rarely the wake-up outruns the request and an empty wave runs first:
        # then both ranks ran 32 more dummies, still in step.)
        dummies = [s["num_dummy_batches"] for s in after]
        assert dummies[1] % 32 == 0 and dummies[0] + 4 == dummies[1], dummies
        waves = dummies[1] // 32
        assert after[0]["current_wave"] == after[1]["current_wave"] == waves
        assert c.router.link.current_wave == waves
    finally:
        c.shutdown()


def send_start_wave(c, engine: int, wave: int, exclude: int = -1) -> None:
    c._send([c.identities[engine], EngineCoreRequestType.START_DP_WAVE.value,
             msgspec.msgpack.encode(StartDPWave(wave, exclude))])


def test_stale_start_wave_is_ignored_and_a_later_one_is_adopted_by_all():
    c = make_client(True, False, lockstep_config())
    try:
        c.add_request(EngineCoreRequest("w", [1, 2], SamplingParams(max_tokens=2)))
        while not any(o.finish_reason is not None for o in c.get_output(timeout=10).outputs):
            pass
        assert wait_for(lambda: not c.router.link.engines_running)
        assert [s["current_wave"] for s in dp_states(c)] == [1, 1]
        for e in range(2):  # stale, and the sender's own index: nothing happens
            send_start_wave(c, e, 0)
            send_start_wave(c, e, 1, exclude=e)
        time.sleep(0.3)
        states = dp_states(c)
        assert [s["current_wave"] for s in states] == [1, 1]
        assert not any(s["engines_running"] for s in states)
        # A future wave, to every rank (as the coordinator broadcasts): all run it.
        for e in range(2):
            send_start_wave(c, e, 7)
        assert wait_for(lambda: [s["current_wave"] for s in dp_states(c)] == [8, 8])
        assert wait_for(lambda: c.router.link.current_wave == 8)  # rank 0 told the coordinator
        # Requests still run; the front-end stamps the new wave.
        c.add_request(EngineCoreRequest("w2", [3, 4], SamplingParams(max_tokens=2)))
        while not any(o.finish_reason is not None for o in c.get_output(timeout=10).outputs):
            pass
    finally:
        c.shutdown()


def test_coordinator_wave_rules():
    coord = DPCoordinator(2, lockstep=True)
    # A front-end sends to idle engines: every rank is woken (none excluded).
    assert coord.on_front_end(WaveStartRequest(0, 1)) == (0, -1)
    assert coord.on_front_end(WaveStartRequest(0, 0)) is None  # already running
    # Counts stamped (wave, step) replace the rank's previous ones.
    coord.on_engine_output(EngineCoreOutputs(engine_index=1, scheduler_stats=SchedulerStats(
        num_running_reqs=3, num_waiting_reqs=2, step_counter=5, current_wave=0)))
    assert coord.status().counts == [[0, 0], [2, 3]]
    assert coord.on_engine_output(EngineCoreOutputs(engine_index=0, wave_complete=0)) is None
    assert (coord.current_wave, coord.engines_running) == (1, False)
    # A front-end's wake-up for a wave that already ran is stale: no new wave.
    assert coord.on_front_end(WaveStartRequest(0, 1)) is None
    # A stale wave_complete changes nothing; a rank asking for the current wave
    # starts it, excluding itself; a stale ask does not.
    coord.on_engine_output(EngineCoreOutputs(engine_index=0, wave_complete=0))
    assert coord.current_wave == 1
    assert coord.on_engine_output(EngineCoreOutputs(engine_index=1, start_wave=0)) is None
    assert coord.on_engine_output(EngineCoreOutputs(engine_index=1, start_wave=1)) == (1, 1)
    assert coord.on_engine_output(EngineCoreOutputs(engine_index=0, start_wave=1)) is None
    # A later wave from a rank moves the coordinator on.
    assert coord.on_engine_output(EngineCoreOutputs(engine_index=0, start_wave=4)) == (4, 0)
    # Independent ranks (dense): no waves at all.
    dense = DPCoordinator(2, lockstep=False)
    assert dense.on_front_end(WaveStartRequest(0, 0)) is None


def test_a_rank_registering_during_a_wave_is_sent_it():
    # The wave's broadcast went out before this rank registered: it gets the wave
    # alone, or the other ranks would wait for it at the all-reduce for ever.
    coord = DPCoordinator(2, lockstep=True)
    assert coord.on_register(b"\x00\x00") is None  # idle: nothing to join
    assert coord.on_front_end(WaveStartRequest(0, 0)) == (0, -1)
    assert coord.on_register(b"\x01\x00") == (0, -1)
    assert coord.registered == {b"\x00\x00", b"\x01\x00"}
    assert DPCoordinator(2, lockstep=False).on_register(b"\x00\x00") is None


def test_pause_abort_staggered_pauses_and_requests_while_paused():
    async def main():
        cfg = lockstep_config(synthetic_step_latency_s=0.002)
        a = make_client(True, True, cfg, client_count=2)
        b = a.attach(1)
        try:
            for i in range(10):
                await a.add_request_async(EngineCoreRequest(
                    f"p{i}", [1, 2, i], SamplingParams(max_tokens=10**4, ignore_eos=True)))
            await asyncio.sleep(0.2)
            # Two front-ends pause at once: both calls return, nothing deadlocks.
            await asyncio.wait_for(asyncio.gather(
                a.call_utility_async("pause_scheduler", "abort"),
                b.call_utility_async("pause_scheduler", "abort")), 20)
            reasons, ranks = {}, set()
            while len(reasons) < 10:
                outs = await asyncio.wait_for(a.get_output_async(), 10)
                for o in outs.outputs:
                    if o.finish_reason is not None:
                        reasons[o.request_id] = o.finish_reason
                        ranks.add(outs.engine_index)
            assert set(reasons.values()) == {FinishReason.ABORT} and ranks == {0, 1}
            assert await a.call_utility_async("is_scheduler_paused") is True
            # Sent while paused: waits ...
            await a.add_request_async(EngineCoreRequest("late", [5, 6], SamplingParams(
                max_tokens=3)))
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(a.get_output_async(), 0.5)
            # ... a pause in flight on one rank (the other has not got it) refuses resume,
            task = asyncio.ensure_future(a.call_utility_on_async(0, "pause_scheduler", "keep"))
            await asyncio.sleep(0.2)
            assert not task.done()
            with pytest.raises(RuntimeError, match="pause is still in flight"):
                await a.call_utility_on_async(0, "resume_scheduler")
            await a.call_utility_on_async(1, "pause_scheduler", "keep")
            await asyncio.wait_for(task, 10)
            # ... and runs after resume.
            await a.call_utility_async("resume_scheduler")
            tokens = []
            while True:
                outs = await asyncio.wait_for(a.get_output_async(), 10)
                done = False
                for o in outs.outputs:
                    assert o.request_id == "late"
                    tokens += o.new_token_ids
                    done = o.finish_reason is not None
                if done:
                    break
            assert len(tokens) == 3
            assert await a.call_utility_async("barrier") is True
        finally:
            b.shutdown()
            a.shutdown()

    asyncio.run(main())


def test_staggered_barriers_pair_up():
    c = make_client(True, False, lockstep_config())
    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(4) as pool:
            # Rank 0 gets two barriers before rank 1 gets any: the first pair returns
            # when rank 1 has one, the second when it has two.
            f1 = pool.submit(c.call_utility_on, 0, "barrier", timeout=20)
            f2 = pool.submit(c.call_utility_on, 0, "barrier", timeout=20)
            time.sleep(0.3)
            assert not f1.done() and not f2.done()
            assert c.call_utility_on(1, "barrier", timeout=20) is True
            assert wait_for(lambda: f1.done() or f2.done())
            assert not (f1.done() and f2.done())
            assert c.call_utility_on(1, "barrier", timeout=20) is True
            assert f1.result(10) is True and f2.result(10) is True
        assert wait_for(lambda: not any(s["engines_running"] for s in dp_states(c)))
    finally:
        c.shutdown()


@pytest.mark.parametrize("interval", [1, 4])
def test_prefill_throttling_admits_on_cadence_steps(interval):
    # Two running slots per rank: queued requests are admitted as others finish
    # (after 3-7 tokens), i.e. on all sorts of steps unless throttled.
    c = make_client(True, False, lockstep_config(
        prefill_schedule_interval=interval, max_num_seqs=2, synthetic_step_latency_s=0.001))
    try:
        for i in range(40):
            c.add_request(EngineCoreRequest(f"t{i}", [i + 1, 2], SamplingParams(
                max_tokens=3 + i % 5, ignore_eos=True), data_parallel_rank=i % 2))
        got, _ = drain_by_rank(c, 40)
        assert len(got) == 40
        steps = [s for st in dp_states(c) for s in st["admission_steps"]]
        assert steps and all(s % interval == 0 for s in steps), steps
        if interval == 1:
            assert any(s % 4 for s in steps), steps  # control: admissions off the 4-cadence
    finally:
        c.shutdown()


def test_killing_a_lockstep_rank_is_engine_dead_fast_and_nothing_hangs():
    c = make_client(True, False, lockstep_config(synthetic_step_latency_s=0.005))
    try:
        for i in range(4):
            c.add_request(EngineCoreRequest(f"k{i}", [1, i], SamplingParams(
                max_tokens=10**4, ignore_eos=True)))
        c.get_output(timeout=10)
        os.kill(c.procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            while True:
                c.get_output(timeout=5)
        assert time.monotonic() - t0 < 5
        # Rank 0 does not sit in the all-reduce: the dead peer fails it at once.
        assert wait_for(lambda: not c.procs[0].is_alive(), timeout=10)
    finally:
        c.shutdown()
    assert not any(p.is_alive() for p in c.procs)


@pytest.mark.parametrize("lockstep", [False, True])
def test_scale_2_to_3_to_2_while_serving_loses_nothing(lockstep):
    c = make_client(True, False, lockstep_config(
        data_parallel_lockstep=lockstep, synthetic_step_latency_s=0.002))
    expected = {f"e{i}": 30 + i % 7 for i in range(90)}
    got: dict[str, list[int]] = {}
    finished: dict[str, FinishReason] = {}
    ranks: set[int] = set()

    submitted = [0]

    def submit(lo, hi):
        submitted[0] = hi
        for i in range(lo, hi):
            c.add_request(EngineCoreRequest(f"e{i}", [i + 1, 5], SamplingParams(
                max_tokens=expected[f"e{i}"], ignore_eos=True, seed=i)))

    def drain(until_done=False, seconds=0.0):
        deadline = time.monotonic() + seconds
        # Count finishes as this thread sees them (the client's own bookkeeping
        # runs ahead, on its reader thread).
        while len(finished) < submitted[0] and (until_done or time.monotonic() < deadline):
            outs = c.get_output(timeout=30)
            ranks.add(outs.engine_index)
            for o in outs.outputs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finished[o.request_id] = o.finish_reason

    try:
        submit(0, 30)
        drain(seconds=0.05)
        c.scale_elastic_ep(3)  # requests are running on both ranks meanwhile
        assert c.num_engines == 3 and len(c.procs) == 3
        assert c.call_utility_on(2, "get_dp_state")["data_parallel_size"] == 3
        submit(30, 60)
        drain(seconds=0.05)
        assert 2 in ranks  # the new rank serves
        c.scale_elastic_ep(2)
        assert c.num_engines == 2 and len(c.procs) == 2
        submit(60, 90)
        drain(until_done=True)
        assert set(finished.values()) == {FinishReason.LENGTH}
        assert {k: len(v) for k, v in got.items()} == expected
        assert [s["data_parallel_size"] for s in dp_states(c)] == [2, 2]
        assert c.router.load == [0, 0] and not c.router.live
    finally:
        c.shutdown()
    assert not any(p.is_alive() for p in c.procs)


def test_async_scale_2_to_3_to_2_while_serving():
    async def main():
        c = make_client(True, True, lockstep_config(
            synthetic_step_latency_s=0.002))
        expected = {f"a{i}": 20 + i % 5 for i in range(60)}
        got: dict[str, int] = {}
        ranks: set[int] = set()

        async def collect():
            while len([k for k, v in got.items() if v == expected[k]]) < len(expected):
                outs = await asyncio.wait_for(c.get_output_async(), 30)
                ranks.add(outs.engine_index)
                for o in outs.outputs:
                    got[o.request_id] = got.get(o.request_id, 0) + len(o.new_token_ids)

        async def submit(lo, hi):
            for i in range(lo, hi):
                await c.add_request_async(EngineCoreRequest(f"a{i}", [i + 1, 5], SamplingParams(
                    max_tokens=expected[f"a{i}"], ignore_eos=True, seed=i)))

        try:
            collector = asyncio.ensure_future(collect())
            await submit(0, 20)
            await c.scale_elastic_ep_async(3)
            assert c.num_engines == 3
            await submit(20, 40)
            await c.scale_elastic_ep_async(2)
            assert c.num_engines == 2 and len(c.procs) == 2
            await submit(40, 60)
            await asyncio.wait_for(collector, 60)
            assert got == expected and 2 in ranks
            assert c.router.load == [0, 0] and not c.router.live
        finally:
            c.shutdown()

    asyncio.run(main())
