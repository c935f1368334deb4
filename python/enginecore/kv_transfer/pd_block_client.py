"""The decode (consumer) end of the P/D transport: pulls a request's blocks into its own.

One thread owns every socket: a DEALER (CURVE client) per producer address, opened on
the first transfer to it with a HELLO whose LAYOUT answer must match this cache
(another model, block size, dtype or head shape: every transfer to that producer
fails, nothing is copied). A transfer pulls ``chunk_blocks`` blocks per PULL with up to
``window`` pulls in flight (so a producer never queues more than a window per
consumer), copies each chunk into the request's local blocks as it comes, then
releases the producer's blocks (DONE).

A transfer that hears nothing for ``timeout_s`` (the producer died, hung, or forgot the
request) fails: ``take_done`` reports it with its local block ids, and the connector
applies kv_load_failure_policy (recompute the prompt, or fail the request). Its socket
is dropped, so the next transfer to that address starts a fresh link.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import zmq

from enginecore.kv_transfer import pd_wire as wire
from enginecore.kv_transfer.pd_block_views import CacheBlockBytes
from enginecore.transport import CurveKeys, secure_client

logger = logging.getLogger(__name__)

_POLL_MS = 20


@dataclass
class PullJob:
    """Pull ``remote_block_ids`` of ``remote_request_id`` at host:port into ``local_block_ids``."""

    request_id: str  # this engine's request
    host: str
    port: int
    remote_request_id: str
    remote_block_ids: list[int]
    local_block_ids: list[int]


@dataclass(frozen=True)
class ReleaseJob:
    """Release a producer's blocks unpulled (this engine had them all in its own cache)."""

    host: str
    port: int
    remote_request_id: str


@dataclass
class _Transfer:
    job: PullJob
    transfer_id: int
    next_start: int = 0  # the next position to ask for
    received: int = 0
    in_flight: int = 0
    last_heard: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.monotonic)


@dataclass
class _Peer:
    sock: zmq.Socket
    layout: wire.KVLayout | None = None  # the producer's, once it answered HELLO
    waiting: list[_Transfer] = field(default_factory=list)  # until the LAYOUT answer


class BlockClient:
    def __init__(self, blocks: CacheBlockBytes, layout: wire.KVLayout, keys: CurveKeys | None,
                 engine_id: str, timeout_s: float = 30.0, chunk_blocks: int = 64,
                 window: int = 4) -> None:
        self.blocks = blocks
        self.layout = layout
        self.keys = keys
        self.engine_id = engine_id
        self.timeout_s = timeout_s
        self.chunk_blocks = max(1, chunk_blocks)
        self.window = max(1, window)
        self._ctx = zmq.Context()
        self._jobs: queue.SimpleQueue[PullJob | ReleaseJob] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ok: set[str] = set()
        self._failed: dict[str, list[int]] = {}
        self.stats = {"transfers_ok": 0, "transfers_failed": 0, "bytes_received": 0,
                      "seconds": 0.0}
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._by_socket: dict[zmq.Socket, tuple[str, int]] = {}
        self._transfers: dict[int, _Transfer] = {}
        self._ids = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-block-client", daemon=True)
        self._thread.start()

    # -- the worker side's calls -------------------------------------------------------------
    def start(self, job: PullJob) -> None:
        if len(job.remote_block_ids) != len(job.local_block_ids):
            raise ValueError(f"{len(job.remote_block_ids)} remote blocks for "
                             f"{len(job.local_block_ids)} local ones")
        self._jobs.put(job)

    def release(self, job: ReleaseJob) -> None:
        self._jobs.put(job)

    def take_done(self) -> tuple[set[str], dict[str, list[int]]]:
        """(requests whose blocks arrived, {request: local block ids} whose pull failed)."""
        with self._lock:
            ok, failed = self._ok, self._failed
            self._ok, self._failed = set(), {}
        return ok, failed

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)

    # -- the socket thread -------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        while not self._stop.is_set():
            self._admit_jobs(poller)
            events = dict(poller.poll(_POLL_MS)) if self._peers else {}
            if not self._peers:
                time.sleep(_POLL_MS / 1000)
            for sock in events:
                address = self._by_socket.get(sock)
                if address is None:
                    continue
                while address in self._peers:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        self._handle(address, frames, poller)
                    except Exception:  # one bad answer must not stop the thread
                        logger.exception("kv block client: an answer from %s:%d failed",
                                         *address)
            self._check_timeouts(poller)

    def _admit_jobs(self, poller: zmq.Poller) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, ReleaseJob):
                peer = self._peer(job.host, job.port, poller)
                peer.sock.send_multipart([wire.DONE, wire.encode(wire.Release(
                    job.remote_request_id, True))])
                continue
            self._ids += 1
            t = _Transfer(job, self._ids)
            self._transfers[t.transfer_id] = t
            if not job.remote_block_ids:
                self._finish(t, ok=True, poller=poller)
                continue
            peer = self._peer(job.host, job.port, poller)
            if peer.layout is None:
                peer.waiting.append(t)
            else:
                self._fill_window(peer, t)

    def _peer(self, host: str, port: int, poller: zmq.Poller) -> _Peer:
        address = (host, port)
        peer = self._peers.get(address)
        if peer is None:
            sock = self._ctx.socket(zmq.DEALER)
            endpoint = f"tcp://{host}:{port}"
            secure_client(sock, endpoint, self.keys)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(endpoint)
            sock.send_multipart([wire.HELLO, wire.encode(wire.Hello(self.engine_id,
                                                                    self.layout))])
            peer = self._peers[address] = _Peer(sock)
            self._by_socket[sock] = address
            poller.register(sock, zmq.POLLIN)
        return peer

    def _drop_peer(self, address: tuple[str, int], poller: zmq.Poller, why: str) -> None:
        peer = self._peers.pop(address, None)
        if peer is None:
            return
        self._by_socket.pop(peer.sock, None)
        poller.unregister(peer.sock)
        peer.sock.close(linger=0)
        for t in [t for t in self._transfers.values()
                  if (t.job.host, t.job.port) == address]:
            logger.warning("kv block client: request %s: %s", t.job.request_id, why)
            self._finish(t, ok=False, poller=poller, notify=False)

    def _fill_window(self, peer: _Peer, t: _Transfer) -> None:
        job = t.job
        while t.in_flight < self.window and t.next_start < len(job.remote_block_ids):
            start = t.next_start
            ids = job.remote_block_ids[start:start + self.chunk_blocks]
            peer.sock.send_multipart([wire.PULL, wire.encode(wire.Pull(
                t.transfer_id, job.remote_request_id, ids, start))])
            t.next_start += len(ids)
            t.in_flight += 1

    def _handle(self, address: tuple[str, int], frames: list[zmq.Frame],
                poller: zmq.Poller) -> None:
        peer = self._peers[address]
        kind = frames[0].bytes
        if kind == wire.LAYOUT:
            layout = wire.decode(frames[1].buffer, wire.KVLayout)
            problem = self.layout.mismatch(layout)
            if problem:
                self._drop_peer(address, poller, f"the producer at {address[0]}:{address[1]} "
                                f"has another KV layout ({problem}); nothing was copied")
                return
            peer.layout = layout
            waiting, peer.waiting = peer.waiting, []
            for t in waiting:
                self._fill_window(peer, t)
        elif kind == wire.CHUNK:
            header = wire.decode(frames[1].buffer, wire.ChunkHeader)
            t = self._transfers.get(header.transfer_id)
            if t is None:
                return  # a transfer that already timed out
            try:
                self._copy_chunk(t, header, frames[2:])
            except ValueError as e:
                logger.warning("kv block client: request %s: a bad chunk: %s",
                               t.job.request_id, e)
                self._finish(t, ok=False, poller=poller)
                return
            t.in_flight -= 1
            t.received += header.count
            t.last_heard = time.monotonic()
            if t.received >= len(t.job.remote_block_ids):
                self._finish(t, ok=True, poller=poller)
            else:
                self._fill_window(peer, t)
        elif kind == wire.ERROR:
            err = wire.decode(frames[1].buffer, wire.TransferError)
            t = self._transfers.get(err.transfer_id)
            if t is not None:
                logger.warning("kv block client: request %s: the producer refused: %s",
                               t.job.request_id, err.message)
                self._finish(t, ok=False, poller=poller)

    def _copy_chunk(self, t: _Transfer, header: wire.ChunkHeader,
                    frames: list[zmq.Frame]) -> None:
        n_runs = len(header.runs)
        if len(frames) != 2 * self.blocks.num_layers * n_runs or sum(header.runs) != \
                header.count:
            raise ValueError(f"a chunk of {len(frames)} frames does not fit "
                             f"{self.blocks.num_layers} layers x {n_runs} runs")
        local = t.job.local_block_ids[header.start:header.start + header.count]
        bb = self.blocks.block_bytes
        i = 0
        for layer in range(self.blocks.num_layers):
            for kv in (0, 1):
                offset = 0
                for n in header.runs:
                    data = frames[i].buffer
                    i += 1
                    # The producer's run may land on several runs of local blocks.
                    pos = 0
                    for first, m in wire.runs_of(local[offset:offset + n]):
                        self.blocks.write(layer, kv, first, m, data[pos * bb:(pos + m) * bb])
                        pos += m
                    offset += n
                    self.stats["bytes_received"] += data.nbytes

    def _finish(self, t: _Transfer, ok: bool, poller: zmq.Poller, notify: bool = True) -> None:
        self._transfers.pop(t.transfer_id, None)
        job = t.job
        peer = self._peers.get((job.host, job.port))
        if notify and peer is not None and job.remote_block_ids:
            peer.sock.send_multipart([wire.DONE, wire.encode(wire.Release(
                job.remote_request_id, ok))])
        with self._lock:
            if ok:
                self._ok.add(job.request_id)
                self.stats["transfers_ok"] += 1
                self.stats["seconds"] += time.monotonic() - t.started
            else:
                self._failed[job.request_id] = list(job.local_block_ids)
                self.stats["transfers_failed"] += 1

    def _check_timeouts(self, poller: zmq.Poller) -> None:
        now = time.monotonic()
        stale = {(t.job.host, t.job.port) for t in self._transfers.values()
                 if now - t.last_heard > self.timeout_s}
        for address in stale:
            self._drop_peer(address, poller, f"the producer at {address[0]}:{address[1]} "
                            f"sent nothing for {self.timeout_s:g} s (dead or hung)")
