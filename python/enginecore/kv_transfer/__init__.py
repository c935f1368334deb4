"""KV transfer: vLLM's v1 KV connector API (base.py), its config and factory."""

from enginecore.kv_transfer.base import (
                                         KVConnectorBase_V1,
                                         KVConnectorHandshakeMetadata,
                                         KVConnectorMetadata,
                                         KVConnectorRole,
)
from enginecore.kv_transfer.factory import KVConnectorFactory
from enginecore.kv_transfer.kv_transfer_config import KVTransferConfig
from enginecore.kv_transfer.output import KVConnectorOutput, KVOutputAggregator

__all__ = [
                                         "KVConnectorBase_V1",
                                         "KVConnectorFactory",
                                         "KVConnectorHandshakeMetadata",
                                         "KVConnectorMetadata",
                                         "KVConnectorOutput",
                                         "KVConnectorRole",
                                         "KVOutputAggregator",
                                         "KVTransferConfig",
]
