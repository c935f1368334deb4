"""The front-end room: what vLLM keeps above its engine core.

``AsyncLLM`` (asyncio, for servers) and the offline ``LLM`` share the
``InputProcessor`` (tokenize, chat templates, validate) and the
``OutputProcessor`` (incremental detokenization, stop strings, ``n``, output
kinds, logprobs, timing) whose per-step loop has a Cython twin.
"""

from enginecore.frontend.async_llm import AsyncLLM
from enginecore.frontend.input_processor import InputProcessor
from enginecore.frontend.metrics import FrontendMetrics, IterationStats
from enginecore.frontend.output_processor import OutputProcessor, RequestOutputCollector

__all__ = ["AsyncLLM", "FrontendMetrics", "InputProcessor", "IterationStats",
           "OutputProcessor", "RequestOutputCollector"]
