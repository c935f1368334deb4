"""Reasoning parsers (vLLM's ``--reasoning-parser``): split a reasoning model's
output into ``reasoning_content`` (its thinking) and ``content`` (the answer)."""

from enginecore.reasoning.abs_reasoning_parsers import (
    ReasoningParser,
    ReasoningParserManager,
    ReasoningSplit,
)
from enginecore.reasoning.resolve import resolve_reasoning_parser
from enginecore.reasoning.think_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ThinkTagReasoningParser,
)

__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningParser",
           "ReasoningParserManager", "ReasoningSplit", "ThinkTagReasoningParser",
           "resolve_reasoning_parser"]
