"""Structured outputs with llguidance: compile a request's constraint into a
matcher (off the busy loop, with a compile cache), give the scheduler a token
bitmask per step, and advance the matcher with each accepted token."""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from enginecore.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class StructuredOutputError(ValueError):
    """The constraint does not compile (bad schema, regex or grammar)."""


class StructuredOutputManager:
    def __init__(self, tokenizer_json_path: str | None, vocab_size: int,
                 eos_token_id: int | None) -> None:
        self.tokenizer_json_path = tokenizer_json_path
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
        """A fresh matcher for one request; raises StructuredOutputError."""
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer(), self._grammar(params), log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(f"invalid {params.key()[0]} constraint: "
                                        f"{matcher.get_error()}")
        return matcher

    def bitmask(self, matcher: Any) -> np.ndarray:
        """Allowed next tokens, one bit per token id (int32 words)."""
        import llguidance.numpy as lnp

        mask = np.full((1, self.words), -1, dtype=np.int32)
        lnp.fill_next_token_bitmask(matcher, mask, 0)
        return mask[0]

    @staticmethod
    def accept(matcher: Any, token_ids: list[int]) -> bool:
        return matcher.consume_tokens(token_ids)
