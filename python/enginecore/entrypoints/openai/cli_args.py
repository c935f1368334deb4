"""``enginecore serve`` arguments: vLLM's server flags plus every EngineArgs field."""

from __future__ import annotations

import argparse

from enginecore.config import EngineArgs
from enginecore.entrypoints.cli_common import add_subcommand
from enginecore.entrypoints.openai.chat_reasoning import add_reasoning_args
from enginecore.entrypoints.openai.chat_templating import add_chat_template_args
from enginecore.entrypoints.openai.metrics_names import add_metrics_args
from enginecore.entrypoints.openai.serving_engine import DEFAULT_MAX_BODY_BYTES
from enginecore.entrypoints.openai.serving_models import parse_lora_module
from enginecore.entrypoints.openai.tool_calls import add_tool_args


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="an HF-format directory or a .gguf file (default: the default "
                             "model, SmolLM2-135M-Instruct); same as --model")
    srv = parser.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (0.0.0.0 or :: for every interface)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /health")
    srv.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     help="the model names the API answers to (the first is reported); "
                          "default: the model argument")
    srv.add_argument("--lora-modules", nargs="+", default=[], type=parse_lora_module,
                     metavar="NAME=PATH",
                     help="LoRA adapters (PEFT directories), each served as model NAME; "
                          'also the JSON form {"name": ..., "path": ...}; turns on '
                          "--enable-lora")
    srv.add_argument("--api-server-count", type=int, default=1,
                     help="API server processes on the one port, each a front-end of the "
                          "same engine(s)")
    srv.add_argument("--max-queued-requests", type=int, default=None,
                     help="sequences allowed to wait beyond what the engine runs at once "
                          "(max-num-seqs x data-parallel-size); more get 429 at once "
                          "(default: only --max-sequences-in-flight bounds them)")
    srv.add_argument("--max-sequences-in-flight", type=int, default=None, metavar="N",
                     help="sequences (prompts x n of every request) admitted at once; more "
                          "get 429 at once (default: 16 x max-num-seqs x "
                          "data-parallel-size)")
    srv.add_argument("--max-prompt-bytes", type=int, default=None, metavar="N",
                     help="the largest prompt text (or chat messages' text) accepted, "
                          "checked before tokenizing; larger is a 400 (default: 32 bytes per "
                          "token of max-model-len, at least 1 MiB)")
    srv.add_argument("--shutdown-timeout", type=float, default=10.0,
                     help="seconds SIGTERM waits for requests in flight before aborting them")
    srv.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                     help="larger request bodies get 413")
    add_tool_args(parser.add_argument_group("tool calling"))
    srv.add_argument("--uvicorn-log-level", default="warning",
                     choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_chat_template_args(srv)
    add_reasoning_args(srv)
    add_metrics_args(srv)
    EngineArgs.add_cli_args(parser)
    # As vLLM's server: stats on (the /metrics gauges and the engine's stats line);
    # --disable-log-stats (vLLM's spelling, config_aliases.py) or --no-log-stats
    # turn them off, and then /metrics has only the server's counters.
    parser.set_defaults(log_stats=True)
    return parser


def add_parser(sub: argparse._SubParsersAction) -> None:
    srv = add_subcommand(sub, "serve", "an OpenAI-compatible server (default model if none)")
    add_serve_args(srv).set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from enginecore.entrypoints.openai.launcher import run_serve

    return run_serve(args)
