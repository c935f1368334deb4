"""SyntheticExecutor: a measuring instrument for the engine, never the default.

Tokens are a pure function of (request seed, position), so any schedule,
preemption or batch composition gives the same tokens; steps take a
configurable latency, and up to ``max_concurrent_batches`` run at once.
"""

from __future__ import annotations

import struct
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from operator import index
from typing import Any

from enginecore import _native
from enginecore.executor.abstract import Executor, KVCacheConfig, KVCacheSpec, completed_future
from enginecore.model.lora_slots import LoRASlots
from enginecore.protocol import LoRARequest
from enginecore.sched.arg_checks import INT64_MAX
from enginecore.sched.output import ModelRunnerOutput, SchedulerOutput

_MASK = (1 << 64) - 1
# A request's state: its seed and the number of tokens the runner knows, in a
# 16-byte bytearray both loops update in place (native byte order: the C++ loop
# reads it with memcpy), so a step allocates no int per request for it.
_STATE = struct.Struct("=Qq")


def _check_state(state: Any) -> None:
    if type(state) is not bytearray or len(state) != _STATE.size:
        raise TypeError("synthetic state entries are 16-byte bytearrays (seed, known)")


def new_state(seed: int, known: int) -> bytearray:
    """A request's synthetic state (see ``_STATE``)."""
    return bytearray(_STATE.pack(seed, known))


def state_fields(state: bytearray) -> tuple[int, int]:
    """(seed, tokens the runner knows) of a state from ``new_state``."""
    return _STATE.unpack(state)


def synthetic_token(seed: int, position: int, vocab_size: int) -> int:
    """splitmix64 of (seed, position), reduced to the vocabulary."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E019) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) % vocab_size


def request_seed(seed: int | None, prompt_token_ids: list[int]) -> int:
    """The request's seed, or (unseeded) a CRC of its prompt, so equal prompts agree."""
    if seed is not None:
        return seed & _MASK
    return zlib.crc32(bytes(str(prompt_token_ids[:256]), "ascii")) | (len(prompt_token_ids) << 32)


def synthetic_sample_py(
    scheduled: dict[str, int], spec: dict[str, list[int]], state: dict[str, bytearray],
    cached_ids: list[str], cached_computed: list[int], new_computed: dict[str, int],
    vocab_size: int,
) -> tuple[list[str], dict[str, int], list[list[int]]]:
    """The per-request loop (twin of csrc/synthetic_sampler.cpp): (req_ids,
    req_id_to_index, sampled). ``state`` is req_id -> ``new_state(seed, tokens
    the runner knows)``, updated in place; drafts are accepted while they equal
    the tokens this instrument samples."""
    if vocab_size <= 0:
        raise ValueError("vocab_size must be positive")
    computed = dict(zip(cached_ids, cached_computed))
    computed.update(new_computed)
    req_ids = list(scheduled)
    sampled: list[list[int]] = []
    for rid, num_scheduled in scheduled.items():
        st = state[rid]
        _check_state(st)
        seed, known = state_fields(st)
        drafts = spec.get(rid)
        n = num_scheduled - len(drafts) if drafts else num_scheduled
        if computed[rid] + n < known:
            sampled.append([])  # mid-prefill chunk: nothing to sample
            continue
        pos = known
        tokens = [synthetic_token(seed, pos, vocab_size)]
        if drafts:
            for d in drafts:
                if index(d) != tokens[-1]:  # an int as the native loop reads it
                    break
                pos += 1
                tokens.append(synthetic_token(seed, pos, vocab_size))
        known_after = known + len(tokens)
        if known_after > INT64_MAX:
            raise ValueError("synthetic state: tokens known past int64")
        _check_state(st)  # again, as the native loop (a draft's Python code ran)
        _STATE.pack_into(st, 0, seed, known_after)
        sampled.append(tokens)
    return req_ids, {r: i for i, r in enumerate(req_ids)}, sampled


class SyntheticExecutor(Executor):
    RPC_METHODS = frozenset({"echo", "num_steps"})

    def _init_executor(self) -> None:
        mc = self.config.model_config
        self.vocab_size = mc.vocab_size
        self.latency_s = self.config.executor_config.synthetic_step_latency_s
        self._max_batches = self.config.executor_config.max_concurrent_batches
        # req_id -> new_state(seed, number of tokens the runner knows)
        self._state: dict[str, bytearray] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.num_steps = 0
        self.num_dummy_batches = 0
        self._loras: LoRASlots[LoRARequest] = LoRASlots(self.config.lora_config.max_loras)
        self.kv_cache_config: KVCacheConfig | None = None

    @property
    def max_concurrent_batches(self) -> int:
        return self._max_batches

    def get_kv_cache_specs(self) -> KVCacheSpec:
        mc = self.config.model_config
        return KVCacheSpec(
            self.config.cache_config.block_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, 4
        )

    def determine_available_memory(self) -> int:
        return self.config.cache_config.kv_cache_memory_bytes or (1 << 30)

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future:
        if self.is_sleeping:
            raise RuntimeError("execute_model called while the executor sleeps")
        output = self._run(scheduler_output)
        if self.latency_s <= 0:
            return completed_future(output) if non_block else output
        if not non_block:
            time.sleep(self.latency_s)
            return output
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_batches, thread_name_prefix="synthetic")
        return self._pool.submit(self._after_latency, output)

    def _after_latency(self, output: ModelRunnerOutput) -> ModelRunnerOutput:
        time.sleep(self.latency_s)
        return output

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        state = self._state
        with self._lock:
            self.num_steps += 1
            for rid in so.finished_req_ids:
                state.pop(rid, None)
            for rid in so.preempted_req_ids:
                state.pop(rid, None)
            new_computed: dict[str, int] = {}
            for new in so.scheduled_new_reqs:
                seed = request_seed(new.sampling_params.seed,
                                    new.token_ids[: new.num_prompt_tokens])
                state[new.req_id] = new_state(seed, len(new.token_ids))
                new_computed[new.req_id] = new.num_computed_tokens
            cached = so.scheduled_cached_reqs
            ext = _native.extension()
            sample = ext.synthetic_sample if ext is not None else synthetic_sample_py
            req_ids, index_of, sampled = sample(
                so.num_scheduled_tokens, so.scheduled_spec_decode_tokens, state, cached.req_ids,
                cached.num_computed_tokens, new_computed, self.vocab_size)
        return ModelRunnerOutput(req_ids, index_of, sampled)

    def execute_dummy_batch(self) -> None:
        self.num_dummy_batches += 1
        if self.latency_s > 0:
            time.sleep(self.latency_s)

    def _rpc_echo(self, value: Any = None) -> Any:
        return value

    def _rpc_num_steps(self) -> int:
        return self.num_steps

    def add_lora(self, lora_request: LoRARequest) -> bool:
        self._loras.add(lora_request.lora_int_id, lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return self._loras.remove(lora_id)

    def list_loras(self) -> set[int]:
        return self._loras.ids()

    def pin_lora(self, lora_id: int) -> bool:
        return self._loras.pin(lora_id)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
