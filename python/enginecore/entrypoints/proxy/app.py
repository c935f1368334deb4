"""The proxy's ASGI app (Starlette, as the server's): the two generation routes through
the relay, /v1/models from a decode server, /health over both sides, /version.

/health is 200 while at least one prefill and one decode server answer their own
/health with 200; otherwise 503 naming the side that is down. Either way the body
lists every server: ``{"prefill": [{"url", "healthy", "detail"}], "decode": [...]}``.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import enginecore
from enginecore.entrypoints.openai.api_server import APIKeyMiddleware
from enginecore.entrypoints.openai.errors import APIError, error_response, exception_handlers
from enginecore.entrypoints.openai.serving_engine import read_body
from enginecore.entrypoints.proxy.backends import describe
from enginecore.entrypoints.proxy.relay import Relay

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


def build_proxy_app(relay: Relay, *, max_body_bytes: int, health_timeout_s: float = 2.0,
                    api_key: str | None = None) -> Any:
    client = relay.client

    def generation(path: str) -> Any:
        async def endpoint(request: Request) -> Any:
            raw = await read_body(request, max_body_bytes)
            try:
                body = msgspec.json.decode(raw) if raw else None
            except msgspec.DecodeError as e:
                raise APIError(400, f"the request body is not JSON: {e}") from None
            if not isinstance(body, dict):
                raise APIError(400, "the request body must be a JSON object")
            return await relay.handle(path, body, request.headers)
        return endpoint

    async def health_route(request: Request) -> Response:
        sides = {"prefill": await relay.prefill.health(client, health_timeout_s),
                 "decode": await relay.decode.health(client, health_timeout_s)}
        down = [side for side, servers in sides.items()
                if not any(s["healthy"] for s in servers)]
        if not down:
            return Response(msgspec.json.encode(sides), media_type="application/json")
        why = "; ".join(
            f"no healthy {side} server ("
            + ", ".join(f"{s['url']}: {s['detail']}" for s in sides[side]) + ")"
            for side in down)
        return error_response(503, why)

    async def models_route(request: Request) -> Response:
        failures = []
        for backend in relay.decode.order():
            try:
                r = await client.get(backend.url + "/v1/models",
                                     headers=_auth_of(request))
            except httpx.HTTPError as e:
                failures.append(f"{backend.url}: {describe(e)}")
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type", "application/json"))
        return error_response(503, "no decode server answered /v1/models ("
                              + "; ".join(failures) + ")")

    async def version_route(request: Request) -> Response:
        return Response(msgspec.json.encode({"version": enginecore.__version__}),
                        media_type="application/json")

    routes = [Route("/health", health_route, methods=["GET"]),
              Route("/version", version_route, methods=["GET"]),
              Route("/v1/models", models_route, methods=["GET"])]
    routes += [Route(path, generation(path), methods=["POST"]) for path in GENERATION_ROUTES]

    @asynccontextmanager
    async def lifespan(app: Any):
        try:
            yield
        finally:
            await client.aclose()

    app: Any = Starlette(routes=routes, lifespan=lifespan, exception_handlers=exception_handlers())
    if api_key:
        app = APIKeyMiddleware(app, api_key)
    return app


def _auth_of(request: Request) -> dict[str, str]:
    value = request.headers.get("authorization")
    return {"authorization": value} if value is not None else {}
