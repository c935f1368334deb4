"""Front-ends in other processes: the process that starts the engines reserves
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
(an engine dies with its owner, which it watches by parent pid).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import zmq

from enginecore.config import EngineConfig
from enginecore.protocol import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS


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


def bind_front_end(ctx: zmq.Context, bind: Any, index: int) -> tuple[zmq.Socket, zmq.Socket,
                                                                     str, str]:
    """Front-end ``index``'s request ROUTER and output PULL, bound by ``bind(socket,
    name)`` (which returns the address)."""
    inp = ctx.socket(zmq.ROUTER)
    inp.setsockopt(zmq.ROUTER_MANDATORY, 1)
    inp.setsockopt(zmq.LINGER, 0)
    # Heartbeats: a rank on another node that dies (kill -9, power) drops its
    # connection within seconds (see _watch_remote_ranks).
    inp.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    inp.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    in_addr = bind(inp, f"input{index}.sock")
    out = ctx.socket(zmq.PULL)
    out.setsockopt(zmq.LINGER, 0)
    out_addr = bind(out, f"output{index}.sock")
    return inp, out, in_addr, out_addr


class RemoteFrontEnds:
    """Mixed into ``MPClient``: reserving front-ends for other processes, handing
    them over, and attaching from the other side."""

    def handoff(self, client_index: int) -> FrontEndHandoff:
        if not getattr(self, "_owner", False):
            raise RuntimeError("only the client that started the engines hands front-ends over")
        if not 0 < client_index < len(self._front_ends):
            raise ValueError(f"client_index must be in [1, {len(self._front_ends)})")
        inp, _, in_addr, out_addr = self._front_ends[client_index]
        if inp is not None:
            raise ValueError(f"front-end {client_index} is bound in this process (use attach); "
                             "start the client with local_client_count to reserve it")
        return FrontEndHandoff(self.config, client_index, len(self._front_ends), in_addr,
                               out_addr, self._coord_addresses, self.num_gpu_blocks,
                               self.max_model_len, os.getpid())

    @classmethod
    def connect(cls, handoff: FrontEndHandoff, timeout_s: float = 60.0) -> Any:
        """Attach to the engines as ``handoff.client_index``, in this process. The
        client does not own the engines: its ``shutdown`` leaves them running."""
        client = cls.__new__(cls)
        client._init_common(handoff.config, handoff.client_index)
        client._owner = False
        client._own_context = True
        client.ctx = zmq.Context()
        client.procs = []
        client.coordinator = None
        client._coord_addresses = handoff.coordinator_addresses
        client._expected_disconnects = 0
        client._leaving = set()
        client.num_gpu_blocks = handoff.num_gpu_blocks
        client.max_model_len = handoff.max_model_len
        addresses = iter((handoff.input_address, handoff.output_address))

        def bind(sock: zmq.Socket, _name: str) -> str:
            address = next(addresses)
            sock.bind(address)
            return address

        try:
            client._front_ends = [bind_front_end(client.ctx, bind, handoff.client_index)]
            (client.input_socket, client.output_socket, client.input_address,
             client.output_address) = client._front_ends[0]
            client._await_input_sockets(client.num_engines, timeout_s)
            client._watch_remote_ranks()
            client._connect_coordinator()
            client._post_init()
        except BaseException:
            client._closed = True
            client.ctx.destroy(linger=0)
            raise
        return client
