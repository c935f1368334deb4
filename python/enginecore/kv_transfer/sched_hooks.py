"""The scheduler's side of a KV connector (vLLM's Scheduler connector logic, in one place).

The Scheduler owns one ``ConnectorScheduling`` when a connector is configured and calls
it at five points: admitting a waiting request (``match`` / ``after_alloc``, or
``ready_after_recv`` for a request whose KV arrived asynchronously), the end of
``schedule()`` (``build_meta``), a request's finish (``request_finished``: the params for
the client and whether its blocks wait for a send), and each step's results
(``update_from_output``: finished sends / receives, load errors, stats).
"""

from __future__ import annotations

import logging
from typing import Any

from enginecore.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata
from enginecore.kv_transfer.kv_cache_blocks import KVCacheBlocks
from enginecore.kv_transfer.output import KVConnectorOutput
from enginecore.request import Request, RequestStatus

logger = logging.getLogger(__name__)

WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS


class ConnectorScheduling:
    def __init__(self, connector: KVConnectorBase_V1, block_size: int) -> None:
        self.connector = connector
        self.block_size = block_size
        self.fail_on_load_error = connector.kv_transfer_config.kv_load_failure_policy == "fail"
        # Received asynchronously, not yet admitted (vLLM's finished_recving_kv_req_ids).
        self.finished_recving_kv_req_ids: set[str] = set()
        # Finished requests whose blocks stay until the connector reports the send done.
        self.delayed_free: set[str] = set()
        # Requests whose request_finished already ran (it runs once per request).
        self._notified: set[str] = set()
        # Requests in WAITING_FOR_REMOTE_KVS (a set: one aborted while waiting leaves it).
        self.waiting_for_remote: set[str] = set()
        # Async loads that failed under "recompute": request -> its first failed block.
        self.failed_recv: dict[str, int] = {}
        # Cumulative: tokens the connector supplied instead of the model computing them.
        self.num_external_computed_tokens = 0
        self._stats: dict[str, Any] = {}

    # -- admission --------------------------------------------------------------------
    def match(self, request: Request, num_local_computed: int) -> tuple[int | None, bool]:
        """(external tokens, load async) beyond the local prefix-cache hits."""
        if (request.pooling_params is not None
                or request.sampling_params.prompt_logprobs is not None):
            return 0, False  # every prompt position is computed (as for the prefix cache)
        n, load_async = self.connector.get_num_new_matched_tokens(request, num_local_computed)
        if n is None:
            return None, False
        # At least the last token is computed: the model needs its logits.
        n = max(0, min(int(n), request.num_tokens - 1 - num_local_computed))
        return n, bool(load_async) and n > 0

    def after_alloc(self, request: Request, block_ids: list[int], num_local_blocks: int,
                    num_external: int, load_async: bool, kv: Any) -> None:
        self.connector.update_state_after_alloc(
            request, KVCacheBlocks(block_ids, num_local_blocks), num_external)
        request.num_external_computed_tokens = num_external
        self.num_external_computed_tokens += num_external
        if load_async:
            # Not in the prefix cache until the bytes are there.
            kv.uncache_from(request, num_local_blocks * self.block_size)
            request.status = WAITING_FOR_REMOTE_KVS
            self.waiting_for_remote.add(request.request_id)

    def ready_after_recv(self, request: Request, kv: Any) -> bool:
        """Whether a WAITING_FOR_REMOTE_KVS request's KV has arrived; if so it becomes
        WAITING with its loaded tokens counted as computed."""
        rid = request.request_id
        if rid not in self.finished_recving_kv_req_ids:
            return False
        self.finished_recving_kv_req_ids.discard(rid)
        self.waiting_for_remote.discard(rid)
        if rid in self.failed_recv:
            # Recompute: the request starts over from its local prefix-cache hits (its
            # blocks go back; the ones that arrived were never put in the prefix cache).
            self.failed_recv.pop(rid)
            logger.warning("request %s: its KV load failed; its prompt is recomputed", rid)
            kv.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            return True
        num_computed = min(len(kv.get_block_ids(request)) * self.block_size,
                           request.num_tokens - 1)
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.WAITING
        return True

    # -- each step ---------------------------------------------------------------------
    def build_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.connector.build_connector_meta(scheduler_output)

    def has_pending(self) -> bool:
        """Transfers in flight: the engine keeps stepping so the workers report them."""
        return bool(self.delayed_free or self.waiting_for_remote)

    @property
    def num_waiting_for_remote(self) -> int:
        return len(self.waiting_for_remote)

    def request_finished(self, request: Request, block_ids: list[int]) -> dict[str, Any] | None:
        """The connector's request_finished, once per request; the params for the client."""
        rid = request.request_id
        if rid in self._notified:
            return None
        self._notified.add(rid)
        delay, params = self.connector.request_finished(request, block_ids)
        if delay:
            self.delayed_free.add(rid)
        return params

    def forget(self, request_id: str) -> None:
        self._notified.discard(request_id)
        self.delayed_free.discard(request_id)
        self.waiting_for_remote.discard(request_id)
        self.failed_recv.pop(request_id, None)
        self.finished_recving_kv_req_ids.discard(request_id)

    def update_from_output(self, output: KVConnectorOutput | None) -> list[str]:
        """Fold the workers' connector output in; the ids whose delayed blocks may go."""
        if output is None:
            return []
        self.connector.update_connector_output(output)
        if output.finished_recving:
            self.finished_recving_kv_req_ids |= output.finished_recving
        for key, value in (output.kv_connector_stats or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._stats[key] = self._stats.get(key, 0) + value
            else:
                self._stats[key] = value
        return [rid for rid in output.finished_sending or () if rid in self.delayed_free]

    def take_stats(self) -> dict[str, Any] | None:
        stats, self._stats = self._stats, {}
        return stats or None
