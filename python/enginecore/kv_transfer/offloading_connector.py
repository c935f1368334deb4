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

from enginecore.kv_transfer.base import KVConnectorRole
from enginecore.kv_transfer.offload_scheduler import OffloadingConnectorMetadata, OffloadScheduler
from enginecore.kv_transfer.offload_worker import OffloadWorker
from enginecore.kv_transfer.split_connector import SplitRoleConnector


def _num_cpu_blocks(extra: dict) -> int:
    n = extra.get("num_cpu_blocks")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError("OffloadingConnector needs kv_connector_extra_config.num_cpu_blocks "
                         f"(a positive integer: the host tier's size in blocks), got {n!r}")
    return n


class OffloadingConnector(SplitRoleConnector):
    metadata_type = OffloadingConnectorMetadata

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
