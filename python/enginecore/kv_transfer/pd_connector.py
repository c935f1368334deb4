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

from enginecore.kv_transfer.base import KVConnectorRole
from enginecore.kv_transfer.pd_scheduler import PDConnectorMetadata, PDScheduler
from enginecore.kv_transfer.pd_worker import PDWorker
from enginecore.kv_transfer.split_connector import SplitRoleConnector


class PDConnector(SplitRoleConnector):
    metadata_type = PDConnectorMetadata

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

    def set_xfer_handshake_metadata(self, metadata: dict[tuple[int, int], Any]) -> None:
        self.connector_scheduler.set_handshake(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]
                                             ) -> None:
        self.set_xfer_handshake_metadata(metadata)

    def get_handshake_metadata(self) -> Any:
        return self.connector_worker.handshake()
