"""Request and response bodies of the OpenAI-compatible server, as msgspec structs.

Requests are decoded (and type-checked) straight from the body bytes; fields a
real client sends that the server does not know are ignored (msgspec's default)
and named in the log (ignored_fields.py, as vLLM does),
so a newer client never breaks a request. Field names are OpenAI's, plus the
extra sampling fields vLLM's server accepts (top_k, min_p, repetition_penalty,
ignore_eos, min_tokens, structured_outputs, guided_*, ...), with vLLM's meaning.

Responses: every field a client reads is present (``null`` included), except
``usage`` on stream chunks, which is omitted unless asked for, as vLLM does.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

from enginecore.entrypoints.openai.tool_protocol import DeltaToolCall, ToolCall
from enginecore.outputs import Logprob

# -- shared pieces --------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    # vLLM: usage on every chunk, not only on the last one.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str = "response"
    description: str | None = None
    # "schema" is OpenAI's name for the JSON schema itself.
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``structured_outputs`` request field (exactly one constraint)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # Accepted for compatibility; llguidance is the only backend here.
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """The sampling fields common to /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # -- vLLM's extra sampling fields --
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = None
    return_tokens_as_token_ids: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's P/D field: what the KV connector needs (do_remote_decode, do_remote_prefill,
    # remote_engine_id, remote_block_ids, remote_host, remote_port); enginecore proxy.
    kv_transfer_params: dict[str, Any] | None = None


# -- requests -------------------------------------------------------------------------

# A prompt of /v1/completions: a string, a list of strings, a list of token ids or a
# list of token-id lists (msgspec allows one list type in a union; the element
# union is checked for consistency in serving_completion).
PromptInput = str | list[str | int | list[int]]


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: PromptInput
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    # A string, or OpenAI content parts ({"type": "text", "text": ...}).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # An assistant turn's calls and a tool turn's answer (the round trip).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    # -- vLLM's chat extras --
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: PromptInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's: None = the model's own setting.
    normalize: bool | None = None
    add_special_tokens: bool = True


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


# -- responses ------------------------------------------------------------------------


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogProbs(msgspec.Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogProbs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    # vLLM's: with prompt_logprobs, None for the first prompt token, then per position
    # {token id: {logprob, rank, decoded_token}}.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None
    object: str = "text_completion"
    # The KV connector's answer (a P/D producer's params for the decode server).
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(msgspec.Struct):
    role: str
    content: str | None
    tool_calls: list[ToolCall] = []
    reasoning_content: str | None = None  # --reasoning-parser: the model's thinking


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # The KV connector's answer (a P/D producer's params for the decode server).
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class CompletionStreamChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogProbs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    """``usage`` is left out unless asked for; so ``object`` has no default."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(msgspec.Struct, omit_defaults=True):
    """``usage`` is left out unless asked for; so ``object`` has no default."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
    object: str = "list"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    root: str
    parent: str | None
    max_model_len: int | None
    object: str = "model"
    owned_by: str = "enginecore"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


def now() -> int:
    return int(time.time())
