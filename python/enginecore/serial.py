"""msgpack encoding of engine outputs into buffers reused across steps (the
Python twin of csrc/output_encoder.cpp), and the decoders the engine uses."""

from __future__ import annotations

import msgspec

from enginecore.protocol import EngineCoreOutputs


class OutputEncoder:
    """Encode ``EngineCoreOutputs`` into bytearrays taken from a free list.

    A buffer handed out by ``encode`` belongs to the caller until it gives it
    back with ``release`` (after zmq is done sending it).
    """

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._free: list[bytearray] = []
        self.num_allocated = 0

    def encode(self, outputs: EngineCoreOutputs) -> bytearray:
        while self._free:
            buf = self._free.pop()
            try:
                self._encoder.encode_into(outputs, buf)
                return buf
            except BufferError:  # still exported by a zmq frame: leave it to the GC
                continue
        buf = bytearray()
        self.num_allocated += 1
        self._encoder.encode_into(outputs, buf)
        return buf

    def release(self, buf: bytearray) -> None:
        self._free.append(buf)
