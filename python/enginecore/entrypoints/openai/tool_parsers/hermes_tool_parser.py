"""Hermes-style calls (Qwen 2.5 / 3, SmolLM3, Hermes 2 Pro):
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call;
the content is the text before the first block."""

from __future__ import annotations

from typing import Any

from enginecore.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ToolParser,
    ToolParserManager,
)
from enginecore.entrypoints.openai.tool_parsers.json_scan import (
    NotJSON,
    call_of_object,
    partial_marker,
    skip_ws,
)


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"

    def adjust_request(self, request: Any) -> Any:
        # <tool_call> may be a special token of the vocabulary: keep it in the text.
        if getattr(request, "tool_choice", None) != "none":
            request.skip_special_tokens = False
        return request

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start_tag, end_tag = self.tool_call_start_token, self.tool_call_end_token
        first = text.find(start_tag)
        if first < 0:
            held = 0 if final else partial_marker(text, start_tag)
            return ParsedOutput(text[:len(text) - held])
        out = ParsedOutput(text[:first])
        pos = first
        while pos >= 0:
            body_start = pos + len(start_tag)
            end = text.find(end_tag, body_start)
            # An unterminated last block still counts at the end (as vLLM's parser).
            body = text[body_start:end if end >= 0 else len(text)]
            if end < 0 and not final:
                body = body[:len(body) - partial_marker(body, end_tag)]
            i = skip_ws(body, 0)
            if i < len(body):
                if body[i] != "{":
                    raise NotJSON("a <tool_call> block does not hold a JSON object")
                call, obj_end = call_of_object(body, i, final or end >= 0)
                if call is not None:
                    out.calls.append(call)
                if obj_end is not None and body[obj_end:].strip():
                    raise NotJSON("text after the call object in a <tool_call> block")
            elif final or end >= 0:
                raise NotJSON("an empty <tool_call> block")
            if end < 0:
                break
            pos = text.find(start_tag, end + len(end_tag))
        return out
