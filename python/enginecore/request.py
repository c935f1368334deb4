"""Engine-side state of one request."""

from __future__ import annotations

import enum
import time
from typing import Any

from enginecore.multimodal.inputs import MultiModalFeatureSpec
from enginecore.protocol import EngineCoreRequest, FinishReason, LoRARequest, PoolingParams
from enginecore.sampling_params import SamplingParams
from enginecore.sched.block_hash import ExtraKey, check_algo, encode_extra_keys
from enginecore.sched.request_table import request_table_class


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
    """A request as the scheduler sees it: a typed view of its row in a request
    table (tokens, progress, stop parameters, block table and block hashes,
    sched/request_table.py) plus the fields no hot loop reads.

    Block hashes cover every full block of ``all_token_ids`` and are extended
    as output tokens are appended, never recomputed. A request made without a
    ``table`` gets a table of its own and moves to the scheduler's when added.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "priority",
        "lora_request",
        "cache_salt",
        "stop_reason",
        "num_cached_tokens",
        "num_preemptions",
        "block_size",
        "hash_algo",
        "max_tokens",
        "min_tokens",
        "stop_token_ids",
        "ignore_eos",
        "current_wave",
        "pooling_params",
        "mm_features",
        "_grammar",
        "grammar_error",
        "table",
        "slot",
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
        table: Any = None,
        mm_features: list[MultiModalFeatureSpec] | None = None,
    ) -> None:
        self.table = None
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.lora_request = lora_request
        self.cache_salt = cache_salt
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.current_wave = current_wave
        self.pooling_params = pooling_params
        # Images (vLLM's MultiModalFeatureSpec), in placeholder order; None: text only.
        self.mm_features = (sorted(mm_features, key=lambda f: f.mm_position.offset)
                            if mm_features else None)
        # llguidance matcher for structured outputs (set by EngineCore.preprocess_add_request).
        self._grammar = None
        self.grammar_error: str | None = None
        # None (no front-end resolved it): up to the context limit, which the
        # scheduler's max_model_len check enforces.
        self.max_tokens = (sampling_params.max_tokens if sampling_params.max_tokens is not None
                           else _NO_TOKEN_LIMIT)
        self.min_tokens = sampling_params.min_tokens
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.ignore_eos = sampling_params.ignore_eos
        self.hash_algo = hash_algo
        if enable_block_hashes:
            check_algo(hash_algo)
        keys: list[ExtraKey] = []
        if lora_request is not None:
            keys.append(lora_request.lora_int_id)
        if cache_salt is not None:
            keys.append(cache_salt)
        if self.mm_features:
            # Two prompts with the same placeholder tokens but other images must
            # not share blocks: the items' identifiers key every block.
            keys.extend(f.identifier for f in self.mm_features)
        if table is None:
            table = request_table_class()(None, block_size)
        elif table.block_size != block_size:
            raise ValueError(f"block_size {block_size} differs from its table's "
                             f"{table.block_size}")
        self.block_size = block_size if enable_block_hashes else 0
        self.slot = table.add(
            request_id, prompt_token_ids, client_index, self.max_tokens, self.min_tokens,
            -1 if eos_token_id is None else eos_token_id, self.ignore_eos,
            sorted(self.stop_token_ids), priority, self.arrival_time,
            encode_extra_keys(keys or None), enable_block_hashes)
        self.table = table

    def __del__(self) -> None:
        table = self.table
        if table is not None:
            try:
                table.free_blocks(self.slot)
                table.release(self.slot)
            except Exception:  # noqa: BLE001 - interpreter shutdown: nothing to keep
                pass

    def move_to(self, table: Any) -> None:
        """Move this request's row to ``table`` (a scheduler's); it must hold no blocks."""
        if table is self.table:
            return
        if table.block_size != self.table.block_size:
            raise ValueError(f"block_size {self.table.block_size} differs from the "
                             f"scheduler's {table.block_size}")
        old, old_slot = self.table, self.slot
        self.slot = table.import_row(old.export_row(old_slot))
        self.table = table
        old.release(old_slot)

    @classmethod
    def from_engine_core_request(
        cls,
        req: EngineCoreRequest,
        eos_token_id: int | None,
        block_size: int,
        hash_algo: str,
        enable_block_hashes: bool,
        table: Any = None,
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
            table=table,
            mm_features=req.mm_features,
        )

    # -- the row's fields ------------------------------------------------------------
    @property
    def status(self) -> RequestStatus:
        return RequestStatus(self.table.get_status(self.slot))

    @status.setter
    def status(self, status: RequestStatus) -> None:
        self.table.set_status(self.slot, int(status))

    @property
    def num_computed_tokens(self) -> int:
        return self.table.get_num_computed_tokens(self.slot)

    @num_computed_tokens.setter
    def num_computed_tokens(self, n: int) -> None:
        self.table.set_num_computed_tokens(self.slot, n)

    @property
    def client_index(self) -> int:
        return self.table.get_client_index(self.slot)

    @property
    def all_token_ids(self) -> list[int]:
        """The prompt and output tokens (a copy)."""
        return self.table.get_token_ids(self.slot)

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens (a copy)."""
        return self.table.get_output_token_ids(self.slot)

    @property
    def spec_token_ids(self) -> list[int]:
        """Draft tokens proposed for the next step (a copy)."""
        return self.table.get_spec_token_ids(self.slot)

    @spec_token_ids.setter
    def spec_token_ids(self, token_ids: list[int]) -> None:
        self.table.set_spec_token_ids(self.slot, token_ids)

    @property
    def block_hashes(self) -> list[bytes]:
        """The hash of every full block of ``all_token_ids``, on demand."""
        return self.table.get_block_hashes(self.slot)

    @property
    def grammar(self) -> Any:
        return self._grammar

    @grammar.setter
    def grammar(self, grammar: Any) -> None:
        self._grammar = grammar
        self.table.set_has_grammar(self.slot, grammar is not None)

    @property
    def num_tokens(self) -> int:
        return self.table.get_num_tokens(self.slot)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.table.get_num_tokens(self.slot) - len(self.prompt_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request else 0

    def is_finished(self) -> bool:
        return self.table.get_status(self.slot) >= RequestStatus.FINISHED_STOPPED

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.table.append_token_ids(self.slot, token_ids)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.finish_reason(self.status)
