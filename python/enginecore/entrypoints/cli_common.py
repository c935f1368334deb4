"""What every ``enginecore`` subcommand shares: the parser class (one-line errors,
vLLM-style ``--flag_name`` spellings), ``--log-level`` on every level of the
command line, and how a user's mistake is reported (one line, exit 2)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from enginecore.config_cli import HelpFormatter

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C


class UserError(Exception):
    """A mistake in the command line or in what it names: reported as one line
    (no traceback unless --log-level debug), exit code 2."""


class CLIParser(argparse.ArgumentParser):
    """argparse with one-line errors and vLLM's ``--max_model_len`` spelling
    accepted for ``--max-model-len``; no abbreviated flags (with ~60 flags a
    prefix is a trap, not a convenience)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([_dashed(a) for a in args], namespace)


def _dashed(arg: str) -> str:
    """--max_model_len=5 -> --max-model-len=5 (the flag name only, never a value)."""
    if not arg.startswith("--") or arg == "--":
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


def add_log_level(parser: argparse.ArgumentParser, default: Any = argparse.SUPPRESS) -> None:
    """On the top parser with a default, on each subcommand without one, so it may
    come before or after the subcommand and the last one given wins."""
    parser.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default=default,
                        metavar="{" + ",".join(LOG_LEVELS) + "}",
                        help="logging level of enginecore and its engine processes")


def add_subcommand(sub: argparse._SubParsersAction, name: str, help: str,
                   description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand's parser, with the shared formatter and ``--log-level``
    (``serve`` and ``chat`` register through this too)."""
    parser = sub.add_parser(name, help=help, description=description or help,
                            formatter_class=HelpFormatter)
    add_log_level(parser)
    return parser


_FIELD = re.compile(r"\b(?:EngineArgs|SamplingParams)\.([a-z_]+)\b")


def as_flags(message: str) -> str:
    """'EngineArgs.block_size must be ...' -> '--block-size must be ...': errors
    name the flag the user typed."""
    return _FIELD.sub(lambda m: "--" + m.group(1).replace("_", "-"), message)


@contextmanager
def user_errors() -> Iterator[None]:
    """Around what turns the command line into objects (SamplingParams,
    EngineArgs, the model's files, the engine's start-up checks): the library's
    ValueError / TypeError / OSError there are the user's mistakes."""
    from enginecore.model.default_model import ModelNotAvailableError

    try:
        yield
    except (ValueError, TypeError, OSError, ModelNotAvailableError) as e:
        raise UserError(as_flags(_one_line(e))) from e


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        return f"{e.strerror}: {e.filename}"  # without the "[Errno 2]" prefix
    return " ".join(str(e).split()) or type(e).__name__
