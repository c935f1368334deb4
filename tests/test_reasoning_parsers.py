"""Reasoning parsers: non-streamed splits as vLLM's, streamed splits identical at
every split point of the text, the registry and plug-ins, and structured outputs
that start after the reasoning (llguidance over a real tokenizer)."""

from __future__ import annotations

import json

import pytest

from enginecore.reasoning import ReasoningParserManager
from enginecore.reasoning.resolve import resolve_reasoning_parser
from enginecore.reasoning.streaming import ReasoningStream
from enginecore.reasoning.structured import after_reasoning
from enginecore.sampling_params import SamplingParams, StructuredOutputsParams

R1_PROMPT = "<｜User｜>hi<｜Assistant｜><think>\n"  # noqa: RUF001 - DeepSeek-R1's tokens use U+FF5C
QWEN_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
QWEN_NO_THINK = QWEN_PROMPT + "<think>\n\n</think>\n\n"

CASES = [  # (parser, prompt, output, reasoning, content)
    ("deepseek_r1", R1_PROMPT, "I should greet.</think>Hello!", "I should greet.", "Hello!"),
    ("deepseek_r1", R1_PROMPT, "<think>x < y</think>\n\nyes", "x < y", "\n\nyes"),
    ("deepseek_r1", R1_PROMPT, "still thinking </thi", "still thinking </thi", None),
    ("deepseek_r1", R1_PROMPT, "all done</think>", "all done", None),
    ("qwen3", QWEN_PROMPT, "<think>\nhmm\n</think>\n\nHi there", "\nhmm\n", "\n\nHi there"),
    ("qwen3", QWEN_PROMPT, "Hi there", None, "Hi there"),
    ("qwen3", QWEN_PROMPT, "<thinking is fun", None, "<thinking is fun"),
    ("qwen3", QWEN_NO_THINK, "Hi </think> there", None, "Hi </think> there"),
    ("qwen3", QWEN_PROMPT + "<think>\n", "deep</think>answer", "deep", "answer"),
    ("qwen3", QWEN_PROMPT, "<think>cut off", "cut off", None),
]


def _parser(name, prompt):
    return ReasoningParserManager.get_reasoning_parser(name)(None, prompt)


@pytest.mark.parametrize("name, prompt, output, reasoning, content", CASES)
def test_non_streamed_split(name, prompt, output, reasoning, content):
    assert _parser(name, prompt).extract_reasoning_content(output) == (reasoning, content)


def _streamed(parser, pieces):
    rs = ReasoningStream(parser)
    got_r, got_c = [], []
    for i, piece in enumerate(pieces):
        r, c = rs.delta(piece, final=i == len(pieces) - 1)
        got_r.append(r)
        got_c.append(c)
    return "".join(got_r), "".join(got_c)


@pytest.mark.parametrize("name, prompt, output, reasoning, content", CASES)
def test_every_split_point_streams_the_same(name, prompt, output, reasoning, content):
    want = (reasoning or "", content or "")
    for i in range(len(output) + 1):
        assert _streamed(_parser(name, prompt), [output[:i], output[i:]]) == want, i
        for j in range(i, len(output) + 1):
            pieces = [output[:i], output[i:j], output[j:]]
            assert _streamed(_parser(name, prompt), pieces) == want, (i, j)
    # one character at a time: no marker text ever leaks into either part
    rs = ReasoningStream(_parser(name, prompt))
    seen_r = seen_c = ""
    for k, ch in enumerate(output):
        r, c = rs.delta(ch, final=k == len(output) - 1)
        seen_r, seen_c = seen_r + r, seen_c + c
        assert want[0].startswith(seen_r) and want[1].startswith(seen_c)


def test_registry_and_plugins(tmp_path):
    assert {"deepseek_r1", "qwen3"} <= set(ReasoningParserManager.reasoning_parsers)
    with pytest.raises(KeyError, match="not found"):
        resolve_reasoning_parser("nope")
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from enginecore.reasoning import ReasoningParserManager, ThinkTagReasoningParser\n"
        "@ReasoningParserManager.register_module('bracket')\n"
        "class Bracket(ThinkTagReasoningParser):\n"
        "    start_token, end_token = '[[', ']]'\n")
    cls = resolve_reasoning_parser("bracket", str(plugin))
    assert cls(None, "").extract_reasoning_content("[[a]]b") == ("a", "b")


def _matcher_accepts(grammar: str, text: str, tokenizer_dir: str) -> bool:
    import llguidance
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
    lt = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=2)
    m = llguidance.LLMatcher(lt, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    ok = all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False).ids)
    return ok and m.is_accepting()


@pytest.mark.parametrize("constraint, good, bad", [
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}},
               "required": ["a"], "additionalProperties": False}}, '{"a": 1}', '{"a": "x"}'),
    ({"regex": "[0-9]{3}"}, "123", "12a"),
    ({"choice": ["yes", "no"]}, "no", "maybe"),
    ({"grammar": 'start: "x" NUM\nNUM: /[0-9]+/'}, "x42", "y42"),
])
def test_structured_outputs_start_after_the_reasoning(tiny_chat_model, constraint, good, bad):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    r1 = after_reasoning(params, _parser("deepseek_r1", R1_PROMPT))
    grammar = r1.structured_outputs.grammar
    thought = "let me think: {not json} </thin"
    assert _matcher_accepts(grammar, thought + "</think>" + good, tiny_chat_model)
    assert not _matcher_accepts(grammar, thought + "</think>" + bad, tiny_chat_model)
    assert not _matcher_accepts(grammar, good, tiny_chat_model)  # the thinking comes first
    # reasoning switched off by the template: the constraint as it was
    off = after_reasoning(params, _parser("qwen3", QWEN_NO_THINK))
    assert off.structured_outputs == params.structured_outputs
    # qwen3 may think or not
    q = after_reasoning(params, _parser("qwen3", QWEN_PROMPT)).structured_outputs.grammar
    assert _matcher_accepts(q, good, tiny_chat_model)
    assert _matcher_accepts(q, "<think>hm</think>" + good, tiny_chat_model)
    json.dumps(constraint)
