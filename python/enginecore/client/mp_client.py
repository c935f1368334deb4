"""Clients for an engine core in its own process: sync and asyncio, under the one
name callers import (``enginecore.client.mp_client``). The common part is
``mp_client_base.py``; each client has its own module."""

from enginecore.client.async_mp_client import AsyncMPClient
from enginecore.client.mp_client_base import MPClient
from enginecore.client.sync_mp_client import SyncMPClient

__all__ = ["AsyncMPClient", "MPClient", "SyncMPClient"]
