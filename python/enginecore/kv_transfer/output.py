"""KVConnectorOutput (per worker, per step) and KVOutputAggregator (across workers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_stats: dict[str, Any] | None = None
    invalid_block_ids: set[int] = field(default_factory=set)

    def is_empty(self) -> bool:
        return (not self.finished_sending and not self.finished_recving
                and not self.kv_connector_stats and not self.invalid_block_ids)


class KVOutputAggregator:
    """A request's send / receive is finished only when every worker reported it."""

    def __init__(self, expected_finished_count: int) -> None:
        if expected_finished_count < 1:
            raise ValueError("expected_finished_count must be >= 1")
        self._expected = expected_finished_count
        self._send_remaining: dict[str, int] = {}
        self._recv_remaining: dict[str, int] = {}

    def _update(self, ids: set[str] | None, remaining: dict[str, int], done: set[str]) -> None:
        for req_id in ids or ():
            left = remaining.get(req_id, self._expected) - 1
            if left == 0:
                remaining.pop(req_id, None)
                done.add(req_id)
            else:
                remaining[req_id] = left

    def aggregate(self, outputs: list[KVConnectorOutput]) -> KVConnectorOutput:
        sending: set[str] = set()
        recving: set[str] = set()
        invalid: set[int] = set()
        stats: dict[str, Any] = {}
        for out in outputs:
            self._update(out.finished_sending, self._send_remaining, sending)
            self._update(out.finished_recving, self._recv_remaining, recving)
            invalid |= out.invalid_block_ids
            for key, value in (out.kv_connector_stats or {}).items():
                stats[key] = stats.get(key, 0) + value if isinstance(value, (int, float)) \
                    else value
        return KVConnectorOutput(finished_sending=sending or None,
                                 finished_recving=recving or None,
                                 kv_connector_stats=stats or None, invalid_block_ids=invalid)

    @classmethod
    def from_connector(cls, connector: Any, world_size: int) -> KVOutputAggregator:
        """vLLM's: every worker reports, unless the connector says how many must."""
        return cls(connector.get_finished_count() or world_size)
