"""Sampling parameters of one request, validated on construction and on decode."""

from __future__ import annotations

import enum

import msgspec

_MAX_SEED = 2**63 - 1
# More parallel samples than this is a mistake, not a request (OpenAI caps n at 128).
MAX_N = 128


class RequestOutputKind(enum.IntEnum):
    """What each ``RequestOutput`` of a stream carries (vLLM's names and values)."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request has finished


class StructuredOutputsParams(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True
):  # type: ignore[call-arg]
    """A constraint on the generated text; set exactly one field.

    ``json``: a JSON schema (as JSON text or a dict); ``regex``: a regular
    expression; ``choice``: the allowed strings; ``grammar``: a Lark or
    GBNF/EBNF grammar. Compiled with llguidance off the busy loop.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of json, regex, choice, "
                             f"grammar; got {given or 'none'}")
        if self.choice is not None and not self.choice:
            raise ValueError("StructuredOutputsParams.choice must not be empty")

    def key(self) -> tuple[str, str]:
        """(kind, text): the compile-cache key."""
        import json as _json

        if self.json is not None:
            text = self.json if isinstance(self.json, str) else _json.dumps(self.json,
                                                                           sort_keys=True)
            return "json", text
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", _json.dumps(self.choice)
        return "grammar", self.grammar or ""


class SamplingParams(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True
):  # type: ignore[call-arg]
    """What to sample and when to stop. Defaults sample up to 16 tokens.

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 disables top-k.
    ``logprobs=N`` returns the top-N logprobs (plus the sampled token's) at each
    sampled position. Invalid values raise ``ValueError`` naming the field.

    The last group of fields is the front-end's (``enginecore.frontend``); the
    engine carries them but never reads them: ``n`` parallel samples (child
    requests with seeds ``seed + i``), ``stop`` strings, ``include_stop_str_in_output``,
    ``skip_special_tokens``, ``spaces_between_special_tokens``, ``output_kind``.
    ``max_tokens=None`` means "up to the context limit"; the front-end's input
    processor resolves it to ``max_model_len - len(prompt)`` before sending.
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None
    # -- front-end fields (the engine ignores them) --
    n: int = 1
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        def bad(field: str, value: object, must: str) -> ValueError:
            return ValueError(f"SamplingParams.{field} must be {must}, got {value!r}")

        if self.max_tokens is not None and (
                not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "None or an int >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if not self.temperature >= 0.0:  # also catches NaN
            raise bad("temperature", self.temperature, ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", self.top_k, "-1, 0 (disabled) or a positive int")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.seed is not None and not (-_MAX_SEED <= self.seed <= _MAX_SEED):
            raise bad("seed", self.seed, "a 64-bit signed int")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of non-negative ints")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise bad("logprobs", self.logprobs, "None or an int in [0, 20]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", self.repetition_penalty, "in (0, 10]")
        self._validate_front_end_fields(bad)

    def _validate_front_end_fields(self, bad) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise bad("n", self.n, f"an int in [1, {MAX_N}]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s
                                                      for s in self.stop):
            raise bad("stop", self.stop, "a non-empty str or a list of non-empty strs")
        for name in ("include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "a bool")
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise bad("output_kind", self.output_kind,
                          "a RequestOutputKind (0 cumulative, 1 delta, 2 final only)") from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
