"""The executor class a config asks for (``executor_backend``).

Its own module so that abstract.py, which every executor imports, imports none of them.
"""

from __future__ import annotations

from enginecore.config import EngineConfig
from enginecore.executor.abstract import Executor
from enginecore.executor.synthetic import SyntheticExecutor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    backend = config.executor_config.backend
    if backend == "synthetic":
        return SyntheticExecutor
    if backend == "uniproc":
        # Imported on demand: it brings torch and the model, which a synthetic engine
        # (the measuring instrument) does not load.
        from enginecore.executor.uniproc import UniProcExecutor

        return UniProcExecutor
    raise ValueError(f"unknown executor backend {backend!r}; supported: 'uniproc', 'synthetic'")
