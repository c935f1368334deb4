"""PDConnector: disaggregated prefill/decode over the project's CurveZMQ block transport,
with vLLM's NixlConnector semantics (registered as ``PDConnector`` and, since NIXL has
no build on these machines, as ``NixlConnector``: a vLLM P/D launch line works as is).

``kv_role``: ``kv_producer`` (serves blocks), ``kv_consumer`` (pulls them) or
``kv_both``; what a request does is up to its ``kv_transfer_params`` (``enginecore
proxy`` sets them). ``kv_connector_extra_config``:

* ``host`` (127.0.0.1) / ``port`` (0: any free one) -- where a producer serves blocks,
  and what it tells decode engines (``remote_host`` / ``remote_port``);
* ``curve`` (true), ``curve_key_file`` -- the deployment's CURVE keys (pd_keys.py);
* ``transfer_timeout_s`` (30) -- a pull that hears nothing that long fails
  (``kv_load_failure_policy``: ``recompute`` the prompt here, or ``fail`` the request);
* ``lease_s`` (480) -- a producer frees blocks nobody pulled within that long;
* ``chunk_blocks`` (64) / ``window`` (4) -- blocks per pull, pulls in flight.
"""

from __future__ import annotations

from typing import Any

from enginecore.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole
from enginecore.kv_transfer.pd_scheduler import PDConnectorMetadata, PDScheduler
from enginecore.kv_transfer.pd_worker import PDWorker


class PDConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kvc = self.kv_transfer_config
        extra = dict(kvc.kv_connector_extra_config)
        block_size = vllm_config.cache_config.block_size
        produce, consume = kvc.is_kv_producer, kvc.is_kv_consumer
        self.connector_scheduler: PDScheduler | None = None
        self.connector_worker: PDWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = PDScheduler(
                str(kvc.engine_id), block_size, produce, consume,
                str(extra.get("host", "127.0.0.1")), int(extra.get("port", 0)))
        else:
            mc = vllm_config.model_config
            self.connector_worker = PDWorker(str(kvc.engine_id), block_size, produce,
                                             consume, extra,
                                             str(getattr(mc, "model", "") or ""))

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self.connector_scheduler.get_num_new_matched_tokens(request,
                                                                   num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self.connector_scheduler.update_state_after_alloc(request, blocks,
                                                          num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> PDConnectorMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self.connector_scheduler.update_connector_output(connector_output)

    def set_xfer_handshake_metadata(self, metadata: dict[tuple[int, int], Any]) -> None:
        self.connector_scheduler.set_handshake(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]
                                             ) -> None:
        self.set_xfer_handshake_metadata(metadata)

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.connector_worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> Any:
        return self.connector_worker.handshake()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        self.connector_worker.start_load_kv(meta if isinstance(meta, PDConnectorMetadata)
                                            else None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # pulls are whole-request and asynchronous (WAITING_FOR_REMOTE_KVS)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # the blocks are served from the cache itself once registered

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
