"""EngineArgs as command-line flags, generated from its fields (config.py).

Each field becomes ``--field-name`` (plus its short spellings, vLLM's ``-dp``...)
with the field's description, type and default, in the field's group; bools get
``--x / --no-x``; ``int | None`` fields take ``None`` too; a few sizes take 1k /
2K / 256M. vLLM's spellings (config_aliases.py) get a flag each in their own
group and are only passed on when given.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

from enginecore.config_aliases import ALIASES

_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def human_int(text: str) -> int:
    """2048, 1k (1000), 1K (1024), 25.6k, 256M, 1G: vLLM's forms for sizes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: an integer, optionally with k/m/g (x1000) or K/M/G (x1024)")
    number, unit = m.groups()
    power = _UNITS[unit.lower()]
    if unit.isupper():
        if "." in number:
            raise argparse.ArgumentTypeError(
                f"invalid size {text!r}: binary units (K, M, G) take whole numbers")
        return int(number) * 1024**power
    value = float(number) * 1000**power if "." in number else int(number) * 1000**power
    if value != int(value):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: not a whole number of tokens")
    return int(value)


def _json_value(text: str) -> Any:
    """A JSON value (vLLM's dict flags: --limit-mm-per-prompt '{"image": 2}')."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {e}") from None


def _none_or(convert: Any) -> Any:
    """For ``X | None`` fields: 'None' (as vLLM writes it) is None."""
    def parse(text: str) -> Any:
        return None if text in ("None", "none", "") else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names it in errors
    return parse


def _base_type(hint: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of ``X`` or ``X | None``."""
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(get_args(hint))
    return hint, False


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default; wider columns for long flag names."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36, width=100)

    def _format_action(self, action: argparse.Action) -> str:
        # argparse shows no default for a flag without help (e.g. --port): give it one.
        if not action.help and action.option_strings and action.default is not argparse.SUPPRESS \
                and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # A None default is explained in the help itself ("default: the model's ...").
        if action.default is None and "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> argparse.ArgumentParser:
    """Every field of ``cls`` (EngineArgs: fields made by ``config.arg``, whose
    metadata holds group and help) as a flag, grouped as config.py groups them,
    then vLLM's spellings. The parser's formatter shows defaults (``HelpFormatter``).
    The class is passed in, not imported, so config.py can call this module."""
    hints = get_type_hints(cls)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, f in _fields(cls).items():
        meta = f.metadata
        group = groups.get(meta["group"])
        if group is None:
            group = groups[meta["group"]] = parser.add_argument_group(meta["group"])
        flags = ["--" + name.replace("_", "-"), *meta.get("flags", ())]
        kw: dict[str, Any] = {"dest": name, "default": f.default,
                              "help": meta["help"].replace("%", "%%")}
        base, optional = _base_type(hints[name])
        if base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            convert = {"human_int": human_int, "json": _json_value}.get(
                meta.get("parse"), meta.get("convert", base))
            if "nargs" in meta:  # a list of strs, space separated (vLLM's nargs="+")
                kw["nargs"], convert = meta["nargs"], str
            kw["type"] = _none_or(convert) if optional else convert
            if "choices" in meta:
                kw["choices"] = (*meta["choices"], None) if optional else meta["choices"]
                kw["metavar"] = "{" + ",".join(meta["choices"]) + "}"
            else:
                kw["metavar"] = meta.get("metavar", getattr(base, "__name__", "VALUE").upper())
        group.add_argument(*flags, **kw)
    vllm = parser.add_argument_group(
        "vLLM spellings", "accepted so that vLLM command lines run; each maps onto the flags "
        "above (docs/architecture.md, 'EngineArgs and vLLM's names')")
    for name, alias in ALIASES.items():
        cli = dict(alias.cli)
        if "type" in cli:
            cli.setdefault("metavar", getattr(cli["type"], "__name__", "VALUE").upper())
        vllm.add_argument("--" + name.replace("_", "-"), *alias.flags, dest=name,
                          default=argparse.SUPPRESS, help=alias.help.replace("%", "%%"), **cli)
    return parser


def dataclass_kwargs(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The keywords of ``cls`` (EngineArgs) a parsed command line gives: the fields whose value
    differs from the field's default, overridden by the vLLM spellings that were
    used (on a command line the spelling given wins: a subcommand may change a
    field's default, as ``serve`` may turn ``log_stats`` on, and
    ``--disable-log-stats`` must still turn it off)."""
    kwargs = {name: getattr(args, name) for name, f in _fields(cls).items()
              if hasattr(args, name) and getattr(args, name) != f.default}
    for name, alias in ALIASES.items():
        if hasattr(args, name):
            kwargs.update(alias.translate(getattr(args, name), kwargs))
    return kwargs
