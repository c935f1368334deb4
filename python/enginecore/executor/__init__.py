"""Executors run the model for the engine: in-process, synthetic (a measuring instrument)."""

from enginecore.executor.abstract import Executor, KVCacheSpec
from enginecore.executor.factory import get_executor_class
from enginecore.executor.synthetic import SyntheticExecutor

__all__ = ["Executor", "KVCacheSpec", "SyntheticExecutor", "get_executor_class"]
