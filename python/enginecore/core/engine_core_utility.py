"""EngineCore's utility methods: what front-ends may call by name (the allow-list and
the argument conversion live in core/utility.py). A mixin of EngineCore, which holds
``self.scheduler``, ``self.model_executor`` and ``self.config``."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import msgspec

from enginecore.bounds import NonNegInt64, PositiveInt64, finite
from enginecore.model.mm_registry import is_multimodal_architecture
from enginecore.protocol import LoRARequest, SchedulerStats
from enginecore.sched.scheduler import PauseState

logger = logging.getLogger(__name__)

# Utility argument types (core/utility.py converts to them before the call, so a
# bad argument is refused before the method has done anything).
PauseMode = Literal["abort", "keep", "wait"]
Seconds = finite(ge=0.0)
DPSize = Annotated[int, msgspec.Meta(ge=1, le=0xFFFF)]
SleepLevel = Literal[1, 2]
WakeUpTag = Literal["weights", "kv_cache"]



class EngineCoreUtilities:
    def profile(self, is_start: bool = True) -> None:
        self.model_executor.profile(is_start)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def pause_scheduler(self, mode: PauseMode = "abort") -> None:
        """Stop scheduling. ``abort``: abort every live request, then pause;
        ``keep``: freeze every request where it is; ``wait``: let running
        requests finish, admit no new ones. Requests added while paused wait."""
        if mode not in ("abort", "keep", "wait"):
            raise ValueError(f"pause mode must be 'abort', 'keep' or 'wait', got {mode!r}")
        if mode == "abort":
            self._drain_batch_queue()
            self.abort_requests(list(self.scheduler.requests))
        state = PauseState.PAUSED_NEW if mode == "wait" else PauseState.PAUSED_ALL
        self.scheduler.set_pause_state(state)

    def resume_scheduler(self) -> None:
        self.scheduler.set_pause_state(PauseState.UNPAUSED)

    def is_scheduler_paused(self) -> bool:
        return self.scheduler.pause_state != PauseState.UNPAUSED

    def sleep(self, level: SleepLevel = 1) -> None:
        """Free the KV cache (level 1) and the weights (level 2). Running
        requests are preempted and resume by recompute after ``wake_up``."""
        if level not in (1, 2):  # before anything is preempted
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self._drain_batch_queue()
        self.scheduler.preempt_all()
        self.model_executor.sleep(level)
        self.scheduler.reset_prefix_cache()

    def wake_up(self, tags: list[WakeUpTag] | None = None) -> None:
        self.model_executor.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.model_executor.is_sleeping

    def execute_dummy_batch(self) -> None:
        self.model_executor.execute_dummy_batch()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.model_executor.add_lora(lora_request)

    def remove_lora(self, lora_id: PositiveInt64) -> bool:
        return self.model_executor.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.model_executor.list_loras()

    def pin_lora(self, lora_id: PositiveInt64) -> bool:
        return self.model_executor.pin_lora(lora_id)

    def collective_rpc(
        self,
        method: str,
        timeout: Seconds | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        return self.model_executor.collective_rpc(method, timeout, tuple(args), kwargs)

    def save_sharded_state(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> None:
        self.model_executor.save_sharded_state(path, pattern, max_size)

    def set_weight_version(self, version: str | None) -> None:
        self.weight_version = version

    def get_weight_version(self) -> str | None:
        return self.weight_version

    def get_kv_cache_group_metadata(self) -> list[dict[str, Any]]:
        spec = self.model_executor.get_kv_cache_specs()
        return [{
            "group_id": 0,
            "kind": "full_attention",
            "block_size": spec.block_size,
            "num_blocks": self.config.cache_config.num_gpu_blocks,
            "num_layers": spec.num_layers,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "page_size_bytes": spec.page_size_bytes,
        }]

    def get_supported_tasks(self) -> tuple[str, ...]:
        return self.model_executor.get_supported_tasks()

    def reset_mm_cache(self) -> bool:
        """Forget every processed item the receiver cache holds (the front-end
        clears its sender cache first); False when the model takes no images."""
        if self.mm_receiver_cache is None:
            logger.info("reset_mm_cache: %s takes no multimodal inputs; nothing to reset",
                        self.config.model_config.model)
            return False
        self.mm_receiver_cache.clear()
        return True

    def reset_encoder_cache(self) -> bool:
        """Forget every cached encoder output (vision embeddings); refused (False)
        while a live request still needs one; False, with a log line, for a model
        without an encoder (as reset_mm_cache)."""
        if not is_multimodal_architecture(self.config.model_config.architecture):
            logger.info("reset_encoder_cache: %s has no encoder cache; nothing to reset",
                        self.config.model_config.model)
            return False
        return self.scheduler.reset_encoder_cache()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        return self.scheduler.get_request_counts()

    def barrier(self) -> bool:
        """Return once every data-parallel rank has reached it (one engine: at once)."""
        return True

    def reinitialize_distributed(self, new_size: DPSize, generation: NonNegInt64) -> bool:
        """Data parallel only: move to a group of ``new_size`` ranks; False on a
        rank that leaves (DPEngineCoreProc)."""
        raise RuntimeError("reinitialize_distributed needs a data-parallel engine "
                           "(data_parallel_size > 1)")

    def get_dp_state(self) -> dict[str, Any]:
        """Data-parallel state of this engine (rank, size, wave, ...)."""
        return {"data_parallel_rank": 0, "data_parallel_size": 1, "lockstep": False}

    def echo(self, value: Any = None) -> Any:
        """Return the argument: a liveness and round-trip check for clients."""
        return value

