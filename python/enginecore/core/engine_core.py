"""EngineCore: the scheduler, the KV cache and the executor in one loop step.

In-process users call ``add_request`` / ``step`` directly; ``EngineCoreProc``
(core/engine_core_proc.py) wraps it in a busy loop behind ZMQ.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import msgspec

from enginecore import _native
from enginecore.blocking_queue import make_blocking_queue
from enginecore.config import EngineConfig
from enginecore.core.engine_core_utility import EngineCoreUtilities
from enginecore.core.fault_isolation import FaultIsolation
from enginecore.core.kv_connector_hooks import (
    after_add,
    check_kv_transfer_params,
    init_kv_connector,
)
from enginecore.core.stat_logger import StatLogger
from enginecore.executor.abstract import Executor, KVCacheConfig
from enginecore.executor.factory import get_executor_class
from enginecore.model.mm_registry import is_multimodal_architecture
from enginecore.multimodal.cache import engine_receiver_cache_from_config
from enginecore.multimodal.inputs import check_mm_features
from enginecore.protocol import (
    EngineCoreRequest,
    decode_request,
    encode_request,
)
from enginecore.request import Request, RequestStatus
from enginecore.sched.columnar_outputs import ColumnarOutputs
from enginecore.sched.encoder_scheduling import encoder_fit_error
from enginecore.sched.output import ModelRunnerOutput, SchedulerOutput
from enginecore.sched.scheduler import Scheduler
from enginecore.sched.structured_output import StructuredOutputError, StructuredOutputManager

logger = logging.getLogger(__name__)

class EngineCore(EngineCoreUtilities):
    """Inner loop of the engine: ``step()`` schedules, runs the model, and
    turns sampled tokens into per-client outputs (``ColumnarOutputs``: columns with
    the typed ``.outputs`` view; ``to_struct()`` gives the wire's EngineCoreOutputs)."""

    def __init__(
        self,
        config: EngineConfig,
        executor_class: type[Executor] | None = None,
        log_stats: bool = False,
        executor_fail_callback: Any = None,
    ) -> None:
        _native.set_native(config.use_native)
        self.config = config
        # One switch: the caller's flag or the config's (EngineArgs.log_stats) turns on
        # the stats every step (to front-ends) and the periodic stats line.
        self.log_stats = log_stats or config.log_stats
        if executor_class is None:
            executor_class = get_executor_class(config)
        logger.info(
            "EngineCore starting: model=%s executor=%s native=%s",
            config.model_config.model, executor_class.__name__, _native.native_available(),
        )
        self.model_executor = executor_class(config)
        if executor_fail_callback is not None:
            self.model_executor.register_failure_callback(executor_fail_callback)
        num_blocks = self._initialize_kv_caches()
        self.batch_queue_size = self.model_executor.max_concurrent_batches
        # Oldest batch first; native queue on the native path.
        self.batch_queue = (
            make_blocking_queue(self.batch_queue_size) if self.batch_queue_size > 1 else None
        )
        mc = config.model_config
        path = mc.model_path
        tok_json = os.path.join(path, "tokenizer.json") if path else None
        self.structured_output = StructuredOutputManager(
            tok_json if tok_json and os.path.exists(tok_json) else None, mc.vocab_size,
            mc.eos_token_id, config.structured_outputs_config.mask_budget_ms)
        self.scheduler = Scheduler(
            config,
            num_blocks,
            # log_iteration_details implies stats (the per-step lines read them).
            log_stats=self.log_stats or config.log_iteration_details,
            log_iteration_details=config.log_iteration_details,
            track_in_flight=self.batch_queue is not None,
            structured_output=self.structured_output,
        )
        init_kv_connector(self)
        self.stat_logger = StatLogger(
            getattr(self, "engine_index", 0), config.log_stats_interval_s,
            config.log_iteration_details,
        ) if self.log_stats or config.log_iteration_details else None
        self.step_fn = self.step if self.batch_queue is None else self.step_with_batch_queue
        # A batch that makes the executor raise costs only the culprit request(s).
        self.fault_isolation = FaultIsolation(self)
        # Aborts that arrive (from the input thread) while a step runs are
        # applied before that step's outputs are processed.
        self.aborts_queue: queue.Queue[list[str]] = queue.Queue()
        self.weight_version: str | None = None
        self._eos_token_id = mc.eos_token_id
        self._vocab_size = mc.vocab_size
        self._max_model_len = self.scheduler.max_model_len
        cc = config.cache_config
        self._block_size = cc.block_size
        self._hash_algo = cc.prefix_caching_hash_algo
        # A KV connector finds blocks by their hashes, prefix caching or not.
        self._enable_hashes = cc.enable_prefix_caching or self.scheduler.connector is not None
        self._tasks = self.get_supported_tasks()
        self._max_batched = config.scheduler_config.max_num_batched_tokens
        self._wire_encoder = msgspec.msgpack.Encoder()
        # Processed images by identifier, so a front-end sends each once (None:
        # the model takes no images).
        self.mm_receiver_cache = engine_receiver_cache_from_config(config)
        self.scheduler.mm_receiver_cache = self.mm_receiver_cache  # its lookups in stats

    # -- start-up -------------------------------------------------------------------
    def _initialize_kv_caches(self) -> int:
        cc = self.config.cache_config
        spec = self.model_executor.get_kv_cache_specs()
        t0 = time.perf_counter()
        if spec.page_size_bytes == 0:
            # No KV cache (an encoder): blocks are bookkeeping for the scheduler only.
            sc = self.config.scheduler_config
            num_blocks = 2 * (-(-max(sc.max_num_batched_tokens, sc.max_model_len)
                                // spec.block_size))
            cc.num_gpu_blocks = num_blocks
            self.model_executor.initialize_from_config(KVCacheConfig(num_blocks, spec))
            logger.info("no KV cache for this model (task %s)", self.config.model_config.task)
            return num_blocks
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        else:
            available = self.model_executor.determine_available_memory()
            num_blocks = available // spec.page_size_bytes
            if num_blocks < 1:
                raise ValueError(
                    f"no room for the KV cache: {available} bytes available, one block needs "
                    f"{spec.page_size_bytes}; raise kv_cache_memory_bytes / gpu_memory_utilization"
                )
        cc.num_gpu_blocks = num_blocks
        self.model_executor.initialize_from_config(KVCacheConfig(num_blocks, spec))
        tokens = num_blocks * spec.block_size
        max_len = self.config.scheduler_config.max_model_len
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB), %.1fx max_model_len %d "
            "(sized in %.2f s)",
            num_blocks, spec.block_size, tokens, num_blocks * spec.page_size_bytes / 2**20,
            tokens / max_len, max_len, time.perf_counter() - t0,
        )
        if tokens < max_len:
            logger.warning(
                "the KV cache holds %d tokens, less than max_model_len %d: requests are capped "
                "at %d tokens", tokens, max_len, tokens,
            )
            self.config.scheduler_config.max_model_len = tokens
        return num_blocks

    # -- requests ----------------------------------------------------------------------
    def preprocess_add_request(self, request: EngineCoreRequest,
                               validated: bool = False) -> tuple[Request, int]:
        """Turn a wire request into an engine Request (block hashes included).

        Runs off the busy loop in the process engine. Raises ``TypeError`` for a
        request id that is not a str, ``ValueError`` for anything the wire would
        refuse (types, numeric bounds: no native loop sees an unbounded value);
        ``validated``: it was just decoded, so it is known good.
        """
        if not isinstance(request.request_id, str):
            raise TypeError(
                f"request_id must be a str, got {type(request.request_id).__name__}"
            )
        if not validated:
            request = decode_request(encode_request(self._wire_encoder, request))
        if request.mm_features:
            request = self._receive_mm_features(request)
        req = Request.from_engine_core_request(
            request, self._eos_token_id, self._block_size, self._hash_algo,
            self._enable_hashes and self._fits(request) is None,
            table=self.scheduler.request_table,
        )
        self._compile_grammar(req)
        return req, request.current_wave

    def _receive_mm_features(self, request: EngineCoreRequest) -> EngineCoreRequest:
        """The request with every item's tensors (id-only items from the receiver
        cache), bounds checked; ValueError naming the problem."""
        cache = self.mm_receiver_cache
        if cache is None:
            raise ValueError(f"the model {self.config.model_config.model} "
                             f"({self.config.model_config.architecture}) does not take images "
                             "or other multimodal inputs")
        features = cache.get_and_update_features(request.mm_features)
        check_mm_features(features, len(request.prompt_token_ids))
        return msgspec.structs.replace(request, mm_features=features)

    def _compile_grammar(self, req: Request) -> None:
        so = req.sampling_params.structured_outputs
        if so is None or req.grammar is not None or req.grammar_error is not None:
            return
        try:
            req.grammar = self.structured_output.compile(so)
        except StructuredOutputError as e:
            req.grammar_error = str(e)

    def _fits(self, request: EngineCoreRequest | Request) -> str | None:
        """Why the request cannot run, or None when it can."""
        prompt = request.prompt_token_ids
        n = len(prompt)
        if n == 0:
            return "the prompt is empty"
        limit = self._max_model_len + (1 if request.pooling_params is not None else 0)
        if n >= limit:
            return (
                f"prompt of {n} tokens leaves no room to generate within max_model_len "
                f"{self._max_model_len}"
            )
        if min(prompt) < 0 or max(prompt) >= self._vocab_size:
            return f"prompt token ids must be in [0, {self._vocab_size})"
        bad = _out_of_vocab(request, self._vocab_size)
        if bad is not None:
            return f"{bad} must be token ids in [0, {self._vocab_size}) (the model's vocabulary)"
        task = "embed" if request.pooling_params is not None else "generate"
        if task not in self._tasks:
            return f"this model does not support the {task!r} task; it supports {self._tasks}"
        if isinstance(request, Request) and request.mm_features:
            sched = self.scheduler
            reason = encoder_fit_error(request, is_multimodal_architecture(
                self.config.model_config.architecture), sched.max_num_encoder_input_tokens,
                sched.encoder_cache_manager.cache_size)
            if reason is not None:
                return reason
        if task == "embed" and n > self._max_batched:
            return (f"a pooling prompt must run in one step: {n} tokens > "
                    f"max_num_batched_tokens {self._max_batched}")
        return None

    def add_request(self, request: Request | EngineCoreRequest, request_wave: int = 0) -> None:
        """Queue a request. A request that cannot run is answered with finish
        reason ERROR; a duplicate live id raises ``ValueError`` and leaves the
        first untouched."""
        if isinstance(request, EngineCoreRequest):
            request, _wave = self.preprocess_add_request(request)
        if not isinstance(request.request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request.request_id).__name__}")
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id!r} is already live; rejected")
        self._compile_grammar(request)
        reason = self._fits(request) or request.grammar_error
        if reason is None and request.lora_request is not None:
            reason = self._load_lora_for(request)
        if reason is not None:
            logger.warning("rejecting request %s: %s", request.request_id, reason)
            self.scheduler.reject_request(request, reason)
            return
        check_kv_transfer_params(self, request)
        self.scheduler.add_request(request)
        after_add(self, request)

    def _load_lora_for(self, request: Request) -> str | None:
        """Make the request's adapter resident; the reason it cannot be, or None."""
        if not self.config.lora_config.enable_lora:
            return "LoRA is not enabled on this engine (enable_lora=True)"
        try:
            self.model_executor.add_lora(request.lora_request)
        except (ValueError, NotImplementedError, RuntimeError, OSError) as e:
            return str(e) if isinstance(e, ValueError) else (
                f"LoRA {request.lora_request.lora_name!r}: {e}")
        return None

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort live requests; unknown or finished ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def _process_aborts_queue(self) -> None:
        q = self.aborts_queue
        if not q.queue:  # the common step: nothing queued (a lock-free look at its deque)
            return
        while not q.empty():
            try:
                ids = q.get_nowait()
            except queue.Empty:
                break
            self.abort_requests(ids)

    # -- stepping ------------------------------------------------------------------------
    def step(self) -> tuple[dict[int, ColumnarOutputs], bool]:
        """One schedule + execute + update. Returns (outputs per client, model ran)."""
        scheduler = self.scheduler
        if not scheduler.has_requests() or self.model_executor.is_sleeping:
            return scheduler.take_pending_outputs(), False
        t0 = time.perf_counter()
        scheduler_output = scheduler.schedule()
        if not self._needs_execution(scheduler_output):
            return scheduler.take_pending_outputs(), False
        try:
            model_output = self._execute(scheduler_output)
        except Exception as e:  # noqa: BLE001 - one request's fault is that request's
            self.fault_isolation.batch_failed([scheduler_output], e)
            return scheduler.take_pending_outputs(), False
        self._process_aborts_queue()
        self._stamp_elapsed(t0)
        outputs = scheduler.update_from_output(scheduler_output, model_output)
        self.fault_isolation.step_succeeded()
        if self.stat_logger is not None:
            self.stat_logger.record(outputs, scheduler_output.total_num_scheduled_tokens)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def step_with_batch_queue(self) -> tuple[dict[int, ColumnarOutputs], bool]:
        """Keep up to ``max_concurrent_batches`` batches in flight: schedule and
        launch a new batch while the queue has room and the oldest is still
        running; otherwise block on the oldest and process its outputs."""
        batch_queue = self.batch_queue
        assert batch_queue is not None
        scheduler = self.scheduler
        model_executed = False
        t0 = time.perf_counter()
        if scheduler.has_requests() and not self.model_executor.is_sleeping:
            scheduler_output = scheduler.schedule()
            if self._needs_execution(scheduler_output):
                try:
                    future = self.model_executor.execute_model(scheduler_output, non_block=True)
                except Exception as e:  # noqa: BLE001 - raised before it was queued
                    future = Future()
                    future.set_exception(e)
                batch_queue.put((future, scheduler_output))
                model_executed = scheduler_output.total_num_scheduled_tokens > 0
                if (
                    model_executed
                    and len(batch_queue) < self.batch_queue_size
                    and not batch_queue.peek()[0].done()
                ):
                    return {}, True
        if not batch_queue:
            return scheduler.take_pending_outputs(), False
        future, scheduler_output = batch_queue.get_nowait()
        try:
            model_output = self._result(future)
        except Exception as e:  # noqa: BLE001 - one request's fault is that request's
            self._batch_queue_failed(scheduler_output, e)
            return scheduler.take_pending_outputs(), False
        self._process_aborts_queue()
        self._stamp_elapsed(t0)
        outputs = scheduler.update_from_output(scheduler_output, model_output)
        self.fault_isolation.step_succeeded()
        if self.stat_logger is not None:
            self.stat_logger.record(outputs, scheduler_output.total_num_scheduled_tokens)
        return outputs, model_executed

    def _batch_queue_failed(self, so: SchedulerOutput, error: Exception) -> None:
        """The oldest batch raised: the batches still in flight are awaited and
        recomputed with it (their tokens were computed on state that is rewound);
        those that raised too are suspects as well."""
        failed, others = [so], []
        while self.batch_queue:
            future, other = self.batch_queue.get_nowait()
            try:
                self._result(future)
                others.append(other)
            except Exception:  # noqa: BLE001
                failed.append(other)
        self.fault_isolation.batch_failed(failed, error, others)

    @staticmethod
    def _needs_execution(so: SchedulerOutput) -> bool:
        # Finished/preempted ids must reach the runner even without tokens to run; with
        # a KV connector every step does (the workers report finished transfers).
        return bool(so.total_num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids
                    or so.kv_connector_metadata is not None)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            result = self.model_executor.execute_model(scheduler_output, non_block=False)
        except Exception:  # not Ctrl-C or a shutdown signal: those are no executor failure
            self.scheduler.log_state()
            raise
        if isinstance(result, Future):
            return self._result(result)
        return self._sampled(result)

    def _result(self, future: Future) -> ModelRunnerOutput:
        try:
            return self._sampled(future.result())
        except Exception:
            self.scheduler.log_state()
            raise

    def _sampled(self, output: ModelRunnerOutput | None) -> ModelRunnerOutput:
        if output is None:  # sampling was deferred (structured outputs)
            output = self.model_executor.sample_tokens(None)
        return output  # type: ignore[return-value]

    def _stamp_elapsed(self, t0: float) -> None:
        details = self.scheduler.last_iteration
        if details is not None:
            details.elapsed_ms = (time.perf_counter() - t0) * 1e3

    def post_step(self, model_executed: bool) -> None:
        """Hand draft tokens from the executor back to the scheduler (spec decode)."""
        if not model_executed:
            return
        take = getattr(self.model_executor, "take_draft_token_ids", None)
        if take is None:
            return
        drafts = take()
        if drafts:
            requests = self.scheduler.requests
            for rid, tokens in drafts.items():
                req = requests.get(rid)
                # Constrained requests take no drafts: the grammar state must not run ahead.
                if req is not None and not req.is_finished() and req.grammar is None:
                    req.spec_token_ids = tokens

    def _drain_batch_queue(self) -> None:
        """Finish every in-flight batch; their outputs are kept for the next step."""
        if not self.batch_queue:
            return
        while self.batch_queue:
            future, so = self.batch_queue.get_nowait()
            try:
                model_output = self._result(future)
            except Exception as e:  # noqa: BLE001 - as in step_with_batch_queue
                self._batch_queue_failed(so, e)
                return
            outputs = self.scheduler.update_from_output(so, model_output)
            for client, outs in outputs.items():
                for out in outs.outputs:
                    self.scheduler.owe_output(client, out)

    def shutdown(self) -> None:
        self.model_executor.shutdown()


def _out_of_vocab(request: EngineCoreRequest | Request, vocab: int) -> str | None:
    """The first token-id field of a request (beyond its prompt) outside the vocabulary."""
    sp = request.sampling_params
    eos = request.eos_token_id
    if eos is not None and eos >= vocab:
        return "eos_token_id"
    if sp is None:
        return None
    if sp.logit_bias and max(sp.logit_bias) >= vocab:
        return "logit_bias keys"
    if sp.allowed_token_ids and max(sp.allowed_token_ids) >= vocab:
        return "allowed_token_ids"
    if sp.bad_words_token_ids and max(max(w) for w in sp.bad_words_token_ids) >= vocab:
        return "bad_words_token_ids"
    return None
