"""Tool-call shapes of the OpenAI chat API (as vLLM names them): a call in a
message, a call's fragment in a stream delta, and what a tool parser extracted."""

from __future__ import annotations

import uuid

import msgspec


def make_tool_call_id() -> str:
    """vLLM's default id of a call (``chatcmpl-tool-`` and 32 hex digits)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class FunctionCall(msgspec.Struct):
    name: str
    # A JSON object as text, as OpenAI sends it.
    arguments: str


class ToolCall(msgspec.Struct):
    function: FunctionCall
    id: str = msgspec.field(default_factory=make_tool_call_id)
    type: str = "function"


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """One call's piece of a stream chunk: the first piece of a call has its id,
    type and name; later pieces only argument text (keyed by ``index``)."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class ExtractedToolCallInformation(msgspec.Struct):
    tools_called: bool
    tool_calls: list[ToolCall]
    # The text beside the calls (None when there is none).
    content: str | None = None
