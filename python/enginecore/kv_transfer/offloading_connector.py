"""OffloadingConnector: a second KV tier in host memory behind the engine's own cache
(vLLM's OffloadingConnector semantics; kv_role ``kv_both``).

Blocks of finished requests are copied to the tier (so blocks the engine's cache later
evicts are kept there), and a waiting request's prefix beyond the local hits is brought
back from it asynchronously, overlapped with the engine's steps. Hit counters: the
scheduler side's ``offload_lookups`` / ``offload_hit_blocks`` / ``offload_stored_blocks``
/ ``offload_evicted_blocks`` (``connector_scheduler.stats()``) and the workers'
``offload_loaded_blocks`` / ``offload_stored_blocks`` in the KV transfer stats.

``kv_connector_extra_config``: ``num_cpu_blocks`` (vLLM's key: the tier's size in
blocks of the engine's block size; required).
"""

from __future__ import annotations

from typing import Any

from enginecore.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole
from enginecore.kv_transfer.offload_scheduler import OffloadingConnectorMetadata, OffloadScheduler
from enginecore.kv_transfer.offload_worker import OffloadWorker


def _num_cpu_blocks(extra: dict) -> int:
    n = extra.get("num_cpu_blocks")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError("OffloadingConnector needs kv_connector_extra_config.num_cpu_blocks "
                         f"(a positive integer: the host tier's size in blocks), got {n!r}")
    return n


class OffloadingConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        slots = _num_cpu_blocks(dict(self.kv_transfer_config.kv_connector_extra_config))
        self.connector_scheduler: OffloadScheduler | None = None
        self.connector_worker: OffloadWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = OffloadScheduler(vllm_config.cache_config.block_size,
                                                        slots)
        else:
            self.connector_worker = OffloadWorker(slots)

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self.connector_scheduler.get_num_new_matched_tokens(request,
                                                                   num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self.connector_scheduler.update_state_after_alloc(request, blocks,
                                                          num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> OffloadingConnectorMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self.connector_scheduler.update_connector_output(connector_output)

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        self.connector_worker.start_load_kv(
            meta if isinstance(meta, OffloadingConnectorMetadata) else None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are whole-request and asynchronous (WAITING_FOR_REMOTE_KVS)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # stores copy whole finished blocks, on the copier's thread

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self.connector_worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.connector_worker.take_load_errors()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        if self.connector_worker is None:
            return None
        return self.connector_worker.stats() or None

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
