"""Llama 3.x JSON calls: the output is one or more ``{"name": ..., "parameters":
{...}}`` objects (``arguments`` also read), separated by ``;``, optionally after
``<|python_tag|>``. An output that does not start so is plain content."""

from __future__ import annotations

from enginecore.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ToolParser,
    ToolParserManager,
)
from enginecore.entrypoints.openai.tool_parsers.json_scan import calls_of_sequence, skip_ws

PYTHON_TAG = "<|python_tag|>"


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    bot_token = PYTHON_TAG

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        if text.startswith(self.bot_token, i):
            i = skip_ws(text, i + len(self.bot_token))
        elif not final and self.bot_token.startswith(text[i:]):
            return ParsedOutput("")  # may still become the tag (or a call)
        if i >= len(text):
            return ParsedOutput(text if final else "")
        if text[i] != "{":
            return ParsedOutput(text)
        return ParsedOutput("", calls_of_sequence(text, i, final, separators=";"))


@ToolParserManager.register_module("llama4_json")
class Llama4JsonToolParser(Llama3JsonToolParser):
    pass
