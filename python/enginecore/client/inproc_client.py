"""InprocClient: the engine core in the caller's process; get_output steps it."""

from __future__ import annotations

from typing import Any

from enginecore.client.core_client import EngineCoreClient
from enginecore.config import EngineConfig
from enginecore.core.engine_core import EngineCore
from enginecore.core.utility import convert_args, signature_of
from enginecore.executor.abstract import Executor
from enginecore.protocol import EngineCoreOutputs, EngineCoreRequest


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None,
                 log_stats: bool = False) -> None:
        self.engine = EngineCore(config, executor_class, log_stats)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        outputs, executed = self.engine.step_fn()
        self.engine.post_step(executed)
        merged = EngineCoreOutputs()
        for outs in outputs.values():
            merged.outputs.extend(outs.outputs)
            merged.scheduler_stats = outs.scheduler_stats or merged.scheduler_stats
        return merged

    def has_unfinished_requests(self) -> bool:
        return self.engine.scheduler.has_requests() or bool(self.engine.batch_queue)

    def call_utility(self, method: str, *args: Any) -> Any:
        signature_of(method)  # same allow-list as across the process boundary
        return getattr(self.engine, method)(*convert_args(method, list(args)))

    def shutdown(self) -> None:
        self.engine.shutdown()


__all__ = ["InprocClient"]
