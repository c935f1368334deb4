"""The P/D block transport's messages (docs/protocol.md, "KV block transport").

A decode engine (DEALER, CURVE client) pulls a request's blocks from the prefill engine
that computed them (ROUTER, CURVE server). Every message is a type frame, one msgspec
msgpack struct, and for a chunk the raw block bytes as further frames:

    consumer -> producer   HELLO  Hello                      (once per link)
                           PULL   Pull                       (one chunk; a window in flight)
                           DONE   Release                    (blocks may be freed)
    producer -> consumer   LAYOUT KVLayout                   (answer to HELLO)
                           CHUNK  ChunkHeader, frame * n     (answer to PULL)
                           ERROR  TransferError              (answer to a bad PULL/HELLO)

A chunk carries positions [start, start + count) of the request's block list; its
frames are, layer by layer, K then V, one frame per run of consecutive producer block
ids (``runs`` lists the run lengths), so a run is one zero-copy view of the cache.
Nothing received is ever unpickled; block bytes are only ever copied into the cache.
"""

from __future__ import annotations

import msgspec

HELLO = b"H"
PULL = b"P"
DONE = b"D"
LAYOUT = b"L"
CHUNK = b"C"
ERROR = b"E"


class KVLayout(msgspec.Struct, array_like=True, frozen=True):
    """What both ends must agree on before a byte of KV is copied."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32"
    model: str  # the model's identity (its name or path): KV of another model is refused

    @property
    def block_bytes(self) -> int:
        """One block of one layer's K (or V)."""
        import torch

        elem = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.block_size * self.num_kv_heads * self.head_dim * elem

    def mismatch(self, other: KVLayout) -> str | None:
        """What differs (None: nothing)."""
        diffs = [f"{f}: {getattr(self, f)!r} here, {getattr(other, f)!r} there"
                 for f in self.__struct_fields__ if getattr(self, f) != getattr(other, f)]
        return "; ".join(diffs) or None


class Hello(msgspec.Struct, array_like=True, frozen=True):
    engine_id: str
    layout: KVLayout


class Pull(msgspec.Struct, array_like=True, frozen=True):
    transfer_id: int  # the consumer's own number for this transfer (echoed back)
    request_id: str  # the producer's request id (kv_transfer_params["remote_request_id"])
    block_ids: list[int]  # producer block ids, a part of those the request registered
    start: int  # position of block_ids[0] in the whole transfer (echoed back)


class ChunkHeader(msgspec.Struct, array_like=True, frozen=True):
    transfer_id: int
    start: int
    count: int
    runs: list[int]  # lengths of the runs of consecutive producer block ids


class Release(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    ok: bool  # False: the consumer gave up (it recomputes); the blocks are freed anyway


class TransferError(msgspec.Struct, array_like=True, frozen=True):
    transfer_id: int  # -1: not about one transfer (a HELLO)
    message: str


def runs_of(block_ids: list[int]) -> list[tuple[int, int]]:
    """[(first id, length)] of consecutive ids: [4, 5, 6, 9] -> [(4, 3), (9, 1)]."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


encode = msgspec.msgpack.Encoder().encode
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def decode(data: bytes | memoryview, kind: type) -> object:
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    return dec.decode(data)
