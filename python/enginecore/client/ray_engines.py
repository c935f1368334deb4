"""Data-parallel ranks as Ray actors: ``data_parallel_backend="ray"``.

One placement group per rank, packed on one node: on CUDA a bundle per device
holding it and a CPU (the engine runs its model in-process, so the engine actor
sits on that bundle), on CPU one CPU bundle for the engine actor. Without a
running cluster (``RAY_ADDRESS`` unset and none started) a local one starts.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("data_parallel_backend='ray' needs Ray: pip install 'enginecore[ray]'"
                          ) from None
    return ray


class RayEngines:
    """The actors of one engine set, their placement groups, and a watcher."""

    def __init__(self, executor_class: Any, log_stats: bool, log_level: int) -> None:
        self._args = (executor_class, log_stats, log_level)
        self.actors: dict[int, Any] = {}  # rank -> actor
        self.placement_groups: dict[int, Any] = {}
        self._runs: dict[Any, int] = {}  # run() object ref -> rank
        self._leaving: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False

    def start(self, config: Any, ranks: list[int], init: bytes, timeout_s: float,
              before_wait: Callable[[], None] | None = None) -> tuple[int, int]:
        """Place and start ``ranks``; (num_gpu_blocks, max_model_len) of the first.
        ``before_wait`` runs once the actors exist, before waiting for their
        engines (an elastic scale-up commits the rescale there)."""
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from enginecore.core.ray_actor import DPEngineCoreActor

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                     ignore_reinit_error=True, logging_level=logging.WARNING)
        cuda = config.model_config.device.startswith("cuda")
        bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}
        pgs = {rank: placement_group([bundle], strategy="STRICT_PACK",
                                     name=f"enginecore_dp{rank}_{os.getpid()}_{id(self)}")
               for rank in ranks}
        self.placement_groups.update(pgs)
        try:
            ray.get([pg.ready() for pg in pgs.values()], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"the Ray cluster has no room for {len(ranks)} ranks of {bundle} within "
                f"{timeout_s:g} s (cluster resources: {ray.cluster_resources()})") from None
        actor_class = ray.remote(DPEngineCoreActor)
        executor_class, log_stats, log_level = self._args
        actors = {}
        for rank, pg in pgs.items():
            actors[rank] = actor_class.options(
                name=f"EngineCore_DP{rank}_{os.getpid()}_{id(self)}",
                num_cpus=1, num_gpus=1 if cuda else 0,
                # run() holds one thread for the actor's life; pid() and the like
                # need another.
                max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=0),
            ).remote(_with_rank(config, rank), init, executor_class, log_stats, rank, log_level)
        self.actors.update(actors)
        waits = [a.wait_for_init.remote() for a in actors.values()]
        if before_wait is not None:
            before_wait()
        # Every rank builds its engine at once (the DP group needs them all).
        try:
            ready = ray.get(waits, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"Ray engines did not initialise within {timeout_s:g} s "
                               "(handshake_timeout_s)") from None
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"a Ray engine failed to start: {e}") from None
        with self._lock:
            for rank, actor in actors.items():
                self._runs[actor.run.remote()] = rank
        return ready[0]

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death(why)`` once, when a rank's actor ends (not a leaving one)."""
        ray = _ray()

        def watcher() -> None:
            while not self._closed:
                with self._lock:
                    refs = list(self._runs)
                # Re-read now and then: a rescale adds and removes ranks.
                done, _ = ray.wait(refs, num_returns=1, timeout=0.5)
                if not done or self._closed:
                    continue
                with self._lock:
                    # None: remove() took it (a rank that left); the pop and the
                    # leaving check share the lock so remove() cannot slip between.
                    rank = self._runs.pop(done[0], None)
                    if rank is None or rank in self._leaving:
                        continue
                try:
                    ray.get(done[0])
                    why = f"Ray engine rank {rank} stopped"
                except Exception as e:  # noqa: BLE001 - the actor died: say how
                    why = f"Ray engine rank {rank} died: {type(e).__name__}"
                on_death(why)
                return

        threading.Thread(target=watcher, daemon=True, name="enginecore-ray-monitor").start()

    def leaving(self, ranks: list[int]) -> None:
        """These ranks are about to leave in a rescale: their end is no death."""
        with self._lock:
            self._leaving.update(ranks)

    def remove(self, ranks: list[int], timeout_s: float) -> None:
        """After they left: wait for their run() to return, then free their places."""
        ray = _ray()
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            refs = [ref for ref, rank in self._runs.items() if rank in ranks]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        with self._lock:
            # Take their runs from the watcher before the ranks stop counting as
            # leaving (a later scale-up may reuse the rank numbers).
            for ref in refs:
                self._runs.pop(ref, None)
            self._leaving.difference_update(ranks)
        for rank in ranks:
            ray.kill(self.actors.pop(rank), no_restart=True)
            remove_placement_group(self.placement_groups.pop(rank))

    def pids(self) -> list[int]:
        ray = _ray()
        return ray.get([self.actors[r].pid.remote() for r in sorted(self.actors)])

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = _ray()
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        for pg in self.placement_groups.values():
            remove_placement_group(pg)


def _with_rank(config: Any, rank: int) -> Any:
    import dataclasses

    return dataclasses.replace(config, parallel_config=dataclasses.replace(
        config.parallel_config, data_parallel_rank=rank))
