"""A choice's stream through a reasoning parser: each text delta in, the
reasoning and content deltas out (the difference of two parse states, so the
pieces always add up to the non-streamed split, whatever the split points)."""

from __future__ import annotations

from enginecore.reasoning.abs_reasoning_parsers import ReasoningParser


class ReasoningStream:
    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def delta(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) after ``text`` more was generated."""
        self.text += text
        split = self.parser.parse(self.text, final)
        reasoning = split.reasoning[self.sent_reasoning:]
        content = split.content[self.sent_content:]
        self.sent_reasoning = len(split.reasoning)
        self.sent_content = len(split.content)
        return reasoning, content
