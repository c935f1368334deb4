"""``enginecore proxy --prefill URL... --decode URL...``: the disaggregated P/D router.

Start the prefill servers with a producer connector and the decode servers with a
consumer one, e.g. ``enginecore serve M --port 8100 --kv-transfer-config
'{"kv_connector":"PDConnector","kv_role":"kv_producer"}'`` and the same with
``kv_consumer`` on port 8200; then ``enginecore proxy --prefill 127.0.0.1:8100 --decode
127.0.0.1:8200`` serves the OpenAI API on --port and answers like one server.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from enginecore.entrypoints.cli_common import UserError, add_subcommand
from enginecore.entrypoints.openai.serving_engine import DEFAULT_MAX_BODY_BYTES
from enginecore.entrypoints.proxy.relay import PREFILL_FAILURE_POLICIES


@dataclass(frozen=True)
class ProxyConfig:
    prefill: list[str]
    decode: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_failure_policy: str = "recompute"
    timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    cooldown_s: float = 2.0
    max_connections: int = 1024
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = None

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ProxyConfig:
        if not 0 <= args.port <= 65535:
            raise UserError(f"--port must be in [0, 65535] (0: any free port), got {args.port}")
        for flag in ("timeout", "connect_timeout", "cooldown"):
            if getattr(args, flag) <= 0:
                raise UserError(f"--{flag.replace('_', '-')} must be > 0")
        return cls(prefill=args.prefill, decode=args.decode, host=args.host, port=args.port,
                   prefill_failure_policy=args.prefill_failure_policy,
                   timeout_s=args.timeout, connect_timeout_s=args.connect_timeout,
                   cooldown_s=args.cooldown, max_connections=args.max_connections,
                   max_request_body_bytes=args.max_request_body_bytes, api_key=args.api_key)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_subcommand(sub, "proxy", "an OpenAI-compatible router for disaggregated "
                       "prefill/decode servers",
                       description=__doc__.split("\n\n", 1)[1].strip())
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill servers (http://host:port), taken in round robin "
                        "(required; no default)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode servers (http://host:port), taken in round robin "
                        "(required; no default)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0 or :: for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    p.add_argument("--prefill-failure-policy", choices=PREFILL_FAILURE_POLICIES,
                   default="recompute",
                   help="when no prefill server can take a request: recompute (the decode "
                        "server computes the prompt) or fail (503/502)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a server may take to answer (read timeout)")
    p.add_argument("--connect-timeout", type=float, default=5.0,
                   help="seconds to connect to a server before trying the next one")
    p.add_argument("--cooldown", type=float, default=2.0,
                   help="seconds a server that refused a connection is tried last")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open connections to the servers, all together")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(the header is passed on to the servers)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.set_defaults(func=run_proxy)


def build_relay(config: ProxyConfig):
    import httpx

    from enginecore.entrypoints.proxy.backends import BackendPool
    from enginecore.entrypoints.proxy.relay import Relay

    try:
        prefill = BackendPool.of("prefill", config.prefill, config.cooldown_s)
        decode = BackendPool.of("decode", config.decode, config.cooldown_s)
    except ValueError as e:
        raise UserError(str(e)) from None
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
        limits=httpx.Limits(max_connections=config.max_connections,
                            max_keepalive_connections=min(256, config.max_connections)),
        trust_env=False)  # never route loopback traffic through an HTTP(S)_PROXY
    return Relay(prefill, decode, client, config.prefill_failure_policy)


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from enginecore.entrypoints.openai.launcher import _run_async, bind_sockets
    from enginecore.entrypoints.proxy.app import build_proxy_app

    t0 = time.monotonic()
    config = ProxyConfig.from_cli_args(args)
    (sock,) = bind_sockets(config.host, config.port, 1)
    port = sock.getsockname()[1]

    async def main() -> None:
        import asyncio

        app = build_proxy_app(build_relay(config), max_body_bytes=config.max_request_body_bytes,
                              api_key=config.api_key)
        server = uvicorn.Server(uvicorn.Config(
            app, http="httptools", loop="none", lifespan="on", access_log=False,
            log_level=args.uvicorn_log_level, timeout_keep_alive=30))

        async def announce() -> None:
            while not server.started and not server.should_exit:
                await asyncio.sleep(0.02)
            if server.started:
                print(f"enginecore proxy: serving on http://{config.host}:{port} "
                      f"({time.monotonic() - t0:.1f} s after start; prefill "
                      f"{' '.join(config.prefill)}; decode {' '.join(config.decode)})",
                      file=sys.stderr, flush=True)

        # Held while serving: the loop keeps only a weak reference to a task.
        announcer = asyncio.ensure_future(announce())
        await server.serve(sockets=[sock])
        del announcer

    try:
        _run_async(main())
    finally:
        sock.close()  # uvicorn closes its own copy
    return 0
