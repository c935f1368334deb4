"""Per-request fault isolation: a batch that makes the executor raise costs only
the request(s) that make it raise, not the engine.

When executing a batch raises, every request of that batch is rewound (its KV
for the step dropped from the prefix cache, then preempted for recompute: the
runner is told to forget it) and becomes a suspect. The suspects are probed in
halves: the scheduler runs only the probed group (``Scheduler.probe``) until
each of its requests has passed the point where the batch failed. A group that
passes is cleared; one that raises is split again. A single request that raises
on its own twice (once could be a transient fault) is a culprit: if a dummy
batch still runs (the executor itself is healthy), the culprit ends with ERROR
and the exception's message, and serving goes on. A dummy batch that raises too
means the executor is gone (a lost device): EXECUTOR_FAILED, the engine dies
loudly. So does a failure that keeps coming back with no request to blame
(``MAX_BLAMELESS_ROUNDS``: e.g. running out of device memory only at full batch
size, which no smaller group reproduces).

Suspects are probed from a recompute, so the probe of a request runs the same
tokens as the failed step. Requests that were not in the failed batch wait (new
ones are queued) until the round is over.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from enginecore.request import RequestStatus
from enginecore.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

MAX_BLAMELESS_ROUNDS = 3
# Healthy steps after a blameless round that forgive it.
FORGIVE_AFTER_STEPS = 256


class ExecutorFailed(RuntimeError):
    """The executor fails for any request (or keeps failing with none to blame)."""


class FaultIsolation:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.groups: deque[list[str]] = deque()
        self.current: list[str] | None = None
        # request id -> num_computed_tokens it must reach to pass its probe
        self.targets: dict[str, int] = {}
        self.culprits = 0
        self.strikes: dict[str, int] = {}  # times a request failed alone this round
        self.suspects: set[str] = set()  # this round's
        self.cleared: set[str] = set()  # suspects that passed their probe
        self.blameless_rounds = 0
        self._healthy_steps = 0
        self.num_rounds = 0
        self.num_culprits = 0

    @property
    def active(self) -> bool:
        return self.current is not None

    # -- events from EngineCore.step -------------------------------------------------------
    def batch_failed(self, failed: list[SchedulerOutput], error: Exception,
                     others: list[SchedulerOutput] = ()) -> None:
        """``failed`` raised ``error``; ``others`` (a batch queue) were in flight
        with them and are recomputed too. Raises ``ExecutorFailed`` when the
        engine cannot go on."""
        engine = self.engine
        scheduler = engine.scheduler
        reason = f"{type(error).__name__}: {error}"
        if engine.model_executor.is_failed:
            raise ExecutorFailed(f"the executor failed for good: {reason}") from error
        suspects = [rid for so in failed for rid in so.num_scheduled_tokens
                    if rid in scheduler.requests]
        for so in (*failed, *others):
            self._record_targets(so)
            rewind_step(scheduler, so)
        if self.current is None:  # a normal batch raised: a new round
            self.num_rounds += 1
            self.culprits = 0
            self.suspects = set(suspects)
            self.cleared = set()
            scheduler.preempt_all()  # the probes get the whole cache
            group = suspects
            logger.error("engine: a batch of %d requests raised %s; isolating the request(s) "
                         "that make it fail", len(suspects), reason, exc_info=error)
        else:
            group = [r for r in self.current if r in scheduler.requests]
            logger.warning("engine: probing %d requests raised %s", len(self.current), reason)
        self.current = None
        if len(group) == 1:
            rid = group[0]
            self.strikes[rid] = self.strikes.get(rid, 0) + 1
            if self.strikes[rid] >= 2:
                self._convict(rid, reason)
            else:
                self.groups.appendleft(group)  # once more, alone
        elif group:
            half = len(group) // 2
            self.groups.appendleft(group[half:])
            self.groups.appendleft(group[:half])
        self._next_group()

    def step_succeeded(self) -> None:
        """A batch ran: during a round, is the probed group through?"""
        if self.current is None:
            self._healthy_steps += 1
            if self.blameless_rounds and self._healthy_steps >= FORGIVE_AFTER_STEPS:
                self.blameless_rounds = 0
            return
        requests = self.engine.scheduler.requests
        passed = []
        for rid in self.current:
            request = requests.get(rid)
            if request is None:
                continue  # ended meanwhile (an abort): neither cleared nor blamed
            if request.num_computed_tokens < self.targets.get(rid, 0):
                return
            passed.append(rid)
        self.cleared.update(passed)
        self.current = None
        self._next_group()

    # -- the round ---------------------------------------------------------------------------
    def _record_targets(self, so: SchedulerOutput) -> None:
        cached = so.scheduled_cached_reqs
        before = dict(zip(cached.req_ids, cached.num_computed_tokens))
        for new in so.scheduled_new_reqs:
            before[new.req_id] = new.num_computed_tokens
        for rid, n in so.num_scheduled_tokens.items():
            target = before.get(rid, 0) + n
            self.targets[rid] = max(self.targets.get(rid, 0), target)

    def _next_group(self) -> None:
        scheduler = self.engine.scheduler
        while self.groups:
            group = [r for r in self.groups.popleft() if r in scheduler.requests]
            if group:
                self.current = group
                scheduler.probe = set(group)
                return
        # Round over.
        scheduler.probe = None
        self.targets.clear()
        self.strikes.clear()
        if self.culprits:
            self.blameless_rounds = 0  # the failure had a cause, and it is gone
            logger.warning("engine: isolation round over; %d request(s) ended with ERROR",
                           self.culprits)
        elif self.suspects <= self.cleared:
            # Every suspect ran fine on its own: the failure is no request's doing.
            self.blameless_rounds += 1
            self._healthy_steps = 0
            logger.error("engine: no single request makes the executor fail (blameless round "
                         "%d of %d allowed)", self.blameless_rounds, MAX_BLAMELESS_ROUNDS)
            if self.blameless_rounds >= MAX_BLAMELESS_ROUNDS:
                raise ExecutorFailed(
                    f"EXECUTOR_FAILED: batches failed {self.blameless_rounds} times with no "
                    "request to blame (requests that ran fine before fail again)")
        else:
            logger.warning("engine: isolation round over without a verdict (suspects ended "
                           "before their probe)")

    def _convict(self, rid: str, reason: str) -> None:
        engine = self.engine
        try:
            engine.model_executor.execute_dummy_batch()
        except Exception as e:  # the executor itself is broken
            raise ExecutorFailed(
                f"EXECUTOR_FAILED: the executor fails even for a dummy batch ({type(e).__name__}:"
                f" {e}) after request {rid!r} failed with {reason}") from e
        self.culprits += 1
        self.num_culprits += 1
        logger.error("engine: request %r alone makes the executor raise %s; it ends with ERROR",
                     rid, reason)
        engine.scheduler.finish_requests(
            [rid], RequestStatus.FINISHED_ERROR,
            reason=f"the model runner failed on this request: {reason}")


def rewind_step(scheduler: Any, so: SchedulerOutput) -> None:
    """Undo a step that did not run: its requests go back to waiting for recompute
    (the runner drops their state), the blocks it was to fill leave the prefix
    cache (their KV was never written), and the ids the runner was to be told
    about are told again."""
    kv = scheduler.kv_cache_manager
    cached = so.scheduled_cached_reqs
    before = dict(zip(cached.req_ids, cached.num_computed_tokens))
    for new in so.scheduled_new_reqs:
        before[new.req_id] = new.num_computed_tokens
    for rid in so.num_scheduled_tokens:
        scheduler.in_flight.discard(rid)
        request = scheduler.requests.get(rid)
        if request is None:
            continue
        kv.uncache_from(request, before.get(rid, 0))
        if request.status == RequestStatus.RUNNING:
            scheduler.running.remove(request)
            scheduler.preempt(request)
    scheduler.finished_req_ids |= so.finished_req_ids
    scheduler.preempted_req_ids |= so.preempted_req_ids


__all__ = ["ExecutorFailed", "FaultIsolation", "rewind_step"]
