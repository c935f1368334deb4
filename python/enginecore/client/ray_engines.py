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
from typing import Any, Callable

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

    def __init__(self) -> None:
        self.actors: list[Any] = []
        self.placement_groups: list[Any] = []
        self._runs: dict[Any, int] = {}
        self._closed = False

    def start(self, config: Any, ranks: list[int], init: bytes, executor_class: Any,
              log_stats: bool, log_level: int, timeout_s: float) -> tuple[int, int]:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from enginecore.core.ray_actor import DPEngineCoreActor

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                     ignore_reinit_error=True, logging_level=logging.WARNING)
        cuda = config.model_config.device.startswith("cuda")
        bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}
        for rank in ranks:
            self.placement_groups.append(placement_group(
                [bundle], strategy="STRICT_PACK", name=f"enginecore_dp{rank}_{os.getpid()}"))
        try:
            ray.get([pg.ready() for pg in self.placement_groups], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"the Ray cluster has no room for {len(ranks)} ranks of {bundle} within "
                f"{timeout_s:g} s (cluster resources: {ray.cluster_resources()})") from None
        actor_class = ray.remote(DPEngineCoreActor)
        for rank, pg in zip(ranks, self.placement_groups):
            rank_config = _with_rank(config, rank)
            self.actors.append(actor_class.options(
                name=f"EngineCore_DP{rank}_{os.getpid()}",
                num_cpus=1, num_gpus=1 if cuda else 0,
                # run() holds one thread for the actor's life; pid() and the like
                # need another.
                max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=0),
            ).remote(rank_config, init, executor_class, log_stats, rank, log_level))
        # Every rank builds its engine at once (the DP group needs them all).
        try:
            ready = ray.get([a.wait_for_init.remote() for a in self.actors], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"Ray engines did not initialise within {timeout_s:g} s "
                               "(handshake_timeout_s)") from None
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"a Ray engine failed to start: {e}") from None
        for rank, actor in zip(ranks, self.actors):
            self._runs[actor.run.remote()] = rank
        return ready[0]

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death(why)`` once, when any rank's actor ends."""
        ray = _ray()

        def watcher() -> None:
            refs = list(self._runs)
            done, _ = ray.wait(refs, num_returns=1)
            if self._closed:
                return
            rank = self._runs[done[0]]
            try:
                ray.get(done[0])
                why = f"Ray engine rank {rank} stopped"
            except Exception as e:  # noqa: BLE001 - the actor died: say how
                why = f"Ray engine rank {rank} died: {type(e).__name__}"
            on_death(why)

        threading.Thread(target=watcher, daemon=True, name="enginecore-ray-monitor").start()

    def pids(self) -> list[int]:
        ray = _ray()
        return ray.get([a.pid.remote() for a in self.actors])

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = _ray()
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        for pg in self.placement_groups:
            remove_placement_group(pg)


def _with_rank(config: Any, rank: int) -> Any:
    import dataclasses

    return dataclasses.replace(config, parallel_config=dataclasses.replace(
        config.parallel_config, data_parallel_rank=rank))
