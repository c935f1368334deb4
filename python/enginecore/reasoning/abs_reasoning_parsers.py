"""The reasoning-parser interface and registry, in vLLM's shape
(``ReasoningParser``, ``ReasoningParserManager.register_module`` /
``get_reasoning_parser`` / ``import_reasoning_parser``).

A parser says, for the text generated so far, which part is reasoning and which
is content (``parse(text, final)``); it must be *monotonic*: for a longer text,
both parts extend the shorter text's parts. Streaming is then the difference of
two such states (streaming.py), so every split point of the stream gives the same
total as the non-streamed answer. While the text ends in what may be the start of
a marker (``</thi``), ``parse`` holds it back until it knows (``final`` flushes)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str
    content: str


class ReasoningParser:
    """Base class: subclasses implement ``parse``; ``extract_reasoning_content`` is
    vLLM's non-streaming entry point."""

    def __init__(self, tokenizer: Any = None, prompt: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.prompt = prompt or ""

    def parse(self, text: str, final: bool) -> ReasoningSplit:
        raise NotImplementedError

    def extract_reasoning_content(self, model_output: str,
                                  request: Any = None) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output; None where a part is empty."""
        split = self.parse(model_output, final=True)
        return split.reasoning or None, split.content or None

    extract_reasoning = extract_reasoning_content  # vLLM's newer name

    def is_reasoning_end(self, text: str) -> bool:
        """Whether the reasoning is over in ``text`` (content may follow)."""
        raise NotImplementedError

    def reasoning_required(self) -> bool:
        """Whether the output must start with reasoning (else it may, or may not)."""
        return False

    def structured_output_prefix(self) -> str | None:
        """A Lark rule for the reasoning that structured outputs must let through
        first (None: the output starts with the answer); see structured.py."""
        return None


class ReasoningParserManager:
    """Reasoning parsers by name (``--reasoning-parser NAME``)."""

    reasoning_parsers: ClassVar[dict[str, type[ReasoningParser]]] = {}

    @classmethod
    def register_module(cls, name: str | list[str] | None = None, force: bool = True,
                        module: type | None = None) -> Any:
        def register(parser: type) -> type:
            if not (isinstance(parser, type) and issubclass(parser, ReasoningParser)):
                raise TypeError(f"{parser!r} is not a ReasoningParser subclass")
            names = [name] if isinstance(name, str) else (name or [parser.__name__])
            for n in names:
                if not force and n in cls.reasoning_parsers:
                    raise KeyError(f"reasoning parser {n!r} is already registered")
                cls.reasoning_parsers[n] = parser
            return parser

        if module is not None:
            return register(module)
        return register

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        if name in cls.reasoning_parsers:
            return cls.reasoning_parsers[name]
        raise KeyError(f"reasoning parser {name!r} not found; known: "
                       f"{sorted(cls.reasoning_parsers)} (or register one with "
                       "--reasoning-parser-plugin)")

    @classmethod
    def import_reasoning_parser(cls, plugin: str) -> None:
        """A .py file or a module path whose import registers parsers."""
        if plugin.endswith(".py") or os.path.sep in plugin:
            if not os.path.isfile(plugin):
                raise FileNotFoundError(f"reasoning parser plugin {plugin!r} does not exist")
            name = "enginecore_reasoning_plugin_" + os.path.basename(plugin)[:-3]
            spec = importlib.util.spec_from_file_location(name, plugin)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot import the reasoning parser plugin {plugin!r}")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        else:
            importlib.import_module(plugin)
