"""UniProcExecutor: the model runner in the engine's own process (the default)."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from enginecore.executor.abstract import Executor, KVCacheConfig, KVCacheSpec, completed_future
from enginecore.executor.cpu_threads import (
    StarvationGovernor,
    apply_thread_plan,
    plan_threads,
    starvation_governor,
)
from enginecore.executor.profiler import TorchProfiler
from enginecore.protocol import LoRARequest
from enginecore.sched.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_FRACTION = 0.25
DEFAULT_CPU_KV_CAP = 4 << 30


def release_free_host_memory() -> None:
    """Give freed heap pages back to the OS. Tensors of a few MiB come from
    glibc's heap once its mmap threshold has grown, and free() alone keeps them."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


class UniProcExecutor(Executor):
    RPC_METHODS = frozenset({"echo", "device_info"})

    def _init_executor(self) -> None:
        if self.config.model_config.device == "cpu":
            # Before the weights load: torch's thread team (and its binding) is set once.
            ec, pc = self.config.executor_config, self.config.parallel_config
            apply_thread_plan(plan_threads(ec.cpu_threads, ec.cpu_threads_bind,
                                           pc.data_parallel_rank_local % max(
                                               pc.data_parallel_size_local, 1),
                                           max(pc.data_parallel_size_local, 1)))
        self._governor: StarvationGovernor | None = (
            starvation_governor() if self.config.model_config.device == "cpu" else None)
        if self.config.model_config.task == "embed":
            from enginecore.model.pooling_runner import PoolingModelRunner

            self.runner = PoolingModelRunner(self.config)
        else:
            from enginecore.model.model_runner import ModelRunner

            self.runner = ModelRunner(self.config)
        self.runner.load_model()
        self._kv_config: KVCacheConfig | None = None
        self._max_batches = self.config.executor_config.max_concurrent_batches
        # With a batch queue, batches run in order on one model thread, so the
        # engine schedules the next batch while torch computes this one.
        self._pool: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(1, thread_name_prefix="enginecore-model")
            if self._max_batches > 1 else None)
        self._lock = threading.Lock()
        self._profiler = TorchProfiler(self.config.executor_config.profiler_dir,
                                       self.config.parallel_config.data_parallel_rank)

    @property
    def max_concurrent_batches(self) -> int:
        return self._max_batches

    def get_kv_cache_specs(self) -> KVCacheSpec:
        if self.config.model_config.task == "embed":
            return KVCacheSpec(self.config.cache_config.block_size, 0, 0, 0, 0)  # no KV cache
        a = self.runner.arch
        return KVCacheSpec(self.config.cache_config.block_size, a.num_layers, a.num_kv_heads,
                           a.head_dim, torch.finfo(self.runner.dtype).bits // 8)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return (self.config.model_config.task,)

    def determine_available_memory(self) -> int:
        cc = self.config.cache_config
        if cc.kv_cache_memory_bytes is not None:
            return cc.kv_cache_memory_bytes
        device = self.runner.device
        if device.type == "cuda":
            return self._profile_cuda_memory()
        space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
        if space not in ("", "0"):  # vLLM's knob: GiB of KV cache (0: the default)
            try:
                gib = float(space)
            except ValueError:
                raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be GiB (a number), got "
                                 f"{space!r}") from None
            if not gib > 0:
                raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be > 0 GiB, got {space!r}")
            return int(gib * 2**30)
        avail = mem_available_bytes()
        budget = min(int(avail * DEFAULT_CPU_KV_FRACTION), DEFAULT_CPU_KV_CAP)
        logger.info("CPU KV cache budget: %.2f GiB (%.0f%% of %.1f GiB available, capped at "
                    "%.0f GiB; set kv_cache_memory_bytes to change)", budget / 2**30,
                    100 * DEFAULT_CPU_KV_FRACTION, avail / 2**30, DEFAULT_CPU_KV_CAP / 2**30)
        return budget

    def _profile_cuda_memory(self) -> int:
        """Run a forward pass at max batch, then give the KV cache what is left
        of gpu_memory_utilization."""
        cc = self.config.cache_config
        device = self.runner.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        # A temporary one-block cache lets the profile run the real attention path.
        self.runner.allocate_kv_cache(1)
        n = self.config.scheduler_config.max_num_batched_tokens
        self.runner.dummy_forward(n)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        self.runner.free_kv_cache()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free - torch.cuda.memory_reserved(device)
        budget = int(total * cc.gpu_memory_utilization) - peak - max(used_by_others, 0)
        logger.info("CUDA memory: total %.2f GiB, peak during profile %.2f GiB, KV budget %.2f GiB",
                    total / 2**30, peak / 2**30, budget / 2**30)
        return max(budget, 0)

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self._kv_config = kv_cache_config
        self.runner.allocate_kv_cache(kv_cache_config.num_blocks)
        self.runner.dummy_forward(self.config.cache_config.block_size)  # warm-up

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future:
        if non_block and self._pool is not None:
            return self._pool.submit(self._execute, scheduler_output)
        output = self._execute(scheduler_output)
        return completed_future(output) if non_block else output

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # An exception here is not the executor's death: the engine finds the
        # request(s) that cause it (core/fault_isolation.py) and probes the device
        # with a dummy batch before it gives up.
        with self._lock:
            if self._governor is not None:  # on the thread that runs the model
                self._governor.before_step()
            output = self.runner.execute_model(scheduler_output)
        if output.kv_connector_output is not None:
            output.kv_connector_output = self.kv_output_aggregator.aggregate(
                [output.kv_connector_output])
        return output

    def get_kv_connector_handshake_metadata(self) -> list[dict[tuple[int, int], Any]]:
        kvc = getattr(self.runner, "kv_connector", None)
        meta = None if kvc is None else kvc.handshake_metadata()
        return [] if meta is None else [{(0, 0): meta}]

    def execute_dummy_batch(self) -> None:
        self.runner.dummy_forward(1)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        with self._lock:  # not while a batch on the model thread reads the slots
            return self.runner.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        with self._lock:
            return self.runner.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.runner.list_loras() if hasattr(self.runner, "list_loras") else set()

    def pin_lora(self, lora_id: int) -> bool:
        return self.runner.pin_lora(lora_id)

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        """Drafts proposed after the last step (speculative decoding)."""
        return self.runner.take_draft_token_ids()

    def profile(self, is_start: bool = True) -> None:
        if is_start:
            self._profiler.start()
        else:
            self._profiler.stop()

    # -- sleep mode ---------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        super().sleep(level)
        self.runner.free_kv_cache()
        if level == 2:
            self.runner.unload_model()
        elif self.runner.device.type == "cuda" and hasattr(self.runner.model, "to_device"):
            # Level 1 on CUDA: weights wait in host memory, the device is free.
            self.runner.model.to_device(torch.device("cpu"))
            self._weights_offloaded = True
        gc.collect()
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            release_free_host_memory()

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = list(tags) if tags else ["weights", "kv_cache"]
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use 'weights', 'kv_cache'")
        if "weights" in tags and self.runner.model is None:
            self.runner.load_model()
        if "weights" in tags and getattr(self, "_weights_offloaded", False):
            self.runner.model.to_device(self.runner.device)
            self._weights_offloaded = False
        if "kv_cache" in tags and not self.runner.kv_caches and self._kv_config is not None:
            self.runner.allocate_kv_cache(self._kv_config.num_blocks)
        if self.runner.model is not None and self.runner.kv_caches:
            self._sleeping_level = 0

    # -- misc ---------------------------------------------------------------------------------
    def _rpc_echo(self, value: Any = None) -> Any:
        return value

    def _rpc_device_info(self) -> dict[str, Any]:
        """Where this rank runs: device, dtype, and on CUDA which GPU it sees."""
        info = {"device": str(self.runner.device), "dtype": str(self.runner.dtype),
                "torch_threads": torch.get_num_threads(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
        if self.runner.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.runner.device)
            info |= {"cuda_device_name": props.name, "cuda_device_uuid": str(props.uuid),
                     "cuda_device_count": torch.cuda.device_count()}
        return info

    def save_sharded_state(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> None:
        """The weights as an HF checkpoint in ``path`` (model/checkpoint.py: safetensors
        shards under HF names, the index when sharded, config and tokenizer files)."""
        from enginecore.model.checkpoint import save_checkpoint

        if self.runner.model is None:
            raise RuntimeError("weights are released (sleep level 2); wake_up first")
        save_checkpoint(self.runner.model, self.runner.model_path, path, pattern, max_size,
                        rank=self.config.parallel_config.data_parallel_rank)

    def shutdown(self) -> None:
        kvc = getattr(self.runner, "kv_connector", None)
        if kvc is not None:
            kvc.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._governor is not None:
            self._governor.close()
        self.runner.free_kv_cache()
