"""--metrics-prefix: /metrics under vLLM's names (and both), from real collectors."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from enginecore.entrypoints.openai.metrics_endpoint import MetricsEndpoint
from enginecore.entrypoints.openai.metrics_names import rename_exposition
from enginecore.frontend.metrics import FrontendMetrics, IterationStats
from enginecore.protocol import SchedulerStats

# What vLLM's Grafana board (examples/online_serving/prometheus_grafana) queries.
VLLM_BOARD = ["vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc",
              "vllm:prompt_tokens", "vllm:generation_tokens",
              "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
              "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
              "vllm:request_queue_time_seconds", "vllm:prefix_cache_queries",
              "vllm:prefix_cache_hits", "vllm:num_preemptions"]


def _samples(text: bytes) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text.decode())
            for s in fam.samples if not s.name.endswith("_created")}


@pytest.fixture
def endpoint():
    registry = CollectorRegistry()
    metrics = FrontendMetrics("m", registry)
    metrics.record(IterationStats(num_prompt_tokens=7, num_generation_tokens=3,
                                  time_to_first_tokens=[0.02], inter_token_latencies=[0.01]),
                   SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25))
    return MetricsEndpoint(["/metrics"], registry)


def test_default_keeps_todays_names(endpoint):
    names = {k[0] for k in _samples(endpoint.render()[0])}
    assert "enginecore:prompt_tokens_total" in names
    assert not any(n.startswith("vllm:") for n in names)


def test_vllm_prefix_exposes_the_board_names_with_the_same_values(endpoint):
    own = _samples(endpoint.render()[0])
    endpoint.prefix = "vllm"
    text = endpoint.render()[0]
    renamed = _samples(text)
    assert not any(k[0].startswith("enginecore:") for k in renamed)
    families = {f.name for f in text_string_to_metric_families(text.decode())}
    assert set(VLLM_BOARD) <= families
    for (name, labels), value in own.items():
        assert renamed[("vllm:" + name[len("enginecore:"):], labels)] == value
    assert renamed[("vllm:num_requests_running", (("engine", "0"), ("model_name", "m")))] == 2
    assert renamed[("vllm:gpu_cache_usage_perc", (("engine", "0"), ("model_name", "m")))] == 0.25
    assert renamed[("vllm:time_per_output_token_seconds_count", (("model_name", "m"),))] == 1


def test_both_prefixes(endpoint):
    endpoint.prefix = "both"
    names = {k[0] for k in _samples(endpoint.render()[0])}
    assert {"enginecore:prompt_tokens_total", "vllm:prompt_tokens_total"} <= names
    with pytest.raises(ValueError, match="metrics prefix"):
        rename_exposition(b"", "sglang")
