"""``--metrics-prefix``: the names /metrics exposes.

The collectors are named after vLLM's with an ``enginecore:`` prefix
(frontend/metrics.py). Grafana boards and alerts written for vLLM query
``vllm:...``; with ``--metrics-prefix vllm`` the exposition says ``vllm:`` instead,
and also carries the two names older vLLM boards still chart
(``vllm:time_per_output_token_seconds`` beside ``vllm:inter_token_latency_seconds``,
``vllm:gpu_cache_usage_perc`` beside ``vllm:kv_cache_usage_perc``); ``both``
exposes each family under both prefixes (a migration's dashboards keep working).
The renaming is done on the rendered text, so it holds in multiprocess mode too."""

from __future__ import annotations

from typing import Any

OWN_PREFIX = b"enginecore:"
PREFIXES = ("enginecore", "vllm", "both")

# vLLM names that older dashboards chart, as copies of the current family.
_VLLM_ALIASES = {
    b"vllm:inter_token_latency_seconds": b"vllm:time_per_output_token_seconds",
    b"vllm:kv_cache_usage_perc": b"vllm:gpu_cache_usage_perc",
}


def add_metrics_args(group: Any) -> None:
    group.add_argument("--metrics-prefix", default="enginecore", choices=list(PREFIXES),
                       help="the prefix of /metrics names: 'vllm' exposes vLLM's names "
                            "(vllm:...) so dashboards built for vLLM work unchanged; 'both' "
                            "exposes each metric under both")


def _families(text: bytes) -> list[tuple[bytes, list[bytes]]]:
    """(family name, its lines) in exposition order (a family starts at # HELP)."""
    groups: list[tuple[bytes, list[bytes]]] = []
    for line in text.splitlines():
        if line.startswith(b"# HELP "):
            groups.append((line.split(b" ", 3)[2], [line]))
        elif groups:
            groups[-1][1].append(line)
        else:
            groups.append((b"", [line]))
    return groups


def _renamed(name: bytes, lines: list[bytes], new: bytes) -> list[bytes]:
    out = []
    for line in lines:
        if line.startswith(b"# "):
            head, _, rest = line.partition(name)
            out.append(head + new + rest)
        elif line.startswith(name):
            out.append(new + line[len(name):])
        else:
            out.append(line)
    return out


def rename_exposition(text: bytes, prefix: str) -> bytes:
    """Prometheus text with the ``enginecore:`` families renamed for ``prefix``."""
    if prefix == "enginecore":
        return text
    if prefix not in PREFIXES:
        raise ValueError(f"metrics prefix must be one of {PREFIXES}, got {prefix!r}")
    out: list[bytes] = []
    for name, lines in _families(text):
        if not name.startswith(OWN_PREFIX):
            out.extend(lines)
            continue
        if prefix == "both":
            out.extend(lines)
        vllm_name = b"vllm:" + name[len(OWN_PREFIX):]
        out.extend(_renamed(name, lines, vllm_name))
        alias = _VLLM_ALIASES.get(vllm_name)
        if alias is not None:
            out.extend(_renamed(name, lines, alias))
    return b"\n".join(out) + b"\n"
