"""One step's outputs for one client as columns: what ``update_from_output`` and
``take_pending_outputs`` return on both paths.

A plain decode is two appends (the request id, the new token list); outputs that
are not plain decodes (finished, with logprobs, pooled, owed from outside a step)
stay ``EngineCoreOutput`` objects in the token column, with ``None`` as their id.
``outputs`` is the typed view (one ``EngineCoreOutput`` per request) and
``to_struct()`` the equivalent ``EngineCoreOutputs``. The output thread writes msgpack
straight from the columns (``csrc/output_encoder.cpp``, or its twin
``serial.encode_columnar_py``): the same bytes as msgspec's encoding of ``to_struct()``.
"""
from __future__ import annotations

import time

from enginecore.protocol import EngineCoreOutput, EngineCoreOutputs, SchedulerStats


class ColumnarOutputs:
    __slots__ = ("engine_index", "request_ids", "new_token_ids", "specials", "scheduler_stats",
                 "timestamp")

    # Never set on step outputs; read by code that takes either kind.
    utility_output = None
    finished_requests = None
    wave_complete = None
    start_wave = None

    def __init__(self) -> None:
        self.engine_index = 0
        self.request_ids: list[str | None] = []
        self.new_token_ids: list[list[int] | EngineCoreOutput] = []
        # The objects among them, in order (the encoder pre-encodes just these).
        self.specials: list[EngineCoreOutput] = []
        self.scheduler_stats: SchedulerStats | None = None
        self.timestamp = time.monotonic()

    def append_output(self, out: EngineCoreOutput) -> None:
        """An output that is not a plain decode (kept as the object)."""
        self.request_ids.append(None)
        self.new_token_ids.append(out)
        self.specials.append(out)

    @property
    def outputs(self) -> list[EngineCoreOutput]:
        return [EngineCoreOutput(rid, toks) if rid is not None else toks  # type: ignore[misc]
                for rid, toks in zip(self.request_ids, self.new_token_ids)]

    def to_struct(self) -> EngineCoreOutputs:
        return EngineCoreOutputs(engine_index=self.engine_index, outputs=self.outputs,
                                 scheduler_stats=self.scheduler_stats,
                                 timestamp=self.timestamp)
