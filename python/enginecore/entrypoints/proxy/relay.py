"""One request through the disaggregated pair: prefill, then decode (vLLM's disagg proxy).

1. The body goes to a prefill server with ``max_tokens=1`` (and ``max_completion_tokens``),
   ``stream=false``, ``n=1`` and ``kv_transfer_params = {"do_remote_decode": true, ...}``:
   the prefill engine computes the prompt's KV, keeps its blocks (delay-free) and answers
   with the ``kv_transfer_params`` a decode engine needs to pull them
   (``do_remote_prefill``, ``remote_engine_id``, ``remote_block_ids``, ``remote_host``,
   ``remote_port``).
2. The original body, plus those ``kv_transfer_params``, goes to a decode server, whose
   answer (a JSON body or an SSE stream) is the client's answer, byte for byte.

Failures: a server that refuses the connection is skipped for the next one of its side.
A prefill that cannot be had at all (every prefill server down, or dying mid-request)
follows ``prefill_failure_policy``: ``recompute`` sends the request to decode without
``kv_transfer_params`` (the decode engine computes the prompt itself), ``fail`` answers
503 (none reachable) or 502 (one broke). A 4xx from the prefill server is the request's
own fault and is the client's answer as it is. No decode server: 503; one breaking
mid-stream: an SSE ``error`` event and ``[DONE]``, so the client's stream always ends.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
from starlette.responses import Response

from enginecore.entrypoints.openai.errors import APIError, error_body
from enginecore.entrypoints.openai.streaming import SSEResponse, sse_event
from enginecore.entrypoints.proxy.backends import BackendPool, NoBackendError, describe
from enginecore.kv_transfer.transfer_params import check_kv_transfer_params

logger = logging.getLogger("enginecore.proxy")

PREFILL_FAILURE_POLICIES = ("recompute", "fail")

# What a prefill server is asked for (vLLM's field names and values).
PREFILL_KV_TRANSFER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Request headers passed on to both servers.
_FORWARDED = ("authorization", "x-request-id")
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's body: one token, no stream, one choice, do_remote_decode."""
    out = dict(body)
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["n"] = 1
    for key in ("stream_options", "min_tokens", "best_of"):
        out.pop(key, None)
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict | None) -> dict[str, Any]:
    out = dict(body)
    if kv_transfer_params:
        out["kv_transfer_params"] = kv_transfer_params
    else:
        out.pop("kv_transfer_params", None)
    return out


def forwarded_headers(headers: Any) -> dict[str, str]:
    out = {"content-type": "application/json"}
    for name in _FORWARDED:
        value = headers.get(name)
        if value is not None:
            out[name] = value
    # vLLM's proxies name the pair's request with one id on both servers.
    out.setdefault("x-request-id", uuid.uuid4().hex)
    return out


class Relay:
    def __init__(self, prefill: BackendPool, decode: BackendPool, client: httpx.AsyncClient,
                 prefill_failure_policy: str = "recompute") -> None:
        if prefill_failure_policy not in PREFILL_FAILURE_POLICIES:
            raise ValueError(f"prefill_failure_policy must be one of "
                             f"{PREFILL_FAILURE_POLICIES}, got {prefill_failure_policy!r}")
        self.prefill = prefill
        self.decode = decode
        self.client = client
        self.prefill_failure_policy = prefill_failure_policy
        self.counts = {"requests": 0, "prefill_fallbacks": 0, "without_kv_params": 0}
        self._warned_no_params = False

    async def handle(self, path: str, body: dict[str, Any], headers: Any) -> Any:
        """The client's answer to ``body`` POSTed to ``path`` (a Response or an ASGI app)."""
        self.counts["requests"] += 1
        fwd = forwarded_headers(headers)
        try:
            answer = await self._prefill(path, prefill_body(body), fwd)
        except (NoBackendError, _PrefillBroke) as e:
            if self.prefill_failure_policy == "fail":
                status = 503 if isinstance(e, NoBackendError) else 502
                raise APIError(status, str(e)) from None
            self.counts["prefill_fallbacks"] += 1
            logger.warning("%s; the decode server computes the prompt itself", e)
            answer = None
        if isinstance(answer, Response):
            return answer  # the prefill server refused the request (its 4xx)
        params = answer
        if answer is not None and not params:
            self.counts["without_kv_params"] += 1
            if not self._warned_no_params:
                self._warned_no_params = True
                logger.warning("the prefill server answered without kv_transfer_params (is "
                               "it running with a kv_producer/kv_both --kv-transfer-config?); "
                               "decode servers compute those prompts themselves")
        return await self._decode(path, decode_body(body, params), fwd,
                                  bool(body.get("stream")))

    async def _prefill(self, path: str, body: dict, headers: dict) -> dict | Response | None:
        """The prefill's kv_transfer_params (None or {} if it sent none), or the
        prefill server's own 4xx answer."""
        content = msgspec.json.encode(body)
        failures = []
        for backend in self.prefill.order():
            try:
                r = await self.client.post(backend.url + path, content=content, headers=headers)
            except httpx.TimeoutException as e:
                # Busy, not dead: asking another would compute the prompt twice.
                raise _PrefillBroke(f"prefill server {backend.url} did not answer in time "
                                    f"({describe(e)})") from None
            except httpx.TransportError as e:
                self.prefill.mark_down(backend, describe(e))
                failures.append(f"{backend.url}: {describe(e)}")
                continue
            if r.status_code >= 500:
                failures.append(f"{backend.url}: HTTP {r.status_code} {r.text[:200]}")
                continue
            self.prefill.mark_up(backend)
            if r.status_code != 200:
                return _passthrough(r)
            try:
                answer = msgspec.json.decode(r.content)
            except msgspec.DecodeError:
                raise _PrefillBroke(f"prefill server {backend.url} answered a body that is "
                                    "not JSON") from None
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            if params is not None and not isinstance(params, dict):
                # Sent on, it would be the decode server's 400 blaming the client.
                raise _PrefillBroke(f"prefill server {backend.url} answered kv_transfer_params "
                                    f"that are not an object ({type(params).__name__})")
            if params is not None:
                try:
                    check_kv_transfer_params(params)
                except ValueError as e:
                    raise _PrefillBroke(f"prefill server {backend.url} answered bad "
                                        f"kv_transfer_params: {e}") from None
            return params
        raise NoBackendError("no prefill server could take the request ("
                             + "; ".join(failures) + ")")

    async def _decode(self, path: str, body: dict, headers: dict, stream: bool) -> Any:
        content = msgspec.json.encode(body)
        failures = []
        for backend in self.decode.order():
            req = self.client.build_request("POST", backend.url + path, content=content,
                                            headers=headers)
            try:
                r = await self.client.send(req, stream=True)
            except _CONNECT_ERRORS as e:
                self.decode.mark_down(backend, describe(e))
                failures.append(f"{backend.url}: {describe(e)}")
                continue
            except httpx.HTTPError as e:
                raise APIError(502, f"decode server {backend.url} failed: {describe(e)}"
                               ) from None
            self.decode.mark_up(backend)
            if stream and r.status_code == 200:
                return SSEResponse(_relay(r, backend.url), end_with_done=False)
            try:
                await r.aread()
            except httpx.HTTPError as e:
                raise APIError(502, f"decode server {backend.url} broke off its answer: "
                               f"{describe(e)}") from None
            finally:
                await r.aclose()
            return _passthrough(r)
        raise APIError(503, "no decode server could take the request ("
                       + "; ".join(failures) + ")")


class _PrefillBroke(Exception):
    """A prefill server took the request and then failed it (died, hung, garbage)."""


def _passthrough(r: httpx.Response) -> Response:
    return Response(r.content, status_code=r.status_code,
                    media_type=r.headers.get("content-type", "application/json"))


async def _relay(r: httpx.Response, url: str) -> AsyncIterator[bytes]:
    """The decode server's SSE bytes as they come; an error event and [DONE] if it
    breaks off, so the client's stream ends either way."""
    try:
        async for chunk in r.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:
        logger.warning("decode server %s broke off a stream: %s", url, describe(e))
        yield sse_event(error_body(502, f"decode server {url} broke off the stream: "
                                        f"{describe(e)}"))
        yield b"data: [DONE]\n\n"
    finally:
        await r.aclose()  # also when the client went away: the decode server aborts
