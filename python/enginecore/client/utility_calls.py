"""Utility calls in flight on a multiprocess client: one record per call, and the
replies of every engine it went to folded into one outcome."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from enginecore.core.utility import convert_result
from enginecore.protocol import EngineCoreOutputs


@dataclass
class PendingCall:
    """One call sent to ``replies_due`` engines; settled when the last one answers."""

    method: str
    # concurrent.futures.Future (sync client) or asyncio.Future (asyncio client).
    future: Any
    replies_due: int
    # The rank whose result is the call's result (the first engine it went to).
    answering_rank: int
    first_failure: BaseException | None = None
    value: Any = None


class PendingCalls:
    """call_id -> PendingCall, for one client's output reader."""

    def __init__(self) -> None:
        self._calls: dict[int, PendingCall] = {}

    def __len__(self) -> int:
        return len(self._calls)

    def __contains__(self, call_id: int) -> bool:
        return call_id in self._calls

    def add(self, call_id: int, call: PendingCall) -> None:
        self._calls[call_id] = call

    def discard(self, call_id: int) -> None:
        self._calls.pop(call_id, None)

    def reply(self, outs: EngineCoreOutputs, single_engine: bool) -> tuple[Any, Any] | None:
        """Collect one engine's reply; once every engine answered, (future, outcome)
        where outcome is an exception or the answering rank's converted result."""
        u = outs.utility_output
        call = self._calls.get(u.call_id)
        if call is None:
            return None
        call.replies_due -= 1
        if u.failure_message is not None and call.first_failure is None:
            call.first_failure = RuntimeError(u.failure_message)
        if outs.engine_index == call.answering_rank or single_engine:
            call.value = u.result.value if u.result else None
        if call.replies_due > 0:
            return None
        del self._calls[u.call_id]
        if call.first_failure is not None:
            return call.future, call.first_failure
        try:
            return call.future, convert_result(call.method, call.value)
        except Exception as e:  # noqa: BLE001 - the caller gets it as the call's failure
            return call.future, e

    def settle(self, outs: EngineCoreOutputs, single_engine: bool) -> None:
        """``reply``, then the future gets its outcome (unless its waiter gave up)."""
        done = self.reply(outs, single_engine)
        if done is not None and not done[0].done():
            fut, outcome = done
            if isinstance(outcome, BaseException):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)

    def fail_all(self, error: BaseException) -> None:
        """The engine is gone: every waiter learns it now."""
        for call in list(self._calls.values()):
            if not call.future.done():
                call.future.set_exception(error)
        self._calls.clear()
