"""The tool-parser interface (vLLM's ``ToolParser``) and its registry
(``ToolParserManager``: parsers by name, plug-ins by file path or module name).

A parser is made per request with the tokenizer. ``extract_tool_calls`` reads a
finished output; ``extract_tool_calls_streaming`` is called once per delta with
the text so far and answers the ``DeltaMessage`` to send (None: nothing yet).

Parsers here describe their format once, as ``parse(text, final)``: the content
and the calls of the text so far, where each answer for a prefix is a prefix of
the answer for the whole text. Streaming is then the difference between the state
of the text so far and what was already sent, so any way the output is cut into
deltas gives the same calls and content as the finished output.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from enginecore.entrypoints.openai.protocol import DeltaMessage
from enginecore.entrypoints.openai.tool_parsers.json_scan import NotJSON, ParsedCall
from enginecore.entrypoints.openai.tool_protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)


@dataclass
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser:
    """Base of every tool parser; subclasses give ``parse`` (or override the two
    ``extract_*`` methods, as a vLLM plug-in does)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.model_tokenizer = tokenizer
        # vLLM's streaming state names (plug-ins read and write them).
        self.prev_tool_call_arr: list[dict[str, Any]] = []
        self.current_tool_id = -1
        self.current_tool_name_sent = False
        self.streamed_args_for_tool: list[str] = []
        self._sent_content = ""
        self._ids: list[str] = []

    def adjust_request(self, request: Any) -> Any:
        """The request as this parser needs it (e.g. special tokens kept in the text)."""
        return request

    def make_call_id(self) -> str:
        return make_tool_call_id()

    # -- the format --------------------------------------------------------------------
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """Content and calls of ``text`` (``final``: the whole output; else a
        prefix, holding back what may still turn out to belong to a call).
        Raises NotJSON when a finished output is not well-formed calls."""
        raise NotImplementedError

    # -- vLLM's interface --------------------------------------------------------------
    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        try:
            parsed = self.parse(model_output, final=True)
        except (NotJSON, ValueError, SyntaxError):
            # Not well-formed calls: the whole output is the answer's text (as vLLM).
            return ExtractedToolCallInformation(False, [], model_output)
        if not parsed.calls:
            return ExtractedToolCallInformation(False, [], model_output)
        calls = [ToolCall(FunctionCall(c.name, c.arguments), id=self.make_call_id())
                 for c in parsed.calls]
        return ExtractedToolCallInformation(True, calls, parsed.content or None)

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str,
        previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int], request: Any,
    ) -> DeltaMessage | None:
        try:
            parsed = self.parse(current_text, final=False)
        except (NotJSON, ValueError, SyntaxError):
            return None  # not calls after all: the end of the stream says what it was
        return self._delta(parsed)

    def finish_streaming(self, current_text: str, request: Any) -> DeltaMessage | None:
        """What is left to send once the output has ended (text held back because it
        might have started a call)."""
        try:
            parsed = self.parse(current_text, final=True)
        except (NotJSON, ValueError, SyntaxError):
            if self.streamed_args_for_tool:
                return None  # calls were sent; the rest is not well-formed
            parsed = ParsedOutput(current_text)
        return self._delta(parsed)

    def _delta(self, parsed: ParsedOutput) -> DeltaMessage | None:
        content = None
        if parsed.content.startswith(self._sent_content) and \
                len(parsed.content) > len(self._sent_content):
            content = parsed.content[len(self._sent_content):]
            self._sent_content = parsed.content
        pieces = []
        for index, call in enumerate(parsed.calls):
            if index == len(self.streamed_args_for_tool):
                self._ids.append(self.make_call_id())
                self.streamed_args_for_tool.append(call.arguments)
                self.prev_tool_call_arr.append({"name": call.name, "arguments": call.arguments})
                self.current_tool_id = index
                self.current_tool_name_sent = True
                pieces.append(DeltaToolCall(index, self._ids[index], "function",
                                            DeltaFunctionCall(call.name, call.arguments)))
                continue
            sent = self.streamed_args_for_tool[index]
            if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                pieces.append(DeltaToolCall(index, function=DeltaFunctionCall(
                    arguments=call.arguments[len(sent):])))
                self.streamed_args_for_tool[index] = call.arguments
                self.prev_tool_call_arr[index]["arguments"] = call.arguments
        if content is None and not pieces:
            return None
        return DeltaMessage(content=content, tool_calls=pieces or None)


class ToolParserManager:
    """Parsers by name (``--tool-call-parser``); ``--tool-parser-plugin`` imports a
    file or module whose ``@ToolParserManager.register_module(...)`` adds more."""

    tool_parsers: ClassVar[dict[str, type[ToolParser]]] = {}

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        try:
            return cls.tool_parsers[name]
        except KeyError:
            raise KeyError(f"tool call parser {name!r} is not registered; known: "
                           f"{sorted(cls.tool_parsers)}") from None

    @classmethod
    def register_module(cls, name: str | list[str] | None = None, force: bool = True,
                        module: type[ToolParser] | None = None) -> Any:
        def register(parser: type[ToolParser]) -> type[ToolParser]:
            if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
                raise TypeError(f"a tool parser must subclass ToolParser, got {parser!r}")
            names = [name] if isinstance(name, str) else (name or [parser.__name__])
            for n in names:
                if not force and n in cls.tool_parsers:
                    raise KeyError(f"tool call parser {n!r} is already registered")
                cls.tool_parsers[n] = parser
            return parser

        if module is not None:
            return register(module)
        return register

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Import a plug-in: a .py file by path, or a module by dotted name."""
        if os.path.exists(plugin_path):
            module_name = "enginecore_tool_plugin_" + os.path.splitext(
                os.path.basename(plugin_path))[0]
            spec = importlib.util.spec_from_file_location(module_name, plugin_path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot import tool parser plug-in {plugin_path!r}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        else:
            importlib.import_module(plugin_path)

