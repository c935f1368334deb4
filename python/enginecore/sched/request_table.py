"""The scheduler's per-request hot state: tokens, counts, stop parameters, block
tables and block hashes, one row per request, addressed by an int slot.

``PyRequestTable`` is the pure-Python twin of ``_C.RequestTable``
(csrc/request_table.cpp): the same interface, the same results. ``Request``
(request.py) is a typed view of one row plus the cold fields; the scheduler's
loops (sched/scheduler_loops.py, csrc/scheduler_loops.cpp) read the rows directly.
Rows stay until their ``Request`` is released, so a finished request can still
be read. Status values are ``RequestStatus``'s.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from enginecore import _native
from enginecore.sched.arg_checks import (
    boolean,
    check_hashable,
    int32,
    int64,
    int64_error,
    number,
    token_list,
)
from enginecore.sched.block_hash import chain_hashes_py
from enginecore.sched.block_pool import PyBlockPool

# RequestStatus values (request.py), which csrc/request_table.h mirrors.
WAITING, RUNNING, PREEMPTED, STOPPED, LENGTH = 0, 1, 2, 3, 4
# check_stop's answer: why the request stopped.
NOT_STOPPED, STOP_LENGTH, STOP_EOS, STOP_TOKEN = 0, 1, 2, 3

# A row as plain values, to move a request between tables (of either kind).
RowState = tuple


class PyRequestTable:
    __slots__ = ("block_pool", "block_size", "request_id", "tokens", "num_prompt",
                 "num_computed", "status", "client_index", "max_tokens", "min_tokens",
                 "eos_token_id", "ignore_eos", "stop_token_ids", "has_grammar", "spec",
                 "priority", "arrival_time", "extra_keys", "hash_blocks", "hashes",
                 "block_ids", "num_cached_blocks", "block_extra_keys", "_free", "_live",
                 "_lock")

    def __init__(self, block_pool: PyBlockPool | None, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_pool = block_pool
        self.block_size = block_size
        # One list per field, indexed by slot: the loops read them without a call.
        self.request_id: list[str | None] = []
        self.tokens: list[list[int]] = []
        self.num_prompt: list[int] = []
        self.num_computed: list[int] = []
        self.status: list[int] = []
        self.client_index: list[int] = []
        self.max_tokens: list[int] = []
        self.min_tokens: list[int] = []
        self.eos_token_id: list[int] = []  # -1: none
        self.ignore_eos: list[bool] = []
        self.stop_token_ids: list[frozenset[int]] = []
        self.has_grammar: list[bool] = []
        self.spec: list[list[int]] = []
        self.priority: list[int] = []
        self.arrival_time: list[float] = []
        self.extra_keys: list[bytes] = []
        self.hash_blocks: list[bool] = []
        self.hashes: list[list[bytes]] = []
        self.block_ids: list[list[int]] = []
        self.num_cached_blocks: list[int] = []
        # Per prompt block, encoded keys hashed before the request's extra keys
        # (the identifiers of the multimodal items the block overlaps); b"" or
        # past the end: none.
        self.block_extra_keys: list[list[bytes]] = []
        self._free: list[int] = []
        self._live = 0
        # Rows are added off the busy loop (the engine's input thread) and released
        # wherever a Request dies: slot bookkeeping is one critical section.
        self._lock = threading.Lock()

    # -- rows ------------------------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: Sequence[int], client_index: int,
            max_tokens: int, min_tokens: int, eos_token_id: int, ignore_eos: bool,
            stop_token_ids: Sequence[int], priority: int, arrival_time: float,
            extra_keys: bytes, hash_blocks: bool,
            block_extra_keys: Sequence[bytes] = ()) -> int:
        """A new row (status WAITING); its prompt's full blocks are hashed now.
        Arguments are checked as the native binding checks them (arg_checks.py);
        with ``hash_blocks`` every prompt token must be in [0, 2**32).
        ``block_extra_keys[b]``: encoded keys that block ``b`` hashes before
        ``extra_keys`` (sched/block_hash.py mm_block_extra_keys)."""
        _check_str(request_id, "request_id")
        client_index = int64(client_index, "client_index")
        max_tokens = int64(max_tokens, "max_tokens")
        min_tokens = int64(min_tokens, "min_tokens")
        eos_token_id = int64(eos_token_id, "eos_token_id")
        ignore_eos = boolean(ignore_eos, "ignore_eos")
        priority = int64(priority, "priority")
        arrival_time = number(arrival_time, "arrival_time")
        _check_bytes(extra_keys, "extra_keys")
        hash_blocks = boolean(hash_blocks, "hash_blocks")
        block_extras = _check_bytes_list(block_extra_keys, "block_extra_keys")
        tokens = token_list(prompt_token_ids)
        stops = frozenset(token_list(stop_token_ids))
        hashes = []
        if hash_blocks:
            check_hashable(tokens)
            hashes = _hash(tokens, 0, self.block_size, None, extra_keys, block_extras)
        row = (request_id, tokens, len(tokens), 0, WAITING, client_index, max_tokens,
               min_tokens, eos_token_id, ignore_eos, stops, False, [], priority,
               arrival_time, extra_keys, hash_blocks, hashes, [], 0, block_extras)
        return self._put(row)

    def export_row(self, slot: int) -> RowState:
        """The row as plain values (for ``import_row`` on a table of either kind)."""
        self._check(slot)
        return (self.request_id[slot], list(self.tokens[slot]), self.num_prompt[slot],
                self.num_computed[slot], self.status[slot], self.client_index[slot],
                self.max_tokens[slot], self.min_tokens[slot], self.eos_token_id[slot],
                self.ignore_eos[slot], sorted(self.stop_token_ids[slot]),
                self.has_grammar[slot], list(self.spec[slot]), self.priority[slot],
                self.arrival_time[slot], self.extra_keys[slot], self.hash_blocks[slot],
                list(self.hashes[slot]), list(self.block_ids[slot]),
                self.num_cached_blocks[slot], list(self.block_extra_keys[slot]))

    def import_row(self, state: RowState) -> int:
        """A row equal to an exported one. Block tables do not move between
        pools: the exported row must hold no blocks."""
        state = tuple(state)
        if len(state) != 21:
            raise ValueError(f"a row state has 21 fields, got {len(state)}")
        if len(state[18]) != 0:
            raise ValueError("a request that holds KV blocks cannot move to another table")
        # Checked as `add` checks its arguments, and for consistency: a state no
        # export makes would leave a row the loops read out of bounds.
        (rid, tokens, num_prompt, num_computed, status, client, max_tokens, min_tokens, eos,
         ignore_eos, stops, has_grammar, spec, priority, arrival, extra, hash_blocks, hashes,
         _, num_cached, block_extras) = (check(value, f"row state field {name}")
                           for (name, check), value in zip(_ROW_FIELDS, state))
        if not 0 <= num_prompt <= len(tokens):
            raise ValueError(f"row state: num_prompt {num_prompt} outside [0, {len(tokens)}]")
        if num_computed < 0:
            raise ValueError("row state: num_computed < 0")
        if num_cached != 0:
            raise ValueError("row state: a row without blocks has no cached blocks")
        if len(hashes) > len(tokens) // self.block_size:
            raise ValueError("row state: more block hashes than full blocks")
        if hash_blocks:
            check_hashable(tokens)
        return self._put((rid, tokens, num_prompt, num_computed, status, client, max_tokens,
                          min_tokens, eos, ignore_eos, stops, has_grammar, spec, priority,
                          arrival, extra, hash_blocks, hashes, [], 0, block_extras))

    def release(self, slot: int) -> None:
        """The row's request is gone: its slot is reused (its blocks must be freed)."""
        with self._lock:  # the check too: two releases of a slot must not both free it
            self._check(slot)
            if self.block_ids[slot]:
                raise RuntimeError(f"slot {slot} still holds {len(self.block_ids[slot])} blocks")
            self.request_id[slot] = None
            self.tokens[slot] = []
            self.hashes[slot] = []
            self.spec[slot] = []
            self.block_extra_keys[slot] = []
            self._free.append(slot)
            self._live -= 1

    def __len__(self) -> int:
        return self._live

    def block_tables(self) -> dict[str, list[int]]:
        """Every row's block ids, by request id, for rows that hold blocks."""
        return {self.request_id[s]: list(b) for s, b in enumerate(self.block_ids)
                if b and self.request_id[s] is not None}

    # -- fields ----------------------------------------------------------------------
    def get_request_id(self, slot: int) -> str:
        self._check(slot)
        return self.request_id[slot]  # type: ignore[return-value]

    def get_status(self, slot: int) -> int:
        self._check(slot)
        return self.status[slot]

    def set_status(self, slot: int, status: int) -> None:
        status = int32(status, "status")
        self._check(slot)
        self.status[slot] = status

    def get_num_computed_tokens(self, slot: int) -> int:
        self._check(slot)
        return self.num_computed[slot]

    def set_num_computed_tokens(self, slot: int, n: int) -> None:
        n = int64(n, "n")
        self._check(slot)
        if n < 0:
            raise ValueError(f"num_computed_tokens must be >= 0, got {n}")
        self.num_computed[slot] = n

    def get_num_tokens(self, slot: int) -> int:
        self._check(slot)
        return len(self.tokens[slot])

    def get_num_prompt_tokens(self, slot: int) -> int:
        self._check(slot)
        return self.num_prompt[slot]

    def get_token_ids(self, slot: int) -> list[int]:
        self._check(slot)
        return list(self.tokens[slot])

    def get_output_token_ids(self, slot: int) -> list[int]:
        self._check(slot)
        return self.tokens[slot][self.num_prompt[slot]:]

    def get_client_index(self, slot: int) -> int:
        self._check(slot)
        return self.client_index[slot]

    def get_spec_token_ids(self, slot: int) -> list[int]:
        self._check(slot)
        return list(self.spec[slot])

    def set_spec_token_ids(self, slot: int, token_ids: Sequence[int]) -> None:
        self._check(slot)
        self.spec[slot] = token_list(token_ids)

    def set_has_grammar(self, slot: int, has_grammar: bool) -> None:
        has_grammar = boolean(has_grammar, "has_grammar")
        self._check(slot)
        self.has_grammar[slot] = has_grammar

    def get_block_hashes(self, slot: int) -> list[bytes]:
        self._check(slot)
        return list(self.hashes[slot])

    def get_num_block_hashes(self, slot: int) -> int:
        self._check(slot)
        return len(self.hashes[slot])

    def get_block_ids(self, slot: int) -> list[int]:
        self._check(slot)
        return list(self.block_ids[slot])

    def get_num_cached_blocks(self, slot: int) -> int:
        self._check(slot)
        return self.num_cached_blocks[slot]

    # -- tokens and stops ------------------------------------------------------------
    def append_token_ids(self, slot: int, token_ids: Sequence[int]) -> None:
        """Append output tokens; the blocks they fill are hashed. With hashing,
        a token outside [0, 2**32) is refused before any of them is kept."""
        self._check(slot)
        new = token_list(token_ids)
        if self.hash_blocks[slot]:
            check_hashable(new)
        self.tokens[slot].extend(new)
        self._extend_hashes(slot)

    def check_stop(self, slot: int, max_model_len: int) -> int:
        """Scheduler's stop checks on the last output token, in vLLM's order; a
        stopped row's status is set. NOT_STOPPED, STOP_LENGTH, STOP_EOS or STOP_TOKEN."""
        max_model_len = int64(max_model_len, "max_model_len")
        self._check(slot)
        return self._check_stop(slot, max_model_len)

    def _check_stop(self, slot: int, max_model_len: int) -> int:
        """check_stop on checked arguments (update_decodes_py's per-token call)."""
        toks = self.tokens[slot]
        n_out = len(toks) - self.num_prompt[slot]
        if len(toks) >= max_model_len or n_out >= self.max_tokens[slot]:
            self.status[slot] = LENGTH
            return STOP_LENGTH
        if n_out < self.min_tokens[slot] or n_out <= 0:
            return NOT_STOPPED
        last = toks[-1]
        if last == self.eos_token_id[slot] and not self.ignore_eos[slot]:
            self.status[slot] = STOPPED
            return STOP_EOS
        if last in self.stop_token_ids[slot]:
            self.status[slot] = STOPPED
            return STOP_TOKEN
        return NOT_STOPPED

    # -- KV blocks -------------------------------------------------------------------
    def get_computed_blocks(self, slot: int, max_hit_blocks: int) -> list[int]:
        """The longest run of the row's leading block hashes the pool holds (at
        most ``max_hit_blocks``): those blocks' ids."""
        max_hit_blocks = int64(max_hit_blocks, "max_hit_blocks")
        self._check(slot)
        get = self._pool().get_cached_block
        hits = []
        for h in self.hashes[slot][:max(max_hit_blocks, 0)]:
            block = get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, slot: int, num_new_tokens: int, num_new_computed_tokens: int,
                       new_computed_blocks: Sequence[int], num_lookahead_tokens: int,
                       max_model_len: int) -> list[int] | None:
        """KVCacheManager.allocate_slots for this row: the new block ids, or None
        (changing nothing) when the pool has too few free blocks. Blocks that
        become full of computed tokens are registered in the prefix cache."""
        num_new_tokens = int64(num_new_tokens, "num_new_tokens")
        num_new_computed_tokens = int64(num_new_computed_tokens, "num_new_computed_tokens")
        num_lookahead_tokens = int64(num_lookahead_tokens, "num_lookahead_tokens")
        max_model_len = int64(max_model_len, "max_model_len")
        self._check(slot)
        pool = self._pool()
        new_computed_blocks = token_list(new_computed_blocks)  # ints, as the native list
        for b in new_computed_blocks:
            pool.ref_cnt(b)  # IndexError for an id outside the pool, before any change
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError("token counts must be >= 0")
        if num_new_tokens == 0 and not new_computed_blocks:
            raise ValueError("num_new_tokens must be positive")
        return self._allocate(slot, num_new_tokens, num_new_computed_tokens,
                              new_computed_blocks, num_lookahead_tokens, max_model_len)

    def _allocate(self, slot: int, num_new_tokens: int, num_new_computed_tokens: int,
                  new_computed_blocks: list[int], num_lookahead_tokens: int,
                  max_model_len: int) -> list[int] | None:
        """``allocate_slots`` on values already checked (schedule_running_py's
        block growth calls it directly)."""
        pool = self.block_pool
        blocks = self.block_ids[slot]
        bs = self.block_size
        num_computed = self.num_computed[slot] + num_new_computed_tokens
        num_needed = min(num_computed + num_new_tokens + num_lookahead_tokens, max_model_len)
        num_new = -(-num_needed // bs) - len(blocks) - len(new_computed_blocks)
        num_revived = sum(1 for b in new_computed_blocks if pool.ref_cnt(b) == 0)
        if num_new > pool.get_num_free_blocks() - num_revived:
            return None
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        new = pool.get_new_blocks(num_new) if num_new > 0 else []
        blocks.extend(new)
        if pool.enable_caching:
            self._cache_full(slot, pool, num_computed + num_new_tokens)
        return new

    def free_blocks(self, slot: int) -> None:
        """Release the row's blocks, tail first so its tail is evicted first."""
        self._check(slot)
        blocks = self.block_ids[slot]
        self.num_cached_blocks[slot] = 0
        if blocks:
            self.block_ids[slot] = []
            self._pool().free_blocks(reversed(blocks))

    def uncache_from(self, slot: int, num_tokens: int) -> None:
        """The row's tokens from ``num_tokens`` on were never computed (their step
        failed): its blocks past that point leave the prefix cache."""
        num_tokens = int64(num_tokens, "num_tokens")
        self._check(slot)
        blocks = self.block_ids[slot]
        if not blocks:
            return
        first = max(num_tokens, 0) // self.block_size
        self._pool().uncache(blocks[first:])
        if self.num_cached_blocks[slot] > first:
            self.num_cached_blocks[slot] = first

    # -- internals (the loops in scheduler_loops.py share these) ---------------------
    def _cache_full(self, slot: int, pool: Any, end: int) -> None:
        """Register the row's blocks full of computed tokens (up to token ``end``)."""
        n_tok = len(self.tokens[slot])
        num_full = min(end, n_tok) // self.block_size
        num_full = min(num_full, len(self.hashes[slot]))
        done = self.num_cached_blocks[slot]
        if num_full > done:
            pool.cache_full_blocks(self.block_ids[slot], self.hashes[slot], done, num_full)
            self.num_cached_blocks[slot] = num_full

    def _extend_hashes(self, slot: int) -> None:
        if not self.hash_blocks[slot]:
            return
        hashes = self.hashes[slot]
        bs = self.block_size
        toks = self.tokens[slot]
        done = len(hashes)
        if len(toks) >= (done + 1) * bs:
            hashes.extend(_hash(toks, done * bs, bs, hashes[-1] if done else None,
                                self.extra_keys[slot], self.block_extra_keys[slot][done:]))

    def _pool(self) -> Any:
        if self.block_pool is None:
            raise RuntimeError("this request table has no block pool (a request not yet "
                               "added to a scheduler holds no KV blocks)")
        return self.block_pool

    def _put(self, row: tuple) -> int:
        with self._lock:
            if self._free:
                slot = self._free.pop()
            else:
                slot = len(self.request_id)
                for column in self._columns():
                    column.append(None)
            (self.request_id[slot], self.tokens[slot], self.num_prompt[slot],
             self.num_computed[slot], self.status[slot], self.client_index[slot],
             self.max_tokens[slot], self.min_tokens[slot], self.eos_token_id[slot],
             self.ignore_eos[slot], self.stop_token_ids[slot], self.has_grammar[slot],
             self.spec[slot], self.priority[slot], self.arrival_time[slot],
             self.extra_keys[slot], self.hash_blocks[slot], self.hashes[slot],
             self.block_ids[slot], self.num_cached_blocks[slot],
             self.block_extra_keys[slot]) = row
            self._live += 1
        return slot

    def _columns(self) -> tuple[list, ...]:
        return (self.request_id, self.tokens, self.num_prompt, self.num_computed, self.status,
                self.client_index, self.max_tokens, self.min_tokens, self.eos_token_id,
                self.ignore_eos, self.stop_token_ids, self.has_grammar, self.spec,
                self.priority, self.arrival_time, self.extra_keys, self.hash_blocks,
                self.hashes, self.block_ids, self.num_cached_blocks, self.block_extra_keys)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < len(self.request_id) or self.request_id[slot] is None:
            raise int64_error(slot, "slot") or IndexError(f"no request in slot {slot}")


def _check_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def _check_bytes(value: Any, name: str) -> bytes:
    if not isinstance(value, bytes):
        raise TypeError(f"{name} must be bytes, got {type(value).__name__}")
    return value


def _check_bytes_list(value: Any, name: str) -> list[bytes]:
    try:
        items = list(value)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of bytes, got {type(value).__name__}") from None
    for item in items:
        _check_bytes(item, name)
    return items


def _check_hashes(hashes: Any, name: str) -> list[bytes]:
    hashes = list(hashes)
    for h in hashes:
        if not isinstance(h, bytes) or len(h) != 32:
            raise ValueError("block hashes are 32 bytes")
    return hashes


# How import_row checks each field of a row state: as `add` checks its arguments
# (and as the native import_row converts them), in export_row's order.
_ROW_FIELDS = (
    ("request_id", _check_str), ("tokens", lambda v, _: token_list(v)),
    ("num_prompt", int64), ("num_computed", int64), ("status", int32),
    ("client_index", int64), ("max_tokens", int64), ("min_tokens", int64),
    ("eos_token_id", int64), ("ignore_eos", boolean),
    ("stop_token_ids", lambda v, _: frozenset(token_list(v))), ("has_grammar", boolean),
    ("spec", lambda v, _: token_list(v)), ("priority", int64), ("arrival_time", number),
    ("extra_keys", _check_bytes), ("hash_blocks", boolean), ("hashes", _check_hashes),
    ("block_ids", lambda v, _: v), ("num_cached_blocks", int64),
    ("block_extra_keys", _check_bytes_list),
)


def _hash(tokens: list[int], start: int, block_size: int, parent: bytes | None,
          extra_keys: bytes, block_extras: Sequence[bytes] = ()) -> list[bytes]:
    """Hashes of the full blocks of tokens[start:], chained from ``parent``, with
    already-encoded extra keys; ``block_extras[i]`` goes before them in block i."""
    return chain_hashes_py(tokens[start:], block_size, parent, extra_keys, block_extras)


def request_table_class() -> type:
    """``_C.RequestTable`` on the native path, ``PyRequestTable`` otherwise."""
    return _native.twin("RequestTable", PyRequestTable)
