"""make_client: the EngineCoreClient a front-end asks for (in-process, sync or asyncio).

Its own module, above the interface (core_client.py) and the clients that
implement it, so that neither knows the other.
"""

from __future__ import annotations

from typing import Any

from enginecore.client.core_client import EngineCoreClient
from enginecore.client.inproc_client import InprocClient
from enginecore.client.mp_client import AsyncMPClient, SyncMPClient
from enginecore.config import EngineConfig
from enginecore.executor.abstract import Executor


def make_client(
    multiprocess_mode: bool,
    asyncio_mode: bool,
    config: EngineConfig,
    executor_class: type[Executor] | None = None,
    log_stats: bool = False,
    **kwargs: Any,
) -> EngineCoreClient:
    """In-process (``multiprocess_mode=False``), or the engine in its own
    process with a sync or an asyncio client (vLLM's ``EngineCoreClient.make_client``)."""
    if asyncio_mode and not multiprocess_mode:
        raise ValueError("asyncio_mode needs multiprocess_mode=True")
    pc = config.parallel_config
    if pc.data_parallel_size > 1 and not multiprocess_mode:
        raise ValueError("data_parallel_size > 1 needs multiprocess_mode=True "
                         "(one engine process per rank)")
    if multiprocess_mode:
        cls = AsyncMPClient if asyncio_mode else SyncMPClient
        return cls(config, executor_class, log_stats, **kwargs)
    if kwargs:
        raise TypeError(f"InprocClient takes no {', '.join(sorted(kwargs))}")
    return InprocClient(config, executor_class, log_stats)


EngineCoreClient.make_client = staticmethod(make_client)
