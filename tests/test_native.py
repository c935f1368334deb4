"""Native pieces against their Python twins: hashes, SHA-256 variants, the
blocking queue, whole engine runs, and the GIL while the engine waits."""

from __future__ import annotations

import ast
import bisect
import hashlib
import inspect
import os
import queue
import threading
import time
from array import array
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enginecore import _native
from enginecore.blocking_queue import PyBlockingQueue, make_blocking_queue
from enginecore.executor.synthetic import new_state, synthetic_sample_py
from enginecore.sched.block_hash import block_hashes_py, encode_extra_keys
from helpers import make_request, synthetic_engine

C = _native._ext
pytestmark = pytest.mark.skipif(C is None, reason="native extension not built")


STUB = Path(__file__).resolve().parent.parent / "python" / "enginecore" / "_C.pyi"


def _stub_functions(body: list[ast.stmt]) -> dict[str, list[str]]:
    """name -> parameter names of the stub's functions (``self`` left out)."""
    return {node.name: [a.arg for a in node.args.args if a.arg != "self"]
            for node in body if isinstance(node, ast.FunctionDef)}


def _native_params(fn) -> list[str]:
    """Parameter names from pybind11's signature line: ``name(a: int, b: object) -> x``."""
    head = fn.__doc__.splitlines()[0]
    inside = head[head.index("(") + 1: head.rindex(")")]
    return [p.split(":")[0].strip() for p in inside.split(",")
            if p.strip() and p.split(":")[0].strip() != "self"]


def test_stub_names_every_export_of_the_extension():
    tree = ast.parse(STUB.read_text())
    functions = _stub_functions(tree.body)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    public = {name for name in dir(C) if not name.startswith("_")}
    assert set(functions) | set(classes) == public
    for name, params in functions.items():
        assert params == _native_params(getattr(C, name)), name
    for name, node in classes.items():
        native = getattr(C, name)
        members = set(_stub_functions(node.body)) - {"__init__"}
        assert members == {m for m in vars(native) if not m.startswith("_")
                           or m in ("__len__", "__bool__")}, name
        assert inspect.isclass(native)


def test_every_native_structure_and_loop_has_a_twin_of_the_same_interface():
    """``_C.Name`` <-> ``PyName`` and ``_C.name`` <-> ``name_py``: every public member
    of a native class is on its twin with the same parameter names."""
    from enginecore.blocking_queue import PyBlockingQueue
    from enginecore.sched import block_pool, request_table, scheduler_loops

    twins = {"BlockPool": block_pool.PyBlockPool, "RequestTable": request_table.PyRequestTable,
             "BlockingQueue": PyBlockingQueue}
    for name, twin in twins.items():
        native = getattr(C, name)
        for member, value in vars(native).items():
            if member.startswith("_") and member != "__len__":
                continue
            assert hasattr(twin, member), f"{twin.__name__} lacks {member}"
            if callable(value) and not isinstance(value, property):
                params = list(inspect.signature(getattr(twin, member)).parameters)[1:]
                assert params == _native_params(value), (name, member)
    assert twins_of_functions()["schedule_running"][0] == scheduler_loops.__name__


PACKAGE = STUB.parent


def twins_of_functions() -> dict[str, tuple[str, list[str]]]:
    """For every function of the stub: (the module defining ``name_py``, its
    parameter names), found by reading the package's source (each twin exactly once)."""
    wanted = {f"{name}_py": name for name in _stub_functions(ast.parse(STUB.read_text()).body)}
    found: dict[str, list[tuple[str, list[str]]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = "enginecore." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name in wanted:
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                found.setdefault(wanted[node.name], []).append((module, names))
    missing = sorted(set(wanted.values()) - set(found))
    assert not missing, f"_C functions without a name_py twin: {missing}"
    twice = {name: [m for m, _ in defs] for name, defs in found.items() if len(defs) > 1}
    assert not twice, f"twins defined more than once: {twice}"
    return {name: defs[0] for name, defs in found.items()}


def test_every_native_function_has_a_twin_named_by_the_rule_with_its_parameters():
    """The one twin rule (docs/architecture.md): ``_C.name`` <-> ``name_py`` with the
    same parameter names, in the same order, for every function the extension exports
    (the stub lists exactly those, test above); the twin imports and is callable."""
    import importlib

    for name, (module, params) in twins_of_functions().items():
        assert params == _native_params(getattr(C, name)), (name, module, params)
        twin = getattr(importlib.import_module(module), f"{name}_py")
        assert list(inspect.signature(twin).parameters) == params, (name, module)


@pytest.mark.parametrize("portable", [False, True])
def test_sha256_matches_hashlib(portable):
    C.sha256_force_portable(portable)
    try:
        for n in list(range(0, 200)) + [1000, 4096, 65537]:
            data = os.urandom(n)
            assert C.sha256(data) == hashlib.sha256(data).digest(), n
    finally:
        C.sha256_force_portable(False)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    block_size=st.sampled_from([1, 2, 4, 16, 32]),
    parent=st.one_of(st.none(), st.binary(min_size=32, max_size=32)),
    extra=st.one_of(st.none(), st.lists(st.one_of(st.integers(-(2**63), 2**63 - 1),
                                                  st.text(), st.binary()), max_size=3)),
    container=st.sampled_from(["list", "tuple", "array", "iterator"]),
    portable=st.booleans(),
)
def test_native_block_hashes_equal_python_twin(tokens, block_size, parent, extra, container,
                                               portable):
    seq = {"list": list, "tuple": tuple, "array": lambda t: array("I", t),
           "iterator": lambda t: (x for x in t)}[container](tokens)
    C.sha256_force_portable(portable)
    try:
        got = C.block_hashes(seq, block_size, parent, encode_extra_keys(extra))
    finally:
        C.sha256_force_portable(False)
    assert got == block_hashes_py(tokens, block_size, parent, encode_extra_keys(extra))


def test_native_rejects_what_python_rejects():
    for bad in ([1, -1], [2**32], [1.5], ["7"]):
        with pytest.raises((ValueError, TypeError)):
            C.block_hashes(bad, 1, None, b"")
        with pytest.raises((ValueError, TypeError)):
            block_hashes_py(bad, 1, None, b"")


@pytest.mark.parametrize("kind", ["native", "python"])
def test_blocking_queue_semantics(kind):
    q = C.BlockingQueue(2) if kind == "native" else PyBlockingQueue(2)
    assert not q and q.empty() and len(q) == 0 and q.maxsize == 2
    q.put("a")
    q.put_nowait(("b", 1))
    with pytest.raises(queue.Full):
        q.put("c")
    assert q.peek() == "a" and len(q) == 2
    assert q.get() == "a" and q.get_nowait() == ("b", 1)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.15)
    assert 0.1 < time.monotonic() - t0 < 2
    threading.Timer(0.05, q.put, args=("late",)).start()
    assert q.get(timeout=5) == "late"


def test_make_blocking_queue_follows_the_switch(hot_path):
    q = make_blocking_queue()
    assert isinstance(q, C.BlockingQueue) == (hot_path == "native")


def default_requests():
    reqs = []
    for i in range(30):
        req = make_request(f"r{i}", [i % 7 + 1] * (i % 9 + 2) + [i], max_tokens=5 + i % 13,
                           seed=i)
        if i % 3 == 0:  # salted: the decode-filled blocks hash with extra keys
            req.cache_salt = f"salt{i % 2}"
        reqs.append(req)
    return reqs


def schedule_and_tokens(requests=None, **kw):
    engine_args = dict(block_size=4, max_num_batched_tokens=48, num_gpu_blocks_override=40,
                       max_model_len=64)
    engine_args.update(kw)
    eng = synthetic_engine(**engine_args)
    for req in requests if requests is not None else default_requests():
        eng.add_request(req)
    trace, tokens = [], {}
    real_schedule = eng.scheduler.schedule

    def spy():
        so = real_schedule()
        # What the runner is told: tokens per request and the blocks each got.
        trace.append((dict(so.num_scheduled_tokens), so.scheduled_cached_reqs.new_block_ids,
                      [r.block_ids for r in so.scheduled_new_reqs]))
        return so

    eng.scheduler.schedule = spy
    while eng.scheduler.has_requests() or eng.batch_queue:
        for outs in eng.step_fn()[0].values():
            for o in outs.outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    # The prefix cache at the end: every block hash registered, prompt and decode.
    pool = eng.scheduler.kv_cache_manager.block_pool
    cached = sorted(h for h in map(pool.block_hash, range(pool.num_blocks)) if h is not None)
    free_order = pool.free_block_ids()
    return (trace, tokens, eng.scheduler.num_preempted_total, cached, free_order,
            pool.num_evictions)


def run_on_both_paths(make_requests, **kw):
    runs = {}
    for path in ("native", "python"):
        previous = _native._enabled
        _native.set_native(path == "native")
        try:
            runs[path] = schedule_and_tokens(make_requests(), **kw)
        finally:
            _native._enabled = previous
    return runs


@pytest.mark.parametrize("batches", [1, 2])
def test_whole_engine_runs_identical_on_both_paths(batches):
    runs = run_on_both_paths(default_requests, max_concurrent_batches=batches)
    assert runs["native"] == runs["python"]
    assert runs["native"][2] > 0  # the run did preempt
    assert len(runs["native"][3]) > 30  # decode blocks were hashed and cached
    assert runs["native"][5] > 0  # cached blocks were evicted for reuse


@settings(max_examples=60, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4, 16]), caching=st.booleans(),
       batches=st.sampled_from([1, 2]), num_blocks=st.integers(12, 80))
def test_random_engine_runs_identical_on_both_paths(data, block_size, caching, batches,
                                                    num_blocks):
    """Random prompts sharing prefixes, salts, stop tokens and cache sizes: the
    native loops (block growth, hash extension, full-block registration,
    eviction, preemption hand-back) tell the runner and the client exactly what
    the Python path does."""
    max_model_len = max(32, block_size * 8)
    prefix = data.draw(st.lists(st.integers(1, 60), min_size=0, max_size=20))
    specs = data.draw(st.lists(st.tuples(
        st.lists(st.integers(1, 60), min_size=1, max_size=12),  # prompt tail
        st.integers(1, 20),  # max_tokens
        st.none() | st.sampled_from(["a", "b"]),  # cache salt
        st.lists(st.integers(1, 60), max_size=2),  # stop token ids
    ), min_size=1, max_size=12))

    def make_requests():
        reqs = []
        for i, (tail, max_tokens, salt, stops) in enumerate(specs):
            req = make_request(f"q{i}", (prefix + tail)[: max_model_len - 1],
                               max_tokens=max_tokens, seed=i, stop_token_ids=stops)
            req.cache_salt = salt
            reqs.append(req)
        return reqs

    runs = run_on_both_paths(
        make_requests, block_size=block_size, num_gpu_blocks_override=num_blocks,
        max_model_len=max_model_len, max_num_batched_tokens=max(48, max_model_len),
        enable_prefix_caching=caching, max_concurrent_batches=batches,
        synthetic_vocab_size=64)
    assert runs["native"] == runs["python"]


def test_gil_is_free_while_the_engine_waits_on_the_model(hot_path):
    """While the loop waits on a 50 ms model step, another thread runs Python: the
    other thread's ticks fall inside the steps' middles (a loop holding the GIL
    through its wait leaves none there). An event check, not a speed ratio: the
    ratio is a timing figure for bench/, swinging with the neighbours' load."""
    eng = synthetic_engine(synthetic_step_latency_s=0.05, max_concurrent_batches=2)
    for i in range(8):
        eng.add_request(make_request(f"g{i}", [1, 2, i], max_tokens=10**6, ignore_eos=True))
    eng.step_fn()
    steps: list[tuple[float, float]] = []
    enough = threading.Event()

    def engine_loop():
        while len(steps) < 12:
            start = time.perf_counter()
            eng.step_fn()
            steps.append((start, time.perf_counter()))
        enough.set()

    ticks: list[float] = []
    t = threading.Thread(target=engine_loop)
    t.start()
    try:
        deadline = time.monotonic() + 120  # generous: a loaded machine is slow, not wrong
        while not enough.is_set() and time.monotonic() < deadline:
            ticks.append(time.perf_counter())
    finally:
        t.join(120)
    assert enough.is_set(), "the engine did not take 12 steps in 120 s"
    waits = [(a + 0.01, b - 0.01) for a, b in steps if b - a >= 0.04]
    ran = [bisect.bisect_right(ticks, lo) < bisect.bisect_left(ticks, hi) for lo, hi in waits]
    assert len(waits) >= 6, steps
    assert sum(ran) >= len(waits) // 2, f"the other thread ran in {sum(ran)} of {len(waits)} waits"


@settings(max_examples=200, deadline=None)
@given(data=st.data(), num=st.integers(0, 12), vocab=st.integers(1, 50))
def test_native_synthetic_sampler_equals_python_twin(data, num, vocab):
    """The synthetic executor's loop: same tokens, index, state; drafts accepted
    while they match (a vocabulary of 1-50 makes matches common)."""
    rids = [f"r{i}" for i in range(num)]
    num_cached = data.draw(st.integers(0, num))
    scheduled, spec, state = {}, {}, {}
    cached_computed, new_computed = [], {}
    for i, rid in enumerate(rids):
        known = data.draw(st.integers(1, 40))
        computed = data.draw(st.integers(0, known))
        drafts = data.draw(st.lists(st.integers(0, vocab), max_size=3))
        if drafts:
            spec[rid] = drafts
        scheduled[rid] = data.draw(st.integers(1, 8)) + len(drafts)
        state[rid] = new_state(data.draw(st.integers(0, 2**64 - 1)), known)
        if i < num_cached:
            cached_computed.append(computed)
        else:
            new_computed[rid] = computed
    cached_ids = rids[:num_cached]
    if data.draw(st.booleans()):  # out of schedule order: the native lookup falls back
        order = data.draw(st.permutations(rids))
        scheduled = {r: scheduled[r] for r in order}
    py_state = {r: bytearray(s) for r, s in state.items()}
    want = synthetic_sample_py(scheduled, spec, py_state, cached_ids, cached_computed,
                               new_computed, vocab)
    got = C.synthetic_sample(scheduled, spec, state, cached_ids, cached_computed, new_computed,
                             vocab)
    assert got == want and state == py_state


def _synthetic_cases():
    """Hostile inputs to the synthetic loop: a draft whose __index__ resizes or drops
    the request's state, counts at int64's end, a state of the wrong kind."""
    def resized():
        state = {"a": new_state(3, 3)}

        class Draft:
            def __index__(self):
                state["a"].extend(bytes(4096))
                return 10**30
        return {"a": 2}, {"a": [Draft()]}, state, ["a"], [3], {}

    def dropped():
        state = {"a": new_state(3, 3)}

        class Draft:
            def __index__(self):
                del state["a"]
                return 10**30
        return {"a": 2}, {"a": [Draft()]}, state, ["a"], [3], {}

    def at_int64_end():
        return {"a": 1}, {}, {"a": new_state(7, 2**63 - 1)}, ["a"], [2**63 - 1], {}

    def wrong_state_kind():
        return {"a": 1}, {}, {"a": [1, 2]}, [], [], {}

    def float_draft():
        return {"a": 2}, {"a": [3.0]}, {"a": new_state(3, 3)}, ["a"], [3], {}
    return [resized, dropped, at_int64_end, wrong_state_kind, float_draft]


@pytest.mark.parametrize("case", _synthetic_cases(), ids=lambda c: c.__name__)
def test_native_synthetic_sampler_hostile_inputs_like_the_twin(case):
    """Same answer or same exception type on both loops; the native one never
    writes into a state Python code resized or dropped meanwhile."""
    def run(fn):
        scheduled, spec, state, cached_ids, cached_computed, new_computed = case()
        try:
            out = fn(scheduled, spec, state, cached_ids, cached_computed, new_computed, 50)
        except Exception as e:  # noqa: BLE001 - the exception is the answer compared
            return type(e)
        return out, {k: bytes(v) for k, v in state.items()}
    assert run(C.synthetic_sample) == run(synthetic_sample_py)
