"""Sampling parameters of one request, validated on construction and on decode."""

from __future__ import annotations

import enum
import math
from typing import Annotated, Any

import msgspec

from enginecore.bounds import INT64_MAX, Int64, NonNegInt64, PositiveInt64, check_bounds, finite
from enginecore.errors import short_repr

_MAX_SEED = INT64_MAX
# More parallel samples than this is a mistake, not a request (OpenAI caps n at 128).
MAX_N = 128
# Below this temperature a request samples greedily (dividing logits by a tiny
# temperature overflows float32: NaN logits, token 0 forever). vLLM's _SAMPLING_EPS.
TEMPERATURE_FLOOR = 1e-5

# The bounds of each numeric field (msgspec enforces them on decode, check_bounds
# on construction): docs/protocol.md lists them.
Temperature = finite(ge=0.0)
Probability = finite(ge=0.0, le=1.0)
TopP = finite(gt=0.0, le=1.0)
TopK = Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)]
NumLogprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]
Penalty = finite(ge=-2.0, le=2.0)
RepetitionPenalty = finite(gt=0.0, le=10.0)
NumSamples = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
LogitBias = finite()
# -1: max_model_len (vLLM); 0 and below -1 are refused in __post_init__.
TruncatePromptTokens = Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)]


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

    json: str | dict[str, Any] | None = None
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
        for name, types in (("regex", str), ("grammar", str), ("json", (str, dict))):
            value = getattr(self, name)
            if value is not None and not isinstance(value, types):
                raise ValueError(f"StructuredOutputsParams.{name} must be "
                                 f"{'text or a dict' if name == 'json' else 'text'}, "
                                 f"got {type(value).__name__}")
        if self.choice is not None and not all(isinstance(c, str) for c in self.choice):
            raise ValueError("StructuredOutputsParams.choice must be a list of strings")
        if isinstance(self.json, dict):
            try:  # what the engine does with it (key()): fails here, not there
                self.key()
            except (TypeError, ValueError) as e:
                raise ValueError(f"StructuredOutputsParams.json is not a JSON schema object: "
                                 f"{e}") from None

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

    ``temperature`` below ``TEMPERATURE_FLOOR`` (1e-5; 0 included) means greedy.
    ``top_k`` of 0 or -1 disables top-k.
    ``logprobs=N`` returns the top-N logprobs (plus the sampled token's) at each
    sampled position; ``prompt_logprobs=N`` the same at each prompt position after
    the first (the request then skips the prefix cache: every prompt position is
    computed). ``logit_bias`` adds a bias to the logits of token ids;
    ``allowed_token_ids`` restricts sampling to those ids; ``bad_words_token_ids``
    (filled by the front-end from ``bad_words``) bans the last token of each
    sequence whose other tokens the output ends with. Invalid values raise
    ``ValueError`` naming the field.

    The last group of fields is the front-end's (``enginecore.frontend``); the
    engine carries them but never reads them: ``n`` parallel samples (child
    requests with seeds ``seed + i``), ``stop`` strings, ``include_stop_str_in_output``,
    ``skip_special_tokens``, ``spaces_between_special_tokens``, ``output_kind``.
    ``max_tokens=None`` means "up to the context limit"; the front-end's input
    processor resolves it to ``max_model_len - len(prompt)`` before sending.
    """

    max_tokens: PositiveInt64 | None = 16
    min_tokens: NonNegInt64 = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: Probability = 0.0
    seed: Int64 | None = None
    stop_token_ids: list[NonNegInt64] = []
    ignore_eos: bool = False
    logprobs: NumLogprobs | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: NumLogprobs | None = None
    logit_bias: dict[TokenId, LogitBias] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words_token_ids: list[list[TokenId]] | None = None
    # -- front-end fields (the engine ignores them) --
    n: NumSamples = 1
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    bad_words: list[str] | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    # vLLM's extra_args: extra arguments for plug-ins; "kv_transfer_params" is the
    # KV connector's (the engine request carries it).
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # The field annotations are the bounds (msgspec checks them on decode);
        # the same ones hold for a struct built in Python.
        check_bounds(self)
        if self.extra_args is not None and not (
                isinstance(self.extra_args, dict) and all(isinstance(k, str)
                                                          for k in self.extra_args)):
            raise ValueError("SamplingParams.extra_args must be a dict with str keys, "
                             f"got {self.extra_args!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens must be <= max_tokens "
                             f"({self.max_tokens}), got {self.min_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError("SamplingParams.structured_outputs must be StructuredOutputsParams, "
                             f"got {type(so).__name__}")

        def bad(field: str, value: object, must: str) -> ValueError:
            return ValueError(f"SamplingParams.{field} must be {must}, got {short_repr(value)}")

        self._validate_logits_fields(bad)
        self._validate_front_end_fields(bad)

    def _validate_logits_fields(self, bad) -> None:
        # Their numeric bounds are annotations (check_bounds; dict values below).
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise bad("logit_bias", bias, "a dict of token id -> bias")
            for tid, value in bias.items():
                if type(tid) is not int or tid < 0:
                    raise bad("logit_bias", bias, "keyed by token ids (ints >= 0)")
                if type(value) not in (int, float) or not math.isfinite(value):
                    raise bad("logit_bias", bias, "finite numbers as biases")
        allowed = self.allowed_token_ids
        if allowed is not None and not allowed:
            raise bad("allowed_token_ids", allowed, "a non-empty list (None allows all)")
        words = self.bad_words_token_ids
        if words is not None and not all(words):
            raise bad("bad_words_token_ids", words, "non-empty token id lists")

    def _validate_front_end_fields(self, bad) -> None:
        # n: its bounds are its annotation (check_bounds).
        if self.truncate_prompt_tokens == 0:
            raise bad("truncate_prompt_tokens", 0, "an int >= 1 or -1 (max_model_len)")
        if self.bad_words is not None and (
                not isinstance(self.bad_words, list)
                or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise bad("bad_words", self.bad_words, "a list of non-blank strs")
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
        return self.temperature < TEMPERATURE_FLOOR or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
