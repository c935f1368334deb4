"""Tool calling for /v1/chat/completions: vLLM's flags, OpenAI's request fields.

- ``tools`` are checked up front (a 400 naming the tool: not a function, no name,
  duplicate names, parameters that are not an object JSON schema);
- ``tool_choice`` ``"none"`` | ``"auto"`` | ``"required"`` | ``{"type": "function",
  "function": {"name": ...}}`` (the default is ``"auto"`` when there are tools);
- ``"required"`` and a named function are decoded under a JSON schema built from
  the tools (the engine's structured outputs), so the arguments always parse and
  match their schema on any model: a named call's output *is* its arguments
  object; ``"required"`` outputs ``[{"name": ..., "parameters": {...}}, ...]``;
- ``"auto"`` needs ``--enable-auto-tool-choice --tool-call-parser NAME`` and reads
  the model's own call syntax with that parser (tool_parsers/).

Each mode is a ``ToolParser`` for the response side, so the non-streamed message
and the streamed deltas come from one code path.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass
from typing import Any

from enginecore.entrypoints.openai.errors import bad_request
from enginecore.entrypoints.openai.protocol import DeltaMessage
from enginecore.entrypoints.openai.tool_parsers import ParsedOutput, ToolParser, ToolParserManager
from enginecore.entrypoints.openai.tool_parsers.json_scan import (
    NotJSON,
    ParsedCall,
    calls_of_sequence,
    skip_ws,
)
from enginecore.entrypoints.openai.tool_protocol import ToolCall
from enginecore.sampling_params import StructuredOutputsParams

_AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                     "--tool-call-parser to be set")
_EMPTY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}
# Forced calls in one compact spelling: a weak model cannot pad them with
# whitespace until max_tokens (and the streamed text stays what was parsed).
_COMPACT = {"whitespace_flexible": False}


def add_tool_args(group: argparse._ArgumentGroup) -> None:
    """vLLM's tool-calling flags of ``serve``."""
    group.add_argument("--enable-auto-tool-choice", action="store_true", default=False,
                       help='allow tool_choice "auto" (needs --tool-call-parser)')
    group.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="how the model writes tool calls: hermes, llama3_json, mistral, "
                            "pythonic, or a name a --tool-parser-plugin registers "
                            "(default: none)")
    group.add_argument("--tool-parser-plugin", default=None, metavar="PATH_OR_MODULE",
                       help="a .py file or module that registers tool parsers with "
                            "@ToolParserManager.register_module (default: none)")


@dataclass(frozen=True)
class ToolCallConfig:
    enable_auto_tool_choice: bool = False
    parser_cls: type[ToolParser] | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ToolCallConfig:
        """The server's tool settings (ValueError for flags that do not fit)."""
        plugin = getattr(args, "tool_parser_plugin", None)
        name = getattr(args, "tool_call_parser", None)
        enable = bool(getattr(args, "enable_auto_tool_choice", False))
        if plugin:
            try:
                ToolParserManager.import_tool_parser(plugin)
            except Exception as e:  # noqa: BLE001 - any import failure is the flag's
                raise ValueError(f"--tool-parser-plugin {plugin!r} failed to import: "
                                 f"{type(e).__name__}: {e}") from None
        if enable and not name:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        parser_cls = None
        if name:
            try:
                parser_cls = ToolParserManager.get_tool_parser(name)
            except KeyError as e:
                raise ValueError(f"--tool-call-parser: {e.args[0]}") from None
        return cls(enable, parser_cls)


# -- the request side ---------------------------------------------------------------------

def check_tools(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """Name -> parameters schema of each tool, or a 400 naming what is wrong."""
    from jsonschema import SchemaError, validators

    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f'{where} must be {{"type": "function", "function": {{...}}}}',
                              "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function must be an object with a name", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}.function.name must be a non-empty string", "tools")
        if name in out:
            raise bad_request(f"{where}: the function name {name[:64]!r} is given twice",
                              "tools")
        params = fn.get("parameters")
        if params is None:
            params = _EMPTY_OBJECT_SCHEMA
        if not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters ({name[:64]!r}) must be a JSON "
                              f"schema object, got {type(params).__name__}", "tools")
        if params.get("type", "object") != "object":
            raise bad_request(f"{where}.function.parameters ({name[:64]!r}) must be a schema "
                              f"of type 'object', got {str(params.get('type'))[:32]!r}",
                              "tools")
        try:
            validators.validator_for(params).check_schema(params)
        except SchemaError as e:
            raise bad_request(f"{where}.function.parameters ({name[:64]!r}) is not a valid "
                              f"JSON schema: {str(e.message)[:200]}", "tools") from None
        except RecursionError:  # jsonschema recurses once per level of the schema
            raise bad_request(f"{where}.function.parameters ({name[:64]!r}) nests too deeply "
                              "to check", "tools") from None
        out[name] = params
    return out


@dataclass
class ToolPlan:
    """How one request's tools are used: ``mode`` none / auto / required / named."""

    mode: str
    name: str | None = None
    structured: StructuredOutputsParams | None = None
    parser_cls: type[ToolParser] | None = None
    parallel: bool = True

    def parser(self, tokenizer: Any) -> ToolParser | None:
        """A fresh parser for one choice (None: the output is plain content)."""
        if self.mode == "named":
            return NamedFunctionParser(self.name or "")
        if self.mode == "required":
            return RequiredToolsParser(tokenizer)
        if self.mode == "auto" and self.parser_cls is not None:
            return self.parser_cls(tokenizer)
        return None


def plan_tools(req: Any, config: ToolCallConfig) -> ToolPlan:
    """The request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (400s)."""
    tools = req.tools or []
    choice = req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if choice is None:
        choice = "auto" if tools else "none"
    schemas = check_tools(tools) if tools else {}
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")
        if name not in schemas:
            raise bad_request(f"tool_choice names the function {name[:64]!r}, which is not "
                              "in tools", "tool_choice")
        schema = {**closed_objects(schemas[name]), "x-guidance": _COMPACT}
        return ToolPlan("named", name, StructuredOutputsParams(json=schema), parallel=parallel)
    if choice not in ("none", "auto", "required"):
        raise bad_request(f'tool_choice must be "none", "auto", "required" or a named '
                          f"function, got {str(choice)[:32]!r}", "tool_choice")
    if choice == "none":
        return ToolPlan("none")
    if not tools:
        raise bad_request(f'tool_choice "{choice}" needs tools', "tool_choice")
    if choice == "auto":
        if not config.enable_auto_tool_choice or config.parser_cls is None:
            raise bad_request(_AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolPlan("auto", parser_cls=config.parser_cls, parallel=parallel)
    return ToolPlan("required", structured=StructuredOutputsParams(
        json=required_schema(schemas, parallel)), parallel=parallel)


def required_schema(schemas: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON list of one or more calls, each ``{"name": <a tool>, "parameters":
    <its schema>}`` (vLLM's shape; at most one call without parallel_tool_calls)."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]},
                             "parameters": closed_objects(params)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, params in schemas.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items},
                              "x-guidance": _COMPACT}
    if not parallel:
        schema["maxItems"] = 1
    return schema


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` whose objects allow no properties beyond those they
    name, where the schema leaves that open: a weak model under an open object can
    add keys until max_tokens; what it writes still matches the original schema."""
    if not isinstance(schema, dict):
        return copy.deepcopy(schema)
    out = {k: closed_objects(v) if k in ("items", "additionalProperties", "not") else
           copy.deepcopy(v) for k, v in schema.items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [closed_objects(s) for s in schema[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {k: closed_objects(s) for k, s in schema[key].items()}
    if (schema.get("type") == "object" or "properties" in schema) and \
            "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


def template_message(m: Any) -> dict[str, Any]:
    """A request message as the chat template reads it: an assistant turn's
    ``tool_calls`` with their arguments as objects (templates write them with
    ``tojson``), a tool turn's ``tool_call_id``."""
    content = m.content
    if content is None and m.role == "assistant":
        content = ""  # a turn of only tool calls (templates concatenate content)
    msg: dict[str, Any] = {"role": m.role, "content": content}
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad_request("an assistant message's tool_calls need "
                                  '{"function": {"name", "arguments"}}', "messages")
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    pass  # a template may print text as it is
            calls.append({**call, "function": {**fn, "arguments": args}})
        msg["tool_calls"] = calls
    return msg


# -- the response side: the forced modes as parsers ----------------------------------------

class NamedFunctionParser(ToolParser):
    """tool_choice names a function: the whole output is that call's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__(None)
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        args = text.lstrip()
        if final:
            json.loads(args)
        return ParsedOutput("", [ParsedCall(self.name, args, final)])


class RequiredToolsParser(ToolParser):
    """tool_choice "required": the output is the JSON list ``required_schema`` makes."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        if i >= len(text):
            if final:
                raise NotJSON("no calls")
            return ParsedOutput("")
        if text[i] != "[":
            raise NotJSON("the output is not a list of calls")
        return ParsedOutput("", calls_of_sequence(text, i + 1, final, separators=",",
                                                  closing="]"))


def tool_message(plan: ToolPlan, parser: ToolParser | None, text: str, request: Any,
                 finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
    """(content, tool calls, finish reason) of a finished choice."""
    if parser is None:
        return text, [], finish_reason
    info = parser.extract_tool_calls(text, request)
    if not info.tools_called:
        return info.content, [], finish_reason
    calls = info.tool_calls if plan.parallel else info.tool_calls[:1]
    return info.content, calls, "tool_calls" if finish_reason == "stop" else finish_reason


class ToolStream:
    """One choice's stream through its parser: text deltas in, the delta message
    to send out (content held back while it may start a call, call pieces)."""

    def __init__(self, plan: ToolPlan, parser: ToolParser, request: Any) -> None:
        self.plan = plan
        self.parser = parser
        self.request = request
        self.text = ""
        self.called = False

    def delta(self, text: str, finished: bool) -> DeltaMessage | None:
        previous, self.text = self.text, self.text + text
        if finished:
            out = self.parser.finish_streaming(self.text, self.request)
        else:
            out = self.parser.extract_tool_calls_streaming(
                previous, self.text, text, [], [], [], self.request)
        if out is not None and out.tool_calls and not self.plan.parallel:
            out.tool_calls = [c for c in out.tool_calls if c.index == 0] or None
            if out.content is None and out.tool_calls is None:
                return None
        if out is not None and out.tool_calls:
            self.called = True
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.called and reason == "stop" else reason
