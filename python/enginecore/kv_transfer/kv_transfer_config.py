"""KVTransferConfig: vLLM's ``kv_transfer_config`` (which connector, which role)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KVLoadFailurePolicy = Literal["recompute", "fail"]


@dataclass
class KVTransferConfig:
    """vLLM's field names: ``kv_connector`` (a registered name) or
    ``kv_connector_module_path`` (a plug-in module holding a class named kv_connector)."""

    kv_connector: str | None = None
    kv_role: KVRole | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: KVLoadFailurePolicy = "recompute"
    engine_id: str | None = None
    kv_connector_module_path: str | None = None

    def __post_init__(self) -> None:
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError("kv_transfer_config: kv_role is required when kv_connector is set "
                             f"(one of {get_args(KVRole)})")
        if self.kv_role is not None and self.kv_role not in get_args(KVRole):
            raise ValueError(f"kv_transfer_config.kv_role must be one of {get_args(KVRole)}, "
                             f"got {self.kv_role!r}")
        if self.kv_load_failure_policy not in get_args(KVLoadFailurePolicy):
            raise ValueError("kv_transfer_config.kv_load_failure_policy must be one of "
                             f"{get_args(KVLoadFailurePolicy)}, "
                             f"got {self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(  # a config error
                "kv_transfer_config.kv_connector_extra_config must be a JSON object")
        if self.engine_id is None:
            import uuid
            self.engine_id = str(uuid.uuid4())

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def from_cli(cls, value: str | dict | KVTransferConfig) -> KVTransferConfig:
        """``--kv-transfer-config '<json>'`` (or a dict from LLM(...)); unknown keys are a
        ValueError naming them."""
        if isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--kv-transfer-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("kv_transfer_config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {unknown}; "
                             f"known: {sorted(known)}")
        return cls(**value)
