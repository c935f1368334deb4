"""The front-end's prometheus metrics as plain objects (``LLM.get_metrics()``).

The shape of vLLM's ``vllm.v1.metrics.reader``: one object per series, with the
metric's name (``enginecore:...``; counters without the ``_total`` suffix) and
its labels; a ``Counter`` or ``Gauge`` has a ``value``, a ``Histogram`` its
``count``, ``sum`` and cumulative ``buckets`` (upper bound as prometheus writes
it, e.g. ``"0.5"`` or ``"+Inf"`` -> count), and the per-position spec-decode
acceptance counter becomes one ``Vector`` per series whose ``values[i]`` is the
count of position ``i``. Same registry, same set as the server's /metrics.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry

from enginecore.frontend.metrics import PREFIX

_PER_POSITION = PREFIX + "spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: CollectorRegistry = REGISTRY) -> list[Metric]:
    """Every enginecore series of ``registry``, read now."""
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(PREFIX):
            continue
        if family.type == "gauge":
            out.extend(Gauge(family.name, dict(s.labels), s.value) for s in family.samples)
        elif family.type == "counter":
            totals = [s for s in family.samples if s.name == family.name + "_total"]
            if family.name == _PER_POSITION:
                out.extend(_vectors(family.name, totals))
            else:
                out.extend(Counter(family.name, dict(s.labels), int(s.value)) for s in totals)
        elif family.type == "histogram":
            out.extend(_histograms(family))
    return out


def _vectors(name: str, samples: list) -> list[Vector]:
    """Series that differ only in their "position" label -> one Vector each."""
    by_series: dict[tuple, dict[int, int]] = defaultdict(dict)
    for s in samples:
        labels = dict(s.labels)
        position = int(labels.pop("position"))
        by_series[tuple(sorted(labels.items()))][position] = int(s.value)
    vectors = []
    for key, counts in by_series.items():
        values = [0] * (max(counts) + 1)
        for position, count in counts.items():
            values[position] = count
        vectors.append(Vector(name, dict(key), values))
    return vectors


def _histograms(family) -> list[Histogram]:
    series: dict[tuple, Histogram] = {}

    def of(labels: dict[str, str]) -> Histogram:
        key = tuple(sorted(labels.items()))
        h = series.get(key)
        if h is None:
            h = series[key] = Histogram(family.name, labels, 0, 0.0, {})
        return h

    for s in family.samples:
        labels = dict(s.labels)
        if s.name.endswith("_bucket"):
            le = labels.pop("le")
            of(labels).buckets[le] = int(s.value)
        elif s.name.endswith("_count"):
            of(labels).count = int(s.value)
        elif s.name.endswith("_sum"):
            of(labels).sum = float(s.value)
    return list(series.values())
