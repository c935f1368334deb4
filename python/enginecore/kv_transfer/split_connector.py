"""A connector whose two roles are two objects: ``connector_scheduler`` in the
scheduler, ``connector_worker`` in each model runner (vLLM's NixlConnector and
OffloadingConnector are built this way). Every hook of the role is passed to its
object; subclasses make the two objects and say which metadata type their worker
side reads."""

from __future__ import annotations

from typing import Any

from enginecore.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata


class SplitRoleConnector(KVConnectorBase_V1):
    # The step metadata the worker side reads (anything else reaches it as None).
    metadata_type: type[KVConnectorMetadata] = KVConnectorMetadata
    connector_scheduler: Any = None
    connector_worker: Any = None

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self.connector_scheduler.get_num_new_matched_tokens(request,
                                                                   num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self.connector_scheduler.update_state_after_alloc(request, blocks,
                                                          num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
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
        self.connector_worker.start_load_kv(meta if isinstance(meta, self.metadata_type)
                                            else None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are whole-request and asynchronous (WAITING_FOR_REMOTE_KVS)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # the worker side moves whole blocks on its own threads

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
