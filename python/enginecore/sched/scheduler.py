"""The scheduler: one token budget per step over running and waiting requests
(its results half, ``update_from_output``, is in sched/scheduler_update.py).

vLLM v1 semantics: running requests first (decodes and unfinished prefill
chunks), then waiting ones while budget, ``max_num_seqs`` and KV blocks allow;
chunked prefill; prefix-cache hits; preemption by recompute when blocks run
out; FCFS or priority order; stop checks in ``update_from_output``.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable

from enginecore.config import EngineConfig
from enginecore.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole
from enginecore.kv_transfer.factory import KVConnectorFactory
from enginecore.kv_transfer.sched_hooks import WAITING_FOR_REMOTE_KVS, ConnectorScheduling
from enginecore.protocol import (
    EngineCoreOutput,
    FinishReason,
    IterationDetails,
)
from enginecore.request import Request, RequestStatus
from enginecore.sched.encoder_cache_manager import EncoderCacheManager
from enginecore.sched.encoder_scheduling import EncoderStep, schedule_encoder_inputs, trim_running
from enginecore.sched.kv_cache_manager import KVCacheManager
from enginecore.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from enginecore.sched.request_events import RequestEvents
from enginecore.sched.request_queue import SchedulingPolicy, create_request_queue
from enginecore.sched.scheduler_loops import scheduler_loops
from enginecore.sched.scheduler_reports import SchedulerReports
from enginecore.sched.scheduler_update import SchedulerUpdate
from enginecore.sched.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED


class PauseState(enum.IntEnum):
    UNPAUSED = 0
    PAUSED_NEW = 1  # running requests go on; waiting ones are not admitted
    PAUSED_ALL = 2  # nothing is scheduled; requests keep their place


class Scheduler(SchedulerUpdate, SchedulerReports):
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        *,
        log_stats: bool = False,
        log_iteration_details: bool = False,
        track_in_flight: bool = False,
        structured_output: StructuredOutputManager | None = None,
    ) -> None:
        """``structured_output``: the grammar manager (None: the scheduler compiles
        and checks no constraints)."""
        sc = config.scheduler_config
        self.config = config
        self.max_num_running_reqs = sc.max_num_seqs
        self.max_num_scheduled_tokens = sc.max_num_batched_tokens
        self.max_model_len = sc.max_model_len
        self.enable_chunked_prefill = sc.enable_chunked_prefill
        self.long_prefill_token_threshold = sc.long_prefill_token_threshold
        self.policy = SchedulingPolicy(sc.scheduling_policy)
        self.block_size = config.cache_config.block_size
        self.log_stats = log_stats
        self.log_iteration_details = log_stats and log_iteration_details
        lc = config.lora_config
        # At most max_loras distinct adapters run at once (the runner's slots).
        self.max_loras = lc.max_loras if lc.enable_lora else 0
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            self.block_size,
            self.max_model_len,
            enable_caching=config.cache_config.enable_prefix_caching,
        )
        # Multimodal: the encoder's compute budget per step and its cache (vLLM's
        # max_num_encoder_input_tokens / encoder_cache_size, in embedding tokens).
        self.max_num_encoder_input_tokens = (sc.max_num_encoder_input_tokens
                                             or sc.max_num_batched_tokens)
        self.disable_chunked_mm_input = sc.disable_chunked_mm_input
        self.encoder_cache_manager = EncoderCacheManager(sc.encoder_cache_size
                                                         or sc.max_num_batched_tokens)
        # The request rows (tokens, counts, block tables) the loops work on.
        self.request_table = self.kv_cache_manager.request_table
        self.requests: dict[str, Request] = {}
        self.slot_of: dict[str, int] = {}  # live request id -> its row
        # Live requests with multimodal items: none means no encoder pass per step.
        self.num_mm_requests = 0
        # The native loops or their twins, picked once.
        self._schedule_running, self._update_decodes = scheduler_loops()
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished since the last schedule(): the runner frees their state.
        self.finished_req_ids: set[str] = set()
        # Preempted since the last schedule(): the runner drops their state.
        self.preempted_req_ids: set[str] = set()
        # Outputs owed to clients outside a model step (aborts, rejections).
        self.pending_outputs: dict[int, list[EngineCoreOutput]] = {}
        # With a batch queue, a request sits in at most one in-flight batch.
        self.track_in_flight = track_in_flight
        self.in_flight: set[str] = set()
        self.pause_state = PauseState.UNPAUSED
        # Lockstep data parallel turns this off on steps off the prefill cadence.
        self.admit_new_prefills = True
        self.num_admitted = 0  # requests moved from waiting to running, ever
        self.structured_output = structured_output
        self.step_counter = 0
        self.num_preempted_total = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_num_drafts = 0  # draft proposals verified (vLLM's num_drafts)
        self.spec_num_accepted_per_pos: list[int] = []  # accepted at draft position i
        self.last_iteration: IterationDetails | None = None
        # Fault isolation (core/fault_isolation.py): while set, only these requests
        # are scheduled, to find which of a failed batch's requests make it raise.
        self.probe: set[str] | None = None
        # log_stats: QUEUED / SCHEDULED / PREEMPTED events for the front-end's metrics.
        self.events = RequestEvents(self.owe_output) if log_stats else None
        # KV transfer (vLLM's kv_transfer_config): the scheduler-role connector and
        # its bookkeeping (kv_transfer/sched_hooks.py); None without one.
        self.connector: KVConnectorBase_V1 | None = None
        self.kv_hooks: ConnectorScheduling | None = None
        kvc = getattr(config, "kv_transfer_config", None)
        if kvc is not None and kvc.is_kv_transfer_instance:
            self.connector = KVConnectorFactory.create_connector(config,
                                                                 KVConnectorRole.SCHEDULER)
            self.kv_hooks = ConnectorScheduling(self.connector, self.block_size)

    def get_kv_connector(self) -> KVConnectorBase_V1 | None:
        return self.connector

    # -- requests in ---------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already live")
        self.kv_cache_manager.adopt(request)
        self.requests[request.request_id] = request
        self.slot_of[request.request_id] = request.slot
        if request.mm_features:
            self.num_mm_requests += 1
        self.waiting.add_request(request)
        if self.events is not None:
            self.events.queued(request)

    def reject_request(self, request: Request, reason: str) -> None:
        """Answer a request that cannot run with finish reason ERROR and ``reason``."""
        self.owe_output(
            request.client_index,
            EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR,
                             stop_reason=reason),
        )

    def finish_requests(
        self, request_ids: str | Iterable[str], status: RequestStatus,
        reason: str | None = None, silent: bool = False,
    ) -> list[Request]:
        """Finish live requests from outside the model step (abort, error). Unknown,
        already finished and repeated ids are ignored: exactly one finish each.
        They are answered with the status's finish reason (and ``reason`` as the
        stop reason) on the next step's outputs, unless ``silent`` (the answer
        went out already)."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished: dict[str, Request] = {}
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished() or rid in finished:
                continue
            finished[rid] = request
        if not finished:
            return []
        running = {id(r) for r in finished.values() if r.status == _RUNNING}
        if running:
            self.running = [r for r in self.running if id(r) not in running]
        waiting = [r for r in finished.values() if r.status != _RUNNING]
        if waiting:
            self.waiting.remove_requests(waiting)
        finish_reason = RequestStatus.finish_reason(status)
        for request in finished.values():
            request.status = status
            params = self._connector_finished(request)
            self._free_request(request)
            if not silent:
                self.owe_output(request.client_index, EngineCoreOutput(
                    request.request_id, [], finish_reason=finish_reason, stop_reason=reason,
                    kv_transfer_params=params))
        return list(finished.values())

    def owe_output(self, client_index: int, output: EngineCoreOutput) -> None:
        self.pending_outputs.setdefault(client_index, []).append(output)

    def _free_request(self, request: Request) -> None:
        self.finished_req_ids.add(request.request_id)
        if self.events is not None:
            self.events.forget(request.request_id)
        hooks = self.kv_hooks
        if hooks is not None:
            self._connector_finished(request)
            if request.request_id in hooks.delayed_free:
                return  # its blocks go when the connector reports the send done
        self._free_blocks(request)

    def _free_blocks(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        if request.mm_features:
            self.encoder_cache_manager.free(request.request_id)
        if self.requests.get(request.request_id) is request:
            del self.requests[request.request_id]
            del self.slot_of[request.request_id]
            if request.mm_features:
                self.num_mm_requests -= 1
        if self.kv_hooks is not None:
            self.kv_hooks.forget(request.request_id)

    def _connector_finished(self, request: Request) -> dict | None:
        """The connector's request_finished (once): kv_transfer_params for the client."""
        if self.kv_hooks is None:
            return None
        return self.kv_hooks.request_finished(request,
                                              self.kv_cache_manager.get_block_ids(request))

    # -- state -----------------------------------------------------------------
    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids)

    def has_requests(self) -> bool:
        """Anything to do or to report: live requests, owed outputs, or
        finished ids the runner has not been told about yet."""
        return bool(self.requests or self.pending_outputs or self.finished_req_ids)

    def has_schedulable_work(self) -> bool:
        """Whether a step could make progress now (False while paused-all)."""
        if self.pending_outputs or self.finished_req_ids:
            return True
        if self.kv_hooks is not None and self.kv_hooks.has_pending():
            return True  # the workers must be polled for finished transfers
        if self.pause_state == PauseState.PAUSED_ALL:
            return False
        if self.running:
            return True
        return bool(self.waiting) and self.pause_state == PauseState.UNPAUSED

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        return len(self.running), len(self.waiting)

    def set_pause_state(self, state: PauseState) -> None:
        if state != self.pause_state:
            logger.info("scheduler pause state %s -> %s", self.pause_state.name, state.name)
        self.pause_state = state

    def reset_prefix_cache(self) -> bool:
        ok = self.kv_cache_manager.reset_prefix_cache()
        if not ok:
            logger.warning("prefix cache not reset: %d requests still hold blocks",
                           len(self.kv_cache_manager.req_to_blocks))
        return ok

    # -- schedule ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        token_budget = self.max_num_scheduled_tokens
        threshold = self.long_prefill_token_threshold
        max_len_1 = self.max_model_len - 1
        in_flight = self.in_flight
        probe = self.probe
        # Running requests this step passes over: those in a batch in flight, and
        # while a fault is isolated, those not being probed.
        skip = in_flight if probe is None else in_flight | {
            r.request_id for r in self.running if r.request_id not in probe}
        scheduled_new: list[Request] = []
        pause = self.pause_state
        encoder = EncoderStep(self.max_num_encoder_input_tokens)
        ec = self.encoder_cache_manager

        if pause != PauseState.PAUSED_ALL:
            # The whole running loop: native (csrc/scheduler_loops.cpp) or its twin.
            rs = self._schedule_running(
                self.request_table, self.running, skip, in_flight if self.track_in_flight
                else None, token_budget, threshold, max_len_1, self.max_model_len,
                self.policy is SchedulingPolicy.PRIORITY)
            (token_budget, scheduled_running, running_new_blocks, num_scheduled_tokens,
             spec_tokens, preempted, cached_ids, cached_computed, any_grammar) = rs
            for victim in preempted:
                self._preempted(victim)
            # Images: chunks that reach an item encode it or stop before it (a
            # text-only engine skips the per-request pass: ~7 us at 256 decodes).
            if self.num_mm_requests:
                token_budget += trim_running(scheduled_running, num_scheduled_tokens,
                                             cached_computed, encoder, ec,
                                             self.disable_chunked_mm_input)
        else:
            num_scheduled_tokens, spec_tokens = {}, {}
            scheduled_running, running_new_blocks, preempted = [], [], []
            cached_ids, cached_computed, any_grammar = [], [], False

        # (A steady decode step has no one waiting: it skips the admission set-up.)
        if (not preempted and pause == PauseState.UNPAUSED and self.admit_new_prefills
                and self.waiting):
            waiting = self.waiting
            skipped: list[Request] = []
            active_loras = ({r.lora_int_id for r in self.running if r.lora_request}
                            if self.max_loras else set())
            while waiting and token_budget > 0 and len(self.running) < self.max_num_running_reqs:
                request = waiting.peek_request()
                if probe is not None and request.request_id not in probe:
                    skipped.append(waiting.pop_request())  # waits for the isolation to end
                    continue
                lid = request.lora_int_id
                if lid and lid not in active_loras and len(active_loras) >= self.max_loras:
                    skipped.append(waiting.pop_request())  # waits for a free adapter slot
                    continue
                hooks = self.kv_hooks
                if (hooks is not None and request.status == WAITING_FOR_REMOTE_KVS
                        and not hooks.ready_after_recv(request, kv)):
                    skipped.append(waiting.pop_request())  # its KV is still on the way
                    continue
                num_external, load_async = 0, False
                if request.num_computed_tokens:  # its KV arrived through the connector
                    computed_blocks, num_computed = [], request.num_computed_tokens
                else:
                    computed_blocks, num_computed = kv.get_computed_blocks(request)
                    if hooks is not None:
                        num_external, load_async = hooks.match(request, num_computed)
                        if num_external is None:  # the connector asks to wait
                            skipped.append(waiting.pop_request())
                            continue
                num_local = num_computed
                num_computed += num_external
                num_new = 0 if load_async else request.num_tokens - num_computed
                pooling = request.pooling_params is not None
                if threshold and num_new > threshold and not pooling:
                    num_new = threshold
                if num_new > token_budget:
                    # An encoder sees the whole sequence at once: pooling never chunks.
                    if not self.enable_chunked_prefill or pooling:
                        break
                    num_new = token_budget
                if request.mm_features and not load_async:
                    num_new = schedule_encoder_inputs(request, num_computed, num_new, encoder,
                                                      ec, self.disable_chunked_mm_input)
                    if num_new == 0:
                        break  # its next item waits for encoder budget or cache room
                new_blocks = kv.allocate_slots(request, num_new + num_external, num_local,
                                               computed_blocks)
                if new_blocks is None:
                    break
                if hooks is not None:
                    hooks.after_alloc(request, kv.get_block_ids(request), len(computed_blocks),
                                      num_external, load_async, kv)
                    if load_async:  # waits in WAITING_FOR_REMOTE_KVS, holding its blocks
                        skipped.append(waiting.pop_request())
                        continue
                waiting.pop_request()
                self.running.append(request)
                request.status = _RUNNING
                request.num_computed_tokens = num_computed
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_computed
                scheduled_new.append(request)
                if self.events is not None:
                    self.events.scheduled(request)
                self.num_admitted += 1
                num_scheduled_tokens[request.request_id] = num_new
                token_budget -= num_new
                if lid:
                    active_loras.add(lid)
            for request in reversed(skipped):
                waiting.prepend_request(request)

        new_reqs_data = [
            NewRequestData(
                req_id=r.request_id,
                token_ids=r.all_token_ids,
                num_prompt_tokens=len(r.prompt_token_ids),
                sampling_params=r.sampling_params,
                block_ids=kv.get_block_ids(r),
                num_computed_tokens=r.num_computed_tokens,
                lora_request=r.lora_request,
                eos_token_id=r.eos_token_id,
                mm_features=r.mm_features,
            )
            for r in scheduled_new
        ]
        for r in scheduled_new:
            r.num_computed_tokens += num_scheduled_tokens[r.request_id]
            any_grammar = any_grammar or r.grammar is not None
        grammar_bitmask = (self._grammar_bitmasks(scheduled_running, scheduled_new)
                           if any_grammar else {})
        cached = CachedRequestData(
            req_ids=cached_ids,
            new_block_ids=running_new_blocks,
            num_computed_tokens=cached_computed,
        )
        total = self.max_num_scheduled_tokens - token_budget
        self.step_counter += 1
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
            step_id=self.step_counter,
            grammar_bitmask=grammar_bitmask,
            scheduled_encoder_inputs=encoder.inputs,
            free_encoder_mm_hashes=ec.get_freed_mm_hashes(),
        )
        if self.kv_hooks is not None:
            output.kv_connector_metadata = self.kv_hooks.build_meta(output)
        self.finished_req_ids = set()
        self.preempted_req_ids = set()
        if self.track_in_flight:
            in_flight.update(num_scheduled_tokens)
        if self.log_iteration_details:
            self.last_iteration = self._iteration_details(output, scheduled_new, len(preempted))
            self.last_iteration.num_encoder_inputs = sum(map(len, encoder.inputs.values()))
            self.last_iteration.num_encoder_output_tokens = encoder.num_encoder_output_tokens
        return output

    def _grammar_bitmasks(self, running, new) -> dict:
        """Bitmasks for constrained requests that sample this step (called once
        their computed counts include this step's tokens). A request is in at most
        one batch in flight, so its grammar state already includes every token it
        accepted: the mask is right even with a batch queue."""
        masks = {}
        for r in (*running, *new):
            if r.grammar is None:
                continue
            if r.num_computed_tokens >= r.num_tokens:
                # A matcher in error, or a mask over the per-step budget, ends the
                # request with ERROR when its token arrives (update_from_output);
                # this step it samples unconstrained, as the batch is already set.
                mask, error = self.structured_output.bitmask_within_budget(r.grammar)
                masks[r.request_id] = mask
                if error is not None:
                    r.grammar_error = error
        return masks

    def preempt_all(self) -> int:
        """Preempt every running request (their KV cache is about to go away)."""
        victims = [r for r in self.running if r.request_id not in self.in_flight]
        for request in reversed(victims):
            self.running.remove(request)
            self._preempt(request)
        return len(victims)

    def preempt(self, request: Request) -> None:
        """Back to waiting (front), to be recomputed; not in ``running`` any more."""
        self._preempt(request)

    def reset_encoder_cache(self) -> bool:
        """Forget every encoder output (the runner drops them with the next step);
        refused (False) while a live request still needs one."""
        ec = self.encoder_cache_manager
        ok = ec.reset()
        if not ok:
            logger.warning("encoder cache not reset: %d entries are still needed by live "
                           "requests", ec.num_referenced)
        return ok

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = _PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        self._preempted(request)

    def _preempted(self, request: Request) -> None:
        """The scheduler's part of a preemption whose row is already reset."""
        if request.mm_features:  # its encoder outputs stay cached, now freeable
            self.encoder_cache_manager.free(request.request_id)
        request.num_preemptions += 1
        self.preempted_req_ids.add(request.request_id)
        self.num_preempted_total += 1
        self.waiting.prepend_request(request)
        if self.events is not None:
            self.events.preempted(request)
