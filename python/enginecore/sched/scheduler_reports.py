"""The scheduler's reports: per-step iteration details, SchedulerStats (KV cache,
prefix / encoder / receiver caches, spec decoding, the KV connector) and the state dump
on an executor failure; a mixin of ``Scheduler`` (sched/scheduler.py), which owns the
state these read."""

from __future__ import annotations

import logging

from enginecore.protocol import IterationDetails, PrefixCacheStats, SchedulerStats
from enginecore.request import Request
from enginecore.sched.output import SchedulerOutput

logger = logging.getLogger("enginecore.sched.scheduler")


class SchedulerReports:
    """Reads the scheduler's counters; holds no state of its own."""

    def _iteration_details(
        self, output: SchedulerOutput, scheduled_new: list[Request], num_preempted: int
    ) -> IterationDetails:
        details = IterationDetails(num_preempted=num_preempted)
        for rid, n in output.num_scheduled_tokens.items():
            request = self.requests[rid]
            # Decode: the step computes the one token sampled last step (plus drafts).
            if request.num_computed_tokens - n >= request.num_prompt_tokens:
                details.num_decode_reqs += 1
                details.num_decode_tokens += n
            else:
                details.num_prefill_reqs += 1
                details.num_prefill_tokens += n
        return details

    def make_stats(self) -> SchedulerStats:
        encoder_queries, encoder_hits = self.encoder_cache_manager.make_stats()
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            step_counter=self.step_counter,
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
            num_preempted_total=self.num_preempted_total,
            iteration=self.last_iteration,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_accepted_tokens_per_pos=list(self.spec_num_accepted_per_pos),
            mm_cache_stats=self._mm_cache_stats(),
            kv_connector_stats=None if self.kv_hooks is None else self.kv_hooks.take_stats(),
            num_external_computed_tokens=(0 if self.kv_hooks is None
                                          else self.kv_hooks.num_external_computed_tokens),
            encoder_cache_usage=self.encoder_cache_manager.usage,
            encoder_cache_stats=PrefixCacheStats(queries=encoder_queries, hits=encoder_hits),
        )

    def _mm_cache_stats(self) -> PrefixCacheStats | None:
        """The engine's multimodal receiver cache lookups since the last stats (the
        engine core sets ``mm_receiver_cache``; None: no images)."""
        cache = getattr(self, "mm_receiver_cache", None)
        if cache is None:
            return None
        queries, hits = cache.take_stats()
        return PrefixCacheStats(queries=queries, hits=hits)

    def log_state(self) -> None:
        """Dump what the scheduler holds (called when the executor fails)."""
        logger.error(
            "scheduler state: %d running %s, %d waiting, kv usage %.1f%%, step %d, pause %s",
            len(self.running),
            [(r.request_id, r.num_computed_tokens, r.num_tokens) for r in self.running[:16]],
            len(self.waiting),
            100 * self.kv_cache_manager.usage,
            self.step_counter,
            self.pause_state.name,
        )
