"""The prefill (producer) end of the P/D transport: serves registered requests' blocks.

A ROUTER socket (CURVE server; only the deployment's client key gets in) on its own
thread answers pulls. The worker side registers a request's blocks when the request
finishes its prefill (``register``); from then on the blocks are the transfer's, not the
scheduler's, until the consumer releases them (DONE) or the lease runs out (a consumer
that never comes, or died): either way the request id shows up in ``take_finished``,
and the scheduler frees the blocks (vLLM's finished_sending). Only blocks registered
for the request named in a pull are ever sent: a peer cannot read arbitrary blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import zmq

from enginecore.kv_transfer import pd_wire as wire
from enginecore.kv_transfer.pd_block_views import CacheBlockBytes
from enginecore.transport import CurveKeys, secure_server, start_authenticator

logger = logging.getLogger(__name__)

_POLL_MS = 50
_SEND_TIMEOUT_MS = 5000  # a consumer that stopped reading: drop its chunk, its pull times out


@dataclass
class _Lease:
    block_ids: frozenset[int]
    expires: float


class BlockServer:
    def __init__(self, blocks: CacheBlockBytes, layout: wire.KVLayout, keys: CurveKeys | None,
                 host: str = "127.0.0.1", port: int = 0, lease_s: float = 480.0,
                 register_grace_s: float = 5.0) -> None:
        self.blocks = blocks
        self.layout = layout
        self.lease_s = lease_s
        # A pull may overtake its registration (the prefill's answer leaves the engine
        # a step before the worker registers the blocks): it waits this long for it.
        self.register_grace_s = register_grace_s
        self._parked: list[tuple[float, bytes, wire.Pull]] = []
        self._ctx = zmq.Context()
        self._auth = start_authenticator(self._ctx, keys)
        self._sock = self._ctx.socket(zmq.ROUTER)
        secure_server(self._sock, keys)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer: an error, not a drop
        self._sock.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # the consumers' windows bound what is queued
        if port == 0:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        else:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        self.host = host
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._finished: set[str] = set()
        self.stats = {"chunks_sent": 0, "bytes_sent": 0, "released": 0, "expired": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-block-server",
                                        daemon=True)
        self._thread.start()

    # -- the worker side's calls -------------------------------------------------------------
    def register(self, request_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._leases[request_id] = _Lease(frozenset(block_ids),
                                              time.monotonic() + self.lease_s)

    def take_finished(self) -> set[str]:
        """Requests whose blocks are no longer the transfer's (released or expired)."""
        with self._lock:
            done, self._finished = self._finished, set()
        return done

    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)

    # -- the socket's thread ----------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(_POLL_MS):
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                try:
                    self._handle(frames)
                except Exception:  # one bad message must not stop the server
                    logger.exception("kv block server: a message failed")
            self._retry_parked()
            self._expire()

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            logger.warning("kv block server: a message of %d frames dropped", len(frames))
            return
        peer, kind, payload = frames
        if kind == wire.HELLO:
            hello = wire.decode(payload, wire.Hello)
            problem = self.layout.mismatch(hello.layout)
            if problem:
                logger.error("kv block server: engine %s has another KV layout (%s)",
                             hello.engine_id, problem)
            self._send(peer, [wire.LAYOUT, wire.encode(self.layout)])
        elif kind == wire.PULL:
            self._pull(peer, wire.decode(payload, wire.Pull))
        elif kind == wire.DONE:
            release = wire.decode(payload, wire.Release)
            with self._lock:
                if self._leases.pop(release.request_id, None) is not None:
                    self._finished.add(release.request_id)
                    self.stats["released"] += 1
        else:
            logger.warning("kv block server: unknown message type %r dropped", kind[:8])

    def _retry_parked(self) -> None:
        if not self._parked:
            return
        parked, self._parked = self._parked, []
        for deadline, peer, pull in parked:
            self._pull(peer, pull, deadline)

    def _pull(self, peer: bytes, pull: wire.Pull, deadline: float | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            lease = self._leases.get(pull.request_id)
            if lease is not None:
                lease.expires = now + self.lease_s
        if lease is None and (deadline is None or now < deadline):
            self._parked.append((deadline or now + self.register_grace_s, peer, pull))
            return
        if lease is None:
            self._error(peer, pull.transfer_id, f"request {pull.request_id!r} has no blocks "
                        f"here (not registered within {self.register_grace_s:g} s, already "
                        "released, or its lease expired)")
            return
        if not lease.block_ids.issuperset(pull.block_ids) or not pull.block_ids:
            self._error(peer, pull.transfer_id, f"blocks {pull.block_ids} are not all "
                        f"blocks of request {pull.request_id!r}")
            return
        runs = wire.runs_of(pull.block_ids)
        header = wire.ChunkHeader(pull.transfer_id, pull.start, len(pull.block_ids),
                                  [n for _, n in runs])
        views = [self.blocks.read(layer, kv, first, n)
                 for layer in range(self.blocks.num_layers) for kv in (0, 1)
                 for first, n in runs]
        if self._send(peer, [wire.CHUNK, wire.encode(header), *views], copy=False):
            self.stats["chunks_sent"] += 1
            self.stats["bytes_sent"] += sum(v.nbytes for v in views)

    def _error(self, peer: bytes, transfer_id: int, message: str) -> None:
        logger.warning("kv block server: %s", message)
        self._send(peer, [wire.ERROR, wire.encode(wire.TransferError(transfer_id, message))])

    def _send(self, peer: bytes, frames: list, copy: bool = True) -> bool:
        try:
            self._sock.send_multipart([peer, *frames], copy=copy)
            return True
        except zmq.ZMQError as e:  # the peer went away, or stopped reading
            logger.warning("kv block server: could not answer a peer: %s", e)
            return False

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            gone = [rid for rid, lease in self._leases.items() if lease.expires <= now]
            for rid in gone:
                del self._leases[rid]
                self._finished.add(rid)
                self.stats["expired"] += 1
        for rid in gone:
            logger.warning("kv block server: request %s was not pulled within %.0f s; its "
                           "blocks are freed", rid, self.lease_s)
