"""The P/D connector's worker side: the block server (producer) and the block client
(consumer) over the runner's KV cache (kv_transfer/pd_block_*.py).

Per step: ``start_load_kv`` starts the pulls and registers the sends the scheduler
side put in the metadata; transfers then run on the transport's threads, overlapped
with the steps; ``get_finished`` collects what ended: sends released (or expired) as
finished_sending, pulls that arrived or failed as finished_recving, the failed ones'
blocks as load errors (kv_load_failure_policy decides: recompute or fail).
"""

from __future__ import annotations

import logging
from typing import Any

from enginecore.kv_transfer.pd_block_client import BlockClient
from enginecore.kv_transfer.pd_block_server import BlockServer
from enginecore.kv_transfer.pd_block_views import CacheBlockBytes
from enginecore.kv_transfer.pd_keys import load_kv_keys
from enginecore.kv_transfer.pd_scheduler import PDConnectorMetadata, PDHandshake

logger = logging.getLogger(__name__)


class PDWorker:
    def __init__(self, engine_id: str, block_size: int, produce: bool, consume: bool,
                 extra: dict, model: str) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        self.produce = produce
        self.consume = consume
        self.extra = extra
        self.model = model
        self.server: BlockServer | None = None
        self.client: BlockClient | None = None
        self._load_errors: set[int] = set()
        self._pulling: set[str] = set()
        self._aborted_recv: set[str] = set()
        self._reported: dict[str, float] = {}

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        pairs = []
        for t in kv_caches.values():  # [2, blocks, block_size, kv_heads, head_dim]
            heads, dim = t.shape[-2], t.shape[-1]
            pairs.append((t[0].view(-1, heads, dim), t[1].view(-1, heads, dim)))
        blocks = CacheBlockBytes(pairs, self.block_size)
        layout = blocks.layout(self.model)
        keys = load_kv_keys(self.extra)
        if self.produce:
            self.server = BlockServer(blocks, layout, keys,
                                      host=str(self.extra.get("host", "127.0.0.1")),
                                      port=int(self.extra.get("port", 0)),
                                      lease_s=float(self.extra.get("lease_s", 480.0)))
            logger.info("kv transfer: serving blocks on %s:%d", self.server.host,
                        self.server.port)
        if self.consume:
            self.client = BlockClient(
                blocks, layout, keys, self.engine_id,
                timeout_s=float(self.extra.get("transfer_timeout_s", 30.0)),
                chunk_blocks=int(self.extra.get("chunk_blocks", 64)),
                window=int(self.extra.get("window", 4)))

    def handshake(self) -> PDHandshake | None:
        if self.server is None:
            return None
        return PDHandshake(self.engine_id, self.server.host, self.server.port)

    def start_load_kv(self, meta: PDConnectorMetadata | None) -> None:
        if meta is None:
            return
        if self.server is not None:
            for rid, ids in meta.reqs_to_send.items():
                self.server.register(rid, ids)
        for release in meta.reqs_to_release:
            if self.client is not None:
                self.client.release(release)
        for job in meta.reqs_to_recv.values():
            if self.client is None:
                raise RuntimeError("a pull on an engine that is not a kv_consumer")
            self.client.start(job)
            self._pulling.add(job.request_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending: set[str] = set()
        recving: set[str] = set()
        if self.server is not None:
            sending |= self.server.take_finished()
        if self.client is not None:
            ok, failed = self.client.take_done()
            recving |= ok | set(failed)
            for blocks in failed.values():
                self._load_errors.update(blocks)
            # A request finished while its pull ran had its blocks kept: now they may go.
            self._aborted_recv |= finished_req_ids & self._pulling
            self._pulling -= recving
            ended = recving & self._aborted_recv
            sending |= ended
            self._aborted_recv -= ended
        return sending, recving

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def stats(self) -> dict[str, Any]:
        """What changed since the last call (the scheduler sums steps' stats)."""
        now: dict[str, float] = {}
        if self.server is not None:
            now.update({f"pd_{k}": v for k, v in self.server.stats.items()})
        if self.client is not None:
            now.update({f"pd_{k}": v for k, v in self.client.stats.items()})
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        return {k: v for k, v in delta.items() if v}

    def shutdown(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.close()
