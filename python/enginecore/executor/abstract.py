"""The executor interface EngineCore drives (vLLM v1's ``Executor`` shape)."""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from enginecore.config import EngineConfig
from enginecore.kv_transfer.output import KVOutputAggregator
from enginecore.protocol import LoRARequest
from enginecore.sched.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the KV cache of one attention layer group (one group: full attention)."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block takes across all layers, K and V."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * (
            self.dtype_bytes
        )


@dataclass
class KVCacheConfig:
    num_blocks: int
    spec: KVCacheSpec


def completed_future(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class Executor(abc.ABC):
    """Runs the model. ``execute_model`` may return a Future (``non_block``);
    when it yields None, sampling was deferred and ``sample_tokens`` gives the
    tokens (used for structured outputs)."""

    #: Methods ``collective_rpc`` may call on workers; anything else is refused.
    RPC_METHODS: frozenset[str] = frozenset()

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.is_failed = False
        self._failure_callbacks: list[Callable[[], None]] = []
        self._sleeping_level = 0
        self._init_executor()

    @abc.abstractmethod
    def _init_executor(self) -> None: ...

    # -- KV cache sizing -----------------------------------------------------------
    @abc.abstractmethod
    def get_kv_cache_specs(self) -> KVCacheSpec: ...

    @abc.abstractmethod
    def determine_available_memory(self) -> int:
        """Bytes available for the KV cache."""

    @abc.abstractmethod
    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None: ...

    # -- running ---------------------------------------------------------------------
    @property
    def max_concurrent_batches(self) -> int:
        return 1

    @abc.abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future | None:
        ...

    def sample_tokens(self, grammar_output: Any = None, non_block: bool = False) -> Any:
        raise NotImplementedError(f"{type(self).__name__} samples inside execute_model")

    @abc.abstractmethod
    def execute_dummy_batch(self) -> None: ...

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call an allow-listed worker method on every worker; one result each."""
        if method not in self.RPC_METHODS:
            raise ValueError(
                f"collective_rpc method {method!r} is not allowed; allowed: "
                f"{sorted(self.RPC_METHODS)}"
            )
        return [getattr(self, "_rpc_" + method)(*args, **(kwargs or {}))]

    # -- KV transfer -------------------------------------------------------------------
    def init_kv_output_aggregator(self, connector: Any) -> None:
        """A KV connector is configured: finished sends / receives are combined across
        this executor's workers (a request is done once every worker reports it)."""
        self.kv_output_aggregator = KVOutputAggregator.from_connector(connector,
                                                                      self.world_size)

    @property
    def world_size(self) -> int:
        return 1

    def get_kv_connector_handshake_metadata(self) -> list[dict[tuple[int, int], Any]]:
        """Per worker, {(pp_rank, tp_rank): its connector's handshake metadata}."""
        return []

    # -- lifecycle ---------------------------------------------------------------------
    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        """Called (once per callback) when the executor fails for good."""
        if self.is_failed:
            callback()
        else:
            self._failure_callbacks.append(callback)

    def _mark_failed(self) -> None:
        if self.is_failed:
            return
        self.is_failed = True
        for cb in self._failure_callbacks:
            try:
                cb()
            except Exception:  # a callback must not hide the failure
                logger.exception("executor failure callback raised")

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._sleeping_level = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._sleeping_level = 0

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping_level > 0

    def profile(self, is_start: bool = True) -> None:  # noqa: B027 - optional hook
        pass

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        pass

    # -- LoRA ------------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA")

    def remove_lora(self, lora_id: int) -> bool:
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA")

    def list_loras(self) -> set[int]:
        return set()

    def pin_lora(self, lora_id: int) -> bool:
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA")

    # -- misc ----------------------------------------------------------------------------
    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def save_sharded_state(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no weights to save")

