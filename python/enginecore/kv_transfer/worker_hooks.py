"""The model runner's side of a KV connector: the worker-role calls around the forward.

Per step (vLLM's KVConnectorModelRunnerMixin order): ``handle_preemptions``,
``bind_connector_metadata`` and ``start_load_kv`` before the forward; inside it, per
layer, ``wait_for_layer_load`` before the layer's attention and ``save_kv_layer`` after
it (llama.py calls this object's ``wait_for_layer_load`` / ``save_kv_layer`` with the
layer index); after it ``wait_for_save``, ``get_finished``, the load errors and stats
into a ``KVConnectorOutput``, then ``clear_connector_metadata``. A step with no tokens
runs the same calls without a forward, so finished transfers are still reported.

The KV cache a connector sees (``register_kv_caches``): layer name
``model.layers.{i}.self_attn.attn`` -> one tensor per layer in vLLM's layout
``[2, num_blocks + 1, block_size, num_kv_heads, head_dim]`` (K then V; the last block
is the runner's scratch block), token ``t`` of block ``b`` at ``[:, b, t]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from enginecore.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole
from enginecore.kv_transfer.factory import KVConnectorFactory
from enginecore.kv_transfer.output import KVConnectorOutput


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


@dataclass
class ForwardContext:
    """What start_load_kv gets (vLLM's ForwardContext, the fields connectors read)."""

    attn_metadata: Any = None
    # layer name -> that layer's KV cache tensor (the registered ones).
    no_compile_layers: dict[str, Any] = field(default_factory=dict)


class ConnectorWorker:
    def __init__(self, connector: KVConnectorBase_V1) -> None:
        self.connector = connector
        self.kv_caches: dict[str, Any] = {}
        self._names: list[str] = []
        self._attn_metadata: Any = None

    @classmethod
    def maybe_create(cls, config: Any) -> ConnectorWorker | None:
        kvc = getattr(config, "kv_transfer_config", None)
        if kvc is None or not kvc.is_kv_transfer_instance:
            return None
        return cls(KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER))

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.kv_caches = kv_caches
        self._names = list(kv_caches)
        self.connector.register_kv_caches(kv_caches)

    # -- around one step ----------------------------------------------------------------
    def start(self, scheduler_output: Any, attn_metadata: Any = None) -> None:
        c = self.connector
        if scheduler_output.preempted_req_ids:
            c.handle_preemptions(scheduler_output.preempted_req_ids)
        if scheduler_output.kv_connector_metadata is not None:
            c.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        self._attn_metadata = attn_metadata
        c.start_load_kv(ForwardContext(attn_metadata, self.kv_caches))

    def wait_for_layer_load(self, index: int) -> None:
        self.connector.wait_for_layer_load(self._names[index])

    def save_kv_layer(self, index: int) -> None:
        name = self._names[index]
        self.connector.save_kv_layer(name, self.kv_caches[name], self._attn_metadata)

    def finish(self, scheduler_output: Any) -> KVConnectorOutput:
        c = self.connector
        try:
            c.wait_for_save()
            sending, recving = c.get_finished(scheduler_output.finished_req_ids)
            stats = c.get_kv_connector_stats()
            stats = getattr(stats, "data", stats)  # vLLM's KVConnectorStats holds a dict
            return KVConnectorOutput(
                finished_sending=sending or None, finished_recving=recving or None,
                kv_connector_stats=stats or None,
                invalid_block_ids=set(c.get_block_ids_with_load_errors()))
        finally:
            self._attn_metadata = None
            c.clear_connector_metadata()

    def no_forward(self, scheduler_output: Any) -> KVConnectorOutput:
        """A step without tokens: no forward, but transfers still progress and report."""
        self.start(scheduler_output)
        return self.finish(scheduler_output)

    def handshake_metadata(self) -> Any:
        return self.connector.get_handshake_metadata()

    def shutdown(self) -> None:
        self.connector.shutdown()
