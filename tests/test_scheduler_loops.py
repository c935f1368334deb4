"""The scheduler's loops called directly: ``_C.schedule_running`` /
``_C.update_decodes`` against ``schedule_running_py`` / ``update_decodes_py`` on
random tables (hypothesis), with the structures' states compared afterwards."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enginecore import SamplingParams, _native
from enginecore.request import Request, RequestStatus
from enginecore.sched.block_pool import PyBlockPool
from enginecore.sched.request_table import PyRequestTable
from enginecore.sched.scheduler_loops import schedule_running_py, update_decodes_py

C = _native._ext
pytestmark = pytest.mark.skipif(C is None, reason="the native extension is not built")

BLOCK = 4


def table_state(table, requests) -> list:
    pool = table.block_pool
    return ([table.export_row(r.slot) for r in requests],
            pool.free_block_ids(), [pool.ref_cnt(b) for b in range(pool.num_blocks)],
            [pool.block_hash(b) for b in range(pool.num_blocks)], pool.num_evictions)


request_spec = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(0, 5), min_size=1, max_size=14),
    "outputs": st.lists(st.integers(0, 5), max_size=6),
    "computed_back": st.integers(0, 3),  # tokens not yet computed
    "spec": st.lists(st.integers(0, 5), max_size=3),
    "priority": st.integers(0, 2),
    "salt": st.sampled_from([None, "s"]),
    "max_tokens": st.integers(1, 9),
    "min_tokens": st.integers(0, 3),
    "stop": st.lists(st.integers(0, 5), max_size=2),
    "eos": st.sampled_from([None, 0, 3]),
    "ignore_eos": st.booleans(),
    "grammar": st.booleans(),
    "status": st.sampled_from([RequestStatus.RUNNING] * 4 + [RequestStatus.PREEMPTED]),
})


def build(kind: str, specs: list[dict], num_blocks: int, caching: bool):
    """A pool, a table and running requests (blocks allocated for their computed
    tokens where the pool has room) made the same way on either kind."""
    if kind == "native":
        pool = C.BlockPool(num_blocks, caching)
        table = C.RequestTable(pool, BLOCK)
    else:
        pool = PyBlockPool(num_blocks, caching)
        table = PyRequestTable(pool, BLOCK)
    running = []
    for i, sp in enumerate(specs):
        params = SamplingParams(max_tokens=sp["max_tokens"],
                                min_tokens=min(sp["min_tokens"], sp["max_tokens"]),
                                stop_token_ids=sp["stop"], ignore_eos=sp["ignore_eos"])
        req = Request(f"r{i}", sp["prompt"], params, sp["eos"], block_size=BLOCK,
                      priority=sp["priority"], arrival_time=float(i % 3),
                      cache_salt=sp["salt"], table=table)
        req.append_output_token_ids(sp["outputs"])
        computed = max(req.num_tokens - 1 - sp["computed_back"], 0)
        if computed and table.allocate_slots(req.slot, computed, 0, [], 0, 64) is None:
            computed = 0
        req.num_computed_tokens = computed
        req.spec_token_ids = sp["spec"]
        table.set_has_grammar(req.slot, sp["grammar"])
        req.status = sp["status"]
        running.append(req)
    return table, running


def comparable(result, running) -> tuple:
    """A loop result with Request objects replaced by their ids."""
    def ids(x):
        return [r.request_id for r in x]
    (budget, scheduled, new_blocks, num_sched, spec, preempted, req_ids, before,
     any_grammar) = result
    return (budget, ids(scheduled), new_blocks, num_sched, spec, ids(preempted), req_ids,
            before, any_grammar, ids(running))


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(request_spec, min_size=1, max_size=8), num_blocks=st.integers(4, 24),
       caching=st.booleans(), budget=st.integers(1, 40), threshold=st.sampled_from([0, 2, 5]),
       priority=st.booleans(), skip_mask=st.lists(st.booleans(), min_size=8, max_size=8),
       in_flight_mask=st.lists(st.booleans(), min_size=8, max_size=8))
def test_schedule_running_native_equals_twin(specs, num_blocks, caching, budget, threshold,
                                             priority, skip_mask, in_flight_mask):
    in_flight = {f"r{i}" for i, m in enumerate(in_flight_mask[:len(specs)]) if m}
    skip = in_flight | {f"r{i}" for i, m in enumerate(skip_mask[:len(specs)]) if m}
    got = {}
    for kind, fn in (("native", C.schedule_running), ("python", schedule_running_py)):
        table, running = build(kind, specs, num_blocks, caching)
        everyone = list(running)
        try:
            result = comparable(fn(table, running, skip, in_flight or None, budget,
                                   threshold, 63, 64, priority), running)
        except Exception as e:  # noqa: BLE001 - both must raise the same
            result = (type(e).__name__, str(e))
        got[kind] = (result, table_state(table, everyone))
    assert got["native"] == got["python"]


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(request_spec, min_size=1, max_size=8),
       sampled=st.lists(st.lists(st.integers(0, 5), max_size=2), min_size=8, max_size=8),
       gone=st.lists(st.booleans(), min_size=8, max_size=8), shuffle=st.randoms(),
       max_model_len=st.sampled_from([12, 64]), bad=st.sampled_from([None, 2]))
def test_update_decodes_native_equals_twin(specs, sampled, gone, shuffle, max_model_len, bad):
    n = len(specs)
    order = list(range(n))
    shuffle.shuffle(order)
    got = {}
    for kind, fn in (("native", C.update_decodes), ("python", update_decodes_py)):
        table, running = build(kind, specs, 32, True)
        slot_of = {r.request_id: r.slot for i, r in enumerate(running) if not gone[i]}
        scheduled = {f"r{i}": 1 for i in range(n)}
        # The runner answers in its own order (here shuffled) with an index map.
        req_ids = [f"r{i}" for i in order]
        toks = [list(sampled[i]) for i in order]
        if bad is not None and bad < n:
            toks[order.index(bad)] = ["not a token"]
        index_of = {rid: k for k, rid in enumerate(req_ids)}
        in_flight = {f"r{i}" for i in range(0, n, 2)}
        result = fn(table, slot_of, scheduled, toks, req_ids, index_of, in_flight,
                    max_model_len)
        got[kind] = (tuple(result), sorted(in_flight), table_state(table, running))
    assert got["native"] == got["python"]


def test_update_decodes_stops_in_vllms_order():
    """Length before min_tokens, EOS (unless ignored) before stop tokens; a stop
    token is handed back as the stop reason."""
    for fn, kind in ((C.update_decodes, "native"), (update_decodes_py, "python")):
        specs = [dict(prompt=[1, 2], outputs=[], computed_back=0, spec=[], priority=0,
                      salt=None, max_tokens=5, min_tokens=0, stop=[4], eos=3,
                      ignore_eos=ign, grammar=False, status=RequestStatus.RUNNING)
                 for ign in (False, True, False)]
        table, running = build(kind, specs, 8, True)
        slot_of = {r.request_id: r.slot for r in running}
        plain, deferred, finished, failed = fn(
            table, slot_of, {"r0": 1, "r1": 1, "r2": 1}, [[3], [3], [4]],
            ["r0", "r1", "r2"], {}, None, 64)
        assert finished == [("r0", [3], None), ("r2", [4], 4)], kind
        assert plain == {0: (["r1"], [[3]])} and not deferred and not failed
        assert running[0].status == RequestStatus.FINISHED_STOPPED
        assert running[1].status == RequestStatus.RUNNING
