"""What every endpoint of the server shares: the engine, the model names, body
decoding, admission, and running a generation so that a client that goes away
is aborted in the engine at once.

A handler awaits the engine through ``until_disconnect``: the await races the
ASGI ``http.disconnect`` message, and when the client wins the generation is
cancelled, which makes the front-end abort the request in the engine (the
interface's rule: a closed generator is an aborted request). Streams are
watched by the streaming response itself (see streaming.py).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request

from enginecore.entrypoints.openai.admission import Admission
from enginecore.entrypoints.openai.errors import APIError, validation_error, value_error
from enginecore.entrypoints.openai.ignored_fields import log_ignored_fields
from enginecore.entrypoints.openai.request_limits import RequestLimits, too_deep
from enginecore.entrypoints.openai.serving_models import ServingModels
from enginecore.entrypoints.openai.tool_calls import ToolCallConfig
from enginecore.errors import EngineDeadError

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The largest request body accepted (413 beyond): a 128k-token prompt as token
# ids is ~1 MiB of JSON; embeddings batches are the big ones.
DEFAULT_MAX_BODY_BYTES = 32 << 20


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class ServerContext:
    """Per-process server state handed to every endpoint."""

    trust_request_chat_template = False  # --trust-request-chat-template
    reasoning_parser_cls: Any = None  # --reasoning-parser (chat_reasoning.py)

    def __init__(self, engine: Any, models: ServingModels, admission: Admission,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.engine = engine
        self.models = models
        self.admission = admission
        self.max_body_bytes = max_body_bytes
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.max_model_len = models.max_model_len
        self.tool_config = ToolCallConfig()  # the serve flags' (launcher.build_server)
        self.limits = RequestLimits.for_model(models.max_model_len)


class OpenAIServing:
    request_prefix = "req"

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.engine = ctx.engine
        self.models = ctx.models
        self.tokenizer = ctx.tokenizer

    def new_request_id(self, given: str | None = None) -> str:
        return f"{self.request_prefix}-{given or uuid.uuid4().hex}"

    def require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return self.tokenizer

    def engine_prompt(self, prompt: str | list[int], add_special_tokens: bool) -> Any:
        """A completion/embedding prompt (text or token ids) as the front-end takes it."""
        if isinstance(prompt, str):
            if add_special_tokens:
                return prompt
            ids = self.require_tokenizer().encode(prompt, add_special_tokens=False)
            return {"prompt": prompt, "prompt_token_ids": ids}
        return {"prompt_token_ids": prompt}


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it is known to pass ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {declared} bytes; the limit is {limit}")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body passes the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


_decoders: dict[type, msgspec.json.Decoder] = {}


def decode_body(body: bytes, kind: type[T]) -> T:
    """msgspec-validated request body; a 400 naming the field otherwise."""
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.json.Decoder(kind)
    if not body:
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        decoded = dec.decode(body)
    except msgspec.ValidationError as e:
        raise validation_error(e) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise too_deep() from None
    if isinstance(decoded, msgspec.Struct):
        log_ignored_fields(body, kind)
    return decoded


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then the work is
    cancelled (the engine aborts its requests) and ``ClientGone`` raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - the client is gone; only the abort matters
        pass
    raise ClientGone()


def engine_errors(err: BaseException) -> APIError:
    """An exception from the front-end -> the client's answer."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, EngineDeadError):
        return APIError(503, f"the engine is dead: {err}")
    if isinstance(err, (ValueError, TypeError)):
        return value_error(err)
    logger.exception("request failed", exc_info=err)
    return APIError(500, f"internal error: {type(err).__name__}: {err}")


async def answer(request: Request, work: Awaitable[T]) -> T:
    """``until_disconnect(request, work)`` with the front-end's errors as the client's."""
    try:
        return await until_disconnect(request, work)
    except (ClientGone, asyncio.CancelledError):
        raise  # the endpoint answers 499 / the server is cancelling: not an engine error
    except BaseException as e:  # noqa: BLE001 - every error becomes the client's answer
        raise engine_errors(e) from None


async def first_event(request: Request, stream: Any) -> Any:
    """A stream's first event (what decides between an SSE body and an error
    answer); the stream is closed when there is none."""
    try:
        return await until_disconnect(request, anext(stream))
    except (ClientGone, asyncio.CancelledError):
        await stream.aclose()
        raise  # the endpoint answers 499 / the server is cancelling: not an engine error
    except BaseException as e:  # noqa: BLE001 - every error becomes the client's answer
        await stream.aclose()
        raise engine_errors(e) from None


async def collect_final(stream: AsyncIterator[Any]) -> Any:
    """The last output of a generation (outputs are FINAL_ONLY or cumulative)."""
    last = None
    async for out in stream:
        last = out
    if last is None:
        raise APIError(500, "the engine finished the request without an output")
    return last


def check_finish_errors(outputs: list[Any]) -> None:
    """A choice that finished with ``error`` fails the request: 400 when the engine
    refused it before generating anything (a constraint that does not compile,
    an adapter that does not load), 500 otherwise."""
    for comp in outputs:
        if comp.finish_reason == "error":
            reason = comp.stop_reason or "the engine failed the request"
            raise APIError(400 if not comp.token_ids else 500, str(reason))
