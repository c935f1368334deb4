"""The scheduler's native structures under a hostile caller, part two: requests and rows
across threads, references and table kinds, and whole engines, on both paths (the
structures' hostile calls and the loops are in test_request_table_hostile.py)."""

from __future__ import annotations

import gc
import sys
import threading

import pytest

from enginecore import _C as C
from enginecore import _native
from enginecore.request import Request
from enginecore.sampling_params import SamplingParams
from enginecore.sched import scheduler_loops as loops
from enginecore.sched.request_table import PyRequestTable
from helpers import make_request, synthetic_engine
from test_request_table_hostile import add, check_pool


# -- requests, threads, references -----------------------------------------------------
def test_request_with_bad_tail_token_refused_on_both_paths(hot_path):
    """A standalone Request whose prompt ends in an unhashable token: refused at
    once on both paths (natively it was accepted and failed at a later decode)."""
    with pytest.raises(ValueError):
        Request("x", [1, 2, 3, -1], SamplingParams(), None, block_size=2)
    Request("y", [1, 2, 3, -1], SamplingParams(), None, block_size=2, enable_block_hashes=False)


def test_request_collected_while_scheduled_keeps_the_table_whole(hot_path):
    """A scheduler dropping its last reference to a running request (its Request
    is collected): the row and its blocks go back, nothing dangles."""
    eng = synthetic_engine(block_size=4, num_gpu_blocks_override=16, max_model_len=64)
    for i in range(4):
        eng.add_request(make_request(f"g{i}", [1 + i] * 9, max_tokens=30, ignore_eos=True))
    eng.step_fn()
    sched = eng.scheduler
    table, pool = sched.request_table, sched.kv_cache_manager.block_pool
    victim = sched.requests["g1"]
    slot = victim.slot
    sched.finish_requests(["g1"], victim.status.FINISHED_ABORTED)
    del victim
    gc.collect()
    with pytest.raises(IndexError):
        table.get_request_id(slot)  # released by Request.__del__
    check_pool(pool)
    while sched.has_requests():
        eng.step_fn()
    gc.collect()
    assert len(table) == 0 or all(not table.get_block_ids(r.slot)
                                  for r in sched.requests.values())
    check_pool(pool)


def test_threads_adding_and_releasing_while_the_loops_run(hot_path):
    """Two threads make and drop requests in the scheduler's table (as the input
    thread does) while a third runs both loops on it: no crash, no slot given to
    two requests, every row reads its own request."""
    from enginecore.sched.block_pool import block_pool_class
    from enginecore.sched.request_table import request_table_class

    sched, update = loops.scheduler_loops()
    table = request_table_class()(block_pool_class()(128, True), 4)
    sp = SamplingParams(max_tokens=10**6, ignore_eos=True)
    running = [Request(f"run{i}", [1, 2, 3, 4, 5], sp, None, block_size=4, table=table)
               for i in range(6)]
    for r in running:
        r.status = r.status.RUNNING
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    errors, wrong = [], []
    done = threading.Event()

    def churn(tag):
        try:
            alive = []
            for k in range(300):
                alive.append(Request(f"{tag}{k}", [7] * 9, sp, None, block_size=4, table=table))
                if len(alive) > 12:
                    wrong.extend(a.request_id for a in alive
                                 if table.get_request_id(a.slot) != a.request_id)
                    del alive[:6]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    def run_loops():
        try:
            while not done.is_set():
                res = sched(table, list(running), set(), None, 64, 0, 10**6, 10**6, False)
                ids = res[6]
                update(table, {r.request_id: r.slot for r in running}, res[3],
                       [[9] for _ in ids], ids, {rid: i for i, rid in enumerate(ids)}, None,
                       10**6)
                for r in running:
                    if r.num_tokens > 40:
                        table.free_blocks(r.slot)
                        r.num_computed_tokens = 0
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=churn, args=(t,)) for t in "ab"]
    looper = threading.Thread(target=run_loops)
    try:
        looper.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        done.set()
        looper.join(timeout=60)
        sys.setswitchinterval(previous)
    assert not errors and not wrong
    slots = [r.slot for r in running]
    assert len(set(slots)) == len(slots)
    assert all(table.get_request_id(r.slot) == r.request_id for r in running)
    gc.collect()
    assert len(table) == len(running)


def test_add_release_move_loop_leaks_nothing(hot_path):
    """Adds, moves between tables, exports/imports and releases keep reference
    counts and the table's size steady."""
    from enginecore.sched.block_pool import block_pool_class
    from enginecore.sched.request_table import request_table_class

    table = request_table_class()(block_pool_class()(64, True), 4)
    sp, rid, prompt = SamplingParams(max_tokens=5), "leak-probe", list(range(1, 30))

    def cycle():
        r = Request(rid, prompt, sp, 2, block_size=4)
        r.move_to(table)
        table.allocate_slots(r.slot, 29, 0, [], 0, 100)
        table.append_token_ids(r.slot, [5, 6, 7])
        assert r.block_hashes and r.output_token_ids == [5, 6, 7]
        table.free_blocks(r.slot)
        table.release(table.import_row(table.export_row(r.slot)))

    for _ in range(50):
        cycle()
    gc.collect()
    before = (sys.getrefcount(rid), sys.getrefcount(sp), sys.getrefcount(prompt))
    for _ in range(500):
        cycle()
    gc.collect()
    assert (sys.getrefcount(rid), sys.getrefcount(sp), sys.getrefcount(prompt)) == before
    assert len(table) == 0 and table.block_pool.get_num_free_blocks() == 64


def test_moving_across_kinds_and_back():
    """A row exported from one kind imports into the other and back unchanged."""
    native = C.RequestTable(None, 4)
    python = PyRequestTable(None, 4)
    s = add(native, prompt_token_ids=list(range(1, 11)), extra_keys=b"salt")
    native.append_token_ids(s, [11, 12])
    row = native.export_row(s)
    back = native.export_row(native.import_row(python.export_row(python.import_row(row))))
    assert back == row


# -- whole engine ------------------------------------------------------------------------
def engine_run(batches, abort_at):
    eng = synthetic_engine(block_size=4, max_num_batched_tokens=40, num_gpu_blocks_override=30,
                           max_model_len=64, max_concurrent_batches=batches,
                           num_speculative_tokens=2, prompt_lookup_min=1)
    for i in range(16):
        req = make_request(f"e{i}", [1 + i % 3, 2, 3, 1 + i % 3] * (1 + i % 4) + [i],
                           max_tokens=6 + i % 9, seed=i, stop_token_ids=[50])
        if i % 3 == 0:
            req.cache_salt = f"salt{i % 2}"
        eng.add_request(req)
    tokens, reasons, step = {}, {}, 0
    while eng.scheduler.has_requests() or eng.batch_queue:
        step += 1
        if step in abort_at:
            eng.abort_requests([f"e{j}" for j in abort_at[step]])
        outputs, executed = eng.step_fn()
        eng.post_step(executed)
        for outs in outputs.values():
            for o in outs.outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    reasons[o.request_id] = o.finish_reason
    pool = eng.scheduler.kv_cache_manager.block_pool
    check_pool(pool)
    return (tokens, reasons, eng.scheduler.num_preempted_total, pool.free_block_ids(),
            pool.num_evictions, len(eng.scheduler.request_table))


@pytest.mark.parametrize("batches", [1, 2])
def test_engine_with_preemption_spec_salts_and_aborts_identical_on_both_paths(batches):
    abort_at = {3: [1, 5], 6: [9], 9: [14, 15]}
    runs = {}
    for path in ("native", "python"):
        previous = _native._enabled
        _native.set_native(path == "native")
        try:
            runs[path] = engine_run(batches, abort_at)
        finally:
            _native._enabled = previous
    assert runs["native"] == runs["python"]
    assert runs["native"][2] > 0  # it did preempt
    assert sum(1 for r in runs["native"][1].values() if int(r) == 2) == 5  # five aborts
