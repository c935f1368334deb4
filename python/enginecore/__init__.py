"""enginecore: an engine core for LLM serving (scheduler, paged KV cache with
prefix caching, model executor), with native hot paths and pure-Python twins."""

# First, before anything can load torch (and with it libgomp, which reads its wait
# policy once): the engine's compute threads sleep instead of spinning (omp_env.py).
from enginecore.omp_env import apply_default_wait_policy

apply_default_wait_policy()

from enginecore._native import native_available  # noqa: E402 - after the wait policy
from enginecore.config import EngineArgs, EngineConfig  # noqa: E402
from enginecore.core.engine_core import EngineCore  # noqa: E402
from enginecore.errors import EngineDeadError, EngineGenerateError  # noqa: E402
from enginecore.protocol import (  # noqa: E402
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    LoRARequest,
    SchedulerStats,
    UtilityOutput,
    UtilityResult,
)
from enginecore.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from enginecore.sched.block_hash import block_hashes  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name: str):
    """``LLM``, ``AsyncLLM`` and ``cpu_kernels_info`` load on first use: engine
    processes import this package too and need none of the front-end."""
    if name == "LLM":
        from enginecore.entrypoints.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from enginecore.frontend.async_llm import AsyncLLM

        return AsyncLLM
    if name == "cpu_kernels_info":  # imports torch: not before the wait policy's users need it
        from enginecore.model.kernel_twins import cpu_kernels_info

        return cpu_kernels_info
    raise AttributeError(f"module 'enginecore' has no attribute {name!r}")


__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineArgs",
    "EngineConfig",
    "EngineCore",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineCoreRequestType",
    "EngineDeadError",
    "EngineGenerateError",
    "FinishReason",
    "LoRARequest",
    "RequestOutputKind",
    "SamplingParams",
    "SchedulerStats",
    "UtilityOutput",
    "UtilityResult",
    "block_hashes",
    "cpu_kernels_info",
    "native_available",
]
