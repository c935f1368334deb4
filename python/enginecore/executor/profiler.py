"""``start_profile`` / ``stop_profile``: the torch profiler around the steps between
them, written as a Chrome trace (chrome://tracing, Perfetto) into ``profiler_dir``."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

logger = logging.getLogger(__name__)


class TorchProfiler:
    def __init__(self, profiler_dir: str | None, rank: int = 0) -> None:
        self.profiler_dir = profiler_dir
        self.rank = rank
        self._profile: Any = None

    def start(self) -> None:
        if self.profiler_dir is None:
            raise RuntimeError("the profiler is off: start the engine with profiler_dir set "
                               "(--profiler-dir DIR)")
        if self._profile is not None:
            raise RuntimeError("the profiler is already running; stop_profile first")
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        os.makedirs(self.profiler_dir, exist_ok=True)
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profile.__enter__()
        logger.info("torch profiler started (trace into %s at stop_profile)", self.profiler_dir)

    def stop(self) -> str:
        """Stop and write the trace; its path."""
        if self._profile is None:
            raise RuntimeError("the profiler is not running; start_profile first")
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        assert self.profiler_dir is not None
        path = os.path.join(self.profiler_dir,
                            f"enginecore-rank{self.rank}-{os.getpid()}-{time.time_ns()}.json")
        profile.export_chrome_trace(path)
        logger.info("torch profiler trace written to %s", path)
        return path
