"""Clients that front-ends use to talk to an engine core."""

from enginecore.client.core_client import EngineCoreClient
from enginecore.client.factory import make_client
from enginecore.client.inproc_client import InprocClient
from enginecore.client.mp_client import AsyncMPClient, MPClient, SyncMPClient

__all__ = ["AsyncMPClient", "EngineCoreClient", "InprocClient", "MPClient", "SyncMPClient",
           "make_client"]
