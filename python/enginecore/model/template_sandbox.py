"""jinja2's immutable sandbox with budgets, for chat templates.

The plain sandbox caps each ``range()`` but not what a template does with it:
nested loops multiply (``range(100000)`` inside ``range(200)`` is 20 M steps), a
namespace string doubled in a loop grows to gigabytes, ``'x' * 10**9`` allocates
at once. Here every ``{% for %}`` is rewritten at parse time to step through a
guard that charges one unit per item against the render's budget (across every
level of nesting) and checks a wall-clock deadline; string/list ``*``, ``+``, ``~``,
``%`` and the width filters are checked before they allocate; the output is
generated piece by piece and cut at a size limit. A template past any limit
raises ``TemplateLimitError`` (a ValueError: the request's 400).

Compiled templates are kept in a bounded LRU cache (a client that sends a new
template with every request cannot grow it)."""

from __future__ import annotations

import datetime
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateLimitError(ValueError):
    """A chat template went past its time, step or size budget."""


@dataclass(frozen=True)
class RenderLimits:
    """What one render may spend. The model's own templates get the generous
    default; a template sent in a request gets ``REQUEST_LIMITS``."""

    max_loop_steps: int = 10_000_000
    max_seconds: float = 30.0
    max_chars: int = 64 << 20
    max_template_chars: int = 4 << 20


MODEL_LIMITS = RenderLimits()
REQUEST_LIMITS = RenderLimits(max_loop_steps=1_000_000, max_seconds=2.0,
                              max_chars=8 << 20, max_template_chars=256 << 10)

_WIDE_FORMAT = re.compile(r"\d{6,}|\*")  # '%0999999d', '%*d': widths that allocate


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


class _Budget:
    __slots__ = ("deadline", "limits", "steps_left")

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.steps_left = limits.max_loop_steps
        self.deadline = time.monotonic() + limits.max_seconds

    def charge(self, steps: int) -> None:
        self.steps_left -= steps
        if self.steps_left < 0:
            raise TemplateLimitError(
                f"the chat template ran more than {self.limits.max_loop_steps} loop steps")
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(
                f"the chat template ran longer than {self.limits.max_seconds:g} s")

    def check_size(self, size: int) -> None:
        if size > self.limits.max_chars:
            raise TemplateLimitError(
                f"the chat template made a value of more than {self.limits.max_chars} "
                "characters")


class GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' marker around what the
    assistant generated (for its training masks); rendering keeps the text as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson`` for chat templates: plain ``json.dumps`` (jinja2's own
    filter HTML-escapes ``<``, ``>``, ``&`` and ``'``, which changes the prompt a tool
    schema renders to), with its ``ensure_ascii`` / ``separators`` / ``sort_keys``."""
    if isinstance(indent, int) and abs(indent) > 1_000:  # json.dumps also takes a str
        raise TemplateLimitError("tojson's indent in a chat template is limited to 1000")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class GuardedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, whose loops, operators and widths are budgeted."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self) -> None:
        # The environment transformers renders chat templates in: loop controls
        # ({% break %}, {% continue %}), {% generation %} blocks, its tojson.
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[loopcontrols, GenerationBlock])
        self._local = threading.local()
        self.filters["tojson"] = tojson
        self.globals["raise_exception"] = _raise_template_error
        self.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self.globals["range"] = self._range
        for name in ("center", "indent", "format", "truncate", "wordwrap"):
            self.filters[name] = self._checked_filter(name, self.filters[name])

    # -- the budget of the render running on this thread -------------------------------
    def _budget(self) -> _Budget:
        budget = getattr(self._local, "budget", None)
        if budget is None:  # rendered outside render(): the strict limits
            budget = self._local.budget = _Budget(REQUEST_LIMITS)
        return budget

    def guard_loop(self, iterable: Iterable) -> Iterator:
        budget = self._budget()
        for item in iterable:
            budget.charge(1)
            yield item

    def guard_concat(self, *parts: Any) -> str:
        strs = [str(p) for p in parts]
        self._budget().check_size(sum(map(len, strs)))
        return "".join(strs)

    def _range(self, *args: int) -> range:
        r = range(*args)
        self._budget().charge(max(0, len(r) // 1000))  # building it is cheap; using it is not
        if len(r) > 100_000:
            raise TemplateLimitError("range() in a chat template is limited to 100000 items")
        return r

    def _checked_filter(self, name: str, fn: Any) -> Any:
        env = self

        def checked(*args: Any, **kwargs: Any) -> Any:
            budget = env._budget()
            if name == "format" and args and isinstance(args[0], str) and \
                    _WIDE_FORMAT.search(args[0]):
                raise TemplateLimitError("a format width in a chat template is too wide")
            for v in (*args[1:], *kwargs.values()):
                if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 100_000:
                    raise TemplateLimitError(f"a width in the chat template's {name} filter "
                                             "passes 100000")
            out = fn(*args, **kwargs)
            if isinstance(out, str):
                budget.check_size(len(out))
            return out

        if hasattr(fn, "jinja_pass_arg"):
            checked.jinja_pass_arg = fn.jinja_pass_arg  # type: ignore[attr-defined]
        return checked

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = self._budget()
        sized = (str, list, tuple)
        if operator == "*":
            seq, times = (left, right) if isinstance(left, sized) else (right, left)
            if isinstance(seq, sized) and isinstance(times, int):
                budget.check_size(len(seq) * max(times, 0))
        elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
            budget.check_size(len(left) + len(right))
        elif operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
            raise TemplateLimitError("a format width in a chat template is too wide")
        elif operator == "**" and isinstance(right, int) and abs(right) > 10_000:
            raise TemplateLimitError("an exponent in a chat template passes 10000")
        return super().call_binop(context, operator, left, right)

    # -- parse-time rewrite: every loop and ~ through the guards -----------------------
    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.EnvironmentAttribute("guard_loop"), [loop.iter],
                                   [], None, None, lineno=loop.lineno)
        for concat in list(tree.find_all(nodes.Concat)):
            call = nodes.Call(nodes.EnvironmentAttribute("guard_concat"), concat.nodes,
                              [], None, None, lineno=concat.lineno)
            _replace(tree, concat, call)
        return tree

    # -- rendering ---------------------------------------------------------------------
    def render(self, template: Any, limits: RenderLimits, variables: dict[str, Any]) -> str:
        """``template`` rendered under ``limits`` (on the calling thread)."""
        budget = _Budget(limits)
        self._local.budget = budget
        try:
            pieces: list[str] = []
            size = 0
            for piece in template.generate(**variables):
                size += len(piece)
                budget.check_size(size)
                pieces.append(piece)
            return "".join(pieces)
        finally:
            self._local.budget = None


def _replace(tree: nodes.Node, old: nodes.Node, new: nodes.Node) -> None:
    """Put ``new`` where ``old`` is in the tree."""
    for node in tree.find_all(nodes.Node):
        for field_name in node.fields:
            value = getattr(node, field_name, None)
            if value is old:
                setattr(node, field_name, new)
                return
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if item is old:
                        value[i] = new
                        return


class TemplateCache:
    """Compiled templates by source, least recently used out first."""

    def __init__(self, env: GuardedSandbox, capacity: int = 64) -> None:
        self.env = env
        self.capacity = capacity
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._compiled)

    def get(self, source: str, limits: RenderLimits) -> Any:
        if len(source) > limits.max_template_chars:
            raise TemplateLimitError(f"the chat template is longer than "
                                     f"{limits.max_template_chars} characters")
        with self._lock:
            template = self._compiled.get(source)
            if template is not None:
                self._compiled.move_to_end(source)
                return template
        template = self.env.from_string(source)
        with self._lock:
            self._compiled[source] = template
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return template
