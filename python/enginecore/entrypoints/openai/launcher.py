"""``enginecore serve``: which process does what.

One API server (``--api-server-count 1``, the default)::

    enginecore serve  (uvicorn + AsyncLLM, front-end 0)  --zmq-->  engine process(es)

N API servers, one port::

    enginecore serve  (owns the engines, supervises; serves no HTTP)
      |- API server 1..N  (uvicorn + AsyncLLM.from_handoff: front-end i of N+1)
      '- engine process(es)  (each request socket pair belongs to one front-end)

The listening sockets are bound by the first process, before the engine starts
(a taken port fails at once): N sockets with SO_REUSEPORT on the same address,
one handed to each API server process, so the kernel spreads connections evenly
over them. prometheus_client runs in multiprocess mode (a private directory set
before any API server process imports it), so any process's /metrics counts
all of them. SIGTERM/SIGINT to the first process is passed to every API server,
which drains (api_server.py); then the engines stop and the exit code is 0.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Any

from enginecore.config import EngineArgs
from enginecore.entrypoints.cli_common import EXIT_INTERRUPTED, UserError, user_errors
from enginecore.entrypoints.openai.request_limits import (
    RequestLimits,
    default_max_sequences_in_flight,
)
from enginecore.entrypoints.openai.serving_models import LoRAModulePath

logger = logging.getLogger("enginecore.serve")

# How long the first process waits, beyond the drain, for an API server to exit.
_EXIT_GRACE_S = 10.0


def engine_args_of(args: argparse.Namespace) -> EngineArgs:
    """The EngineArgs of ``serve`` (the positional MODEL wins over --model;
    --lora-modules turns LoRA on)."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise UserError(f"two models given ({args.model_tag!r} and --model "
                            f"{args.model!r})")
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535] (0: any free port), got {args.port}")
    if args.api_server_count < 1:
        raise UserError("--api-server-count must be >= 1")
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise UserError("--max-queued-requests must be >= 0")
    for flag in ("max_sequences_in_flight", "max_prompt_bytes"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.shutdown_timeout < 0:
        raise UserError("--shutdown-timeout must be >= 0")
    with user_errors():
        engine_args = EngineArgs.from_cli_args(args)
    from enginecore.entrypoints.openai.tool_calls import ToolCallConfig

    try:
        ToolCallConfig.from_args(args)  # bad tool flags fail before the engine starts
    except ValueError as e:
        raise UserError(str(e)) from None
    loras: list[LoRAModulePath] = args.lora_modules
    if loras and not engine_args.enable_lora:
        engine_args.enable_lora = True
    return engine_args


def process_capacity(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    """Sequences one API server process may hold: --max-sequences-in-flight (default
    16 x max-num-seqs x data-parallel-size), tighter with --max-queued-requests."""
    running = engine_args.max_num_seqs * engine_args.data_parallel_size
    total = getattr(args, "max_sequences_in_flight", None)
    if total is None:
        total = default_max_sequences_in_flight(engine_args.max_num_seqs,
                                                engine_args.data_parallel_size)
    if args.max_queued_requests is not None:
        total = min(total, running + args.max_queued_requests)
    return max(1, -(-total // args.api_server_count))


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listening TCP sockets on host:port (SO_REUSEPORT when more than one)."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if count > 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(addr if not socks else socks[0].getsockname())
            sock.listen(2048)
            sock.set_inheritable(True)
            socks.append(sock)
    except OSError as e:
        for s in socks:
            s.close()
        raise UserError(f"cannot listen on {host}:{port}: {e}") from None
    return socks


def _run_async(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # uvloop is optional: asyncio's loop works, a little slower
        import asyncio

        return asyncio.run(coro)
    return uvloop.run(coro)


def build_server(engine: Any, args: argparse.Namespace, capacity: int | None) -> tuple:
    """(context, ASGI app) of one API server process over ``engine`` (an AsyncLLM)."""
    from enginecore.entrypoints.openai.admission import Admission
    from enginecore.entrypoints.openai.api_server import build_app
    from enginecore.entrypoints.openai.chat_reasoning import configure_reasoning
    from enginecore.entrypoints.openai.chat_templating import configure_chat_templates
    from enginecore.entrypoints.openai.health import EngineHealth
    from enginecore.entrypoints.openai.metrics_endpoint import MetricsEndpoint
    from enginecore.entrypoints.openai.serving_engine import ServerContext
    from enginecore.entrypoints.openai.serving_models import ServingModels
    from enginecore.entrypoints.openai.tool_calls import ToolCallConfig

    mc = engine.model_config
    names = args.served_model_name or [args.model or mc.model]
    models = ServingModels(names, mc.model_path or mc.model, engine.max_model_len,
                           args.lora_modules)
    ctx = ServerContext(engine, models, Admission(engine, capacity),
                        max_body_bytes=args.max_request_body_bytes)
    configure_chat_templates(ctx, engine, args)
    configure_reasoning(ctx, args)
    ctx.tool_config = ToolCallConfig.from_args(args)
    ctx.limits = RequestLimits.for_model(engine.max_model_len,
                                         getattr(args, "max_prompt_bytes", None))
    health = EngineHealth(engine)
    metrics = MetricsEndpoint(["/health", "/version", "/metrics", "/v1/models",
                               "/v1/completions", "/v1/chat/completions", "/v1/embeddings",
                               "/v1/responses",
                               "/tokenize", "/detokenize"])
    metrics.prefix = getattr(args, "metrics_prefix", "enginecore")
    return ctx, build_app(ctx, health, metrics, api_key=args.api_key)


async def _serve_with(engine: Any, args: argparse.Namespace, capacity: int | None,
                      sock: socket.socket, on_started: Any) -> int | None:
    from enginecore.entrypoints.openai.api_server import serve_http

    ctx, app = build_server(engine, args, capacity)
    return await serve_http(app, ctx, sock=sock, host=args.host, port=args.port,
                     shutdown_timeout=args.shutdown_timeout,
                     log_level=args.uvicorn_log_level, on_started=on_started)


def _announce(args: argparse.Namespace, t0: float, what: str) -> None:
    print(f"enginecore serve: {what} on http://{args.host}:{args.port} "
          f"({time.monotonic() - t0:.1f} s after start)", file=sys.stderr, flush=True)


def run_serve(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    engine_args = engine_args_of(args)
    if args.api_server_count == 1:
        return _serve_one(args, engine_args, t0)
    return _serve_many(args, engine_args, t0)


def _serve_one(args: argparse.Namespace, engine_args: EngineArgs, t0: float) -> int:
    (sock,) = bind_sockets(args.host, args.port, 1)
    args.port = sock.getsockname()[1]  # --port 0: the one the kernel chose

    async def main() -> int | None:
        from enginecore.frontend import AsyncLLM

        with user_errors():  # a bad model path or setting: one line, exit 2
            engine = AsyncLLM.from_engine_args(engine_args, log_stats=engine_args.log_stats)
        try:
            return await _serve_with(engine, args, process_capacity(args, engine_args), sock,
                                     lambda: _announce(args, t0, "serving"))
        finally:
            engine.shutdown()

    try:
        ended_by = _run_async(main())
    finally:
        sock.close()  # uvicorn closes its own copy; this one if the engine never started
    return EXIT_INTERRUPTED if ended_by == signal.SIGINT else 0


def _api_worker(args: argparse.Namespace, handoff: Any, sock: socket.socket,
                ready: Any) -> None:
    """An API server process: front-end ``handoff.client_index`` of the engines."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_args = engine_args_of(args)

    async def main() -> int | None:
        from enginecore.frontend import AsyncLLM

        engine = AsyncLLM.from_handoff(handoff, log_stats=engine_args.log_stats)
        try:
            return await _serve_with(engine, args, process_capacity(args, engine_args), sock,
                                     ready.set)
        finally:
            engine.shutdown()

    if _run_async(main()) == signal.SIGINT:
        sys.exit(EXIT_INTERRUPTED)  # the supervisor tells a Ctrl-C from a crash


def _serve_many(args: argparse.Namespace, engine_args: EngineArgs, t0: float) -> int:
    n = args.api_server_count
    socks = bind_sockets(args.host, args.port, n)
    args.port = socks[0].getsockname()[1]
    # Before any API server process imports prometheus_client (they are spawned).
    metrics_dir = tempfile.mkdtemp(prefix="enginecore-metrics-")
    # Set for the API servers' spawn, taken back when serving ends: a caller of main() in
    # this process (tests) must not keep pointing prometheus_client at the removed dir.
    previous_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir

    def forget_metrics_dir() -> None:
        shutil.rmtree(metrics_dir, ignore_errors=True)
        if previous_dir is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous_dir

    stop = {"signal": None}

    def on_signal(sig: int, frame: Any) -> None:
        stop["signal"] = sig

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    from enginecore.frontend import AsyncLLM

    # (log_stats is the engines' setting too: the API servers' gauges need their stats)
    try:
        with user_errors():
            engine = AsyncLLM.from_engine_args(engine_args, client_count=n + 1,
                                               log_stats=engine_args.log_stats)
    except BaseException:
        for s, handler in previous.items():
            signal.signal(s, handler)
        forget_metrics_dir()
        for sock in socks:
            sock.close()
        raise
    spawn = multiprocessing.get_context("spawn")
    # What the API server processes get (the subcommand's function does not pickle).
    worker_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
    procs: list[Any] = []
    code = 0
    try:
        events = []
        for i in range(n):
            ready = spawn.Event()
            proc = spawn.Process(target=_api_worker, name=f"APIServer_{i + 1}",
                                 args=(worker_args, engine.handoff(i + 1), socks[i], ready))
            proc.start()
            procs.append(proc)
            events.append(ready)
        for sock in socks:
            sock.close()  # each API server holds its own now
        code = _supervise(procs, events, stop, args, t0)
        if code == 0 and stop["signal"] == signal.SIGINT:
            code = EXIT_INTERRUPTED
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=_EXIT_GRACE_S)
            if proc.is_alive():
                logger.warning("%s did not exit; killing it", proc.name)
                proc.kill()
                proc.join(timeout=5)
        engine.shutdown()
        for s, handler in previous.items():
            signal.signal(s, handler)
        forget_metrics_dir()
    return code


# How an API server process that a signal drained exits (SIGTERM, Ctrl-C).
_SIGNALLED_EXITS = (0, EXIT_INTERRUPTED)


def _supervise(procs: list[Any], events: list[Any], stop: dict, args: argparse.Namespace,
               t0: float) -> int:
    """Wait for a signal (then drain every API server) or an API server's death
    (then stop them all: a server that lost a process is not the server asked for)."""
    from prometheus_client import multiprocess

    announced = False
    while stop["signal"] is None:
        multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.2)
        if not announced and all(e.is_set() for e in events):
            announced = True
            _announce(args, t0, f"{len(procs)} API servers serving")
        dead = [p for p in procs if not p.is_alive()]
        if dead and all(p.exitcode in _SIGNALLED_EXITS for p in dead):
            # A signal reached API servers before this process (a terminal's Ctrl-C
            # goes to the whole group): the same stop, not a crash.
            interrupted = any(p.exitcode == EXIT_INTERRUPTED for p in dead)
            stop["signal"] = signal.SIGINT if interrupted else signal.SIGTERM
            break
        if dead:
            for p in dead:
                multiprocess.mark_process_dead(p.pid)
            logger.error("%s exited (code %s); stopping the server",
                         ", ".join(p.name for p in dead), dead[0].exitcode)
            return 1
    logger.info("signal %d: draining %d API servers", stop["signal"], len(procs))
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + args.shutdown_timeout + _EXIT_GRACE_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    # -SIGTERM: ours reached a server that had drained on its own signal (a
    # Ctrl-C) and already put back the default disposition on its way out.
    if all(c in _SIGNALLED_EXITS or c == -signal.SIGTERM for c in codes):
        return 0
    logger.warning("API servers exited with codes %s after the drain", codes)
    return 1
