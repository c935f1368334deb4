"""Engine-side pieces the front-end relies on: scheduling events with log_stats,
and max_tokens=None meaning up to max_model_len."""

from __future__ import annotations

from enginecore import FinishReason
from enginecore.protocol import EngineCoreEventType
from helpers import make_request, synthetic_engine


def _events(engine, steps=50):
    seen, stats = {}, 0
    for _ in range(steps):
        if not engine.scheduler.has_requests():
            break
        outputs, executed = engine.step_fn()
        engine.post_step(executed)
        for outs in outputs.values():
            stats += outs.scheduler_stats is not None
            for o in outs.outputs:
                for ev in o.events or ():
                    seen.setdefault(o.request_id, []).append(ev)
    return seen, stats


def test_events_with_log_stats_only(hot_path):
    eng = synthetic_engine(log_stats=True, max_model_len=64)
    eng.add_request(make_request("a", [1, 2, 3], max_tokens=4))
    seen, stats = _events(eng)
    kinds = [e.type for e in seen["a"]]
    assert kinds == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    assert seen["a"][0].timestamp <= seen["a"][1].timestamp
    assert stats > 0  # SchedulerStats come with log_stats alone
    quiet = synthetic_engine(max_model_len=64)
    quiet.add_request(make_request("a", [1, 2, 3], max_tokens=4))
    assert _events(quiet) == ({}, 0)


def test_preemption_is_an_event(hot_path):
    # Two requests that cannot both keep their blocks: one is preempted and rescheduled.
    eng = synthetic_engine(log_stats=True, block_size=4, num_gpu_blocks_override=6,
                           max_model_len=24)
    for rid in ("a", "b"):
        eng.add_request(make_request(rid, list(range(1, 9)), max_tokens=12, ignore_eos=True))
    seen, _ = _events(eng, steps=200)
    kinds = [e.type for evs in seen.values() for e in evs]
    assert EngineCoreEventType.PREEMPTED in kinds
    assert kinds.count(EngineCoreEventType.SCHEDULED) >= 3  # first admissions + the resume


def test_max_tokens_none_runs_to_the_context_limit(hot_path):
    eng = synthetic_engine(max_model_len=16)
    eng.add_request(make_request("r", [1, 2, 3], max_tokens=None, ignore_eos=True))
    out = []
    while eng.scheduler.has_requests():
        outputs, executed = eng.step_fn()
        eng.post_step(executed)
        for outs in outputs.values():
            out += [o for o in outs.outputs if o.request_id == "r"]
    assert sum(len(o.new_token_ids) for o in out) == 13
    assert out[-1].finish_reason is FinishReason.LENGTH
