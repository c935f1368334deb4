"""Structured outputs that start after the reasoning: a request's constraint
(json / regex / choice / grammar) becomes a Lark grammar whose first part is the
parser's free reasoning up to its end marker (``/(?s:.*)/ "</think>"``, lazy so it
ends at the first marker) and whose second part is the constraint itself (as
llguidance's ``%json`` or a nested ``%lark`` grammar). The engine compiles it as
any other grammar; vLLM does the same job by not advancing the matcher until
``is_reasoning_end``."""

from __future__ import annotations

import json

import msgspec

from enginecore.reasoning.abs_reasoning_parsers import ReasoningParser
from enginecore.sampling_params import SamplingParams, StructuredOutputsParams

_FORMATS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _answer_rule(so: StructuredOutputsParams) -> str:
    from llguidance import grammar_from

    kind, text = so.key()
    try:
        inner = grammar_from(_FORMATS[kind], text)  # type: ignore[arg-type]
    except Exception as e:  # noqa: BLE001 - the request's constraint is bad: its 400
        raise ValueError(f"invalid {kind} constraint: {e}") from None
    if inner.lstrip().startswith("{"):
        grammars = json.loads(inner).get("grammars", [])
        if len(grammars) != 1:
            raise ValueError(f"the {kind} constraint cannot follow the reasoning")
        g = grammars[0]
        if g.get("json_schema") is not None:
            return "%json " + json.dumps(g["json_schema"])
        inner = g.get("lark_grammar") or ""
    return "%lark {\n" + inner + "\n}"


def after_reasoning(params: SamplingParams, parser: ReasoningParser) -> SamplingParams:
    """``params`` whose structured output constraint applies once the reasoning
    has ended (unchanged without a constraint, or when the prompt closed the
    reasoning already)."""
    so = params.structured_outputs
    prefix = parser.structured_output_prefix()
    if so is None or prefix is None:
        return params
    optional = "" if parser.reasoning_required() else "?"
    grammar = ("%llguidance {}\n"
               f"start: reasoning_{optional} answer_\n"
               f"reasoning_[lazy]: {prefix}\n"
               f"answer_: {_answer_rule(so)}\n")
    return msgspec.structs.replace(params,
                                   structured_outputs=StructuredOutputsParams(grammar=grammar))
