"""EngineCoreClient: the interface front-ends program against."""

from __future__ import annotations

import abc
from typing import Any

from enginecore.config import EngineConfig
from enginecore.executor.abstract import Executor
from enginecore.protocol import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(abc.ABC):
    @staticmethod
    def make_client(
        multiprocess_mode: bool,
        asyncio_mode: bool,
        config: EngineConfig,
        executor_class: type[Executor] | None = None,
        log_stats: bool = False,
        **kwargs: Any,
    ) -> EngineCoreClient:
        """In-process (``multiprocess_mode=False``), or the engine in its own
        process with a sync or an asyncio client."""
        if asyncio_mode and not multiprocess_mode:
            raise ValueError("asyncio_mode needs multiprocess_mode=True")
        pc = config.parallel_config
        if pc.data_parallel_size > 1 and not multiprocess_mode:
            raise ValueError("data_parallel_size > 1 needs multiprocess_mode=True "
                             "(one engine process per rank)")
        if multiprocess_mode:
            from enginecore.client.mp_client import AsyncMPClient, SyncMPClient

            cls = AsyncMPClient if asyncio_mode else SyncMPClient
            return cls(config, executor_class, log_stats, **kwargs)
        from enginecore.client.inproc_client import InprocClient

        return InprocClient(config, executor_class, log_stats)

    # -- sync API ----------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def call_utility(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    # -- asyncio API ---------------------------------------------------------------------------
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    def __enter__(self) -> EngineCoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
