"""Front-end metrics: prometheus_client collectors the server exposes at /metrics.

Per-request timing (TTFT, inter-token latency, end-to-end latency, queue time,
prefill and decode time, prompt and generation lengths) is gathered by the
per-step loop into an ``IterationStats`` and recorded here once per step; the
engine's ``SchedulerStats`` (sent with outputs when the engine runs with
``log_stats``) give the running/waiting gauges, KV-cache usage, prefix-cache
queries and hits (hit rate = hits / queries), preemptions and spec-decode
drafts / acceptances. Names follow vLLM's with the ``enginecore:`` prefix.

Collectors are made once per registry (``prometheus_client.REGISTRY`` by
default) and shared by every front-end of the process; series carry
``model_name`` (and ``engine``, the DP rank, for engine stats). With several
API server processes, run prometheus_client in multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``); the engine gauges use ``livemostrecent``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from enginecore.outputs import RequestMetrics
from enginecore.protocol import SchedulerStats

PREFIX = "enginecore:"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)


@dataclass
class IterationStats:
    """What one step's outputs said, filled by the per-step loop."""

    num_prompt_tokens: int = 0  # prompts of requests that got their first token
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    # (timing, finish reason, prompt length) of each request that finished.
    finished: list[tuple[RequestMetrics, str, int]] = field(default_factory=list)


class _Families:
    """The collectors of one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        m, me = ["model_name"], ["model_name", "engine"]

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, m, buckets=buckets, registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, me, registry=registry,
                         multiprocess_mode="livemostrecent")

        def counter(name: str, doc: str, labels: list[str] = me) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        self.ttft = hist("time_to_first_token_seconds",
                         "Time from arrival to the first generated token.", _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Time between successive outputs of a request.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds",
                        "Time from arrival to the last output of a request.", _LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds",
                          "Time a request waited in the engine before it was scheduled.",
                          _LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds",
                            "Time from scheduling to the first token.", _LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds",
                           "Time from the first to the last token.", _LATENCY_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt length of finished requests.",
                               _TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens",
                            "Generated tokens of finished requests.", _TOKEN_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.", m)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.", m)
        self.success = counter("request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"])
        self.running = gauge("num_requests_running", "Requests running in the engine.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting in the engine.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.encoder_usage = gauge("encoder_cache_usage_perc",
                                   "Fraction of the encoder cache holding image embeddings (0-1).")
        self.encoder_queries = counter("encoder_cache_queries",
                                       "Multimodal items looked up in the encoder cache.")
        self.encoder_hits = counter("encoder_cache_hits",
                                    "Multimodal items found in the encoder cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted by the engine.")
        # KV transfer (a KV connector is configured).
        self.external_hits = counter("external_prefix_cache_hits",
                                     "Prompt tokens loaded through the KV connector.")
        self.kv_connector = counter("kv_connector_stat",
                                    "The KV connector's counters (blocks loaded, saved, ...).",
                                    me + ["stat"])
        self.spec_drafts = counter("spec_decode_num_draft_tokens",
                                   "Speculative tokens proposed.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens",
                                     "Speculative tokens accepted.")
        self.spec_num_drafts = counter("spec_decode_num_drafts",
                                       "Speculative draft proposals verified.")
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Speculative tokens accepted, by their position in the draft.", me + ["position"])


_families: dict[int, _Families] = {}
_families_lock = threading.Lock()


def _families_of(registry: CollectorRegistry) -> _Families:
    with _families_lock:
        fams = _families.get(id(registry))
        if fams is None:
            fams = _families[id(registry)] = _Families(registry)
        return fams


class FrontendMetrics:
    """Records one front-end's steps into the registry's collectors."""

    def __init__(self, model_name: str, registry: CollectorRegistry = REGISTRY,
                 spec_decode: bool = False) -> None:
        self.model_name = model_name
        self.registry = registry
        # Speculative decoding on: its counters exist (at 0) from an engine's first stats.
        self.spec_decode = spec_decode
        f = self._f = _families_of(registry)
        mn = model_name
        self._ttft, self._itl, self._e2e = f.ttft.labels(mn), f.itl.labels(mn), f.e2e.labels(mn)
        self._queue, self._prefill = f.queue.labels(mn), f.prefill.labels(mn)
        self._decode = f.decode.labels(mn)
        self._prompt_len, self._gen_len = f.prompt_len.labels(mn), f.gen_len.labels(mn)
        self._prompt_tokens = f.prompt_tokens.labels(mn)
        self._generation_tokens = f.generation_tokens.labels(mn)
        # Engine totals are cumulative; counters take the increase since the last stats.
        self._last_totals: dict[int, tuple[int, ...]] = {}
        self._last_per_pos: dict[int, list[int]] = {}

    def record(self, iteration: IterationStats | None, stats: SchedulerStats | None = None,
               engine_index: int = 0) -> None:
        if iteration is not None:
            self._record_iteration(iteration)
        if stats is not None:
            self._record_engine(stats, engine_index)

    def _record_iteration(self, it: IterationStats) -> None:
        if it.num_prompt_tokens:
            self._prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self._generation_tokens.inc(it.num_generation_tokens)
        for v in it.time_to_first_tokens:
            self._ttft.observe(v)
        for v in it.inter_token_latencies:
            self._itl.observe(v)
        for m, reason, prompt_len in it.finished:
            self._f.success.labels(self.model_name, reason).inc()
            if m.finished_ts is not None:
                self._e2e.observe(m.finished_ts - m.arrival_ts)
            if m.queued_ts is not None and m.scheduled_ts is not None:
                self._queue.observe(max(m.scheduled_ts - m.queued_ts, 0.0))
            if m.scheduled_ts is not None and m.first_token_ts is not None:
                self._prefill.observe(max(m.first_token_ts - m.scheduled_ts, 0.0))
            if m.first_token_ts is not None and m.last_token_ts is not None:
                self._decode.observe(m.last_token_ts - m.first_token_ts)
            self._prompt_len.observe(prompt_len)
            self._gen_len.observe(m.num_generation_tokens)

    def _record_engine(self, s: SchedulerStats, engine_index: int) -> None:
        f, labels = self._f, (self.model_name, str(engine_index))
        f.running.labels(*labels).set(s.num_running_reqs)
        f.waiting.labels(*labels).set(s.num_waiting_reqs)
        f.kv_usage.labels(*labels).set(s.kv_cache_usage)
        pc = s.prefix_cache_stats
        if pc.queries:
            f.prefix_queries.labels(*labels).inc(pc.queries)
        if pc.hits:
            f.prefix_hits.labels(*labels).inc(pc.hits)
        f.encoder_usage.labels(*labels).set(s.encoder_cache_usage)
        ec = s.encoder_cache_stats
        if ec.queries:
            f.encoder_queries.labels(*labels).inc(ec.queries)
        if ec.hits:
            f.encoder_hits.labels(*labels).inc(ec.hits)
        for stat, value in (s.kv_connector_stats or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                f.kv_connector.labels(*labels, stat).inc(value)
        totals = (s.num_preempted_total, s.spec_num_draft_tokens, s.spec_num_accepted_tokens,
                  s.spec_num_drafts, s.num_external_computed_tokens)
        last = self._last_totals.get(engine_index)
        if last is None:  # an engine's first stats: its counters exist from now on, at 0
            last = (0, 0, 0, 0, 0)
            for counter in (f.prefix_queries, f.prefix_hits, f.preemptions, f.encoder_queries,
                            f.encoder_hits):
                counter.labels(*labels)
            if self.spec_decode:
                for counter in (f.spec_drafts, f.spec_accepted, f.spec_num_drafts):
                    counter.labels(*labels)
        for counter, now, before in zip((f.preemptions, f.spec_drafts, f.spec_accepted,
                                         f.spec_num_drafts, f.external_hits), totals, last):
            if now > before:
                counter.labels(*labels).inc(now - before)
        # A restarted engine starts from zero again: take its totals as the new base.
        self._last_totals[engine_index] = totals
        per_pos = s.spec_num_accepted_tokens_per_pos
        if per_pos:
            before_pos = self._last_per_pos.get(engine_index, [])
            for pos, now in enumerate(per_pos):
                before = before_pos[pos] if pos < len(before_pos) else 0
                if now > before:
                    f.spec_accepted_per_pos.labels(*labels, str(pos)).inc(now - before)
            self._last_per_pos[engine_index] = list(per_pos)
