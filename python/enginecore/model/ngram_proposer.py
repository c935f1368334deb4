"""N-gram (prompt lookup) draft proposer for speculative decoding.

For a sequence, take its last n tokens (n from ``max_n`` down to ``min_n``),
find the most recent earlier occurrence of that n-gram, and propose the up to
``k`` tokens that followed it. No model, no state: cheap on repetitive text
(code, lists, quotes of the prompt). The search runs in C (``bytes.rfind``
over the uint32 encoding), not a Python loop per token.
"""

from __future__ import annotations

from array import array


class NgramProposer:
    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k = k
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: list[int], limit: int | None = None) -> list[int]:
        """Draft tokens to follow ``tokens`` (at most ``min(k, limit)``)."""
        k = self.k if limit is None else min(self.k, limit)
        L = len(tokens)
        if k <= 0 or L < self.min_n + 1:
            return []
        data = array("I", tokens).tobytes()
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            tail = data[4 * (L - n):]
            end = 4 * (L - 1)  # an earlier occurrence ends before the last token
            while True:
                off = data.rfind(tail, 0, end)
                if off < 0:
                    break
                if off % 4 == 0:
                    start = off // 4 + n
                    return tokens[start : start + k]
                end = off + len(tail) - 1
        return []
