"""A stateless process group for one data-parallel group.

No ``init_process_group``, no global default group: the group is a gloo (CPU)
backend object built on a store prefix of its own, so several groups (one per
elastic generation, or several engines in a test process) can live in one
process. The front-end hosts the TCPStore; every rank is a store client.
"""

from __future__ import annotations

import datetime
import logging

logger = logging.getLogger(__name__)

# A collective that waits longer than this raises instead of hanging: a rank that
# died is seen at once (gloo closes the pair), a stuck one after this long.
COLLECTIVE_TIMEOUT_S = 300.0


def host_store(host: str, timeout_s: float = COLLECTIVE_TIMEOUT_S):
    """The front-end's store for the DP groups: (store, "host:port")."""
    import torch.distributed as dist

    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, f"{host}:{store.port}"


class StatelessDPGroup:
    """Ranks ``0..size-1`` of generation ``generation`` meet at ``store_address``."""

    def __init__(self, store_address: str, rank: int, size: int, generation: int = 0,
                 timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        import torch
        import torch.distributed as dist

        host, port = store_address.rsplit(":", 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        self._store = dist.PrefixStore(f"enginecore-dp-gen{generation}", store)
        self.rank = rank
        self.size = size
        self.generation = generation
        self._pg = dist.ProcessGroupGloo(self._store, rank, size, timeout)
        self._torch = torch
        logger.info("DP group generation %d: rank %d of %d via %s", generation, rank, size,
                    store_address)

    def all_reduce_min(self, values: list[int]) -> list[int]:
        """Element-wise minimum over the ranks (blocking); negate for a maximum."""
        import torch.distributed as dist

        t = self._torch.tensor(values, dtype=self._torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._pg.allreduce([t], opts).wait()
        return t.tolist()

    def barrier(self) -> None:
        self.all_reduce_min([0])

    def destroy(self) -> None:
        self._pg = None
        self._store = None
