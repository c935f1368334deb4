"""EngineCoreClient: the interface front-ends program against (client/factory.py
makes one)."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar

from enginecore.protocol import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(abc.ABC):
    # vLLM's spelling, ``EngineCoreClient.make_client(multiprocess_mode, asyncio_mode,
    # config)``: client/factory.py's ``make_client``, set there because this interface
    # cannot import the clients that implement it (the package imports the factory).
    make_client: ClassVar[Callable[..., EngineCoreClient]]

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
