"""Every ``enginecore`` subcommand's --help shows every flag's default."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from enginecore.entrypoints.cli import build_parser


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"": parser, **sub.choices}


@pytest.mark.parametrize("name", sorted(_subcommands()))
def test_every_flag_shows_its_default(name):
    parser = _subcommands()[name]
    missing = []
    for action in parser._actions:
        if not action.option_strings or action.default is argparse.SUPPRESS or isinstance(
                action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        text = parser._get_formatter()._format_action(action)
        if "default" not in text.lower():
            missing.append(action.option_strings[0])
    assert not missing, f"enginecore {name} --help shows no default for {missing}"


def test_serve_help_shows_the_port_default():
    out = subprocess.run([sys.executable, "-m", "enginecore", "serve", "--help"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    port = next(line for line in out.splitlines() if line.strip().startswith("--port"))
    assert "(default: 8000)" in port
    assert "(default: 127.0.0.1)" in out
