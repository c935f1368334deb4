"""Which LoRA adapters are loaded: ``max_loras`` slots, LRU eviction of unpinned ones."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

T = TypeVar("T")


class LoRASlots(Generic[T]):
    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self._loaded: OrderedDict[int, T] = OrderedDict()  # least recently used first
        self._pinned: set[int] = set()

    def __contains__(self, lora_id: int) -> bool:
        return lora_id in self._loaded

    def get(self, lora_id: int) -> T | None:
        """The adapter, marked as most recently used."""
        value = self._loaded.get(lora_id)
        if value is not None:
            self._loaded.move_to_end(lora_id)
        return value

    def add(self, lora_id: int, value: T) -> int | None:
        """Load an adapter; returns the id evicted to make room, if any."""
        if lora_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {lora_id}")
        if lora_id in self._loaded:
            self._loaded[lora_id] = value
            self._loaded.move_to_end(lora_id)
            return None
        evicted = None
        if len(self._loaded) >= self.max_loras:
            evicted = next((i for i in self._loaded if i not in self._pinned), None)
            if evicted is None:
                raise RuntimeError(
                    f"all {self.max_loras} LoRA slots hold pinned adapters; unpin or remove one"
                )
            del self._loaded[evicted]
        self._loaded[lora_id] = value
        return evicted

    def remove(self, lora_id: int) -> bool:
        self._pinned.discard(lora_id)
        return self._loaded.pop(lora_id, None) is not None

    def pin(self, lora_id: int) -> bool:
        if lora_id not in self._loaded:
            raise ValueError(f"LoRA {lora_id} is not loaded; add it before pinning")
        self._pinned.add(lora_id)
        return True

    def ids(self) -> set[int]:
        return set(self._loaded)
