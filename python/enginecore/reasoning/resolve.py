"""``--reasoning-parser`` to a parser class: the built-ins registered by importing
think_parsers, plug-ins by their own import (kept apart from the registry so the
registry does not import the parsers that import it)."""

from __future__ import annotations

from collections.abc import Callable

import enginecore.reasoning.think_parsers  # noqa: F401 - registers the built-ins
from enginecore.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager


def resolve_reasoning_parser(name: str | None,
                             plugin: str | None = None) -> Callable[..., ReasoningParser] | None:
    """``--reasoning-parser`` (+ ``--reasoning-parser-plugin``) -> the parser class."""
    if plugin:
        ReasoningParserManager.import_reasoning_parser(plugin)
    if not name:
        return None
    return ReasoningParserManager.get_reasoning_parser(name)
