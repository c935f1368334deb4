"""The OpenAI-compatible HTTP app (Starlette routes on uvicorn) of one API server
process, and its graceful shutdown.

Routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/embeddings,
/tokenize, /detokenize, /health, /metrics, /version. Every error is an
OpenAI-shaped JSON body (errors.py), unknown routes and methods included.
``--api-key`` guards every route but /health (constant-time compare).

SIGTERM/SIGINT: uvicorn stops accepting and closes idle connections; requests
in flight get ``shutdown_timeout`` seconds to finish; then what is left is
aborted in the engine, so each stream ends with a final ``abort`` event and
``[DONE]`` (a non-streaming request answers 503), and the process exits 0.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import enginecore
from enginecore.entrypoints.openai.errors import (
    error_body,
    error_response,
    exception_handlers,
)
from enginecore.entrypoints.openai.health import EngineHealth
from enginecore.entrypoints.openai.metrics_endpoint import MetricsEndpoint
from enginecore.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from enginecore.entrypoints.openai.request_limits import off_loop
from enginecore.entrypoints.openai.responses_protocol import ResponsesRequest
from enginecore.entrypoints.openai.serving_chat import OpenAIServingChat
from enginecore.entrypoints.openai.serving_completion import OpenAIServingCompletion
from enginecore.entrypoints.openai.serving_embedding import (
    OpenAIServingEmbedding,
    OpenAIServingTokenization,
)
from enginecore.entrypoints.openai.serving_engine import (
    ClientGone,
    ServerContext,
    decode_body,
    read_body,
)
from enginecore.entrypoints.openai.serving_responses import OpenAIServingResponses

logger = logging.getLogger(__name__)

_UNGUARDED = frozenset({"/health"})


class APIKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` (every route but /health)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in _UNGUARDED:
            got = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    got = value
                    break
            if not hmac.compare_digest(got, self.expected):
                body = error_body(401, "invalid or missing API key (Authorization: Bearer)")
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def build_app(ctx: ServerContext, health: EngineHealth, metrics: MetricsEndpoint,
              api_key: str | None = None) -> Any:
    completion = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)
    responses = OpenAIServingResponses(chat)
    embedding = OpenAIServingEmbedding(ctx)
    tokenization = OpenAIServingTokenization(ctx)

    async def body_of(request: Request, kind: type) -> Any:
        return decode_body(await read_body(request, ctx.max_body_bytes), kind)

    def generation(handler: Callable, kind: type) -> Callable:
        async def endpoint(request: Request) -> Any:
            req = await body_of(request, kind)
            try:
                return await handler(req, request)
            except ClientGone:
                logger.info("%s: the client disconnected; its requests were aborted",
                            request.url.path)
                return Response(status_code=499)
        return endpoint

    async def health_route(request: Request) -> Response:
        if ctx.admission.draining:
            return error_response(503, "the server is shutting down")
        ok, why = health.status()
        return Response(status_code=200) if ok else error_response(503, why)

    async def models_route(request: Request) -> Response:
        import msgspec

        return Response(msgspec.json.encode(ctx.models.model_list()),
                        media_type="application/json")

    async def version_route(request: Request) -> Response:
        return Response(b'{"version":"%s"}' % enginecore.__version__.encode(),
                        media_type="application/json")

    async def tokenize_route(request: Request) -> Response:
        # Rendering and tokenizing a large body: in a worker thread, not on the loop.
        return await off_loop(tokenization.tokenize, await body_of(request, TokenizeRequest))

    async def detokenize_route(request: Request) -> Response:
        return tokenization.detokenize(await body_of(request, DetokenizeRequest))

    async def metrics_route(request: Request) -> Response:
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    routes = [
        Route("/health", health_route, methods=["GET"]),
        Route("/version", version_route, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/v1/models", models_route, methods=["GET"]),
        Route("/v1/completions", generation(completion.create, CompletionRequest),
              methods=["POST"]),
        Route("/v1/chat/completions", generation(chat.create, ChatCompletionRequest),
              methods=["POST"]),
        Route("/v1/embeddings", generation(embedding.create, EmbeddingRequest),
              methods=["POST"]),
        Route("/v1/responses", generation(responses.create, ResponsesRequest),
              methods=["POST"]),
        Route("/tokenize", tokenize_route, methods=["POST"]),
        Route("/detokenize", detokenize_route, methods=["POST"]),
    ]

    @asynccontextmanager
    async def lifespan(app: Any):
        health.start()
        try:
            yield
        finally:
            await health.stop()

    app: Any = Starlette(routes=routes, lifespan=lifespan, exception_handlers=exception_handlers())
    app = metrics.wrap(app)
    if api_key:
        app = APIKeyMiddleware(app, api_key)
    return app


class _DrainingServer(uvicorn.Server):
    """uvicorn, with the drain deadline of the server's admission: on the first
    SIGTERM/SIGINT, in-flight requests get ``shutdown_timeout`` seconds, then are
    aborted. The signal is not re-raised after a clean drain: ``exit_signal``
    says which one came (SIGTERM: exit 0; Ctrl-C: exit 130, as the CLI's)."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self.exit_signal: int | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        self.should_exit = True
        self.exit_signal = sig
        logger.info("signal %d: draining (%d sequences in flight, %.0f s)", sig,
                    self.ctx.admission.in_flight, self.shutdown_timeout)
        self.ctx.admission.draining = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_drain_deadline)

    def _start_drain_deadline(self) -> None:
        async def deadline() -> None:
            if not await self.ctx.admission.wait_idle(self.shutdown_timeout):
                await self.ctx.admission.abort_all()

        self._deadline_task = asyncio.ensure_future(deadline())


async def serve_http(app: Any, ctx: ServerContext, *, sock: socket.socket | None,
                     host: str, port: int, shutdown_timeout: float,
                     log_level: str = "info", on_started: Callable[[], None] | None = None
                     ) -> int | None:
    """Serve until a signal; the signal that ended it (None: none did)."""
    config = uvicorn.Config(app, host=host, port=port, http="httptools", loop="none",
                            lifespan="on", log_level=log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=int(shutdown_timeout) + 5,
                            timeout_keep_alive=30)
    server = _DrainingServer(config, ctx, shutdown_timeout)
    if on_started is not None:
        async def announce() -> None:
            while not server.started and not server.should_exit:
                await asyncio.sleep(0.02)
            if server.started:
                on_started()
        # Held while serving: the loop keeps only a weak reference to a task.
        announcer = asyncio.ensure_future(announce())
    await server.serve(sockets=[sock] if sock is not None else None)
    if on_started is not None:
        del announcer
    return server.exit_signal
