"""``AsyncLLM``: the asyncio front-end (vLLM's names), for servers.

Requests go through the ``InputProcessor`` (tokenize, validate) to an
``AsyncMPClient`` (engines in their own processes, data parallel included); one
output-handler task pulls each step's ``EngineCoreOutputs`` and runs the
``OutputProcessor`` once over them, which fills each stream's collector.
``generate()`` / ``encode()`` are async iterators of outputs; leaving one early
(closing it, cancelling its task) aborts the request in the engine.

Several front-ends (API server processes) can share the engines: the process
that starts them makes ``AsyncLLM.from_engine_args(args, client_count=N)`` and
hands ``engine.handoff(i)`` (picklable) to process i, which makes
``AsyncLLM.from_handoff(handoff)`` (client/remote_front_end.py says how).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncGenerator, Iterable
from typing import Any

import msgspec

from enginecore.client.mp_client import AsyncMPClient
from enginecore.client.remote_front_end import FrontEndHandoff
from enginecore.config import EngineArgs, EngineConfig
from enginecore.errors import EngineDeadError
from enginecore.executor.abstract import Executor
from enginecore.frontend.input_processor import InputProcessor, PromptType
from enginecore.frontend.metrics import FrontendMetrics, IterationStats
from enginecore.frontend.output_processor import OutputProcessor, RequestOutputCollector
from enginecore.frontend.parallel_sampling import ParentRequest
from enginecore.model.tokenizer import Tokenizer
from enginecore.outputs import EmbeddingRequestOutput, RequestMetrics, RequestOutput
from enginecore.protocol import EngineCoreRequest, LoRARequest, PoolingParams
from enginecore.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# Outputs processed between yields to the event loop (a 1024-stream step would
# otherwise hold it for milliseconds).
_CHUNK = 256


def load_tokenizer(config: EngineConfig) -> Tokenizer | None:
    """The model's tokenizer, or None (the synthetic model: token ids only)."""
    path = config.model_config.model_path
    if path is None or not os.path.exists(os.path.join(path, "tokenizer.json")):
        return None
    return Tokenizer.from_dir(path)


class AsyncLLM:
    def __init__(self, config: EngineConfig, client: AsyncMPClient, *, log_stats: bool = True,
                 tokenizer: Tokenizer | None = None) -> None:
        """Use ``from_engine_args`` or ``from_handoff``; this takes a started client."""
        self.config = config
        self.model_config = config.model_config
        self.engine_core = client
        self.log_stats = log_stats
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config)
        self.max_model_len = client.max_model_len
        self.input_processor = InputProcessor(config, self.tokenizer, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats)
        self.metrics = (FrontendMetrics(config.model_config.model,
                                        spec_decode=config.speculative_config.enabled)
                        if log_stats else None)
        self._output_handler: asyncio.Task | None = None
        self._dead_error: BaseException | None = None
        self._shutdown = False

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *, client_index: int = 0,
                         client_count: int = 1, log_stats: bool = True,
                         executor_class: type[Executor] | None = None,
                         engine_log_level: int | None = None,
                         handshake_timeout_s: float = 120.0) -> AsyncLLM:
        """Start the engine(s) and be front-end 0 of ``client_count``; the others
        attach from other processes with ``from_handoff(engine.handoff(i))``."""
        if client_index != 0:
            raise ValueError("from_engine_args starts the engines and is front-end 0; "
                             "front-end i > 0 attaches with AsyncLLM.from_handoff")
        config = engine_args.create_engine_config()
        client = AsyncMPClient(config, executor_class, log_stats,
                               handshake_timeout_s=handshake_timeout_s,
                               engine_log_level=engine_log_level, client_count=client_count,
                               local_client_count=1)
        try:
            return cls(config, client, log_stats=log_stats)
        except BaseException:
            client.shutdown()
            raise

    @classmethod
    def from_handoff(cls, handoff: FrontEndHandoff, *, log_stats: bool = True,
                     timeout_s: float = 60.0) -> AsyncLLM:
        """Attach, in this process, to engines another process started."""
        client = AsyncMPClient.connect(handoff, timeout_s)
        try:
            return cls(handoff.config, client, log_stats=log_stats)
        except BaseException:
            client.shutdown()
            raise

    def handoff(self, client_index: int) -> FrontEndHandoff:
        """What front-end ``client_index`` (another process) needs to attach."""
        return self.engine_core.handoff(client_index)

    # -- state -------------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self._dead_error is not None or self.engine_core._dead

    @property
    def is_running(self) -> bool:
        return not self._shutdown and not self.errored

    @property
    def is_stopped(self) -> bool:
        return self._shutdown

    @property
    def dead_error(self) -> BaseException:
        return self._dead_error if self._dead_error is not None else EngineDeadError()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    async def check_health(self, timeout_s: float | None = None) -> None:
        """Raise ``EngineDeadError`` when the engine is dead; with ``timeout_s``,
        also when every engine does not answer a round trip (``echo``) in time."""
        if self.errored:
            raise self.dead_error
        if timeout_s is None:
            return
        try:
            await asyncio.wait_for(self.engine_core.call_utility_async("echo", "ping"),
                                   timeout_s)
        except asyncio.TimeoutError:
            raise EngineDeadError(f"the engine did not answer a health ping within "
                                  f"{timeout_s:g} s") from None

    # -- requests ----------------------------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
        *, lora_request: LoRARequest | None = None, priority: int = 0,
        cache_salt: str | None = None, data_parallel_rank: int | None = None,
        arrival_time: float | None = None,
    ) -> RequestOutputCollector:
        """Validate (raising ValueError / TypeError), register and send a request;
        its collector receives its outputs."""
        if self.errored:
            raise self.dead_error
        if self._shutdown:
            raise RuntimeError("AsyncLLM is shut down")
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already running")
        text, request = self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time=arrival_time, lora_request=lora_request,
            priority=priority, cache_salt=cache_salt, data_parallel_rank=data_parallel_rank)
        self._ensure_output_handler()
        metrics = RequestMetrics(request.arrival_time, time.monotonic())
        sp = request.sampling_params
        kind = RequestOutputKind.FINAL_ONLY if sp is None else sp.output_kind
        queue = RequestOutputCollector(kind)
        if sp is None or sp.n == 1:
            self.output_processor.add_request(request, text, queue=queue, metrics=metrics)
            await self._send([request])
            return queue
        parent = ParentRequest(request_id, sp, text, request.prompt_token_ids, queue, metrics,
                               request.lora_request)
        children = []
        for i, child_id in enumerate(parent.child_ids):
            child = _child_request(request, child_id, ParentRequest.child_params(sp, i))
            self.output_processor.add_request(
                child, text, external_id=request_id, parent=parent, index=i,
                metrics=RequestMetrics(request.arrival_time, metrics.arrival_ts))
            children.append(child)
        await self._send(children)
        return queue

    async def _send(self, requests: list[EngineCoreRequest]) -> None:
        sent = 0
        try:
            for request in requests:
                await self.engine_core.add_request_async(
                    self.input_processor.strip_sent_mm(request))
                sent += 1
        except BaseException:
            self.input_processor.clear_mm_cache()  # the engine may not have its items
            # Nothing half-registered stays behind: drop the unsent ones here, abort the sent.
            ids = [r.request_id for r in requests]
            self.output_processor.discard(ids)
            if sent:
                try:
                    await self.engine_core.abort_requests_async(ids[:sent])
                except EngineDeadError:
                    pass
            raise

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams | None, request_id: str,
        *, lora_request: LoRARequest | None = None, priority: int = 0,
        cache_salt: str | None = None, data_parallel_rank: int | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs. Invalid input raises before anything is sent;
        an engine failure of this request is an output with finish reason "error";
        a dead engine raises EngineDeadError."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, PoolingParams):
            raise TypeError("generate() takes SamplingParams; use encode() for pooling")
        async for out in self._stream(request_id, prompt, params, lora_request, priority,
                                      cache_salt, data_parallel_rank):
            yield out  # type: ignore[misc]

    async def encode(
        self, prompt: PromptType, pooling_params: PoolingParams | None, request_id: str,
        *, lora_request: LoRARequest | None = None, priority: int = 0,
        cache_salt: str | None = None, data_parallel_rank: int | None = None,
    ) -> AsyncGenerator[EmbeddingRequestOutput, None]:
        """The pooled output of an embedding model (one final output)."""
        params = pooling_params if pooling_params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise TypeError("encode() takes PoolingParams; use generate() for sampling")
        async for out in self._stream(request_id, prompt, params, lora_request, priority,
                                      cache_salt, data_parallel_rank):
            yield out  # type: ignore[misc]

    async def _stream(self, request_id, prompt, params, lora_request, priority, cache_salt,
                      data_parallel_rank) -> AsyncGenerator[Any, None]:
        queue = await self.add_request(request_id, prompt, params, lora_request=lora_request,
                                       priority=priority, cache_salt=cache_salt,
                                       data_parallel_rank=data_parallel_rank)
        finished = False
        try:
            while not finished:
                out = queue.get_nowait() or await queue.get()
                finished = out.finished
                yield out
        except BaseException:  # closed early (GeneratorExit), cancelled, or failed
            if not finished:
                await self._abort_quietly(request_id)
            raise

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await self.abort(request_id)
        except Exception as e:  # noqa: BLE001 - the consumer is gone; nothing to tell
            logger.debug("abort of %s after its stream closed failed: %s", request_id, e)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (a parent's ``n`` children too): each stream ends with an
        output whose finish reason is "abort"; unknown ids are ignored."""
        iteration = IterationStats() if self.metrics is not None else None
        result = self.output_processor.abort_requests(request_id, iteration=iteration)
        if self.metrics is not None:
            self.metrics.record(iteration)
        if result.reqs_to_abort and not self.errored:
            await self.engine_core.abort_requests_async(result.reqs_to_abort)

    # -- the output handler ----------------------------------------------------------------
    def _ensure_output_handler(self) -> None:
        if self._output_handler is None or self._output_handler.done():
            self._output_handler = asyncio.get_running_loop().create_task(
                self._handle_outputs(), name="enginecore-output-handler")

    async def _handle_outputs(self) -> None:
        client, processor, metrics = self.engine_core, self.output_processor, self.metrics
        try:
            while True:
                outs = await client.get_output_async()
                outputs = outs.outputs
                iteration = IterationStats() if metrics is not None else None
                aborts: list[str] = []
                for start in range(0, max(len(outputs), 1), _CHUNK):
                    if start:
                        await asyncio.sleep(0)
                    chunk = outputs[start:start + _CHUNK] if len(outputs) > _CHUNK else outputs
                    aborts.extend(processor.process_outputs(chunk, None,
                                                            iteration).reqs_to_abort)
                if aborts:
                    await client.abort_requests_async(aborts)
                if metrics is not None:
                    metrics.record(iteration, outs.scheduler_stats, outs.engine_index)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # every stream must hear about it
            if not isinstance(e, EngineDeadError):
                logger.exception("the output handler failed; failing every request")
                e = EngineDeadError(f"the front-end's output handler failed: {e!r}")
            self._dead_error = e
            processor.propagate_error(e)

    # -- utilities (allow-listed engine methods) --------------------------------------------
    async def reset_mm_cache(self) -> bool:
        """Forget the processed images on both sides (front-end first)."""
        self.input_processor.clear_mm_cache()
        return await self.engine_core.call_utility_async("reset_mm_cache")

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.call_utility_async("reset_prefix_cache")

    async def sleep(self, level: int = 1) -> None:
        await self.engine_core.call_utility_async("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.engine_core.call_utility_async("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return await self.engine_core.call_utility_async("is_sleeping")

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        self.input_processor._check_lora(lora_request)
        return await self.engine_core.call_utility_async("add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self.engine_core.call_utility_async("remove_lora", lora_id)

    async def list_loras(self) -> set[int]:
        return await self.engine_core.call_utility_async("list_loras")

    async def pin_lora(self, lora_id: int) -> bool:
        return await self.engine_core.call_utility_async("pin_lora", lora_id)

    async def pause_scheduler(self, mode: str = "abort") -> None:
        await self.engine_core.call_utility_async("pause_scheduler", mode)

    async def resume_scheduler(self) -> None:
        await self.engine_core.call_utility_async("resume_scheduler")

    async def is_scheduler_paused(self) -> bool:
        return await self.engine_core.call_utility_async("is_scheduler_paused")

    async def start_profile(self) -> None:
        await self.engine_core.call_utility_async("profile", True)

    async def stop_profile(self) -> None:
        await self.engine_core.call_utility_async("profile", False)

    async def collective_rpc(self, method: str, timeout: float | None = None,
                             args: tuple = (), kwargs: dict[str, Any] | None = None) -> Any:
        return await self.engine_core.call_utility_async("collective_rpc", method, timeout,
                                                         list(args), kwargs)

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return self.input_processor.supported_tasks

    # -- shutdown ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the output handler and the client (the engines too, if this
        front-end started them). Open streams get EngineDeadError. Call it on the
        event loop's thread (or after the loop has ended): asyncio tasks are not
        thread-safe."""
        if self._shutdown:
            return
        self._shutdown = True
        if self._output_handler is not None and not self._output_handler.done():
            self._output_handler.cancel()
        self.output_processor.propagate_error(EngineDeadError("AsyncLLM was shut down"))
        self.engine_core.shutdown()

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _child_request(request: EngineCoreRequest, child_id: str,
                   params: SamplingParams) -> EngineCoreRequest:
    return msgspec.structs.replace(request, request_id=child_id, sampling_params=params)
