"""The fault suite, wire side (issue 13), part two: an engine IO thread that dies is
the engine's death (the front-end hears ENGINE_CORE_DEAD), on both paths; the rest of
the wire faults are in test_faults_wire.py."""

from __future__ import annotations

import threading

import msgspec
import pytest
import zmq

from test_faults_wire import ADD, cfg


# -- item 2: an engine thread's death is the engine's death --------------------------------
class FakeFrontEnd:
    """The front-end side of one engine's sockets, run by the test itself."""

    def __init__(self):
        from enginecore.client.sockets import Addresses

        self.addresses = Addresses("ipc")
        self.ctx = zmq.Context()
        self.handshake = self.ctx.socket(zmq.ROUTER)
        self.hs = self.addresses.bind(self.handshake, "hs.sock")
        self.inp = self.ctx.socket(zmq.ROUTER)
        self.in_addr = self.addresses.bind(self.inp, "in.sock")
        self.out = self.ctx.socket(zmq.PULL)
        self.out_addr = self.addresses.bind(self.out, "out.sock")

    def start_engine(self):
        from enginecore.core.engine_core_proc import EngineCoreProc
        from enginecore.protocol import HandshakeInit

        box = {}
        t = threading.Thread(target=lambda: box.setdefault("engine", EngineCoreProc(
            cfg(), self.hs, handshake_timeout_s=30)))
        t.start()
        assert self.handshake.poll(30000)
        ident, _ = self.handshake.recv_multipart()
        self.handshake.send_multipart([ident, msgspec.msgpack.encode(
            HandshakeInit([self.in_addr], [self.out_addr]))])
        t.join(30)
        self.inp.recv_multipart()  # the engine's registration
        return box["engine"]

    def close(self):
        self.ctx.destroy(linger=0)
        self.addresses.cleanup()


@pytest.mark.parametrize("thread", ["output", "input"])
def test_an_io_thread_dying_is_the_engines_death(hot_path, thread):
    fe = FakeFrontEnd()
    engine = fe.start_engine()
    died: list[BaseException] = []

    def busy():
        try:
            engine.run_busy_loop()
        except BaseException as e:  # noqa: BLE001
            died.append(e)
            engine.send_engine_dead()  # as run_engine_core does

    loop = threading.Thread(target=busy, daemon=True)
    loop.start()
    try:
        if thread == "output":
            engine.output_queue.put_nowait((0, object()))  # nothing the thread can send
        else:
            def explode(*args):
                raise SystemExit("the input thread's bug")
            engine._dispatch_input = explode
            fe.inp.send_multipart([engine.identity, ADD, b"\x90"])
        loop.join(10)
        assert died and f"enginecore-{thread} thread died" in str(died[0])
        assert fe.out.poll(5000) and fe.out.recv() == b"ENGINE_CORE_DEAD"
    finally:
        engine.shutdown()
        fe.close()
