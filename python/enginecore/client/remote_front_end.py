"""The front-ends of one engine set (``FrontEnds``: every engine connects to each),
and front-ends in other processes: the process that starts the engines reserves
the addresses of front-ends 1..N-1, and another process attaches as one of them.

Why this shape: every engine connects its request (DEALER) and output (PUSH)
sockets to each front-end's addresses, listed in the INIT handshake. A zmq
socket cannot move between processes, but a connect may precede its bind (zmq
retries, and queues what the engine sends meanwhile). So the owner puts
*reserved* addresses in INIT for the front-ends it does not bind (a path in its
private 0700 IPC directory, or a free loopback port), and the other process binds
exactly those, waits for each engine's hello on its request socket, connects to
the DP coordinator if there is one, and then works like any client. The owner
hands over a ``FrontEndHandoff`` (picklable: pass it as a spawn argument, never
over a socket).

Liveness across the boundary: the owner's engine monitor already announces a dead
engine on every front-end's output address (reserved ones included), and the
attached front-end also watches its request socket for an engine disconnecting
(client/engine_watch.py; an engine dies with its owner, which it watches by
parent pid).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import zmq

from enginecore.config import EngineConfig, TransportConfig
from enginecore.transport import CurveKeys, secure_server, set_heartbeats


@dataclass(frozen=True)
class FrontEndHandoff:
    """What a process needs to attach to running engines as front-end
    ``client_index`` of ``client_count``."""

    config: EngineConfig
    client_index: int
    client_count: int
    input_address: str
    output_address: str
    coordinator_addresses: dict[str, str] | None
    num_gpu_blocks: int
    max_model_len: int
    owner_pid: int
    # TCP: the launch's CURVE keys, server secret included (this process binds);
    # out of band like the rest of the handoff.
    curve: CurveKeys | None = None


@dataclass(frozen=True)
class FrontEndSockets:
    """One front-end: its request ROUTER and output PULL, and their addresses. The
    sockets are None for a front-end reserved for another process."""

    input_socket: zmq.Socket | None
    output_socket: zmq.Socket | None
    input_address: str
    output_address: str


def bind_front_end(ctx: zmq.Context, bind: Callable[[zmq.Socket, str], str], index: int,
                   tc: TransportConfig, curve: CurveKeys | None, transport: str,
                   ) -> FrontEndSockets:
    """Front-end ``index``'s request ROUTER and output PULL, bound by ``bind(socket,
    name)`` (which returns the address); CURVE servers when ``curve`` (TCP)."""
    inp = ctx.socket(zmq.ROUTER)
    inp.setsockopt(zmq.ROUTER_MANDATORY, 1)
    inp.setsockopt(zmq.LINGER, 0)
    # TCP heartbeats (none on IPC): a rank whose node goes away drops its
    # connection after heartbeat_timeout_s (see EngineWatch.watch_disconnects).
    set_heartbeats(inp, f"{transport}://", tc)
    secure_server(inp, curve)
    in_addr = bind(inp, f"input{index}.sock")
    out = ctx.socket(zmq.PULL)
    out.setsockopt(zmq.LINGER, 0)
    secure_server(out, curve)
    out_addr = bind(out, f"output{index}.sock")
    return FrontEndSockets(inp, out, in_addr, out_addr)


class FrontEnds:
    """The front-ends an engine set connects to, in client-index order: those bound
    in this process and those reserved for others. The launcher fills it (every
    front-end of the launch); a front-end attached from another process has a table
    of its own one (``for_handoff``)."""

    def __init__(self) -> None:
        self._all: list[FrontEndSockets] = []

    def add(self, front_end: FrontEndSockets) -> None:
        self._all.append(front_end)

    def __len__(self) -> int:
        return len(self._all)

    def __getitem__(self, index: int) -> FrontEndSockets:
        return self._all[index]

    @property
    def input_addresses(self) -> list[str]:
        return [fe.input_address for fe in self._all]

    @property
    def output_addresses(self) -> list[str]:
        return [fe.output_address for fe in self._all]

    def _check_index(self, client_index: int) -> FrontEndSockets:
        if not 0 < client_index < len(self._all):
            raise ValueError(f"client_index must be in [1, {len(self._all)})")
        return self._all[client_index]

    def local(self, client_index: int) -> FrontEndSockets:
        """Front-end ``client_index``, bound here (``MPClient.attach``)."""
        fe = self._check_index(client_index)
        if fe.input_socket is None:
            raise ValueError(f"front-end {client_index} is reserved for another process: "
                             "pass handoff(client_index) to connect() there")
        return fe

    def reserved(self, client_index: int) -> FrontEndSockets:
        """Front-end ``client_index``, reserved for another process (``MPClient.handoff``)."""
        fe = self._check_index(client_index)
        if fe.input_socket is not None:
            raise ValueError(f"front-end {client_index} is bound in this process (use attach); "
                             "start the client with local_client_count to reserve it")
        return fe

    def await_hellos(self, count: int, timeout_s: float) -> None:
        """Each of ``count`` engines says hello on every request socket bound here once
        connected; only then can we route."""
        for i, fe in enumerate(self._all):
            if fe.input_socket is None:
                continue  # bound in another process, which waits for its own hellos
            for _ in range(count):
                if not fe.input_socket.poll(int(timeout_s * 1000)):
                    raise TimeoutError(f"an engine did not connect its input socket for "
                                       f"front-end {i} within {timeout_s:g} s")
                fe.input_socket.recv_multipart()

    @classmethod
    def for_handoff(cls, ctx: zmq.Context, handoff: FrontEndHandoff) -> FrontEnds:
        """Bind, in this process, the addresses the owner reserved for the handed-over
        front-end: a table of that one."""
        addresses = iter((handoff.input_address, handoff.output_address))

        def bind(sock: zmq.Socket, _name: str) -> str:
            address = next(addresses)
            sock.bind(address)
            return address

        table = cls()
        table.add(bind_front_end(ctx, bind, handoff.client_index,
                                 handoff.config.transport_config, handoff.curve,
                                 handoff.input_address.split("://")[0]))
        return table
