"""The data-parallel coordinator: a small process between front-ends and ranks.

* Collects each rank's (running, waiting) counts and publishes them to every
  front-end (for load balancing), at most every ``PUBLISH_INTERVAL_S`` unless
  the wave state changed, which goes out at once.
* Tracks the running wave (lockstep): ``wave_complete`` from rank 0 ends it;
  a front-end sending to idle engines (``WaveStartRequest``) or a rank asking
  (``start_wave``) starts the next, broadcast to every rank as START_DP_WAVE.

Sockets (bound here, IPC in the front-end's private directory or TCP on the DP
address): XPUB to front-ends (a new subscriber gets the current state), PULL
from front-ends, ROUTER to ranks (their input DEALERs register with an empty
frame), PULL from ranks (their outputs addressed to client -1).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from typing import Any

import msgspec
import zmq

from enginecore.core.liveness import remove_private_dir
from enginecore.interrupts import children_ignore_sigint, ignore_sigint
from enginecore.protocol import (
    ENGINE_CORE_DEAD,
    DPStatus,
    EngineCoreOutputs,
    EngineCoreRequestType,
    StartDPWave,
    WaveStartRequest,
)
from enginecore.transport import secure_server, start_authenticator

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.1
_START_DP_WAVE = EngineCoreRequestType.START_DP_WAVE.value


class DPCoordinator:
    """State and message handling (no process concerns: tested directly too)."""

    def __init__(self, dp_size: int, lockstep: bool) -> None:
        self.lockstep = lockstep
        self.counts = [[0, 0] for _ in range(dp_size)]  # [waiting, running] per rank
        self._stamps = [(-1, -1)] * dp_size  # (wave, step) of the latest counts
        self.current_wave = 0
        self.engines_running = False
        self.registered: set[bytes] = set()
        self.changed = True

    def on_engine_output(self, outs: EngineCoreOutputs) -> tuple[int, int] | None:
        """Apply a rank's message; (wave, excluded rank) to broadcast as
        START_DP_WAVE, if a wave starts."""
        e = outs.engine_index
        while e >= len(self.counts):  # a rank added by an elastic rescale
            self.counts.append([0, 0])
            self._stamps.append((-1, -1))
        stats = outs.scheduler_stats
        if stats is not None:
            # One rank's counts arrive in order on one socket: the latest wins. The
            # (wave, step) stamp says how current they are (kept for the logs).
            self._stamps[e] = (stats.current_wave, stats.step_counter)
            self.counts[e] = [stats.num_waiting_reqs, stats.num_running_reqs]
            self.changed = True
        if outs.wave_complete is not None and outs.wave_complete >= self.current_wave:
            self.current_wave = outs.wave_complete + 1
            self.engines_running = False
            self.changed = True
            logger.debug("wave %d complete", outs.wave_complete)
        if outs.start_wave is not None and self.lockstep and (
                outs.start_wave > self.current_wave
                or (outs.start_wave == self.current_wave and not self.engines_running)):
            return self._start(outs.start_wave, exclude=e)
        return None

    def on_front_end(self, msg: WaveStartRequest) -> tuple[int, int] | None:
        # The front-end assumed the engines running once it asked: it always gets
        # the real state back, even when the ask is ignored.
        self.changed = True
        if not self.lockstep or self.engines_running or msg.wave < self.current_wave:
            # Running, or the front-end's wave already ran: the request went in with
            # it, or its engine finds the wave stale and asks for the next itself.
            return None
        # Every rank joins, the target included: if its request already finished,
        # it still meets the others at the wave's all-reduce.
        return self._start(msg.wave, exclude=-1)

    def on_register(self, ident: bytes) -> tuple[int, int] | None:
        """A rank's input registers: (wave, excluded rank) to send that rank, if a
        wave runs. It started before the rank registered, so its broadcast missed
        the rank, and the others would wait for it at the wave's all-reduce."""
        self.registered.add(ident)
        if self.lockstep and self.engines_running:
            return self.current_wave, -1
        return None

    def _start(self, wave: int, exclude: int) -> tuple[int, int]:
        self.current_wave = wave
        self.engines_running = True
        self.changed = True
        logger.debug("starting wave %d (asked by %s)", wave,
                     f"rank {exclude}" if exclude >= 0 else "a front-end")
        return wave, exclude

    def status(self) -> DPStatus:
        return DPStatus([list(c) for c in self.counts], self.current_wave, self.engines_running)


def run_coordinator(dp_size: int, lockstep: bool, bind: dict[str, str], conn: Any,
                    parent_pid: int, log_level: int = logging.WARNING,
                    max_message_bytes: int = 64 << 20, curve: Any = None,
                    ipc_dir: str | None = None) -> None:
    """Process entry: bind, report the addresses through ``conn``, serve. ``curve``:
    the launch's keys (TCP); ``ipc_dir``: the front-end's socket directory, removed
    here if the front-end dies first."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s dp-coordinator "
                        "%(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    ignore_sigint()  # the front-end stops us
    ctx = zmq.Context()
    ctx.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    auth = start_authenticator(ctx, curve)
    try:
        _serve(ctx, dp_size, lockstep, bind, conn, parent_pid, curve)
    finally:
        if ipc_dir is not None and os.getppid() != parent_pid:
            remove_private_dir(ipc_dir)
        if auth is not None:
            auth.stop()


def _serve(ctx: zmq.Context, dp_size: int, lockstep: bool, bind: dict[str, str], conn: Any,
           parent_pid: int, curve: Any) -> None:
    front_pub = ctx.socket(zmq.XPUB)
    front_in = ctx.socket(zmq.PULL)
    engine_router = ctx.socket(zmq.ROUTER)
    engine_router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    engine_in = ctx.socket(zmq.PULL)
    sockets = {"status": front_pub, "wave_request": front_in, "engine_input": engine_router,
               "engine_output": engine_in}
    addresses = {}
    for name, sock in sockets.items():
        sock.setsockopt(zmq.LINGER, 0)
        if bind[name].startswith("tcp://"):
            secure_server(sock, curve)
        addresses[name] = _bind(sock, bind[name])
    conn.send(addresses)
    conn.close()
    coord = DPCoordinator(dp_size, lockstep)
    status_enc = msgspec.msgpack.Encoder()
    outs_dec = msgspec.msgpack.Decoder(EngineCoreOutputs)
    wave_dec = msgspec.msgpack.Decoder(WaveStartRequest)
    poller = zmq.Poller()
    for sock in sockets.values():
        poller.register(sock, zmq.POLLIN)
    last_publish = 0.0
    published_wave = (0, False)

    def broadcast(wave: int, exclude: int, to: list[bytes] | None = None) -> None:
        payload = status_enc.encode(StartDPWave(wave, exclude))
        # Every registered rank, or those in ``to``; a copy: failures shrink the set.
        for ident in sorted(coord.registered) if to is None else to:
            try:
                engine_router.send_multipart([ident, _START_DP_WAVE, payload])
            except zmq.ZMQError as e:  # a rank that went away (or left in a rescale)
                logger.info("rank %d is gone (%s); no more waves for it",
                            int.from_bytes(ident, "little"), e)
                coord.registered.discard(ident)

    while True:
        if os.getppid() != parent_pid:
            logger.warning("front-end %d is gone; coordinator exiting", parent_pid)
            return
        events = dict(poller.poll(PUBLISH_INTERVAL_S * 1000))
        if front_pub in events:
            front_pub.recv()  # a (un)subscription: publish the state now
            coord.changed = True
            last_publish = 0.0
        if front_in in events:
            while True:
                try:
                    msg = wave_dec.decode(front_in.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                except msgspec.DecodeError as e:
                    logger.warning("bad message from a front-end dropped: %s", e)
                    continue
                start = coord.on_front_end(msg)
                if start is not None:
                    broadcast(*start)
        if engine_router in events:
            while True:
                try:
                    frames = engine_router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) == 2 and len(frames[0]) == 2 and frames[1] == b"":
                    start = coord.on_register(frames[0])  # a rank's input registering
                    if start is not None:
                        broadcast(*start, to=[frames[0]])
                else:
                    logger.warning("dropped a %d-frame message from a rank", len(frames))
        if engine_in in events:
            while True:
                try:
                    frame = engine_in.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if frame == ENGINE_CORE_DEAD:
                    logger.warning("a rank reported ENGINE_CORE_DEAD")
                    continue
                try:
                    outs = outs_dec.decode(frame)
                    start = coord.on_engine_output(outs)
                except (msgspec.DecodeError, ValueError, TypeError) as e:
                    logger.warning("bad message from a rank dropped: %s", e)
                    continue
                if start is not None:
                    broadcast(*start)
        now = time.monotonic()
        wave_state = (coord.current_wave, coord.engines_running)
        if coord.changed and (wave_state != published_wave
                              or now - last_publish >= PUBLISH_INTERVAL_S):
            front_pub.send(status_enc.encode(coord.status()))
            coord.changed = False
            last_publish = now
            published_wave = wave_state


def _bind(sock: zmq.Socket, where: str) -> str:
    if where.startswith("ipc://"):
        sock.bind(where)
        return where
    host = where.removeprefix("tcp://")
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"


def start_coordinator(dp_size: int, lockstep: bool, bind: dict[str, str], log_level: int,
                      max_message_bytes: int = 64 << 20, curve: Any = None,
                      ipc_dir: str | None = None,
                      ) -> tuple[multiprocessing.process.BaseProcess, dict]:
    """Spawn the coordinator; its process and bound addresses. The keys go through
    the spawn pipe (out of band)."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_coordinator, name="DPCoordinator", daemon=True,
                       args=(dp_size, lockstep, bind, send, os.getpid(), log_level,
                             max_message_bytes, curve, ipc_dir))
    with children_ignore_sigint():
        proc.start()
    send.close()
    if not recv.poll(60):
        proc.kill()
        raise TimeoutError("the DP coordinator did not report its addresses within 60 s")
    try:
        addresses = recv.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"the DP coordinator exited with code {proc.exitcode} at start-up; "
                           "see its log above") from None
    return proc, addresses


__all__ = ["DPCoordinator", "run_coordinator", "start_coordinator"]
