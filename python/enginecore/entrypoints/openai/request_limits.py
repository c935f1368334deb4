"""Per-request limits of the API server, and the CPU-heavy request work it does
off the event loop, so that no one request stalls every other stream.

- Prompt size: a text prompt (or the messages of a chat) over ``max_prompt_bytes``
  (``--max-prompt-bytes``; default 32 bytes per token of max_model_len, at least
  1 MiB) and a token-id prompt longer than the model can take are 400s before any
  tokenizing.
- Off the loop: tokenizing a long text (the tokenizer releases the GIL for those,
  model/tokenizer.py), rendering a chat, /tokenize, and compiling a structured-output
  constraint (llguidance releases the GIL) run in a small thread pool; the event
  loop only awaits them.
- Sequences in flight: ``--max-sequences-in-flight`` (prompts x n of every request
  admitted, default 16 x max-num-seqs x data-parallel-size) bounds admission even
  without ``--max-queued-requests`` (admission.py answers 429 at the bound).
- JSON bodies nested deeper than the decoder can follow are a 400 (serving_engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

# One worker pool for request CPU work (templates, tokenizing, grammar compiles).
from enginecore.entrypoints.openai.chat_templating import off_loop
from enginecore.entrypoints.openai.errors import APIError, bad_request, value_error

T = TypeVar("T")

MIN_MAX_PROMPT_BYTES = 1 << 20
PROMPT_BYTES_PER_TOKEN = 32
# Texts shorter than this are tokenized in place (microseconds; a thread hop costs more).
OFF_LOOP_CHARS = 16 * 1024
# How much longer than max_model_len a token-id prompt may be when it asks to be
# truncated (truncate_prompt_tokens): within reason, not without bound.
TRUNCATABLE_FACTOR = 8
SEQS_IN_FLIGHT_PER_SLOT = 16

def default_max_sequences_in_flight(max_num_seqs: int, data_parallel_size: int) -> int:
    return SEQS_IN_FLIGHT_PER_SLOT * max_num_seqs * data_parallel_size


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int | None
    max_prompt_bytes: int

    @classmethod
    def for_model(cls, max_model_len: int | None,
                  max_prompt_bytes: int | None = None) -> RequestLimits:
        if max_prompt_bytes is None:
            max_prompt_bytes = max(MIN_MAX_PROMPT_BYTES,
                                   PROMPT_BYTES_PER_TOKEN * (max_model_len or 0))
        return cls(max_model_len, max_prompt_bytes)

    def check_text(self, size: int, what: str, param: str) -> None:
        """``size``: the text's length in characters (UTF-8 bytes at least as many)."""
        if size > self.max_prompt_bytes:
            raise bad_request(f"{what} is {size} characters or more; at most "
                              f"{self.max_prompt_bytes} bytes are accepted "
                              "(--max-prompt-bytes)", param)

    def check_token_ids(self, ids: list[Any], truncate: int | None, param: str) -> None:
        if self.max_model_len is None:
            return
        limit = self.max_model_len * (TRUNCATABLE_FACTOR if truncate is not None else 1)
        if len(ids) > limit:
            raise bad_request(f"the prompt has {len(ids)} tokens; at most {limit} are "
                              f"accepted (max_model_len {self.max_model_len})", param)


def messages_size(messages: list[Any]) -> int:
    """Characters of text in chat messages (content strings and text parts)."""
    size = 0
    for m in messages:
        content = m.content
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if isinstance(text, str):
                    size += len(text)
    return size


async def prepare_prompts(serving: Any, prompts: list[Any], add_special_tokens: bool,
                          truncate: int | None, param: str) -> list[Any]:
    """The engine prompts of a completion/embedding request, within the limits;
    long texts are tokenized off the loop."""
    limits: RequestLimits = serving.ctx.limits
    total = 0
    for p in prompts:
        if isinstance(p, str):
            total += len(p)
        else:
            limits.check_token_ids(p, truncate, param)
    limits.check_text(total, "the prompt text", param)
    if total <= OFF_LOOP_CHARS:
        return [serving.engine_prompt(p, add_special_tokens) for p in prompts]
    tokenizer = serving.require_tokenizer()

    def encode_all() -> list[Any]:
        return [{"prompt": p, "prompt_token_ids": tokenizer.encode(
            p, add_special_tokens=add_special_tokens)} if isinstance(p, str)
            else serving.engine_prompt(p, add_special_tokens) for p in prompts]

    return await off_loop(encode_all)


async def precompile_structured(input_processor: Any, params: Any) -> None:
    """Compile a request's constraint off the loop (the front-end then finds it
    checked); a constraint that does not compile is a 400."""
    if getattr(params, "structured_outputs", None) is None:
        return
    check = getattr(input_processor, "check_structured", None)
    if check is None:
        return
    try:
        await off_loop(check, params)
    except (ValueError, TypeError) as e:
        raise value_error(e) from None


def too_deep() -> APIError:
    return bad_request("the request body nests JSON arrays/objects too deeply")
