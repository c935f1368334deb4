"""Tool parsers: each format's finished output, and its stream cut at every split
position (two and three chunks, and one character at a time) gives the same calls
and content as the finished output; no call text leaks into the content."""

from __future__ import annotations

import itertools
import json
import textwrap

import pytest

from enginecore.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"tz": "Europe/Paris", "fmt": "a \"quoted\" {brace} ]"}

# parser name -> [(model output, expected content, expected [(name, arguments dict)])]
CASES = {
    "hermes": [
        ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": '
         + json.dumps(WEATHER) + '}\n</tool_call>',
         "Let me check.", [("get_weather", WEATHER)]),
        ('<tool_call>{"name": "get_weather", "arguments": ' + json.dumps(WEATHER)
         + '}</tool_call>\n<tool_call>{"arguments": ' + json.dumps(TIME)
         + ', "name": "get_time"}</tool_call>',
         None, [("get_weather", WEATHER), ("get_time", TIME)]),
        ('<tool_call>{"name": "noop"}</tool_call>', None, [("noop", {})]),
        ("no calls here, a < b <tool", "no calls here, a < b <tool", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}", None,
         [("get_weather", WEATHER)]),
        ('<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(WEATHER)
         + '}; {"name": "get_time", "arguments": ' + json.dumps(TIME) + "}", None,
         [("get_weather", WEATHER), ("get_time", TIME)]),
        ("The weather is fine {really}.", "The weather is fine {really}.", []),
    ],
    "mistral": [
        ('Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": ' + json.dumps(WEATHER)
         + '}, {"name": "get_time", "arguments": ' + json.dumps(TIME) + "}]",
         "Sure. ", [("get_weather", WEATHER), ("get_time", TIME)]),
        ("[TOOL_CALLS]get_weather[ARGS]" + json.dumps(WEATHER) + "[TOOL_CALLS]get_time[ARGS]"
         + json.dumps(TIME), None, [("get_weather", WEATHER), ("get_time", TIME)]),
        ("Just text [TOOL", "Just text [TOOL", []),
    ],
    "pythonic": [
        (('[get_weather(city="Paris", unit="celsius"), get_time(tz=\'Europe/Paris\', '
          'fmt="a \\"quoted\\" {brace} ]")]'), None,
         [("get_weather", WEATHER), ("get_time", TIME)]),
        ("[ping()]", None, [("ping", {})]),
        ("Paris is sunny.", "Paris is sunny.", []),
    ],
}


def _cases():
    for name, cases in CASES.items():
        for i, case in enumerate(cases):
            yield pytest.param(name, *case, id=f"{name}-{i}")


def _parser(name: str) -> ToolParser:
    return ToolParserManager.get_tool_parser(name)(None)


def _stream(name: str, chunks: list[str]) -> tuple[str, list[dict]]:
    parser = _parser(name)
    content, calls = "", []
    text = ""

    def take(delta) -> None:
        nonlocal content
        if delta is None:
            return
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            if piece.index == len(calls):  # a new call: id, type and name come first
                assert piece.id and piece.type == "function" and piece.function.name
                calls.append({"id": piece.id, "name": piece.function.name,
                              "arguments": piece.function.arguments or ""})
            else:
                assert piece.index < len(calls) and piece.id is None
                assert piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments
    for chunk in chunks:
        previous, text = text, text + chunk
        take(parser.extract_tool_calls_streaming(previous, text, chunk, [], [], [], None))
    take(parser.finish_streaming(text, None))
    return content, calls


def _cuts(text: str):
    n = len(text)
    yield [text]
    yield list(text)
    for i in range(1, n):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(1, n), 2):
        yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("name,output,content,expected", list(_cases()))
def test_finished_and_streamed_outputs_agree(name, output, content, expected):
    info = _parser(name).extract_tool_calls(output, None)
    assert info.tools_called == bool(expected)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] \
        == expected
    assert info.content == (content if expected else output)
    assert all(c.type == "function" and c.id for c in info.tool_calls)
    finished = [(c.function.name, c.function.arguments) for c in info.tool_calls]
    for chunks in _cuts(output):
        got_content, calls = _stream(name, chunks)
        assert got_content == (info.content or ""), chunks
        assert [(c["name"], c["arguments"]) for c in calls] == finished, chunks


def test_hermes_arguments_keep_the_model_text():
    out = '<tool_call>{"name": "f", "arguments": {"a": [1, 2], "b": {"c": null}}}</tool_call>'
    call = _parser("hermes").extract_tool_calls(out, None).tool_calls[0]
    assert call.function.arguments == '{"a": [1, 2], "b": {"c": null}}'
    assert call.id.startswith("chatcmpl-tool-")


def test_malformed_calls_are_content():
    for name, out in [("hermes", "<tool_call>{not json}</tool_call>"),
                      ("llama3_json", '{"name": "f", "parameters": {"a": }'),
                      ("pythonic", "[f(1, 2)]"), ("mistral", "[TOOL_CALLS] [{oops")]:
        info = _parser(name).extract_tool_calls(out, None)
        assert not info.tools_called and info.content == out and info.tool_calls == []


def test_mistral_ids_are_nine_alphanumerics():
    out = '[TOOL_CALLS] [{"name": "f", "arguments": {}}]'
    call = _parser("mistral").extract_tool_calls(out, None).tool_calls[0]
    assert len(call.id) == 9 and call.id.isalnum()


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(KeyError, match="hermes"):
        ToolParserManager.get_tool_parser("nope")


def test_plugin_by_path_and_by_module(tmp_path, monkeypatch):
    plugin = tmp_path / "my_tool_plugin.py"
    plugin.write_text(textwrap.dedent("""
        from enginecore.entrypoints.openai.tool_parsers import ToolParserManager
        from enginecore.entrypoints.openai.tool_parsers.hermes_tool_parser import (
            Hermes2ProToolParser)

        @ToolParserManager.register_module("my_tags")
        class MyTags(Hermes2ProToolParser):
            tool_call_start_token = "<call>"
            tool_call_end_token = "</call>"
    """))
    ToolParserManager.import_tool_parser(str(plugin))
    info = ToolParserManager.get_tool_parser("my_tags")(None).extract_tool_calls(
        'x<call>{"name": "f", "arguments": {"a": 1}}</call>', None)
    assert info.content == "x" and info.tool_calls[0].function.arguments == '{"a": 1}'
    (tmp_path / "my_tool_module.py").write_text(plugin.read_text().replace("my_tags", "mod"))
    monkeypatch.syspath_prepend(str(tmp_path))
    ToolParserManager.import_tool_parser("my_tool_module")
    assert "mod" in ToolParserManager.tool_parsers
