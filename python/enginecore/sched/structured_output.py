"""Structured outputs with llguidance: compile a request's constraint into a
matcher (off the busy loop, with a compile cache), give the scheduler a token
bitmask per step, and advance the matcher with each accepted token."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from enginecore.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class StructuredOutputError(ValueError):
    """The constraint does not compile (bad schema, regex or grammar)."""


# Compilation limits (llguidance's ParserLimits, tighter than its defaults where a
# hostile constraint could otherwise tie up the input thread or memory); the
# per-step cost of a mask is bounded by StructuredOutputsConfig.mask_budget_ms.
MAX_CONSTRAINT_CHARS = 256 * 1024
PARSER_LIMITS = dict(
    initial_lexer_fuel=1_000_000,  # regex ASTs at compile time (~20 ms)
    step_lexer_fuel=200_000,  # one mask's lexer work (~15 ms)
    step_max_items=50_000,  # Earley items per mask step
    max_lexer_states=50_000,  # ~1-2 kB each: ~100 MB at most
    max_grammar_size=200_000,  # grammar symbols
    max_items_in_row=2_000,
)


class StructuredOutputManager:
    def __init__(self, tokenizer_json_path: str | None, vocab_size: int,
                 eos_token_id: int | None, mask_budget_ms: float = 10.0) -> None:
        self.tokenizer_json_path = tokenizer_json_path
        self.mask_budget_s = mask_budget_ms / 1e3
        self._limits: Any = None
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._grammars: dict[tuple[str, str], str] = {}  # compile cache
        self.words = (vocab_size + 31) // 32

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                if self.tokenizer_json_path is None:
                    raise StructuredOutputError("this model has no tokenizer: structured "
                                                "outputs need one")
                import llguidance
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(self.tokenizer_json_path)
                tok.no_padding()
                tok.no_truncation()
                self._ll_tokenizer = llguidance.LLTokenizer(
                    tok.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_id)
            return self._ll_tokenizer

    def _grammar(self, params: StructuredOutputsParams) -> str:
        key = params.key()
        with self._lock:
            cached = self._grammars.get(key)
        if cached is not None:
            return cached
        from llguidance import grammar_from

        kind, text = key
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise StructuredOutputError(f"the {kind} constraint is {len(text)} characters; at "
                                        f"most {MAX_CONSTRAINT_CHARS} are accepted")
        fmt = {"json": "json_schema", "regex": "regex", "choice": "choice",
               "grammar": "grammar"}[kind]
        try:
            grammar = grammar_from(fmt, text)  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - any compile error belongs to this request
            raise StructuredOutputError(f"invalid {kind} constraint: {e}") from None
        with self._lock:
            self._grammars[key] = grammar
        return grammar

    def compile(self, params: StructuredOutputsParams) -> Any:
        """A fresh matcher for one request, within the compile limits and whose first
        mask fits the per-step budget (computed here, off the busy loop); raises
        StructuredOutputError."""
        import llguidance

        if self._limits is None:
            self._limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        kind = params.key()[0]
        matcher = llguidance.LLMatcher(self._tokenizer(), self._grammar(params), log_level=0,
                                       limits=self._limits)
        if matcher.is_error():
            raise StructuredOutputError(f"invalid {kind} constraint: {matcher.get_error()}")
        _, error = self.bitmask_within_budget(matcher)
        if error is not None:
            raise StructuredOutputError(f"{kind} constraint refused: {error}")
        return matcher

    def bitmask(self, matcher: Any) -> np.ndarray:
        """Allowed next tokens, one bit per token id (int32 words)."""
        import llguidance.numpy as lnp

        mask = np.full((1, self.words), -1, dtype=np.int32)
        lnp.fill_next_token_bitmask(matcher, mask, 0)
        return mask[0]

    def bitmask_within_budget(self, matcher: Any) -> tuple[np.ndarray, str | None]:
        """(mask, None), or (all tokens allowed, why) when the matcher is in error or
        the mask took more CPU time than the budget (thread CPU time: a busy machine
        does not make a good constraint fail)."""
        t0 = time.thread_time()
        mask = self.bitmask(matcher)
        spent = time.thread_time() - t0
        if matcher.is_error():
            return np.full(self.words, -1, dtype=np.int32), (
                f"the constraint failed: {matcher.get_error()}")
        if spent > self.mask_budget_s:
            return np.full(self.words, -1, dtype=np.int32), (
                f"its token mask took {spent * 1e3:.1f} ms of CPU, over the per-step budget of "
                f"{self.mask_budget_s * 1e3:g} ms (structured_outputs_mask_budget_ms)")
        return mask, None

    @staticmethod
    def accept(matcher: Any, token_ids: list[int]) -> bool:
        return matcher.consume_tokens(token_ids)
