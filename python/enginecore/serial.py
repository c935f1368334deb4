"""msgpack encoding of engine outputs into buffers reused across steps.

``EngineCoreOutputs`` objects go through msgspec. ``ColumnarOutputs`` (the
process engine's native path) go through ``_C.encode_columnar`` (or
``_C.send_columnar``, which also sends them without the GIL), or, on the
Python path, through msgspec after ``to_struct()``: the same bytes either way.
"""

from __future__ import annotations

import msgspec

from enginecore import _native
from enginecore.protocol import EngineCoreOutputs
from enginecore.sched.columnar_outputs import ColumnarOutputs


class OutputEncoder:
    """Encode ``EngineCoreOutputs`` into bytearrays taken from a free list.

    A buffer handed out by ``encode`` belongs to the caller until it gives it
    back with ``release`` (after zmq is done sending it).
    """

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._free: list[bytearray] = []
        self.num_allocated = 0

    def encode(self, outputs: EngineCoreOutputs | ColumnarOutputs) -> bytearray:
        while self._free:
            buf = self._free.pop()
            try:
                self.encode_into(outputs, buf)
                return buf
            except BufferError:  # still exported by a zmq frame: leave it to the GC
                continue
        buf = bytearray()
        self.num_allocated += 1
        self.encode_into(outputs, buf)
        return buf

    def encode_into(self, outputs: EngineCoreOutputs | ColumnarOutputs,
                    buf: bytearray) -> None:
        if type(outputs) is not ColumnarOutputs:
            self._encoder.encode_into(outputs, buf)
            return
        ext = _native.extension()
        if ext is None:
            self._encoder.encode_into(outputs.to_struct(), buf)
            return
        ext.encode_columnar(*self.columnar_args(outputs), buf)

    def columnar_args(self, outputs: ColumnarOutputs) -> tuple:
        """What ``_C.encode_columnar`` and ``_C.send_columnar`` take: the columns,
        with the special outputs and the stats pre-encoded by msgspec."""
        enc = self._encoder.encode
        stats = outputs.scheduler_stats
        specials = outputs.specials
        return (outputs.engine_index, outputs.request_ids, outputs.new_token_ids,
                [enc(o) for o in specials] if specials else specials,
                None if stats is None else enc(stats), outputs.timestamp)

    def release(self, buf: bytearray) -> None:
        self._free.append(buf)
