"""The scheduler's native structures under a hostile caller, on both paths.

Every public method of ``BlockPool`` / ``RequestTable`` and both scheduler loops
gets wrong types, out-of-range values and inconsistent states. Whatever one kind
does the other does too: the same result, or the same exception type, and the
same state afterwards (which still satisfies the pool's invariants). Exception
messages may differ (pybind11 words its own argument errors).
"""

from __future__ import annotations

import contextlib
import resource

import numpy as np
import pytest

from enginecore import _C as C
from enginecore.sched import scheduler_loops as loops
from enginecore.sched.block_pool import PyBlockPool
from enginecore.sched.request_table import PyRequestTable

H = b"h" * 32
KINDS = {"native": (C.BlockPool, C.RequestTable, C.schedule_running, C.update_decodes),
         "python": (PyBlockPool, PyRequestTable, loops.schedule_running_py,
                    loops.update_decodes_py)}
ADD = dict(request_id="r", prompt_token_ids=[1, 2, 3], client_index=0, max_tokens=10,
           min_tokens=0, eos_token_id=9, ignore_eos=False, stop_token_ids=[4], priority=0,
           arrival_time=0.0, extra_keys=b"", hash_blocks=True)


class Req:
    """What the loops read of a Request: its slot."""

    def __init__(self, slot):
        self.slot = slot


class SlotsReq:
    """As Request keeps it: ``slot`` a __slots__ member (read in place natively)."""

    __slots__ = ("slot",)

    def __init__(self, slot):
        self.slot = slot


def add(table, **kw):
    return table.add(**{**ADD, **kw})


def check_pool(pool):
    """The pool's invariants: a block is referenced xor in the free queue, the
    free count is the queue's length, every cached hash maps to a block carrying it."""
    free = pool.free_block_ids()
    assert len(free) == len(set(free)) == pool.get_num_free_blocks()
    for b in range(pool.num_blocks):
        assert (pool.ref_cnt(b) == 0) == (b in free) and pool.ref_cnt(b) >= 0
    hashed = [pool.block_hash(b) for b in range(pool.num_blocks)]
    assert pool.num_cached_blocks() == sum(
        1 for b, h in enumerate(hashed) if h is not None and pool.get_cached_block(h) == b)


def state(table):
    pool = table.block_pool
    check_pool(pool)
    rows = []
    for s in range(4):
        try:
            rows.append(table.export_row(s))
        except IndexError:
            rows.append(None)
    return (len(table), rows, pool.free_block_ids(), pool.num_cached_blocks(),
            [pool.ref_cnt(b) for b in range(pool.num_blocks)])


def normalised(value):
    if isinstance(value, (Req, SlotsReq)):
        return ("Req", value.slot)
    if isinstance(value, (list, tuple)):
        return [normalised(v) for v in value]
    if isinstance(value, dict):
        return {k: normalised(v) for k, v in value.items()}
    return value


def outcome(kind, case):
    """(result or exception type, state after) of ``case`` on a fresh table of ``kind``."""
    pool_cls, table_cls, sched, update = KINDS[kind]
    table = table_cls(pool_cls(8, True), 2)
    try:
        got = ("ok", normalised(case(table, sched, update)))
    except Exception as e:  # noqa: BLE001 - the exception type is the observable
        got = (type(e).__name__,)
    return got, state(table)


def both(case):
    native, python = outcome("native", case), outcome("python", case)
    assert native == python
    return native[0]


def one_row(t):
    return add(t)


def with_blocks(t):
    s = add(t)
    t.allocate_slots(s, 3, 0, [], 0, 100)
    return s


def state_of(row, **changes):
    """An exported row with some fields replaced (a hand-made row state)."""
    names = ["request_id", "tokens", "num_prompt", "num_computed", "status", "client_index",
             "max_tokens", "min_tokens", "eos_token_id", "ignore_eos", "stop_token_ids",
             "has_grammar", "spec", "priority", "arrival_time", "extra_keys", "hash_blocks",
             "hashes", "block_ids", "num_cached_blocks"]
    fields = list(row)
    for name, value in changes.items():
        fields[names.index(name)] = value
    return tuple(fields)


def imported(**changes):
    return lambda t: t.import_row(state_of(t.export_row(one_row(t)), **changes))


# Each case found a difference between the kinds (or a crash) before it was fixed.
FIXED = {
    # Row states no export makes: the native table read out of bounds
    # (get_output_token_ids returned garbage or raised "Could not allocate list").
    "import_num_prompt_past_tokens": imported(num_prompt=99),
    "import_num_prompt_negative": imported(num_prompt=-2),
    "import_num_computed_negative": imported(num_computed=-1),
    "import_cached_without_blocks": imported(num_cached_blocks=5),
    "import_more_hashes_than_blocks": imported(hashes=[H, H, H]),
    # A row with no request id: counted by len() forever, never releasable.
    "import_request_id_none": imported(request_id=None),
    # Wrong field types: native RuntimeError (cast_error), Python accepted them.
    "import_max_tokens_str": imported(max_tokens="x"),
    "import_arrival_str": imported(arrival_time="1"),
    "import_extra_keys_str": imported(extra_keys="abc"),
    "import_hash_bytearray": imported(hashes=[bytearray(32)]),
    "import_hash_str": imported(hashes=["x" * 32]),
    "import_blocks_none": imported(block_ids=None),
    "import_unhashable_tokens": imported(tokens=[1, 2, -3]),
    # add: the Python table stored whatever it was given.
    "add_request_id_none": lambda t: add(t, request_id=None),
    "add_request_id_bytes": lambda t: add(t, request_id=b"r"),
    "add_max_tokens_past_int64": lambda t: add(t, max_tokens=2**63),
    "add_max_tokens_float": lambda t: add(t, max_tokens=1.5),
    "add_eos_none": lambda t: add(t, eos_token_id=None),
    "add_priority_float": lambda t: add(t, priority=0.5),
    "add_arrival_none": lambda t: add(t, arrival_time=None),
    "add_ignore_eos_str": lambda t: add(t, ignore_eos="no"),
    "add_extra_keys_bytearray": lambda t: add(t, extra_keys=bytearray(b"a")),
    "add_stop_float": lambda t: add(t, stop_token_ids=[1.5]),
    "add_stop_past_int64": lambda t: add(t, stop_token_ids=[2**64]),
    "add_token_past_int64": lambda t: add(t, prompt_token_ids=[2**70]),
    "add_token_past_int64_unhashed": lambda t: add(t, prompt_token_ids=[2**63],
                                                   hash_blocks=False),
    "add_str_prompt": lambda t: add(t, prompt_token_ids="12"),
    # A bad token in the prompt's partial tail block: Python refused it, native took
    # it (and failed the request later, when a decode filled that block).
    "add_unhashable_tail_token": lambda t: add(t, prompt_token_ids=[1, 2, 2**32]),
    "add_negative_tail_token": lambda t: add(t, prompt_token_ids=[1, 2, -1]),
    # Appends: Python kept the bad token before failing, native did not.
    "append_past_int64": lambda t: t.append_token_ids(one_row(t), [2**64]),
    "append_unhashable_then_good": lambda t: (
        t.append_token_ids(one_row(t), [7, 2**32]), t.append_token_ids(0, [5, 6])),
    # Scalars past int64 / of the wrong type: native TypeError, Python accepted them.
    "slot_past_int64": lambda t: t.get_status(2**70),
    "slot_float_empty_table": lambda t: t.get_status(0.0),
    "slot_float": lambda t: t.get_status(0.0 + one_row(t)),
    "set_status_past_int32": lambda t: t.set_status(one_row(t), 2**40),
    "set_status_float": lambda t: t.set_status(one_row(t), 1.5),
    "set_computed_past_int64": lambda t: t.set_num_computed_tokens(one_row(t), 2**64),
    "set_spec_past_int64": lambda t: t.set_spec_token_ids(one_row(t), [2**64]),
    "set_grammar_str": lambda t: t.set_has_grammar(one_row(t), "x"),
    "check_stop_past_int64": lambda t: t.check_stop(one_row(t), 2**64),
    "computed_blocks_past_int64": lambda t: t.get_computed_blocks(one_row(t), 2**64),
    # Counts near int64's end wrapped around natively into a small allocation.
    "allocate_overflow": lambda t: t.allocate_slots(one_row(t), 2**62, 2**62, [], 2**62,
                                                    2**63 - 1),
    "allocate_generator_blocks": lambda t: t.allocate_slots(one_row(t), 1, 2,
                                                            (b for b in [3]), 0, 100),
    "allocate_negative_counts_and_bad_block": lambda t: t.allocate_slots(
        one_row(t), -1, 0, [99], 0, 100),
    # The pool: a bad id in the middle of a list changed the Python pool halfway.
    "pool_free_bad_id_mid_list": lambda t: t.block_pool.free_blocks(
        [t.block_pool.get_new_blocks(2)[0], 7, 99]),
    "pool_touch_bad_id_mid_list": lambda t: t.block_pool.touch([0, 99]),
    "pool_uncache_bad_id_mid_list": lambda t: (
        t.block_pool.cache_full_blocks([0], [H], 0, 1), t.block_pool.uncache([0, -1])),
    "pool_float_id_in_list": lambda t: t.block_pool.touch([1.0]),
    "pool_id_past_int64_in_list": lambda t: t.block_pool.touch([2**64]),
    "pool_id_past_int64": lambda t: t.block_pool.ref_cnt(2**70),
    "pool_take_past_int64": lambda t: t.block_pool.get_new_blocks(2**70),
    # Hashes that are no 32-byte bytes: Python stored a str (or memoryview) as a hash.
    "pool_cache_str_hash": lambda t: t.block_pool.cache_full_blocks([0], ["x" * 32], 0, 1),
    "pool_cache_memoryview_hash": lambda t: t.block_pool.cache_full_blocks(
        [0], [memoryview(H)], 0, 1),
    "pool_lookup_str": lambda t: t.block_pool.get_cached_block("x" * 32),
    "pool_lookup_short": lambda t: t.block_pool.get_cached_block(b"x"),
    "pool_lookup_none": lambda t: t.block_pool.get_cached_block(None),
    "pool_cache_float_id": lambda t: t.block_pool.cache_full_blocks([0.0], [H], 0, 1),
}

# Cases both kinds already agreed on (kept: they pin the agreement down).
HELD = {
    "add_numpy_prompt": lambda t: (add(t, prompt_token_ids=np.array([1, 2, 3])),
                                   t.get_token_ids(0)),
    "add_numpy_ints": lambda t: (add(t, prompt_token_ids=[np.int64(1), np.uint8(3)]),
                                 t.get_token_ids(0)),
    "add_bool_tokens": lambda t: (add(t, prompt_token_ids=[True, False]), t.get_token_ids(0)),
    "add_float_token": lambda t: add(t, prompt_token_ids=[1.0]),
    "add_negative_token_hashed": lambda t: add(t, prompt_token_ids=[-1, 1]),
    "add_negative_token_unhashed": lambda t: (add(t, prompt_token_ids=[-1, 1],
                                                  hash_blocks=False), t.export_row(0)),
    "add_empty_prompt": lambda t: (add(t, prompt_token_ids=[]), t.export_row(0)),
    "add_generator_prompt": lambda t: (add(t, prompt_token_ids=iter([1, 2])), t.export_row(0)),
    "add_none_prompt": lambda t: add(t, prompt_token_ids=None),
    "slot_negative": lambda t: t.get_status(-1),
    "slot_numpy": lambda t: t.get_status(np.int64(one_row(t))),
    "released_slot": lambda t: (t.release(one_row(t)), t.get_token_ids(0)),
    "double_release": lambda t: (t.release(one_row(t)), t.release(0)),
    "release_with_blocks": lambda t: t.release(with_blocks(t)),
    "free_blocks_twice": lambda t: (t.free_blocks(with_blocks(t)), t.free_blocks(0)),
    "export_with_blocks_import": lambda t: t.import_row(t.export_row(with_blocks(t))),
    "export_import_roundtrip": lambda t: t.export_row(t.import_row(t.export_row(one_row(t)))),
    "import_short_state": lambda t: t.import_row((1, 2)),
    "import_none": lambda t: t.import_row(None),
    "append_negative_unhashed": lambda t: (t.append_token_ids(add(t, hash_blocks=False), [-1]),
                                           t.export_row(0)),
    "append_numpy": lambda t: (t.append_token_ids(one_row(t), np.array([4])), t.export_row(0)),
    "append_int_not_list": lambda t: t.append_token_ids(one_row(t), 4),
    "append_partial_bad": lambda t: t.append_token_ids(one_row(t), [4, "x"]),
    "set_computed_negative": lambda t: t.set_num_computed_tokens(one_row(t), -1),
    "set_computed_past_tokens": lambda t: (t.set_num_computed_tokens(one_row(t), 100),
                                           t.allocate_slots(0, 1, 0, [], 0, 200)),
    "check_stop_length_negative_max": lambda t: t.check_stop(add(t, max_tokens=-1), 100),
    "allocate_zero": lambda t: t.allocate_slots(one_row(t), 0, 0, [], 0, 100),
    "allocate_negative_max_model_len": lambda t: t.allocate_slots(one_row(t), 3, 0, [], 0, -5),
    "allocate_duplicate_cached_block": lambda t: t.allocate_slots(one_row(t), 1, 4, [0, 0],
                                                                  0, 100),
    "allocate_more_than_the_pool": lambda t: t.allocate_slots(one_row(t), 10**12, 0, [], 0,
                                                              10**13),
    "uncache_negative": lambda t: (t.uncache_from(with_blocks(t), -5), t.export_row(0)),
    "pool_double_free_mid_list": lambda t: t.block_pool.free_blocks(
        [*t.block_pool.get_new_blocks(2), 1]),
    "pool_cache_free_block": lambda t: (t.block_pool.cache_full_blocks([0], [H], 0, 1),
                                        t.block_pool.get_cached_block(H)),
    "pool_reset_in_use": lambda t: (t.block_pool.get_new_blocks(1),
                                    t.block_pool.reset_prefix_cache()),
    "no_pool": lambda t: type(t)(None, 2).allocate_slots(add(type(t)(None, 2)), 1, 0, [], 0, 9),
}


@pytest.mark.parametrize("name", sorted(FIXED) + sorted(HELD))
def test_both_kinds_agree_on_hostile_calls(name):
    case = FIXED.get(name) or HELD[name]
    both(lambda table, sched, update: case(table))


def test_overflowing_counts_are_refused_not_wrapped():
    got = both(lambda table, sched, update: FIXED["allocate_overflow"](table))
    assert got == ("ok", None)  # the pool is too small


def test_rows_no_export_makes_are_refused():
    for name in ("import_num_prompt_past_tokens", "import_num_prompt_negative",
                 "import_cached_without_blocks", "import_more_hashes_than_blocks"):
        assert both(lambda table, sched, update, name=name: FIXED[name](table)) == ("ValueError",)


@pytest.mark.parametrize("args", [(2**31, True), (0, True), (4, "yes"), (1.5, True)])
def test_pool_sizes_and_types_refused_alike(args):
    """A KV cache of 2**31 blocks: ValueError natively; the Python pool used to try
    to allocate ten 2**31-long lists (the process was killed for memory)."""
    errors = set()
    for pool_cls, *_ in KINDS.values():
        with memory_guard(), pytest.raises((ValueError, TypeError)) as e:
            pool_cls(*args)
        errors.add(e.type)
    assert errors in ({ValueError}, {TypeError})


@contextlib.contextmanager
def memory_guard(extra: int = 1 << 30):
    """At most ``extra`` more bytes of address space (a regression raises
    MemoryError here instead of taking the machine's memory)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + extra if hard == resource.RLIM_INFINITY else min(vm + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# -- the loops -------------------------------------------------------------------------
def three_running(t):
    reqs = []
    for i in range(3):
        s = add(t, request_id=f"r{i}", arrival_time=float(i))
        t.set_status(s, 1)
        reqs.append(Req(s))
    return reqs


def three_slots_running(t, cls=SlotsReq):
    reqs = [cls(r.slot) for r in three_running(t)]
    return reqs


def slot_unset(t):
    reqs = three_slots_running(t)
    del reqs[1].slot
    return reqs


def type_changed_between_steps(t, sched):
    """The native loop remembers where `slot` lives in a type; a property put in the
    member's place afterwards is what `request.slot` reads, and so must the loop."""
    class Changing(SlotsReq):
        __slots__ = ()

    rows = three_slots_running(t, Changing)
    first = schedule(t, sched, running=rows[:1])  # row 0's prompt: computed
    Changing.slot = property(lambda self: 2)  # the same request object is row 2 now
    second = schedule(t, sched, running=rows[:1])
    assert second[6] == ["r2"]  # not row 0 again (nothing left to schedule there)
    t.append_token_ids(2, [5])  # once more: the type has a valid version tag again
    third = schedule(t, sched, running=rows[:1])
    assert third[6] == ["r2"]
    return first, second, third


def subclass_property(t, sched):
    class Shadowed(SlotsReq):
        __slots__ = ()
        slot = property(lambda self: 2)

        def __init__(self):  # nothing to set: the property is its slot
            pass

    schedule(t, sched, running=three_slots_running(t)[:1])  # remembers SlotsReq
    second = schedule(t, sched, running=[Shadowed(), SlotsReq(1)])
    assert second[6] == ["r2", "r1"]  # the property's row, then the member's
    return second


def victim_negative_slot(t, sched, **kw):
    """r0 needs every block; the victim search meets a slot of -1 before r1."""
    r0, r1, _ = three_running(t)
    t.append_token_ids(0, [5] * 8)
    return schedule(t, sched, running=[r0, r1, Req(-1)], **kw)


def schedule(t, sched, **kw):
    args = dict(skip=set(), in_flight=None, token_budget=100, threshold=0, max_len_1=100,
                max_model_len=100, priority=False)
    args.update(kw)
    if "running" not in args:
        args["running"] = three_running(t)
    return sched(t, **args)


def decode(t, sched, update, sampled, **kw):
    res = schedule(t, sched)
    ids = res[6]
    args = dict(slot_of={f"r{i}": i for i in range(3)}, scheduled=res[3], sampled=sampled,
                req_ids=ids, index_of={r: i for i, r in enumerate(ids)}, in_flight=None,
                max_model_len=100)
    args.update(kw)
    out = update(t, **args)
    # Message texts may differ; the failing requests and their exception types may not.
    return out[0], out[1], out[2], [(rid, why.split(":")[0]) for rid, why in out[3]]


def tight(t, sched, **kw):
    running = three_running(t)
    t.append_token_ids(0, [5] * 8)  # r0 needs every block: the others are preempted
    return schedule(t, sched, running=running, **kw)


LOOP_CASES = {
    # Fixed: a None skip left a Python error set under a result (SystemError natively).
    "skip_none": lambda t, s, u: schedule(t, s, skip=None),
    # Fixed: an in_flight list reached PySet_* natively (SystemError mid-preemption,
    # blocks already moved); Python took the list.
    "in_flight_list_preempting": lambda t, s, u: tight(t, s, in_flight=["r2"]),
    "in_flight_list_update": lambda t, s, u: decode(t, s, u, [[5], [6], [7]], in_flight=["r0"]),
    "in_flight_frozenset_update": lambda t, s, u: decode(t, s, u, [[5], [6], [7]],
                                                        in_flight=frozenset()),
    # Fixed: Python scheduled around a released row in `running`; native raised.
    "released_row_running": lambda t, s, u: (t.release(add(t, request_id="x")),
                                             schedule(t, s, running=[Req(0)])),
    # Fixed: Python took arguments the binding refuses (and changed state first).
    "budget_float": lambda t, s, u: schedule(t, s, token_budget=5.0),
    "budget_past_int64": lambda t, s, u: schedule(t, s, token_budget=2**63),
    "running_tuple": lambda t, s, u: s(t, tuple(three_running(t)), set(), None, 100, 0, 100,
                                       100, False),
    "sampled_tuple": lambda t, s, u: decode(t, s, u, ([5], [6], [7])),
    "max_model_len_past_int64": lambda t, s, u: decode(t, s, u, [[5], [6], [7]],
                                                      max_model_len=2**63),
    # Fixed: sampled None was "nothing sampled" in Python, a TypeError natively.
    "sampled_none": lambda t, s, u: decode(t, s, u, [None, [6], [7]]),
    # Fixed: a negative index_of picked the last sample in Python (r1 got r2's token).
    "index_of_negative": lambda t, s, u: decode(t, s, u, [[5], [6], [7]], req_ids=[],
                                                index_of={"r0": 99, "r1": -1, "r2": 1.0}),
    # Fixed: numpy ints as index_of values / slots: natively "an integer is required".
    "index_of_numpy": lambda t, s, u: decode(t, s, u, [[5], [6], [7]], req_ids=[],
                                             index_of={"r0": np.int64(2)}),
    "slot_of_past_int64": lambda t, s, u: decode(t, s, u, [[5], [6], [7]],
                                                 slot_of={"r0": 99, "r1": "x", "r2": 2**70}),
    # Fixed: a bad sampled token was kept in Python's row before the hash failed.
    "sampled_unhashable": lambda t, s, u: decode(t, s, u, [[-5], [2**32], [2**70]]),
    # Fixed: a negative slot read the last row in Python (lists index from the end);
    # natively "no request in slot -1". In the loop and in the victim search.
    "running_negative_slot": lambda t, s, u: (three_running(t),
                                              schedule(t, s, running=[Req(-1)])),
    "victim_negative_slot": lambda t, s, u: victim_negative_slot(t, s),
    "victim_negative_slot_priority": lambda t, s, u: victim_negative_slot(t, s, priority=True),
    # Held.
    "plain": lambda t, s, u: schedule(t, s),
    "budget_negative": lambda t, s, u: schedule(t, s, token_budget=-5),
    "running_not_requests": lambda t, s, u: schedule(t, s, running=[object()]),
    "running_bad_slot": lambda t, s, u: schedule(t, s, running=[Req(99)]),
    "running_duplicate": lambda t, s, u: schedule(t, s, running=[Req(0), Req(0)]),
    "running_slots": lambda t, s, u: schedule(t, s, running=three_slots_running(t)),
    "running_slots_unset": lambda t, s, u: schedule(t, s, running=slot_unset(t)),
    "running_slots_odd_values": lambda t, s, u: (
        three_running(t), schedule(t, s, running=[SlotsReq(True), SlotsReq(np.int64(0))])),
    "running_slots_past_int64": lambda t, s, u: (
        three_running(t), schedule(t, s, running=[SlotsReq(0), SlotsReq(2**70)])),
    "running_slots_type_changed": lambda t, s, u: type_changed_between_steps(t, s),
    "running_slots_subclass_property": lambda t, s, u: subclass_property(t, s),
    "skip_list": lambda t, s, u: schedule(t, s, skip=["r0"]),
    "skip_dict": lambda t, s, u: schedule(t, s, skip={"r1": 1}),
    "preempt_fcfs": lambda t, s, u: tight(t, s),
    "preempt_priority": lambda t, s, u: tight(t, s, priority=True),
    "threshold_negative": lambda t, s, u: schedule(t, s, threshold=-1),
    "max_len_1_negative": lambda t, s, u: schedule(t, s, max_len_1=-1),
    "sampled_kinds": lambda t, s, u: decode(t, s, u, [[np.int64(5)], (6,), np.array([7])]),
    "sampled_bad": lambda t, s, u: decode(t, s, u, [[5.0], ["6"], 7]),
    "sampled_short": lambda t, s, u: decode(t, s, u, [[5]]),
    "sampled_stops": lambda t, s, u: decode(t, s, u, [[9], [4], [5, 6]]),
    "released_row_update": lambda t, s, u: decode(t, s, u, [[5], [6], [7]],
                                                  slot_of={"r0": 0, "r1": 5}),
}


@pytest.mark.parametrize("name", sorted(LOOP_CASES))
def test_both_loops_agree_on_hostile_calls(name):
    both(LOOP_CASES[name])


@pytest.mark.parametrize("name", ["running_slots_type_changed",
                                  "running_slots_subclass_property"])
def test_slot_read_in_place_follows_the_type(name):
    """Both run to the end (their asserts hold) on both paths."""
    for kind in KINDS:
        assert outcome(kind, LOOP_CASES[name])[0][0] == "ok", kind
