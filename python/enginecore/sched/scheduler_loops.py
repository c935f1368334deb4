"""The scheduler's two per-request loops as whole functions over the request
table and the block pool: the pure-Python twins of ``_C.schedule_running`` and
``_C.update_decodes`` (csrc/scheduler_loops.cpp), same names (``_py``), same
signatures, same results. ``scheduler_loops()`` picks the pair by the switch.

* ``schedule_running``: Scheduler.schedule()'s loop over running requests:
  token budget, chunking, drafts, block allocation and preemption by recompute
  when blocks run out; the scheduled requests' computed counts then include
  this step's tokens.
* ``update_decodes``: Scheduler.update_from_output for plain decodes (one
  sampled token, no grammar): append, hash the blocks filled, stop checks. What
  is not plain comes back for the Python method that handles everything else.

Only ``Request.slot`` is read from a Python object; the rest is the table's.
"""

from __future__ import annotations

from operator import index
from typing import Any, NamedTuple

from enginecore import _native
from enginecore.sched.arg_checks import (
    HASHABLE_MAX,
    INT64_MAX,
    INT64_MIN,
    boolean,
    check_hashable,
    int64,
    token_list,
)
from enginecore.sched.request_table import PREEMPTED, RUNNING, STOP_TOKEN, PyRequestTable


class RunningSchedule(NamedTuple):
    """The fields of the tuple ``schedule_running`` returns (on both paths)."""
    token_budget: int  # left
    scheduled: list  # Request objects, in running order
    new_block_ids: list  # per scheduled request: its new block ids, or None
    num_scheduled_tokens: dict  # request id -> tokens this step
    spec_tokens: dict  # request id -> drafts scheduled this step
    preempted: list  # Request objects, in the order preempted (already out of running)
    req_ids: list  # the scheduled requests' ids
    num_computed_tokens: list  # ... and their computed counts before this step
    any_grammar: bool  # whether any scheduled request is constrained


class DecodeUpdate(NamedTuple):
    """The fields of the tuple ``update_decodes`` returns (on both paths)."""
    plain: dict  # client -> ([request ids], [[token]]): unfinished plain decodes
    deferred: list  # (request id, token ids): not plain, for Scheduler._update_request
    finished: list  # (request id, token ids, stop token or None): status already set
    failed: list  # (request id, "Type: message"): this request's update raised


def _pick_victim_py(table: PyRequestTable, running: list, in_flight: Any,
                    priority: bool) -> int:
    """Index in ``running`` of the request to preempt (-1: none): the last one
    (FCFS) or the lowest priority, latest arrival (priority). In-flight ones are spared.
    FCFS reads from the end and stops at the first it may take (the native loop too)."""
    rids = table.request_id
    if not priority:
        for j in range(len(running) - 1, -1, -1):
            s = running[j].slot
            rid = rids[s]
            if rid is None or s < 0:
                table._check(s)  # a released row or a negative slot: IndexError, as native
            if in_flight is None or rid not in in_flight:
                return j
        return -1
    best = -1
    best_key: tuple[int, float] | None = None
    for j, request in enumerate(running):
        s = request.slot
        rid = rids[s]
        if rid is None or s < 0:
            table._check(s)
        if in_flight is not None and rid in in_flight:
            continue
        key = (table.priority[s], table.arrival_time[s])
        if best_key is None or key > best_key:
            best, best_key = j, key
    return best


def _preempt_row_py(table: PyRequestTable, slot: int) -> None:
    """The row's part of a preemption: blocks freed, back to zero computed tokens."""
    table.free_blocks(slot)
    table.status[slot] = PREEMPTED
    table.num_computed[slot] = 0
    table.spec[slot] = []


def schedule_running_py(table: PyRequestTable, running: list, skip: Any, in_flight: Any,
                        token_budget: int, threshold: int, max_len_1: int, max_model_len: int,
                        priority: bool) -> RunningSchedule:
    """Schedule the running requests in order while the token budget lasts.
    ``skip``: ids passed over this step (in flight, or not probed); ``in_flight``:
    ids a preemption must spare (or None). Preempted requests leave ``running``."""
    # The native binding's argument checks, before anything changes (the
    # scheduler's own arguments pass the first test; anything else the thorough one).
    if not (type(table) is PyRequestTable and type(running) is list
            and (in_flight is None or type(in_flight) is set) and type(priority) is bool
            and type(token_budget) is int and type(threshold) is int
            and type(max_len_1) is int and type(max_model_len) is int
            and INT64_MIN <= token_budget <= INT64_MAX and INT64_MIN <= threshold <= INT64_MAX
            and INT64_MIN <= max_len_1 <= INT64_MAX
            and INT64_MIN <= max_model_len <= INT64_MAX):
        _check_arg(table, PyRequestTable, "table")
        _check_arg(running, list, "running")
        _check_in_flight(in_flight, (set, frozenset))
        token_budget = int64(token_budget, "token_budget")
        threshold = int64(threshold, "threshold")
        max_len_1 = int64(max_len_1, "max_len_1")
        max_model_len = int64(max_model_len, "max_model_len")
        priority = boolean(priority, "priority")
    tokens, num_computed, spec_col, rids = (table.tokens, table.num_computed, table.spec,
                                            table.request_id)
    blocks_col, cached_col, hashes_col = table.block_ids, table.num_cached_blocks, table.hashes
    bs = table.block_size
    caching = table.block_pool is not None and table.block_pool.enable_caching
    scheduled: list = []
    new_block_ids: list = []
    num_scheduled: dict[str, int] = {}
    spec_tokens: dict[str, list[int]] = {}
    preempted: list = []
    i = 0
    while i < len(running) and token_budget > 0:
        request = running[i]
        s = request.slot
        rid = rids[s]
        if rid is None or s < 0:
            table._check(s)  # a released row or a negative slot: IndexError, as native
        if rid in skip:
            i += 1
            continue
        computed = num_computed[s]
        n_tok = len(tokens[s])
        drafts = spec_col[s]
        num_new = n_tok + len(drafts) - computed
        if threshold and num_new > threshold:
            num_new = threshold
        if num_new > token_budget:
            num_new = token_budget
        if num_new > max_len_1 - computed:
            num_new = max_len_1 - computed
        if num_new <= 0:
            i += 1
            continue
        end = computed + num_new
        blocks = blocks_col[s]
        new: list[int] | None
        if blocks and end <= len(blocks) * bs:
            # The common decode: the tokens fit the blocks the request has.
            new = []
            if caching and min(end, n_tok) // bs > cached_col[s] and hashes_col[s]:
                table._cache_full(s, table.block_pool, end)
        else:
            while True:
                new = (table._allocate(s, num_new, 0, [], 0, max_model_len)
                       if table.block_pool is not None
                       else table.allocate_slots(s, num_new, 0, [], 0, max_model_len))
                if new is not None:
                    break
                victim_index = _pick_victim_py(table, running, in_flight, priority)
                if victim_index < 0:
                    break
                victim = running.pop(victim_index)
                vrid = rids[victim.slot]
                if victim_index < i:
                    i -= 1
                    if vrid in num_scheduled:
                        # Already scheduled this step: give its budget back.
                        undo = scheduled.index(victim)
                        scheduled.pop(undo)
                        new_block_ids.pop(undo)
                        token_budget += num_scheduled.pop(vrid)
                        spec_tokens.pop(vrid, None)
                _preempt_row_py(table, victim.slot)
                preempted.append(victim)
                if victim is request:
                    break
            if new is None:
                break
        scheduled.append(request)
        new_block_ids.append(new if new else None)
        num_scheduled[rid] = num_new
        token_budget -= num_new
        if drafts:
            n_spec = end - n_tok
            if n_spec > 0:
                spec_tokens[rid] = drafts[:n_spec]
            spec_col[s] = []
        i += 1
    req_ids: list[str] = []
    before: list[int] = []
    any_grammar = False
    has_grammar = table.has_grammar
    for request in scheduled:
        s = request.slot
        rid = rids[s]
        req_ids.append(rid)
        computed = num_computed[s]
        before.append(computed)
        num_computed[s] = computed + num_scheduled[rid]
        if has_grammar[s]:
            any_grammar = True
    # A plain tuple with RunningSchedule's fields, as the native loop returns.
    return (token_budget, scheduled, new_block_ids, num_scheduled, spec_tokens,  # type: ignore[return-value]
            preempted, req_ids, before, any_grammar)


def update_decodes_py(table: PyRequestTable, slot_of: dict, scheduled: dict, sampled: list,
                      req_ids: list, index_of: dict, in_flight: Any,
                      max_model_len: int) -> DecodeUpdate:
    """Apply one step's sampled tokens to the scheduled requests (``slot_of``:
    live request id -> slot). A request that is not running any more (aborted,
    preempted while its batch ran) is passed over; one whose update raises is
    reported in ``failed`` and the rest go on."""
    if not (type(table) is PyRequestTable and type(slot_of) is dict
            and type(scheduled) is dict and type(index_of) is dict and type(sampled) is list
            and type(req_ids) is list and (in_flight is None or type(in_flight) is set)
            and type(max_model_len) is int and INT64_MIN <= max_model_len <= INT64_MAX):
        _check_arg(table, PyRequestTable, "table")
        for arg, name in ((slot_of, "slot_of"), (scheduled, "scheduled"),
                          (index_of, "index_of")):
            _check_arg(arg, dict, name)
        _check_arg(sampled, list, "sampled")
        _check_arg(req_ids, list, "req_ids")
        _check_in_flight(in_flight, set)
        max_model_len = int64(max_model_len, "max_model_len")
    status, tokens, has_grammar, client_col = (table.status, table.tokens, table.has_grammar,
                                               table.client_index)
    hash_blocks, hashes, bs = table.hash_blocks, table.hashes, table.block_size
    plain: dict[int, tuple[list, list]] = {}
    deferred: list = []
    finished: list = []
    failed: list = []
    num_answered = len(req_ids)
    last_client = -1
    col_ids: list = []
    col_toks: list = []
    for k, rid in enumerate(scheduled):
        try:
            if in_flight is not None:
                in_flight.discard(rid)
            s = slot_of.get(rid)
            if s is None or status[s] != RUNNING:
                continue  # aborted or preempted while its batch ran
            if k < num_answered and req_ids[k] == rid:
                i = k  # the runner answers in schedule order as a rule
            else:
                i = index_of.get(rid)
                if i is None:
                    continue  # nothing sampled
                if i < 0:
                    raise IndexError("list index out of range")  # no index from the end
            toks = sampled[i]
            n_new = len(toks)
            if n_new == 0:
                continue  # a prefill chunk
            if n_new != 1 or has_grammar[s]:
                deferred.append((rid, toks))
                continue
            tok = index(toks[0])
            if not 0 <= tok <= HASHABLE_MAX:
                # As the native loop: an int64, and hashable when the row hashes.
                token_list((tok,))
                if table.hash_blocks[s]:
                    check_hashable([tok])
            row = tokens[s]
            row.append(tok)
            if hash_blocks[s] and len(row) >= (len(hashes[s]) + 1) * bs:
                table._extend_hashes(s)
            why = table._check_stop(s, max_model_len)
            if why:
                finished.append((rid, toks, toks[0] if why == STOP_TOKEN else None))
                continue
            client = client_col[s]
            if client != last_client:
                col = plain.get(client)
                if col is None:
                    col = plain[client] = ([], [])
                col_ids, col_toks = col
                last_client = client
            col_ids.append(rid)
            col_toks.append(toks)
        except Exception as e:  # noqa: BLE001 - that request's failure only
            failed.append((rid, f"{type(e).__name__}: {e}"))
            last_client = -1
    return (plain, deferred, finished, failed)  # type: ignore[return-value] # DecodeUpdate's fields


def _check_arg(value: Any, kind: type, name: str) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")


def _check_in_flight(in_flight: Any, kinds: type | tuple[type, ...]) -> None:
    if in_flight is not None and not isinstance(in_flight, kinds):
        raise TypeError(f"in_flight must be a set or None, got {type(in_flight).__name__}")


def scheduler_loops() -> tuple[Any, Any]:
    """(schedule_running, update_decodes): ``_C``'s on the native path, else the twins."""
    ext = _native.extension()
    if ext is not None:
        return ext.schedule_running, ext.update_decodes
    return schedule_running_py, update_decodes_py
