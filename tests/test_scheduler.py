"""Scheduler scenarios, driven through EngineCore with the synthetic executor."""

from __future__ import annotations

import pytest

from enginecore import FinishReason
from enginecore.executor.synthetic import synthetic_token
from enginecore.request import RequestStatus
from enginecore.sched.scheduler import PauseState
from helpers import make_request, run_to_completion, synthetic_engine

VOCAB = 32000


def tokens_for(seed: int, prompt_len: int, n: int) -> list[int]:
    return [synthetic_token(seed, prompt_len + i, VOCAB) for i in range(n)]


def schedule_trace(engine, steps):
    trace = []
    for _ in range(steps):
        so = engine.scheduler.schedule()
        trace.append(dict(so.num_scheduled_tokens))
        out = engine.model_executor.execute_model(so)
        engine.scheduler.update_from_output(so, out)
    return trace


def test_budget_split_two_requests_ten_token_budget(hot_path):
    eng = synthetic_engine(max_num_batched_tokens=10, block_size=4)
    eng.add_request(make_request("a", list(range(1, 13)), max_tokens=3))
    eng.add_request(make_request("b", list(range(50, 57)), max_tokens=3))
    assert schedule_trace(eng, 5) == [
        {"a": 10},
        {"a": 2, "b": 7},
        {"a": 1, "b": 1},
        {"a": 1, "b": 1},
        {},
    ]


def test_chunked_prefill_samples_only_after_last_chunk(hot_path):
    eng = synthetic_engine(max_num_batched_tokens=10, block_size=4)
    eng.add_request(make_request("a", list(range(1, 26)), max_tokens=2, seed=5))
    steps = []
    for _ in range(4):
        outs, _ = eng.step()
        steps.append([o.new_token_ids for v in outs.values() for o in v.outputs])
    assert steps[:2] == [[], []]
    assert steps[2] == [tokens_for(5, 25, 1)]
    assert steps[3] == [tokens_for(5, 25, 2)[1:]]


def test_disabled_chunked_prefill_waits_for_budget():
    eng = synthetic_engine(max_num_batched_tokens=16, enable_chunked_prefill=False,
                           max_model_len=16, block_size=4)
    eng.add_request(make_request("a", list(range(1, 11)), max_tokens=2))
    eng.add_request(make_request("b", list(range(21, 31)), max_tokens=2))
    assert schedule_trace(eng, 2) == [{"a": 10}, {"a": 1, "b": 10}]


def test_second_request_reuses_cached_prefix(hot_path):
    eng = synthetic_engine(block_size=8)
    shared = list(range(100, 124))
    eng.add_request(make_request("a", shared + [1, 2, 3], max_tokens=2))
    run_to_completion(eng)
    eng.add_request(make_request("b", shared + [7, 8, 9, 10], max_tokens=2))
    so = eng.scheduler.schedule()
    assert so.num_scheduled_tokens == {"b": 4}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 24
    out = eng.model_executor.execute_model(so)
    outs = eng.scheduler.update_from_output(so, out)
    stats = eng.scheduler.kv_cache_manager.make_prefix_cache_stats()
    assert stats.hits >= 24
    eng.scheduler.requests["b"]  # still running
    assert outs[0].outputs[0].new_token_ids


def test_preemption_under_block_pressure_gives_same_tokens(hot_path):
    prompts = {f"r{i}": list(range(10 * i + 1, 10 * i + 14)) for i in range(6)}

    def run(**kw):
        eng = synthetic_engine(block_size=4, max_model_len=64, **kw)
        for rid, p in prompts.items():
            eng.add_request(make_request(rid, p, max_tokens=24, seed=int(rid[1:])))
        res = run_to_completion(eng)
        return eng, res

    free_eng, free_res = run()
    tight_eng, tight_res = run(num_gpu_blocks_override=16)
    assert free_eng.scheduler.num_preempted_total == 0
    assert tight_eng.scheduler.num_preempted_total > 0
    assert tight_res == free_res
    assert all(r["finish_reason"] is FinishReason.LENGTH for r in tight_res.values())
    assert all(len(r["tokens"]) == 24 for r in tight_res.values())
    assert tight_eng.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 16


def test_priority_policy_orders_admission_and_preemption():
    eng = synthetic_engine(scheduling_policy="priority", max_num_seqs=1, block_size=4)
    for rid, prio in [("low", 5), ("high", -1), ("mid", 2)]:
        req = make_request(rid, [1, 2, 3], max_tokens=1)
        req.priority = prio
        eng.add_request(req)
    order = []
    for _ in range(6):
        so = eng.scheduler.schedule()
        order += [r.req_id for r in so.scheduled_new_reqs]
        eng.scheduler.update_from_output(so, eng.model_executor.execute_model(so))
    assert order == ["high", "mid", "low"]


def test_priority_preempts_lowest_priority_first():
    eng = synthetic_engine(scheduling_policy="priority", block_size=4,
                           num_gpu_blocks_override=4, max_model_len=16)
    for rid, prio in [("a", 0), ("b", 9)]:
        req = make_request(rid, [1, 2, 3, 4, 5, 6, 7], max_tokens=8)
        req.priority = prio
        eng.add_request(req)
    res = run_to_completion(eng)
    assert eng.scheduler.requests == {}
    assert res["a"]["finish_reason"] is FinishReason.LENGTH
    assert res["b"]["finish_reason"] is FinishReason.LENGTH


def test_abort_while_prefilling_and_while_decoding(hot_path):
    eng = synthetic_engine(max_num_batched_tokens=8, block_size=4)
    eng.add_request(make_request("dec", [1, 2, 3], max_tokens=50))
    eng.add_request(make_request("pre", list(range(1, 40)), max_tokens=5))
    for _ in range(2):
        eng.step()
    assert eng.scheduler.requests["pre"].num_computed_tokens < 39
    assert eng.scheduler.requests["dec"].num_output_tokens >= 1
    eng.abort_requests(["pre", "dec", "unknown"])
    outs, _ = eng.step()
    reasons = {o.request_id: o.finish_reason for o in outs[0].outputs}
    assert reasons == {"pre": FinishReason.ABORT, "dec": FinishReason.ABORT}
    assert eng.scheduler.kv_cache_manager.req_to_blocks == {}
    # Aborting again, or a finished id, is harmless.
    eng.abort_requests(["pre", "dec"])
    assert eng.step()[0] == {}
    assert not eng.scheduler.has_requests()


def test_finished_ids_reach_the_runner_next_step():
    eng = synthetic_engine(block_size=4)
    eng.add_request(make_request("a", [1, 2, 3], max_tokens=1))
    eng.add_request(make_request("b", [1, 2, 3, 4], max_tokens=5))
    eng.step()
    so = eng.scheduler.schedule()
    assert so.finished_req_ids == {"a"}
    assert "a" not in eng.model_executor._run(so).req_ids


class TestStopConditions:
    SEED = 11
    PROMPT = [5, 6, 7, 8, 9]

    def run_one(self, eos=None, **sp):
        eng = synthetic_engine(synthetic_eos_token_id=eos, block_size=4,
                               max_model_len=sp.pop("max_model_len", 4096))
        eng.add_request(make_request("r", self.PROMPT, seed=self.SEED, **sp))
        return run_to_completion(eng)["r"]

    def expected(self, n):
        return tokens_for(self.SEED, len(self.PROMPT), n)

    def test_max_tokens(self, hot_path):
        r = self.run_one(max_tokens=7)
        assert r["tokens"] == self.expected(7) and r["finish_reason"] is FinishReason.LENGTH

    def test_eos(self, hot_path):
        eos = self.expected(3)[2]
        r = self.run_one(eos=eos, max_tokens=20)
        assert r["tokens"] == self.expected(3) and r["finish_reason"] is FinishReason.STOP
        assert r["stop_reason"] is None

    def test_ignore_eos(self, hot_path):
        eos = self.expected(3)[2]
        r = self.run_one(eos=eos, max_tokens=6, ignore_eos=True)
        assert r["tokens"] == self.expected(6) and r["finish_reason"] is FinishReason.LENGTH

    def test_stop_token_ids(self, hot_path):
        stop = self.expected(4)[3]
        r = self.run_one(max_tokens=20, stop_token_ids=[stop])
        assert r["tokens"] == self.expected(4)
        assert r["finish_reason"] is FinishReason.STOP and r["stop_reason"] == stop

    def test_min_tokens_suppresses_early_stops(self, hot_path):
        stop = self.expected(2)[1]
        r = self.run_one(max_tokens=5, min_tokens=3, stop_token_ids=[stop])
        assert r["tokens"] == self.expected(5)
        assert r["finish_reason"] is FinishReason.LENGTH

    def test_max_model_len(self, hot_path):
        r = self.run_one(max_tokens=100, max_model_len=9)
        assert r["tokens"] == self.expected(4) and r["finish_reason"] is FinishReason.LENGTH


def test_pause_states_queue_requests():
    eng = synthetic_engine(block_size=4)
    eng.add_request(make_request("run", [1, 2, 3], max_tokens=4))
    eng.step()
    eng.pause_scheduler(mode="keep")
    assert eng.scheduler.pause_state == PauseState.PAUSED_ALL and eng.is_scheduler_paused()
    eng.add_request(make_request("new", [4, 5, 6], max_tokens=2))
    for _ in range(3):
        assert eng.step() == ({}, False)
    assert not eng.scheduler.has_schedulable_work()
    eng.pause_scheduler(mode="wait")  # running may go on, new ones wait
    res = run_to_completion_while(eng, lambda: "run" in eng.scheduler.requests)
    assert res["run"]["finish_reason"] is FinishReason.LENGTH
    assert eng.scheduler.requests["new"].status == RequestStatus.WAITING
    eng.resume_scheduler()
    res = run_to_completion(eng)
    assert len(res["new"]["tokens"]) == 2


def test_pause_abort_mode_aborts_everything():
    eng = synthetic_engine(block_size=4)
    for i in range(3):
        eng.add_request(make_request(f"r{i}", [1, 2, 3, i], max_tokens=10))
    eng.step()
    eng.pause_scheduler(mode="abort")
    outs, _ = eng.step()
    assert {o.finish_reason for o in outs[0].outputs} == {FinishReason.ABORT}
    with pytest.raises(ValueError, match="pause mode"):
        eng.pause_scheduler(mode="bogus")


def run_to_completion_while(eng, cond, limit=1000):
    res: dict = {}
    from helpers import collect

    for _ in range(limit):
        if not cond():
            return res
        collect(eng.step()[0], res)
    raise AssertionError("condition never cleared")


def test_request_counts_and_stats():
    eng = synthetic_engine(block_size=4, max_num_seqs=2, log_stats=True, log_iteration_details=True)
    for i in range(3):
        eng.add_request(make_request(f"r{i}", [i, 2, 3, 4, 5], max_tokens=3))
    outs, _ = eng.step()
    assert eng.scheduler.get_request_counts() == (2, 1)
    stats = outs[0].scheduler_stats
    assert stats.num_running_reqs == 2 and stats.num_waiting_reqs == 1
    assert stats.iteration.num_prefill_reqs == 2 and stats.iteration.num_prefill_tokens == 10
    assert stats.iteration.elapsed_ms > 0
    outs, _ = eng.step()
    it = outs[0].scheduler_stats.iteration
    assert (it.num_decode_reqs, it.num_decode_tokens) == (2, 2)
