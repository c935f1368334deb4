"""Parsers for models that think between ``<think>`` and ``</think>``.

``deepseek_r1``: DeepSeek-R1's template ends the prompt with ``<think>``, so the
output starts inside the reasoning (an output with no ``</think>`` is all
reasoning: it ran out of tokens while thinking); a leading ``<think>`` is dropped.
``qwen3``: Qwen3 writes ``<think>`` itself unless the template already opened it
(Qwen3-Thinking-2507) or closed it (``enable_thinking: false`` renders an empty
``<think>\\n\\n</think>``); output without reasoning is all content.
"""

from __future__ import annotations

from typing import Any

from enginecore.reasoning.abs_reasoning_parsers import (
    ReasoningParser,
    ReasoningParserManager,
    ReasoningSplit,
)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ThinkTagReasoningParser(ReasoningParser):
    start_token = "<think>"
    end_token = "</think>"

    def __init__(self, tokenizer: Any = None, prompt: str | None = None) -> None:
        super().__init__(tokenizer, prompt)
        self.prompt_opened = self._prompt_state() == "open"
        self.prompt_closed = self._prompt_state() == "closed"

    def _prompt_state(self) -> str:
        """"open": the prompt ends inside a think block; "closed": it ended one
        after its last turn (thinking switched off); "none" otherwise."""
        start = self.prompt.rfind(self.start_token)
        end = self.prompt.rfind(self.end_token)
        if start < 0 and end < 0:
            return "none"
        if start > end:
            return "open"
        # a think block closed at the very end of the prompt (after the last turn)
        tail = self.prompt[end + len(self.end_token):]
        return "closed" if not tail.strip() else "none"

    def starts_in_reasoning(self) -> bool:
        return self.prompt_opened

    def parse(self, text: str, final: bool) -> ReasoningSplit:
        in_reasoning = self.starts_in_reasoning() and not self.prompt_closed
        body = text
        stripped = text.lstrip()
        if stripped.startswith(self.start_token):
            in_reasoning = True
            body = stripped[len(self.start_token):]
        elif not final and self.start_token.startswith(stripped):
            return ReasoningSplit("", "")  # may still become <think>
        if not in_reasoning:
            return ReasoningSplit("", text)
        reasoning, marker, content = body.partition(self.end_token)
        if marker:
            return ReasoningSplit(reasoning, content)
        if not final:
            body = body[: len(body) - _partial_suffix(body, self.end_token)]
        return ReasoningSplit(body, "")

    def is_reasoning_end(self, text: str) -> bool:
        split = self.parse(text, final=False)
        return self.end_token in text or (not split.reasoning and bool(split.content))

    def reasoning_required(self) -> bool:
        return self.starts_in_reasoning() and not self.prompt_closed

    def structured_output_prefix(self) -> str | None:
        if self.prompt_closed:
            return None
        body = f'/(?s:.*)/ "{self.end_token}"'
        # optional thinking opens with its start marker (so the answer alone is no thought)
        return body if self.reasoning_required() else f'"{self.start_token}" {body}'


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    def starts_in_reasoning(self) -> bool:
        return not self.prompt_closed


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ThinkTagReasoningParser):
    pass
