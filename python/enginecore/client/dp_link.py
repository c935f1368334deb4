"""A front-end's link to the data-parallel coordinator: the ranks' queue
lengths for load balancing, and the wave state for lockstep engines."""

from __future__ import annotations

import logging
import threading

import msgspec
import zmq

from enginecore.protocol import DPStatus, WaveStartRequest
from enginecore.transport import CurveKeys, secure_client

logger = logging.getLogger(__name__)

# A waiting request weighs this many running ones when balancing (it holds a
# prefill ahead of it), as in vLLM.
WAITING_WEIGHT = 4


class CoordinatorLink:
    def __init__(self, ctx: zmq.Context, addresses: dict[str, str], lockstep: bool,
                 curve: CurveKeys | None = None) -> None:
        self.lockstep = lockstep
        self._lock = threading.Lock()
        # Per rank [waiting, running]: the coordinator's latest, plus what this
        # front-end sent since (so a burst does not all go to one rank).
        self.counts: list[list[int]] | None = None
        self.current_wave = 0
        self.engines_running = False
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        secure_client(self._push, addresses["wave_request"], curve)
        self._push.connect(addresses["wave_request"])
        self._encoder = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        secure_client(self._sub, addresses["status"], curve)
        self._sub.connect(addresses["status"])
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="enginecore-dp-status")
        self._reader.start()

    def _read(self) -> None:
        decoder = msgspec.msgpack.Decoder(DPStatus)
        sub = self._sub
        while not self._stop.is_set():
            try:
                if not sub.poll(100):
                    continue
                status = decoder.decode(sub.recv())
            except zmq.ZMQError:
                break
            except msgspec.DecodeError as e:
                logger.warning("bad status from the DP coordinator dropped: %s", e)
                continue
            with self._lock:
                self.counts = status.counts
                self.current_wave = status.current_wave
                self.engines_running = status.engines_running
        sub.close(linger=0)

    def pick(self, candidates: list[int], fallback: list[int]) -> int:
        """The least loaded of ``candidates`` (engine indexes = ranks here): by the
        coordinator's counts once known, else by ``fallback`` (this front-end's own
        live requests per engine)."""
        with self._lock:
            counts = self.counts
            if counts is None or max(candidates) >= len(counts):
                return min(candidates, key=fallback.__getitem__)
            best = min(candidates,
                       key=lambda e: WAITING_WEIGHT * counts[e][0] + counts[e][1])
            counts[best][0] += 1
            return best

    def current_wave_for_request(self) -> int:
        """The wave to stamp on a request about to be sent."""
        return self.current_wave

    def sent_to(self, engine: int, wave: int) -> None:
        """A request stamped ``wave`` went to ``engine``: if the (lockstep) engines
        were idle, have the coordinator wake them all. Sent after the request so it
        usually reaches its engine before the wave starts; if not, the engine sees
        the wave ended and starts the next one itself."""
        with self._lock:
            if not self.lockstep or self.engines_running:
                return
            self.engines_running = True  # until the coordinator says otherwise
            self._push.send(self._encoder.encode(WaveStartRequest(wave, engine)))

    def close(self) -> None:
        self._stop.set()
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=2)
        self._push.close(linger=0)
