"""The ``enginecore`` command (also ``python -m enginecore``).

Each subcommand lives in its own module with an ``add_parser(subparsers)``
(built on ``cli_common.add_subcommand``); to add one, add its module to
``SUBCOMMANDS``. Exit codes: 0 done, 1 the work failed, 2 a user error (one line
on stderr), 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import importlib
import logging
import sys
import traceback

from enginecore.entrypoints.cli_common import (
    EXIT_INTERRUPTED,
    EXIT_USER_ERROR,
    CLIParser,
    UserError,
    add_log_level,
)

SUBCOMMANDS = (
    "enginecore.entrypoints.generate",
    "enginecore.entrypoints.synthetic",
    "enginecore.entrypoints.headless",
    "enginecore.entrypoints.openai.cli_args",  # serve
    "enginecore.entrypoints.chat",
    "enginecore.entrypoints.proxy.cli",  # proxy (disaggregated prefill/decode)
)


def build_parser() -> CLIParser:
    from enginecore import __version__

    parser = CLIParser(
        prog="enginecore",
        description="enginecore: an LLM-serving engine core (scheduler, paged KV cache with "
        "prefix caching, model executor). `enginecore COMMAND --help` lists a command's flags.")
    parser.add_argument("--version", action="version", version=f"enginecore {__version__}")
    add_log_level(parser, default="warning")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return args.func(args)
    except UserError as e:
        if args is not None and args.log_level == "debug":
            traceback.print_exc()
        command = f"enginecore {args.command}" if args is not None else "enginecore"
        print(f"{command}: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
