"""msgpack encoding of engine outputs into buffers reused across steps.

``EngineCoreOutputs`` objects go through msgspec. ``ColumnarOutputs`` (one step's
outputs as columns) go through ``_C.encode_columnar`` or its twin
``encode_columnar_py`` (msgspec, with the pre-encoded parts spliced in as
``msgspec.Raw``): the same bytes either way. ``_C.send_columnar`` also sends them
without the GIL; its twin ``send_columnar_py`` sends through pyzmq.
"""

from __future__ import annotations

import msgspec
import zmq

from enginecore import _native
from enginecore.loaded_libraries import loaded_library_path
from enginecore.protocol import EngineCoreOutput, EngineCoreOutputs
from enginecore.sched.columnar_outputs import ColumnarOutputs

_ENCODER = msgspec.msgpack.Encoder()


def encode_columnar_py(engine_index: int, request_ids: list[str | None],
                       new_token_ids: list, specials: list, stats_raw: bytes | None,
                       timestamp: float, buf: bytearray) -> None:
    """The twin of ``_C.encode_columnar``: msgpack of one client's step outputs from
    columns into ``buf``. A ``None`` id takes the next of ``specials`` (outputs that
    are not plain decodes, already msgpack); ``stats_raw`` is msgpack too."""
    raw = iter(specials or ())
    outputs = [EngineCoreOutput(rid, toks) if rid is not None else msgspec.Raw(next(raw))
               for rid, toks in zip(request_ids, new_token_ids, strict=True)]
    struct = EngineCoreOutputs(engine_index=engine_index, outputs=outputs,  # type: ignore[arg-type]
                               scheduler_stats=None if stats_raw is None
                               else msgspec.Raw(stats_raw))  # type: ignore[arg-type]
    struct.timestamp = timestamp  # as given, not __post_init__'s "now" for 0.0
    _ENCODER.encode_into(struct, buf)


def send_columnar_py(socket: int, engine_index: int, request_ids: list[str | None],
                     new_token_ids: list, specials: list, stats_raw: bytes | None,
                     timestamp: float, max_size: int = -1) -> bool:
    """The twin of ``_C.send_columnar``: encode, then send on the zmq socket whose
    handle is ``socket`` (pyzmq's ``Socket.underlying``) through pyzmq; False
    (nothing sent) when the message would pass ``max_size`` bytes."""
    buf = bytearray()
    encode_columnar_py(engine_index, request_ids, new_token_ids, specials, stats_raw,
                       timestamp, buf)
    if 0 <= max_size < len(buf):
        return False
    zmq.Socket.shadow(socket).send(buf, copy=True)  # a shadow never closes the socket
    return True


def libzmq_path_py() -> str | None:
    """The twin of ``_C.libzmq_path``: the path of the libzmq this process has
    mapped (pyzmq's), or None."""
    return loaded_library_path("libzmq")


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
        encode = _native.twin("encode_columnar", encode_columnar_py)
        encode(*self.columnar_args(outputs), buf)

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
