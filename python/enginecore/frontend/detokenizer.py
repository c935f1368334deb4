"""Incremental detokenization: O(1) work per generated token.

Two ways, chosen once per tokenizer:

- ``ByteLevelDetokenizer`` (tokenizers whose decoder is ``ByteLevel``: GPT-2,
  Llama 3, Qwen, SmolLM, ...). Decoding there is "map every token to its bytes,
  concatenate, UTF-8 with replacement". So each token id is turned into its bytes
  once per tokenizer (a table), and a stream only appends a token's bytes to an
  incremental UTF-8 decoder, which holds back an incomplete character until its
  last byte arrives. The text is exactly ``tokenizer.decode(ids)``.
- ``WindowDetokenizer`` (any other decoder: SentencePiece/Metaspace, WordPiece):
  vLLM's prefix/read-offset scheme. Only a short window of recent tokens is
  decoded per token; text is released when it grew and does not end in an
  incomplete character (U+FFFD). The window starts with a few prompt tokens so the
  first generated token decodes in context (e.g. keeps its leading space).

Both have ``decode(new_ids) -> str`` (text that became complete) and
``flush() -> str`` (what is still held, at the end of the stream).
"""

from __future__ import annotations

import codecs
import weakref
from typing import Any

from tokenizers import decoders

_utf8_decoder = codecs.getincrementaldecoder("utf-8")
# Prompt tokens that give the first generated token its context (WindowDetokenizer).
_PROMPT_CONTEXT = 5


def _byte_level_char_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes -> printable characters map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class ByteLevelDetokenizer:
    __slots__ = ("table", "utf8")

    def __init__(self, table: list[bytes]) -> None:
        self.table = table
        self.utf8 = _utf8_decoder("replace")

    def decode(self, new_ids: list[int]) -> str:
        table = self.table
        n = len(table)
        if len(new_ids) == 1:
            t = new_ids[0]
            return self.utf8.decode(table[t] if 0 <= t < n else b"")
        return self.utf8.decode(b"".join([table[t] if 0 <= t < n else b"" for t in new_ids]))

    def flush(self) -> str:
        return self.utf8.decode(b"", True)


class WindowDetokenizer:
    __slots__ = ("tok", "skip", "ids", "prefix_offset", "read_offset", "prefix_text")

    def __init__(self, tok: Any, skip_special_tokens: bool, context: list[int]) -> None:
        self.tok = tok
        self.skip = skip_special_tokens
        self.ids = list(context)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.prefix_text = tok.decode(self.ids, skip_special_tokens=skip_special_tokens)

    def decode(self, new_ids: list[int]) -> str:
        out = []
        ids = self.ids
        for t in new_ids:
            ids.append(t)
            text = self.tok.decode(ids[self.prefix_offset:], skip_special_tokens=self.skip)
            if len(text) > len(self.prefix_text) and not text.endswith("\ufffd"):
                out.append(text[len(self.prefix_text):])
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
                self.prefix_text = self.tok.decode(ids[self.prefix_offset:self.read_offset],
                                                   skip_special_tokens=self.skip)
        return "".join(out)

    def flush(self) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        text = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        self.read_offset = len(self.ids)
        return text[len(self.prefix_text):] if len(text) > len(self.prefix_text) else ""


class DetokenizerFactory:
    """Per tokenizer: which detokenizer streams get, its byte tables, and the
    decoded text of single tokens (logprobs). ``for_tokenizer`` shares one per
    tokenizer object (the tables take ~0.1 s to build for a 50k vocabulary)."""

    _shared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> DetokenizerFactory:
        factory = cls._shared.get(tokenizer)
        if factory is None:
            factory = cls._shared[tokenizer] = cls(tokenizer)
        return factory

    def __init__(self, tokenizer: Any) -> None:
        # ``tokenizer``: enginecore.model.tokenizer.Tokenizer (or a tokenizers.Tokenizer).
        self.hf = getattr(tokenizer, "_tok", tokenizer)
        self.byte_level = isinstance(self.hf.decoder, decoders.ByteLevel)
        self._tables: dict[bool, list[bytes]] = {}
        self._token_text: dict[int, str] = {}

    def new(self, skip_special_tokens: bool, prompt_token_ids: list[int]
            ) -> ByteLevelDetokenizer | WindowDetokenizer:
        if self.byte_level:
            return ByteLevelDetokenizer(self.table(skip_special_tokens))
        return WindowDetokenizer(self.hf, skip_special_tokens,
                                 prompt_token_ids[-_PROMPT_CONTEXT:])

    def table(self, skip_special_tokens: bool) -> list[bytes]:
        """Each token id's bytes as the ByteLevel decoder produces them: a token's
        characters mapped back to bytes, or, if any character is outside the map
        (an added token such as "▁x"), the token's own UTF-8."""
        table = self._tables.get(skip_special_tokens)
        if table is None:
            char_to_byte = _byte_level_char_to_byte()
            special = {i for i, t in self.hf.get_added_tokens_decoder().items() if t.special}
            table = []
            for i in range(self.hf.get_vocab_size(with_added_tokens=True)):
                token = self.hf.id_to_token(i)
                if token is None or (skip_special_tokens and i in special):
                    table.append(b"")
                    continue
                try:
                    table.append(bytes([char_to_byte[c] for c in token]))
                except KeyError:
                    table.append(token.encode("utf-8"))
            self._tables[skip_special_tokens] = table
        return table

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (special tokens kept): logprobs' decoded_token."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.hf.decode([token_id],
                                                              skip_special_tokens=False)
        return text
