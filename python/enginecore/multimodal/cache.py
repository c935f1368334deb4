"""The sender cache (front-end) and the receiver cache (engine): a processed item
crosses the wire once.

Both are LRU maps by identifier bounded by the same number of bytes (the item's
tensor bytes), and both see the same items in the same order: the sender as it
hands requests to the engine client, the receiver as ``preprocess_add_request``
takes them off the wire, before anything else can refuse the request. A hit
refreshes an item on both sides, an insert evicts from the least recently used
end on both sides, and an item larger than the whole cache is kept by neither;
so the sender only ever strips ``data`` from an item the receiver still holds.
``reset_mm_cache`` clears both (the front-end first; the utility call travels
behind every request sent before it).
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from enginecore.multimodal.inputs import MultiModalFeatureSpec, MultiModalTensor


def item_bytes(data: dict[str, MultiModalTensor]) -> int:
    return sum(len(t.data) for t in data.values())


class _LruBytes:
    """identifier -> (value, bytes), least recently used first."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = max(0, int(capacity_bytes))
        self.entries: OrderedDict[str, tuple[object, int]] = OrderedDict()
        self.size = 0

    def touch(self, key: str) -> bool:
        if key not in self.entries:
            return False
        self.entries.move_to_end(key)
        return True

    def put(self, key: str, value: object, nbytes: int) -> None:
        if nbytes > self.capacity or key in self.entries:
            return
        while self.size + nbytes > self.capacity:
            _, (_, old) = self.entries.popitem(last=False)
            self.size -= old
        self.entries[key] = (value, nbytes)
        self.size += nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.size = 0


class MultiModalSenderCache:
    """Front-end: which items the engine holds (their sizes only, no tensors)."""

    def __init__(self, capacity_bytes: int) -> None:
        self._lru = _LruBytes(capacity_bytes)

    def strip_cached(self, features: list[MultiModalFeatureSpec] | None
                     ) -> list[MultiModalFeatureSpec] | None:
        """``features`` as sent: an item the engine holds without its data. Call it
        once per request actually handed to the engine, in send order."""
        if not features:
            return features
        out = []
        for feature in features:
            if self._lru.touch(feature.identifier):
                out.append(msgspec.structs.replace(feature, data=None))
                continue
            if feature.data is None:
                raise ValueError(f"multimodal item {feature.identifier!r} has no data and the "
                                 "engine does not hold it")
            self._lru.put(feature.identifier, None, item_bytes(feature.data))
            out.append(feature)
        return out

    def clear(self) -> None:
        self._lru.clear()

    def __contains__(self, identifier: str) -> bool:
        return identifier in self._lru.entries

    def keys(self) -> list[str]:
        """Identifiers, least recently used first (tests compare both sides)."""
        return list(self._lru.entries)

    @property
    def size_bytes(self) -> int:
        return self._lru.size


class MultiModalReceiverCache:
    """Engine: the items' tensors by identifier, so a request may carry only the id."""

    def __init__(self, capacity_bytes: int) -> None:
        self._lru = _LruBytes(capacity_bytes)
        self.queries = 0
        self.hits = 0

    def get_and_update_features(self, features: list[MultiModalFeatureSpec] | None
                                ) -> list[MultiModalFeatureSpec] | None:
        """``features`` with every item's data filled in (vLLM's name). Items are
        counted and cached in order; ``ValueError`` for an id-only item this cache
        does not hold (the others of the request are still recorded, as the
        sender recorded them)."""
        if not features:
            return features
        out = []
        missing = None
        for given in features:
            feature = given
            self.queries += 1
            if self._lru.touch(feature.identifier):
                self.hits += 1
                if feature.data is None:
                    data = self._lru.entries[feature.identifier][0]
                    feature = msgspec.structs.replace(feature, data=data)  # type: ignore[arg-type]
            elif feature.data is None:
                missing = missing or feature.identifier
            else:
                self._lru.put(feature.identifier, feature.data, item_bytes(feature.data))
            out.append(feature)
        if missing is not None:
            raise ValueError(f"multimodal item {missing!r} was sent without its data, and the "
                             "engine's multimodal cache does not hold it")
        return out

    def clear(self) -> None:
        self._lru.clear()

    def keys(self) -> list[str]:
        return list(self._lru.entries)

    @property
    def size_bytes(self) -> int:
        return self._lru.size

    def take_stats(self) -> tuple[int, int]:
        """(queries, hits) since the last call."""
        counts = (self.queries, self.hits)
        self.queries = self.hits = 0
        return counts


def cache_capacity_bytes(mm_processor_cache_gb: float) -> int:
    return int(mm_processor_cache_gb * (1 << 30))


def engine_receiver_cache_from_config(config: object) -> MultiModalReceiverCache | None:
    """The engine's receiver cache (vLLM's MULTIMODAL_REGISTRY.engine_receiver_cache_
    from_config): None for a model that takes no images, or with the cache off."""
    from enginecore.multimodal.processing import SUPPORTED_ARCHITECTURES

    if config.model_config.architecture not in SUPPORTED_ARCHITECTURES:  # type: ignore[attr-defined]
        return None
    gb = config.multimodal_config.mm_processor_cache_gb  # type: ignore[attr-defined]
    return MultiModalReceiverCache(cache_capacity_bytes(gb))
