"""Pythonic calls (Llama 3.2 / 4, ToolACE): the output is a Python list of calls
with keyword arguments of literal values, ``[f(a=1), g(b="x")]`` (optionally
between ``<|python_start|>`` and ``<|python_end|>``). Arguments are sent as JSON
objects; a call's arguments are sent once the call's parenthesis closes."""

from __future__ import annotations

import ast
import json

from enginecore.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ToolParser,
    ToolParserManager,
)
from enginecore.entrypoints.openai.tool_parsers.json_scan import NotJSON, ParsedCall, skip_ws

_START, _END = "<|python_start|>", "<|python_end|>"


def _string_end(text: str, i: int) -> int | None:
    """Index after the Python string literal opening at ``text[i]`` (' or ")."""
    quote = text[i]
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == quote:
            return i + 1
        i += 1
    return None


def _item_end(text: str, i: int) -> int | None:
    """Index after the bracketed expression item that starts at ``text[i]``: the
    first ``,`` or ``]`` outside brackets and strings (None: not there yet)."""
    depth = 0
    while i < len(text):
        c = text[i]
        if c in "'\"":
            end = _string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                return i
            depth -= 1
        elif c == "," and depth == 0:
            return i
        i += 1
    return None


def _call_of(source: str) -> ParsedCall:
    node = ast.parse(source.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)):
        raise NotJSON("a list item is not a function call")
    if node.args:
        raise NotJSON("pythonic calls take keyword arguments only")
    args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    return ParsedCall(ast.unparse(node.func), json.dumps(args, ensure_ascii=False), True)


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        body = text
        i = skip_ws(body, 0)
        if body.startswith(_START, i):
            i = skip_ws(body, i + len(_START))
        elif not final and _START.startswith(body[i:]) and body[i:]:
            return ParsedOutput("")
        if i >= len(body):
            return ParsedOutput(text if final else "")
        if body[i] != "[":
            return ParsedOutput(text)
        if final:
            return ParsedOutput("", self._final_calls(body[i:]))
        calls = []
        i += 1
        while True:
            i = skip_ws(body, i)
            if i >= len(body) or body[i] == "]":
                return ParsedOutput("", calls)
            end = _item_end(body, i)
            if end is None:
                paren = body.find("(", i)
                name = body[i:paren].strip() if paren >= 0 else ""
                if name.isidentifier() or name.replace(".", "").isidentifier():
                    calls.append(ParsedCall(name, "", False))
                return ParsedOutput("", calls)
            calls.append(_call_of(body[i:end]))
            i = end + 1 if body[end] == "," else end

    @staticmethod
    def _final_calls(source: str) -> list[ParsedCall]:
        source = source.strip()
        if source.endswith(_END):
            source = source[:-len(_END)].rstrip()
        node = ast.parse(source, mode="eval").body
        if not isinstance(node, ast.List):
            raise NotJSON("the output is not a list of calls")
        return [_call_of(ast.unparse(item)) for item in node.elts]
