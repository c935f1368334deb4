"""SharedStorageConnector (vLLM's name): a prompt's KV blocks in files under a directory.

A second engine with the same ``shared_storage_path``, or the same engine after a
restart, loads the blocks a prompt has in the store instead of computing them. The
files and their checks are kv_transfer/block_store.py's.

Scheduler side: ``get_num_new_matched_tokens`` counts the request's consecutive stored
blocks after its local prefix-cache hits (never the block of its last token, which the
model must compute for its logits); ``build_connector_meta`` lists, per step, the blocks
to load (admitted this step) and the prompt blocks that become full this step and are not
stored yet (to save). Worker side: ``start_load_kv`` copies the loaded blocks into the
paged KV cache before the forward; ``wait_for_save`` writes the new blocks after it.
Loads are synchronous (``load_async`` False), so finished sets are never reported.

``kv_connector_extra_config``: ``shared_storage_path`` (required), ``max_bytes`` (a size
cap, least recently used blocks evicted; default none). ``kv_role`` kv_producer only
saves, kv_consumer only loads, kv_both does both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from enginecore.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from enginecore.kv_transfer.block_store import BlockStore, StoreIdentity, model_identity

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SharedStorageConnectorMetadata(KVConnectorMetadata):
    # (request id, block ids, block hashes) to read into the cache / write to the store.
    loads: list[tuple[str, list[int], list[bytes]]] = field(default_factory=list)
    saves: list[tuple[str, list[int], list[bytes]]] = field(default_factory=list)


class _Tracked:
    """A running request as the scheduler side follows it (for its saves)."""

    __slots__ = ("block_ids", "request", "saved_upto")

    def __init__(self, request: Any, saved_upto: int) -> None:
        self.request = request
        self.block_ids: list[int] = []
        self.saved_upto = saved_upto  # blocks before this index are handled


class SharedStorageConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kvc = self._kv_transfer_config
        path = kvc.get_from_extra_config("shared_storage_path", None)
        if not isinstance(path, str) or not path:
            raise ValueError("SharedStorageConnector needs kv_connector_extra_config."
                             "shared_storage_path (a directory)")
        max_bytes = kvc.get_from_extra_config("max_bytes", None)
        if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 1):
            raise ValueError(f"SharedStorageConnector max_bytes must be a positive int, got "
                             f"{max_bytes!r}")
        mc = vllm_config.model_config
        if mc.model_path is None:
            raise ValueError("SharedStorageConnector needs a real model (not the synthetic one)")
        self.block_size = vllm_config.cache_config.block_size
        self.identity = StoreIdentity(
            model=model_identity(mc.model_path), dtype=mc.dtype, block_size=self.block_size,
            num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
            hash_algo=vllm_config.cache_config.prefix_caching_hash_algo)
        self.store = BlockStore(path, self.identity, max_bytes)
        self._load = kvc.is_kv_consumer
        self._save = kvc.is_kv_producer
        # Scheduler side.
        self._tracked: dict[str, _Tracked] = {}
        self._matched: dict[str, tuple[int, int]] = {}  # rid -> (local tokens, external)
        self._pending_loads: dict[str, tuple[list[int], list[bytes]]] = {}
        # Worker side.
        self._caches: dict[str, torch.Tensor] = {}
        self._failed_blocks: set[int] = set()
        self._stats = {"num_blocks_loaded": 0, "num_blocks_saved": 0, "num_load_errors": 0}

    # ---- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        if not self._load:
            return 0, False
        bs = self.block_size
        hashes = request.block_hashes
        last = min((request.num_tokens - 1) // bs, len(hashes))
        n = num_computed_tokens // bs
        while n < last and self.store.contains(hashes[n]):
            n += 1
        external = max(0, n * bs - num_computed_tokens)
        self._matched[request.request_id] = (num_computed_tokens, external)
        return external, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        local, _ = self._matched.pop(rid, (0, 0))
        bs = self.block_size
        first, end = local // bs, (local + num_external_tokens) // bs
        self._tracked[rid] = _Tracked(request, end)
        if num_external_tokens:
            ids = blocks.get_block_ids()[0]
            self._pending_loads[rid] = (ids[first:end], request.block_hashes[first:end])

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = SharedStorageConnectorMetadata()
        planned: set[bytes] = set()
        n_sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            t = self._tracked.get(new.req_id)
            if t is None:
                continue
            t.block_ids = list(new.block_ids)
            load = self._pending_loads.pop(new.req_id, None)
            if load is not None:
                meta.loads.append((new.req_id, *load))
            self._plan_saves(meta, planned, new.req_id, t, new.num_computed_tokens,
                             n_sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for rid, new_blocks, computed in zip(cached.req_ids, cached.new_block_ids,
                                             cached.num_computed_tokens):
            t = self._tracked.get(rid)
            if t is None:
                continue
            if new_blocks:
                t.block_ids.extend(new_blocks)
            self._plan_saves(meta, planned, rid, t, computed, n_sched.get(rid, 0))
        return meta

    def _plan_saves(self, meta: SharedStorageConnectorMetadata, planned: set[bytes],
                    rid: str, t: _Tracked, computed: int, num_scheduled: int) -> None:
        """The prompt blocks this step fills that the store lacks."""
        if not self._save:
            return
        end = min(computed + num_scheduled, t.request.num_prompt_tokens) // self.block_size
        if end <= t.saved_upto:
            return
        hashes = t.request.block_hashes
        ids, keys = [], []
        for i in range(t.saved_upto, min(end, len(hashes))):
            h = hashes[i]
            if h not in planned and not self.store.contains(h):
                planned.add(h)
                ids.append(t.block_ids[i])
                keys.append(h)
        t.saved_upto = end
        if ids:
            meta.saves.append((rid, ids, keys))

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._tracked.pop(rid, None)
        self._pending_loads.pop(rid, None)
        self._matched.pop(rid, None)
        return False, None

    # ---- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        shapes = {tuple(t.shape[2:]) for t in kv_caches.values()}
        expected = (self.block_size, self.identity.num_kv_heads, self.identity.head_dim)
        if shapes != {expected} or len(kv_caches) != self.identity.num_layers:
            raise ValueError(f"SharedStorageConnector: KV cache blocks {shapes} x "
                             f"{len(kv_caches)} layers, expected {expected} x "
                             f"{self.identity.num_layers}")
        self._caches = kv_caches

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, SharedStorageConnectorMetadata) or not meta.loads:
            return
        ident = self.identity
        dtype = _DTYPES[ident.dtype]
        shape = (ident.num_layers, 2, ident.block_size, ident.num_kv_heads, ident.head_dim)
        for _, block_ids, hashes in meta.loads:
            good, payloads = [], []
            for b, h in zip(block_ids, hashes):
                try:
                    payloads.append(self.store.read(h))
                    good.append(b)
                except (OSError, ValueError) as e:
                    logger.warning("KV block %s not loaded: %s", h.hex()[:16], e)
                    self._failed_blocks.add(b)
                    self._stats["num_load_errors"] += 1
            if not good:
                continue
            data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=dtype)
            blocks = data.view(len(good), *shape)
            any_cache = next(iter(self._caches.values()))
            blocks = blocks.to(any_cache.device)
            idx = torch.tensor(good, dtype=torch.long, device=any_cache.device)
            for i, cache in enumerate(self._caches.values()):
                cache[:, idx] = blocks[:, i].transpose(0, 1)
            self._stats["num_blocks_loaded"] += len(good)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are complete before the forward starts."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Blocks hold every layer: they are written once the forward is done."""

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, SharedStorageConnectorMetadata) or not meta.saves:
            return
        for _, block_ids, hashes in meta.saves:
            caches = list(self._caches.values())
            idx = torch.tensor(block_ids, dtype=torch.long, device=caches[0].device)
            # [blocks, layers, 2, block_size, kv heads, head dim], one file per block.
            blocks = torch.stack([c[:, idx].transpose(0, 1) for c in caches], dim=1)
            blocks = blocks.contiguous().cpu()
            for j, h in enumerate(hashes):
                self.store.write(h, blocks[j].reshape(-1).view(torch.uint8).numpy())
            self._stats["num_blocks_saved"] += len(hashes)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        stats = {k: v for k, v in self._stats.items() if v}
        self._stats = dict.fromkeys(self._stats, 0)
        return stats or None
