"""KVConnectorFactory: a connector class by registered name or by module path (plug-ins)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any, ClassVar

from enginecore.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole
from enginecore.kv_transfer.kv_transfer_config import KVTransferConfig

logger = logging.getLogger(__name__)


class KVConnectorFactory:
    _registry: ClassVar[dict[str, Callable[[], type[KVConnectorBase_V1]]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Register lazily: the module is imported only when the connector is built."""
        if name in cls._registry:
            raise ValueError(f"KV connector {name!r} is already registered")

        def loader() -> type[KVConnectorBase_V1]:
            return getattr(importlib.import_module(module_path), class_name)

        cls._registry[name] = loader

    @classmethod
    def get_connector_class(cls, config: KVTransferConfig) -> type[KVConnectorBase_V1]:
        name = config.kv_connector
        if name is None:
            raise ValueError("kv_transfer_config.kv_connector is not set")
        if name in cls._registry:
            connector_cls = cls._registry[name]()
        elif config.kv_connector_module_path:
            module = importlib.import_module(config.kv_connector_module_path)
            connector_cls = getattr(module, name, None)
            if connector_cls is None:
                raise ValueError(f"module {config.kv_connector_module_path!r} has no KV "
                                 f"connector class {name!r}")
        else:
            raise ValueError(f"unknown KV connector {name!r}; registered: "
                             f"{sorted(cls._registry)} (or set kv_connector_module_path)")
        if not (isinstance(connector_cls, type) and issubclass(connector_cls, KVConnectorBase_V1)):
            raise ValueError(  # a config error, as the others
                f"KV connector {name!r} is not a KVConnectorBase_V1 subclass")
        return connector_cls

    @classmethod
    def create_connector(cls, config: Any, role: KVConnectorRole,
                         kv_cache_config: Any = None) -> KVConnectorBase_V1:
        """vLLM's signature: ``config`` is the EngineConfig (its kv_transfer_config
        names the connector)."""
        kv_config = getattr(config, "kv_transfer_config", None)
        if kv_config is None:
            raise ValueError("create_connector needs a config with a kv_transfer_config")
        connector_cls = cls.get_connector_class(kv_config)
        logger.info("KV connector %s (%s) for role %s", kv_config.kv_connector,
                    connector_cls.__name__, role.name)
        return connector_cls(config, role, kv_cache_config)


# The connectors of this package, imported only when chosen.
KVConnectorFactory.register_connector(
    "SharedStorageConnector", "enginecore.kv_transfer.shared_storage_connector",
    "SharedStorageConnector")
KVConnectorFactory.register_connector(
    "OffloadingConnector", "enginecore.kv_transfer.offloading_connector", "OffloadingConnector")
KVConnectorFactory.register_connector(
    "PDConnector", "enginecore.kv_transfer.pd_connector", "PDConnector")
# vLLM's P/D connector name: NIXL has no build on these machines, so a vLLM launch line
# ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}) runs on PDConnector's transport.
KVConnectorFactory.register_connector(
    "NixlConnector", "enginecore.kv_transfer.pd_connector", "PDConnector")
