"""Engine-side state of one request."""

from __future__ import annotations

import enum
import time

from enginecore.protocol import EngineCoreRequest, FinishReason, LoRARequest, PoolingParams
from enginecore.sampling_params import SamplingParams
from enginecore.sched.block_hash import ExtraKey, block_hashes, encode_extra_keys


_NO_TOKEN_LIMIT = 2**62


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """A request as the scheduler sees it: tokens, progress, and its block hashes.

    Block hashes cover every full block of ``all_token_ids`` and are extended
    as output tokens are appended, never recomputed.
    """

    __slots__ = (
        "request_id",
        "client_index",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "priority",
        "lora_request",
        "cache_salt",
        "status",
        "stop_reason",
        "output_token_ids",
        "all_token_ids",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "spec_token_ids",
        "block_size",
        "block_hashes",
        "hash_algo",
        "_extra_keys",
        "_extra_bytes",
        "max_tokens",
        "min_tokens",
        "stop_token_ids",
        "ignore_eos",
        "current_wave",
        "pooling_params",
        "grammar",
        "grammar_error",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        *,
        client_index: int = 0,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        block_size: int = 16,
        hash_algo: str = "sha256",
        enable_block_hashes: bool = True,
        current_wave: int = 0,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.client_index = client_index
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.lora_request = lora_request
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []
        self.current_wave = current_wave
        self.pooling_params = pooling_params
        # llguidance matcher for structured outputs (set by EngineCore.preprocess_add_request).
        self.grammar = None
        self.grammar_error: str | None = None
        # Hot fields copied out of sampling_params: read every step.
        # None (no front-end resolved it): up to the context limit, which the
        # scheduler's max_model_len check enforces.
        self.max_tokens = (sampling_params.max_tokens if sampling_params.max_tokens is not None
                           else _NO_TOKEN_LIMIT)
        self.min_tokens = sampling_params.min_tokens
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.ignore_eos = sampling_params.ignore_eos
        self.block_size = block_size
        self.hash_algo = hash_algo
        keys: list[ExtraKey] = []
        if lora_request is not None:
            keys.append(lora_request.lora_int_id)
        if cache_salt is not None:
            keys.append(cache_salt)
        self._extra_keys = keys or None
        # Encoded once for the native update loop, which extends hashes itself.
        self._extra_bytes = encode_extra_keys(self._extra_keys)
        self.block_hashes: list[bytes] = []
        if enable_block_hashes:
            self.block_hashes = block_hashes(
                prompt_token_ids, block_size, extra_keys=self._extra_keys, algo=hash_algo
            )
        else:
            self.block_size = 0

    @classmethod
    def from_engine_core_request(
        cls,
        req: EngineCoreRequest,
        eos_token_id: int | None,
        block_size: int,
        hash_algo: str,
        enable_block_hashes: bool,
    ) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params or SamplingParams(),
            req.eos_token_id if req.eos_token_id is not None else eos_token_id,
            client_index=req.client_index,
            arrival_time=req.arrival_time or None,
            priority=req.priority,
            lora_request=req.lora_request,
            cache_salt=req.cache_salt,
            block_size=block_size,
            hash_algo=hash_algo,
            enable_block_hashes=enable_block_hashes,
            current_wave=req.current_wave,
            pooling_params=req.pooling_params,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request else 0

    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self._extend_block_hashes()

    def _extend_block_hashes(self) -> None:
        bs = self.block_size
        if not bs:
            return
        done = len(self.block_hashes)
        if len(self.all_token_ids) < (done + 1) * bs:
            return
        parent = self.block_hashes[-1] if done else None
        start = done * bs
        self.block_hashes.extend(
            block_hashes(
                self.all_token_ids[start:],
                bs,
                parent=parent,
                extra_keys=self._extra_keys,
                algo=self.hash_algo,
            )
        )

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.finish_reason(self.status)
