"""KVConnectorBase_V1: vLLM's v1 connector contract, two roles in one class.

The scheduler-role instance lives in the engine core's scheduler and decides which tokens
come from outside; the worker-role instance lives in the model runner and moves the bytes.
They talk only through the KVConnectorMetadata the scheduler builds each step, which rides
on SchedulerOutput.kv_connector_metadata. A connector written for vLLM ports by changing
imports (the engine config takes vLLM's vllm_config place)."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from enginecore.kv_transfer.kv_transfer_config import KVTransferConfig


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0  # in the engine core's scheduler
    WORKER = 1     # in the model runner (one per worker)


class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step (connector-defined)."""


class KVConnectorHandshakeMetadata:
    """Out-of-band metadata a worker publishes for peers (P/D); connector-defined."""


class KVConnectorBase_V1(ABC):
    """``vllm_config`` is the EngineConfig (vLLM's VllmConfig place): connectors read
    ``vllm_config.kv_transfer_config``, ``.cache_config.block_size``, ``.model_config``."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        config = getattr(vllm_config, "kv_transfer_config", None)
        if config is None:
            raise ValueError("kv_transfer_config must be set for a KV connector")
        self._vllm_config = vllm_config
        self._kv_transfer_config: KVTransferConfig = config
        self._kv_cache_config = kv_cache_config
        self._role = role
        self._connector_metadata: KVConnectorMetadata | None = None

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @property
    def kv_transfer_config(self) -> KVTransferConfig:
        return self._kv_transfer_config

    # ---- worker side -------------------------------------------------------------------
    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The runner calls this before the forward with the step's metadata."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """The runner calls this after the forward."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None, "no connector metadata bound"
        return self._connector_metadata

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Once at start-up: layer name -> that layer's KV-cache tensor."""

    @abstractmethod
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Before the forward: start loading the bound metadata's KV into the cache."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until layer_name's KV is loaded (called before that layer's attention)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """After a layer's attention: start saving that layer's KV."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """After the forward: block until every save started this step is done."""

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose async send / async receive finished since the last call:
        (finished_sending, finished_recving). None: nothing to report."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed (kv_load_failure_policy decides what happens)."""
        return set()

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources (threads, files, sockets)."""

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """Counters for SchedulerStats / metrics (connector-defined keys)."""
        return None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Worker side: metadata peers need to reach this worker (P/D)."""
        return None

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:  # noqa: B027 - optional hook
        """Where a host buffer is used: the device <-> host copy function."""

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:  # noqa: B027 - optional hook
        """Worker side, before the step: these requests were preempted (their blocks
        may be reused); finish or cancel what touches them."""

    def get_finished_count(self) -> int | None:
        """How many workers must report a request finished (None: every worker)."""
        return None

    # ---- scheduler side ----------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens beyond num_computed_tokens (local prefix hits) the connector can supply:
        (n, load_async). n None: ask again later; load_async True: the request waits in
        WAITING_FOR_REMOTE_KVS until get_finished reports it received."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """After the scheduler allocated blocks for the request. ``blocks`` is a
        KVCacheBlocks: ``blocks.get_block_ids()[0]`` is every block the request holds
        (its prefix-cache hits first); with num_external_tokens > 0 the connector loads
        those tokens into the blocks after the local hits."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Once per step: the metadata for the worker side; resets per-step state."""

    def update_connector_output(self, connector_output: Any) -> None:  # noqa: B027 - optional hook
        """The workers' KVConnectorOutput of the last step (finished sets, stats)."""

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """On finish or abort: (delay_free, kv_transfer_params). delay_free True keeps the
        blocks until get_finished reports the send done; the params go back to the client."""
        return False, None

    def take_events(self) -> Iterable[Any]:
        """KV cache events the connector produced since the last call."""
        return ()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]  # noqa: B027 - optional hook
                                    ) -> None:
        """Scheduler side: the workers' handshake metadata, keyed by tp rank."""

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        """Scheduler side: the workers' metadata keyed by (pp_rank, tp_rank); a
        connector that knows no pipeline stages gets stage 0 by tp rank."""
        self.set_xfer_handshake_metadata(
            {tp: meta for (pp, tp), meta in metadata.items() if pp == 0})

    @classmethod
    def get_required_kvcache_layout(cls, engine_config: Any) -> str | None:
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return None
