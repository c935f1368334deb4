"""Tool-call parsers by name (``--tool-call-parser``), vLLM's registry and shapes."""

from enginecore.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ToolParser,
    ToolParserManager,
)
from enginecore.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from enginecore.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from enginecore.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from enginecore.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser

__all__ = ["Hermes2ProToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "ParsedOutput", "PythonicToolParser", "ToolParser", "ToolParserManager"]
