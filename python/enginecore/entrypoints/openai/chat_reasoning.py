"""``--reasoning-parser`` on the server: flags, and the per-request pieces
serving_chat uses (the split of a finished choice, a streamed choice's splitter,
structured outputs that start after the reasoning)."""

from __future__ import annotations

import argparse
from typing import Any

from enginecore.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager
from enginecore.reasoning.resolve import resolve_reasoning_parser
from enginecore.reasoning.streaming import ReasoningStream
from enginecore.reasoning.structured import after_reasoning
from enginecore.sampling_params import SamplingParams


def add_reasoning_args(group: Any) -> None:
    import enginecore.reasoning.think_parsers  # noqa: F401 - the built-in names

    names = ", ".join(sorted(ReasoningParserManager.reasoning_parsers))
    group.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help=f"split reasoning models' thinking into reasoning_content: {names}, "
                            "or a name a --reasoning-parser-plugin registers (default: none)")
    group.add_argument("--reasoning-parser-plugin", default=None, metavar="PATH_OR_MODULE",
                       help="a .py file or module that registers reasoning parsers with "
                            "@ReasoningParserManager.register_module (default: none)")


def configure_reasoning(ctx: Any, args: argparse.Namespace) -> None:
    """The parser class onto the server context (a bad name is the user's error)."""
    from enginecore.entrypoints.cli_common import UserError

    try:
        ctx.reasoning_parser_cls = resolve_reasoning_parser(
            getattr(args, "reasoning_parser", None), getattr(args, "reasoning_parser_plugin", None))
    except (KeyError, ImportError, OSError) as e:
        raise UserError(str(e).strip("'\"")) from None


class RequestReasoning:
    """One request's reasoning handling (None where the server has no parser)."""

    def __init__(self, parser_cls: Any, tokenizer: Any, prompt: str) -> None:
        self.parser_cls = parser_cls
        self.tokenizer = tokenizer
        self.prompt = prompt

    @classmethod
    def of(cls, ctx: Any, tokenizer: Any, prompt: dict[str, Any]) -> RequestReasoning | None:
        parser_cls = getattr(ctx, "reasoning_parser_cls", None)
        if parser_cls is None:
            return None
        return cls(parser_cls, tokenizer, prompt.get("prompt") or "")

    def parser(self) -> ReasoningParser:
        return self.parser_cls(self.tokenizer, self.prompt)

    def constrain(self, params: SamplingParams) -> SamplingParams:
        try:
            return after_reasoning(params, self.parser())
        except ValueError as e:
            from enginecore.entrypoints.openai.errors import bad_request

            raise bad_request(str(e), "response_format") from None

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a finished choice's text."""
        reasoning, content = self.parser().extract_reasoning_content(text)
        return reasoning, content or ""

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.parser())
