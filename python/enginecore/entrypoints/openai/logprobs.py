"""Logprobs in OpenAI's two shapes.

The front-end gives one ``{token_id: Logprob}`` dict per generated token: the
sampled token (with its rank in the vocabulary) and the top-N by rank, each
with its decoded text. /v1/completions wants parallel lists (tokens,
token_logprobs, top_logprobs as {text: logprob}, text_offset);
/v1/chat/completions wants one object per token with UTF-8 bytes and a ranked
top list. ``-inf`` (a token a constraint or top-k removed) is sent as -9999.0,
as vLLM does: JSON has no infinity.
"""

from __future__ import annotations

import math
from typing import Any

from enginecore.entrypoints.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogProbs,
    TopLogprob,
)

_FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if value > _FLOOR and not math.isnan(value) else _FLOOR


class TokenText:
    """A token's text for logprobs: the front-end's decoded text, or the
    ``token_id:N`` form when the client asked ``return_tokens_as_token_ids``."""

    def __init__(self, tokenizer: Any, as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def __call__(self, token_id: int, logprob: Any) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        text = getattr(logprob, "decoded_token", None)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _sampled_and_top(entry: dict[int, Any], token_id: int, num_top: int) -> tuple[Any, list]:
    sampled = entry.get(token_id)
    top = sorted(((tid, lp) for tid, lp in entry.items()
                  if lp.rank is not None and 1 <= lp.rank <= num_top),
                 key=lambda item: item[1].rank)
    return sampled, top


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Any]], num_top: int,
                        text_of: TokenText, offset: int) -> CompletionLogProbs:
    """/v1/completions logprobs of ``token_ids``; ``offset`` is where their text starts
    in the choice's text (the echoed prompt, earlier stream chunks)."""
    out = CompletionLogProbs([], [], [], [])
    for tid, entry in zip(token_ids, logprobs):
        sampled, top = _sampled_and_top(entry, tid, num_top)
        text = text_of(tid, sampled)
        out.tokens.append(text)
        out.token_logprobs.append(None if sampled is None else _finite(sampled.logprob))
        out.text_offset.append(offset)
        offset += len(text)
        out.top_logprobs.append({text_of(t, lp): _finite(lp.logprob) for t, lp in top}
                                if num_top else None)
    return out


def echo_logprobs(prompt_ids: list[int], prompt_logprobs: list[dict[int, Any] | None],
                  num_top: int, text_of: TokenText,
                  completion: CompletionLogProbs) -> CompletionLogProbs:
    """``echo`` with logprobs (vLLM): the prompt's tokens lead, the first with None
    for its logprob and top list; ``completion``'s offsets shift past them."""
    out = CompletionLogProbs([], [], [], [])
    offset = 0
    for tid, entry in zip(prompt_ids, prompt_logprobs):
        if entry is None:
            text = text_of(tid, None)
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(text)
            continue
        one = completion_logprobs([tid], [entry], num_top, text_of, offset)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(out, name).extend(getattr(one, name))
        offset += len(one.tokens[0])
    out.tokens.extend(completion.tokens)
    out.token_logprobs.extend(completion.token_logprobs)
    out.top_logprobs.extend(completion.top_logprobs)
    out.text_offset.extend(completion.text_offset)
    return out


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Any]], num_top: int,
                  text_of: TokenText) -> ChatLogprobs:
    content = []
    for tid, entry in zip(token_ids, logprobs):
        sampled, top = _sampled_and_top(entry, tid, num_top)
        text = text_of(tid, sampled)
        content.append(ChatTokenLogprob(
            token=text,
            logprob=_FLOOR if sampled is None else _finite(sampled.logprob),
            bytes=list(text.encode("utf-8", errors="replace")),
            top_logprobs=[TopLogprob(t_text, _finite(lp.logprob),
                                     list(t_text.encode("utf-8", errors="replace")))
                          for t_text, lp in ((text_of(t, lp), lp) for t, lp in top)],
        ))
    return ChatLogprobs(content)
