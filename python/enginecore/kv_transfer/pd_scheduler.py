"""The P/D connector's scheduler side (vLLM's NixlConnectorScheduler semantics).

Producer (a request with ``kv_transfer_params.do_remote_decode``): when it finishes
(the proxy asked for one token) its full prompt blocks are kept (``delay_free``) and
registered with the worker's block server; ``request_finished`` returns the params a
decode engine needs: ``do_remote_prefill``, ``remote_engine_id``, ``remote_block_ids``,
``remote_host``, ``remote_port`` (and ``remote_request_id``: the producer's id, which
the decode engine's request does not share). Only full blocks travel: the decode
engine computes the last partial block (and at least the last token) itself.

Consumer (a request with ``do_remote_prefill``): ``get_num_new_matched_tokens``
offers the remote blocks beyond the local prefix-cache hits, asynchronously; the
request waits in WAITING_FOR_REMOTE_KVS while the worker pulls them. Its params are
used once: after the pull (arrived or failed) the request is scheduled as usual.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from enginecore.kv_transfer.base import KVConnectorMetadata
from enginecore.kv_transfer.pd_block_client import PullJob, ReleaseJob
from enginecore.kv_transfer.transfer_params import check_kv_transfer_params
from enginecore.request import RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class PDHandshake:
    """What a worker tells the scheduler side (and so the decode engines) about itself."""

    engine_id: str
    host: str
    port: int


@dataclass
class PDConnectorMetadata(KVConnectorMetadata):
    reqs_to_recv: dict[str, PullJob] = field(default_factory=dict)
    reqs_to_send: dict[str, list[int]] = field(default_factory=dict)
    # Producers' blocks this engine did not need (all local prefix hits): freed unpulled.
    reqs_to_release: list[ReleaseJob] = field(default_factory=list)


class PDScheduler:
    def __init__(self, engine_id: str, block_size: int, produce: bool, consume: bool,
                 host: str, port: int) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        self.produce = produce
        self.consume = consume
        self.host = host
        self.port = port  # 0 until the worker's handshake tells the bound port
        self._meta = PDConnectorMetadata()
        self._used_params: set[str] = set()  # consumer requests whose params were used
        self._recving: set[str] = set()  # pulls in flight
        self.stats = {"pd_pulls": 0, "pd_sends": 0}

    def set_handshake(self, metadata: dict[tuple[int, int], Any]) -> None:
        hs = metadata.get((0, 0))
        if isinstance(hs, PDHandshake):
            self.host, self.port = hs.host, hs.port

    # -- consumer ------------------------------------------------------------------------
    def _remote(self, request: Any) -> dict | None:
        params = request.kv_transfer_params
        if (not self.consume or not params or not params.get("do_remote_prefill")
                or request.request_id in self._used_params):
            return None
        if not params.get("remote_block_ids") or not params.get("remote_host") \
                or not params.get("remote_port"):
            return None  # the producer had no full block: compute it all here
        try:
            check_kv_transfer_params(params)
        except ValueError as e:  # a request sent past the front-end's check
            logger.warning("request %s: %s; computing its prompt here", request.request_id, e)
            self._used_params.add(request.request_id)
            return None
        return params

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        params = self._remote(request)
        if params is None:
            return 0, False
        remote_tokens = min(len(params["remote_block_ids"]) * self.block_size,
                            len(request.prompt_token_ids))
        n = remote_tokens - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        params = self._remote(request)
        if params is None:
            return
        self._used_params.add(request.request_id)
        if num_external_tokens <= 0:
            self._meta.reqs_to_release.append(ReleaseJob(
                str(params["remote_host"]), int(params["remote_port"]),
                str(params.get("remote_request_id") or request.request_id)))
            return
        block_ids = blocks.get_block_ids()[0]
        first = num_local = getattr(blocks, "num_hashed", 0)
        count = -(-num_external_tokens // self.block_size)
        remote = list(params["remote_block_ids"])[first:first + count]
        local = block_ids[num_local:num_local + len(remote)]
        self._meta.reqs_to_recv[request.request_id] = PullJob(
            request.request_id, str(params["remote_host"]), int(params["remote_port"]),
            str(params.get("remote_request_id") or request.request_id), remote, local)
        self._recving.add(request.request_id)
        self.stats["pd_pulls"] += 1

    # -- producer ------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._used_params.discard(rid)
        if rid in self._recving:
            return True, None  # aborted mid-pull: the blocks go when the pull ends
        params = request.kv_transfer_params
        if not self.produce or not params or not params.get("do_remote_decode"):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None  # stopped or aborted: nothing for a decode engine
        num_full = min(len(request.prompt_token_ids), request.num_computed_tokens) \
            // self.block_size
        ids = list(block_ids[:num_full])
        answer = {"do_remote_prefill": True, "do_remote_decode": False,
                  "remote_engine_id": self.engine_id, "remote_block_ids": ids,
                  "remote_host": self.host, "remote_port": self.port,
                  "remote_request_id": rid, "tp_size": 1}
        if not ids:
            return False, answer
        self._meta.reqs_to_send[rid] = ids
        self.stats["pd_sends"] += 1
        return True, answer

    # -- each step -----------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> PDConnectorMetadata:
        meta, self._meta = self._meta, PDConnectorMetadata()
        return meta

    def update_connector_output(self, output: Any) -> None:
        for rid in output.finished_recving or ():
            self._recving.discard(rid)
