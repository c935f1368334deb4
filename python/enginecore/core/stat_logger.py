"""The engine's stats line (``log_stats``), shaped like vLLM's LoggingStatLogger.

Every ``log_stats_interval_s`` while the engine works, and when it runs out of
requests (at most one line per interval: a short run still gets its line, a
stream of short requests does not flood the log), each engine logs at INFO: prompt and generation
throughput over the window, running / waiting requests, KV-cache usage and the
prefix-cache hit rate of the window (plus preemptions and speculative-decoding
acceptance when there are any). An idle engine logs nothing. With
``log_iteration_details`` it also logs one line per step.

It reads the ``SchedulerStats`` the scheduler attaches to a step's outputs and
counts the tokens in them, so it sees exactly what the front-ends are sent.
Generation tokens are those tokens. Prompt tokens are the prefill tokens the
step computed: exact from ``SchedulerStats.iteration`` when
``log_iteration_details`` computes it; otherwise derived at no per-request cost
as scheduled - sampled + accepted drafts - drafted (the tokens that were not
decode inputs), which counts each request's last prompt token as generation.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from enginecore.protocol import SchedulerStats
from enginecore.sched.columnar_outputs import ColumnarOutputs

logger = logging.getLogger(__name__)


def make_visible(log: logging.Logger) -> None:
    """Turning stats on is one switch: its INFO lines show even where nobody
    configured logging (Python's default shows WARNING and up only)."""
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
    if not log.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False


def count_new_tokens(outs: ColumnarOutputs) -> int:
    return sum(len(t) if type(t) is list else len(t.new_token_ids)  # type: ignore[union-attr]
               for t in outs.new_token_ids)


class StatLogger:
    def __init__(self, engine_index: int, interval_s: float, iteration_details: bool) -> None:
        self.prefix = f"Engine {engine_index:03d}: "
        self.interval_s = interval_s
        self.iteration_details = iteration_details
        self.last_line = float("-inf")
        self._start_window()
        make_visible(logger)
        self._drafts = self._accepted = 0  # cumulative spec-decode counts seen last

    def _start_window(self) -> None:
        self.window_start: float | None = None
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.steps = 0

    def record(self, outputs: dict[int, Any], num_scheduled_tokens: int) -> None:
        """One step's outputs (per client) and the tokens its batch scheduled."""
        stats: SchedulerStats | None = None
        new_tokens = 0
        for outs in outputs.values():
            if outs.scheduler_stats is not None:
                stats = outs.scheduler_stats
            new_tokens += count_new_tokens(outs)
        if stats is None:
            return
        now = time.monotonic()
        it = stats.iteration
        if self.window_start is None:
            # The window opens when this step began (an idle engine's wait is not in it).
            self.window_start = now - (it.elapsed_ms / 1e3 if it is not None else 0.0)
        self.steps += 1
        self.generation_tokens += new_tokens
        self.prefix_queries += stats.prefix_cache_stats.queries
        self.prefix_hits += stats.prefix_cache_stats.hits
        drafted = stats.spec_num_draft_tokens - self._drafts
        accepted = stats.spec_num_accepted_tokens - self._accepted
        self._drafts, self._accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
        if it is None:
            self.prompt_tokens += max(0, num_scheduled_tokens - new_tokens + accepted - drafted)
        else:
            self.prompt_tokens += it.num_prefill_tokens
            if self.iteration_details and it.num_prefill_reqs + it.num_decode_reqs:
                logger.info("%sstep %d: %d prefill requests (%d tokens), %d decode requests "
                            "(%d tokens), %d preempted, %.2f ms", self.prefix, stats.step_counter,
                            it.num_prefill_reqs, it.num_prefill_tokens, it.num_decode_reqs,
                            it.num_decode_tokens, it.num_preempted, it.elapsed_ms)
        idle = stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
        if now - self.window_start >= self.interval_s or (
                idle and now - self.last_line >= self.interval_s):
            self._log(stats, now)

    def _log(self, stats: SchedulerStats, now: float) -> None:
        elapsed = max(now - (self.window_start or now), 1e-9)
        hit_rate = 100.0 * self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
        line = (f"{self.prefix}Avg prompt throughput: {self.prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self.generation_tokens / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
                f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {hit_rate:.1f}%")
        if stats.num_preempted_total:
            line += f", Preempted: {stats.num_preempted_total} reqs in all"
        if stats.spec_num_draft_tokens:
            line += (f", Spec decode acceptance: "
                     f"{100.0 * stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens:.1f}%"
                     f" ({stats.spec_num_accepted_tokens} of {stats.spec_num_draft_tokens} "
                     "drafts in all)")
        logger.info("%s", line)
        self.last_line = now
        self._start_window()
