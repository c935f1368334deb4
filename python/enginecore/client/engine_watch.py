"""How a multiprocess client learns that an engine died when it has no process
handle to wait on (a headless rank elsewhere, a Ray actor, the engines of a
front-end attached from another process), and how every waiter then hears it:
ENGINE_CORE_DEAD on every front-end's output socket, so each reader fails its
callers at once instead of after a timeout."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from enginecore.client.remote_front_end import FrontEnds
from enginecore.protocol import ENGINE_CORE_DEAD
from enginecore.transport import CurveKeys, secure_client

logger = logging.getLogger(__name__)


class WatchedClient(Protocol):
    """What the watch uses of its client (client/mp_client.py)."""

    _closed: bool  # shut down: stop watching, announce nothing
    _dead: bool  # set on a death: new calls fail at once


class EngineWatch:
    """Death notices for one client's front-ends, and the watch on its request
    socket for a rank that disconnects."""

    def __init__(self, client: WatchedClient, ctx: zmq.Context, front_ends: FrontEnds,
                 curve: CurveKeys | None) -> None:
        self.client = client
        self.ctx = ctx
        self.front_ends = front_ends
        self.curve = curve
        # Disconnects to ignore: ranks that leave in an elastic scale-down.
        self.expected_disconnects = 0
        self.thread: threading.Thread | None = None

    def announce_dead(self, why: str) -> None:
        """An engine is gone: every front-end's output socket gets ENGINE_CORE_DEAD,
        so each waiter learns it at once."""
        if self.client._closed:
            return
        logger.error("%s", why)
        self.client._dead = True
        for address in self.front_ends.output_addresses:
            try:
                push = self.ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 1000)
                secure_client(push, address, self.curve)
                push.connect(address)
                push.send(ENGINE_CORE_DEAD)
                push.close()
            except zmq.ZMQError:
                pass

    def watch_disconnects(self) -> None:
        """Ranks we have no process handle for (headless, Ray, another process's):
        their connection to our (first) request socket dropping means they died."""
        own = self.front_ends[0]
        assert own.input_socket is not None, "the first front-end is bound here"
        monitor = own.input_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        address = own.input_address
        # The thread holds the watch weakly: a client dropped without shutdown (and
        # collected) stops it.
        watch_ref = weakref.ref(self)

        def closed() -> bool:
            watch = watch_ref()
            return watch is None or watch.client._closed

        def run() -> None:
            while True:
                try:
                    if not monitor.poll(200):
                        if closed():
                            break
                        continue
                    event = recv_monitor_message(monitor)
                except zmq.ZMQError:
                    break
                watch = watch_ref()
                if watch is None or watch.client._closed:
                    break
                if event["event"] == zmq.EVENT_DISCONNECTED and watch.expected_disconnects:
                    watch.expected_disconnects -= 1  # a rank that left in a rescale
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    watch.announce_dead(f"an engine disconnected from {address} "
                                        "(a remote rank died or its node went away)")
                    break
                del watch
            monitor.close(linger=0)

        self.thread = threading.Thread(target=run, daemon=True,
                                       name="enginecore-remote-watch")
        self.thread.start()

    def join(self, timeout_s: float = 2.0) -> None:
        """Wait for the watch thread (it sees the client closed within 200 ms); the
        context may close its monitor socket only after (zmq sockets are not
        thread-safe)."""
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout_s)
            if thread.is_alive():
                logger.warning("%s did not stop; closing its sockets anyway", thread.name)
