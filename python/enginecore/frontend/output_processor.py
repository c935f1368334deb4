"""Output processing: the per-request stream states and the once-per-step pass
that turns ``EngineCoreOutput``s into ``RequestOutput``s.

``OutputProcessor.process_outputs`` runs the per-step loop (``step_loop.py`` or
its Cython twin, chosen by ``step_loop_module()`` when the processor is
made) over one step's outputs. Requests of ``AsyncLLM`` have a
``RequestOutputCollector`` that their ``generate()`` awaits; ``LLM``'s have none
and come back in the returned list. An abort here (a caller's, or a cancelled
stream) goes through the same loop as an engine ABORT, so the caller gets a
final output with finish reason "abort".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from enginecore import _native
from enginecore.frontend import step_loop
from enginecore.frontend.detokenizer import DetokenizerFactory
from enginecore.frontend.metrics import IterationStats
from enginecore.frontend.parallel_sampling import ParentRequest
from enginecore.outputs import EmbeddingRequestOutput, RequestMetrics, RequestOutput
from enginecore.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from enginecore.sampling_params import RequestOutputKind

AnyOutput = RequestOutput | EmbeddingRequestOutput


def step_loop_module() -> ModuleType:
    """The per-step loop: the Cython module ``step_loop_cy`` (built by the same CMake
    build as ``_C``) on the native path, its Python twin ``step_loop`` otherwise."""
    if not _native.native_available():
        return step_loop
    try:
        from enginecore.frontend import step_loop_cy
    except ImportError as e:  # the same build makes both: a broken install
        raise RuntimeError(f"enginecore._C is built but the Cython step loop is not: {e}; "
                           "reinstall, or run with ENGINECORE_NATIVE=0") from e
    return step_loop_cy


class RequestOutputCollector:
    """One stream's mailbox between the output handler and ``generate()``.

    Holds at most one output: when the consumer falls behind, the next output is
    merged into it (DELTA: concatenated; otherwise the later one wins per index),
    so a slow reader never makes the handler queue up per token.
    """

    __slots__ = ("aggregate", "output", "ready")

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.output: AnyOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: AnyOutput | BaseException) -> None:
        held = self.output
        if held is None or isinstance(output, BaseException):
            self.output = output
        elif isinstance(held, RequestOutput) and isinstance(output, RequestOutput):
            held.add(output, self.aggregate)
        else:  # an exception is never overwritten; a pooling output comes once
            return
        self.ready.set()

    def get_nowait(self) -> AnyOutput | None:
        output = self.output
        self.output = None
        self.ready.clear()
        if isinstance(output, BaseException):
            raise output
        return output

    async def get(self) -> AnyOutput:
        while self.output is None:
            await self.ready.wait()
        return self.get_nowait()  # type: ignore[return-value]


@dataclass
class OutputProcessorOutput:
    request_outputs: list[AnyOutput] = field(default_factory=list)
    # Engine request ids the front-end finished (stop strings): abort them there.
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any | None, log_stats: bool = False) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.detokenizers = (DetokenizerFactory.for_tokenizer(tokenizer) if tokenizer is not None
                             else None)
        self._loop = step_loop_module()
        self.request_states: dict[str, Any] = {}  # engine request id -> RequestState
        self.parent_requests: dict[str, ParentRequest] = {}  # caller id -> parent (n > 1)
        self._external: dict[str, list[str]] = {}  # caller id -> its engine request ids
        self._caller_of: dict[str, str] = {}  # engine request id -> caller id

    @property
    def uses_native_loop(self) -> bool:
        return self._loop.__name__.endswith("_cy")

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(self, request: EngineCoreRequest, prompt: str | None, *,
                    external_id: str | None = None, parent: ParentRequest | None = None,
                    index: int = 0, queue: RequestOutputCollector | None = None,
                    metrics: RequestMetrics | None = None) -> None:
        """Track one engine request (a child of ``parent`` when n > 1)."""
        rid = request.request_id
        if rid in self.request_states:
            raise ValueError(f"request id {rid!r} is already running")
        external_id = rid if external_id is None else external_id
        sp = request.sampling_params
        pooling = request.pooling_params is not None
        detok = None
        token_text = None
        if self.detokenizers is not None and not pooling:
            detok = self.detokenizers.new(sp.skip_special_tokens, request.prompt_token_ids)
            token_text = self.detokenizers.token_text
        if metrics is None:
            metrics = RequestMetrics(request.arrival_time, time.monotonic())
        kind = RequestOutputKind.FINAL_ONLY if pooling else sp.output_kind
        state = self._loop.RequestState(
            rid, external_id, index, parent, queue if parent is None else None, prompt,
            request.prompt_token_ids, request.lora_request, int(kind), detok,
            list(sp.stop) if sp is not None and sp.stop and detok is not None else [],
            bool(sp is not None and sp.include_stop_str_in_output),
            0 if sp is None else sp.min_tokens,
            sp is not None and sp.logprobs is not None, metrics, pooling, token_text)
        self.request_states[rid] = state
        self._external.setdefault(external_id, []).append(rid)
        self._caller_of[rid] = external_id
        if parent is not None:
            self.parent_requests[external_id] = parent

    def process_outputs(self, outputs: list[EngineCoreOutput], now: float | None = None,
                        iteration: IterationStats | None = None) -> OutputProcessorOutput:
        """One engine step's outputs, in one pass."""
        if now is None:
            now = time.monotonic()
        returned, aborts, finished = self._loop.process_outputs(self.request_states, outputs,
                                                                now, iteration)
        for rid in finished:
            self._forget_engine_id(rid)
        return OutputProcessorOutput(returned, aborts)

    def _forget_engine_id(self, rid: str) -> None:
        external = self._caller_of.pop(rid, None)
        if external is None:
            return
        ids = self._external[external]
        ids.remove(rid)
        if not ids:
            del self._external[external]
            self.parent_requests.pop(external, None)

    def has_request(self, request_id: str) -> bool:
        """Whether a caller's request id is running here."""
        return request_id in self._external

    def discard(self, engine_ids: Iterable[str]) -> None:
        """Forget requests that never reached the engine (sending failed)."""
        for rid in engine_ids:
            if self.request_states.pop(rid, None) is not None:
                self._forget_engine_id(rid)

    def engine_ids(self, request_ids: str | Iterable[str]) -> list[str]:
        """The live engine request ids of callers' ids (n > 1: every child)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        out: list[str] = []
        for rid in request_ids:
            out.extend(self._external.get(rid, ()))
        return out

    def abort_requests(self, request_ids: str | Iterable[str], now: float | None = None,
                       iteration: IterationStats | None = None) -> OutputProcessorOutput:
        """Finish callers' requests here with finish reason "abort" (their final
        output goes to their queue or into the result; ``iteration`` counts them as
        finished); returns the engine ids to abort in ``reqs_to_abort``."""
        engine_ids = [r for r in self.engine_ids(request_ids) if r in self.request_states]
        result = self.process_outputs(
            [EngineCoreOutput(r, [], finish_reason=FinishReason.ABORT) for r in engine_ids],
            now, iteration)
        result.reqs_to_abort = engine_ids
        return result

    def propagate_error(self, error: BaseException) -> None:
        """The engine is gone: every waiting stream gets ``error``."""
        queues = {id(q): q for q in (s.queue if s.parent is None else s.parent.queue
                                     for s in self.request_states.values()) if q is not None}
        for q in queues.values():
            q.put(error)
        self.request_states.clear()
        self.parent_requests.clear()
        self._external.clear()
        self._caller_of.clear()
