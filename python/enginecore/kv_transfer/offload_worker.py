"""The offloading connector's worker side: hands the metadata's copy jobs to the copier
(kv_transfer/offload_copier.py) at the start of a step and reports, at its end, what
finished meanwhile: loads as finished_recving (a failed one's blocks as load errors),
stores as finished_sending (the blocks may be freed; a failed one is named in the
stats so the tier drops it), a request finished mid-load as finished_sending once the
load ended."""

from __future__ import annotations

from typing import Any

from enginecore.kv_transfer.offload_copier import LOAD, STORE, OffloadCopier
from enginecore.kv_transfer.offload_scheduler import FAILED_STORES, OffloadingConnectorMetadata


class OffloadWorker:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.copier: OffloadCopier | None = None
        self._loading: set[str] = set()
        self._finished_loading: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_stores: list[str] = []
        self._counts = {"offload_loaded_blocks": 0, "offload_stored_blocks": 0,
                        "offload_load_failures": 0}

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.copier = OffloadCopier(list(kv_caches.values()), self.num_slots)

    def start_load_kv(self, meta: OffloadingConnectorMetadata | None) -> None:
        if meta is None or self.copier is None:
            return
        for job in meta.loads:  # first: a waiting request is waiting for them
            self.copier.submit(job)
            self._loading.add(job.req_id)
        for job in meta.stores:
            self.copier.submit(job)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending: set[str] = set()
        recving: set[str] = set()
        if self.copier is None:
            return sending, recving
        self._finished_loading |= finished_req_ids & self._loading
        for job, ok in self.copier.take_done():
            n = len(job.block_ids)
            if job.kind == LOAD:
                recving.add(job.req_id)
                self._loading.discard(job.req_id)
                if ok:
                    self._counts["offload_loaded_blocks"] += n
                else:
                    self._load_errors.update(job.block_ids)
                    self._counts["offload_load_failures"] += 1
                if job.req_id in self._finished_loading:
                    self._finished_loading.discard(job.req_id)
                    sending.add(job.req_id)
            elif job.kind == STORE:
                sending.add(job.req_id)
                if ok:
                    self._counts["offload_stored_blocks"] += n
                else:
                    self._failed_stores.append(job.req_id)
        return sending, recving

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def stats(self) -> dict[str, Any]:
        """This step's counts (the scheduler sums them), and failed stores by name."""
        out: dict[str, Any] = {k: v for k, v in self._counts.items() if v}
        self._counts = dict.fromkeys(self._counts, 0)
        if self._failed_stores:
            out[FAILED_STORES] = self._failed_stores
            self._failed_stores = []
        return out

    def shutdown(self) -> None:
        if self.copier is not None:
            self.copier.wait_idle(10)
            self.copier.close()
