"""Mistral calls after the ``[TOOL_CALLS]`` control token: a JSON list of
``{"name": ..., "arguments": {...}}`` (tokenizers before v11), or
``name[ARGS]{...}`` per call (v11 and later, each call after its own
``[TOOL_CALLS]``); the content is the text before the first ``[TOOL_CALLS]``.
Call ids are Mistral's: nine letters and digits."""

from __future__ import annotations

import json
import random
import string
from typing import Any

from enginecore.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ToolParser,
    ToolParserManager,
)
from enginecore.entrypoints.openai.tool_parsers.json_scan import (
    NotJSON,
    ParsedCall,
    calls_of_sequence,
    partial_marker,
    skip_ws,
    value_end,
)

_ALPHANUMERIC = string.ascii_letters + string.digits


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    bot_token = "[TOOL_CALLS]"
    args_token = "[ARGS]"

    def adjust_request(self, request: Any) -> Any:
        # [TOOL_CALLS] is a control token: keep it in the text.
        if getattr(request, "tool_choice", None) != "none":
            request.skip_special_tokens = False
        return request

    def make_call_id(self) -> str:
        return "".join(random.choices(_ALPHANUMERIC, k=9))

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(self.bot_token)
        if first < 0:
            held = 0 if final else partial_marker(text, self.bot_token)
            return ParsedOutput(text[:len(text) - held])
        out = ParsedOutput(text[:first])
        rest = text[first + len(self.bot_token):]
        i = skip_ws(rest, 0)
        if i >= len(rest):
            if final:
                raise NotJSON("nothing after [TOOL_CALLS]")
            return out
        if rest[i] == "[":
            out.calls = calls_of_sequence(rest, i + 1, final, separators=",",
                                          closing="]")
            return out
        if rest[i] == "{":  # a single call object without the list
            out.calls = calls_of_sequence(rest, i, final, separators=",")
            return out
        for part in rest.split(self.bot_token):
            call = self._named_call(part, final)
            if call is None:
                break
            out.calls.append(call)
        return out

    def _named_call(self, part: str, final: bool) -> ParsedCall | None:
        """``name[ARGS]{...}`` (or ``name{...}``) -> the call so far."""
        marker = part.find(self.args_token)
        brace = part.find("{")
        if marker < 0 and brace < 0:
            if final:
                raise NotJSON("a [TOOL_CALLS] call without arguments")
            return None
        if marker >= 0 and (brace < 0 or marker < brace):
            name, args_at = part[:marker], marker + len(self.args_token)
        else:
            name, args_at = part[:brace], brace
        name = name.strip()
        if not name:
            raise NotJSON("a [TOOL_CALLS] call without a name")
        i = skip_ws(part, args_at)
        if i >= len(part):
            if final:
                raise NotJSON("a [TOOL_CALLS] call without arguments")
            return ParsedCall(name, "", False)
        end = value_end(part, i)
        if end is None:
            if final:
                raise NotJSON("a [TOOL_CALLS] call's arguments do not end")
            return ParsedCall(name, part[i:], False)
        args = part[i:end]
        if final:
            json.loads(args)
        return ParsedCall(name, args, True)
