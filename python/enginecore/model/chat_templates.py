"""Where a model folder keeps its chat template(s), in transformers' order, and
vLLM's ``--chat-template`` (a file path or the template itself).

transformers (``PreTrainedTokenizerBase.from_pretrained`` / ``get_chat_template``,
5.x) reads, most preferred first:

1. ``chat_template.jinja`` (the default template; what ``save_pretrained`` writes
   today) and ``additional_chat_templates/NAME.jinja`` (named templates);
2. ``tokenizer_config.json``'s ``chat_template``: a string, or a list of named
   templates ``[{"name": "default", "template": ...}, {"name": "tool_use", ...}]``;
3. ``chat_template.json`` (``{"chat_template": ...}``, the processors' legacy file),
   which vLLM falls back to when the tokenizer has none.

With named templates, a request that sends tools gets ``tool_use`` when there is
one, otherwise ``default`` (``get_chat_template``)."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

ContentFormat = Literal["string", "openai"]
CONTENT_FORMATS = ("auto", "string", "openai")


class NoChatTemplateError(ValueError):
    """No template where one was looked for (the message says where)."""


@dataclass
class ChatTemplates:
    """A model's templates by name ("default", "tool_use", ...) and where they came
    from (for error messages)."""

    templates: dict[str, str] = field(default_factory=dict)
    origin: str = ""
    searched: list[str] = field(default_factory=list)

    @property
    def default(self) -> str | None:
        if "default" in self.templates:
            return self.templates["default"]
        return None

    def select(self, tools: Any = None) -> str:
        """The template for a request: ``tool_use`` when it has tools (and the model
        has one), else ``default``; as transformers' ``get_chat_template``."""
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if self.templates:
            names = sorted(self.templates)
            raise NoChatTemplateError(
                f"this model has named chat templates {names} but no 'default' one; "
                "pass a template (--chat-template) to choose")
        where = ", ".join(self.searched) or "nowhere (no model folder)"
        raise NoChatTemplateError(
            f"this model has no chat template (looked in: {where}); start the server with "
            "--chat-template FILE, or pass a plain prompt instead")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _named_list(value: Any, where: str) -> dict[str, str]:
    """tokenizer_config.json's chat_template: a string or [{"name", "template"}]."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        out = {}
        for entry in value:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ValueError(f"{where}: chat_template entries must be "
                                 '{"name": str, "template": str}')
            out[entry["name"]] = entry["template"]
        return out
    if value is None:
        return {}
    raise ValueError(f"{where}: chat_template must be a string or a list of named templates")


def find_chat_templates(model_dir: str | None,
                        tokenizer_config: dict[str, Any] | None = None) -> ChatTemplates:
    """The chat templates a model folder keeps, in transformers' precedence."""
    found = ChatTemplates()
    if model_dir is None:
        return found
    jinja = os.path.join(model_dir, CHAT_TEMPLATE_FILE)
    extra_dir = os.path.join(model_dir, CHAT_TEMPLATE_DIR)
    found.searched.append(jinja)
    templates: dict[str, str] = {}
    if os.path.isdir(extra_dir):
        found.searched.append(extra_dir + "/*.jinja")
        for name in sorted(os.listdir(extra_dir)):
            if name.endswith(".jinja"):
                templates[name[: -len(".jinja")]] = _read(os.path.join(extra_dir, name))
    if os.path.isfile(jinja):
        templates["default"] = _read(jinja)
    if templates:
        found.templates, found.origin = templates, jinja if "default" in templates else extra_dir
        return found
    cfg_path = os.path.join(model_dir, TOKENIZER_CONFIG_FILE)
    found.searched.append(cfg_path + " (chat_template)")
    if tokenizer_config is None and os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            tokenizer_config = json.load(f)
    templates = _named_list((tokenizer_config or {}).get("chat_template"), cfg_path)
    if templates:
        found.templates, found.origin = templates, cfg_path
        return found
    legacy = os.path.join(model_dir, LEGACY_CHAT_TEMPLATE_FILE)
    found.searched.append(legacy)
    if os.path.isfile(legacy):
        with open(legacy, encoding="utf-8") as f:
            value = json.load(f).get("chat_template")
        templates = _named_list(value, legacy)
        if templates:
            found.templates, found.origin = templates, legacy
    return found


# vLLM's rule (entrypoints/chat_utils.py load_chat_template): a value with any of
# these characters is a template, not a path.
_JINJA_CHARS = "{}\n"


def load_chat_template(value: str | os.PathLike | None) -> str | None:
    """``--chat-template``: the contents of a file, or the value itself when it is a
    template; a value that looks like a path but does not open is an error."""
    if value is None:
        return None
    value = os.fspath(value)
    try:
        if os.path.isfile(value):
            text = _read(value)
            if value.endswith(".json"):  # a chat_template.json given as the file
                text = _named_list(json.loads(text).get("chat_template"), value)["default"]
            return text
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"the chat template {value!r} could not be read: {e}") from None
    if any(c in value for c in _JINJA_CHARS):
        return value
    raise ValueError(f"the supplied chat template ({value}) looks like a file path, but it "
                     "does not exist")


@functools.lru_cache(maxsize=64)
def detect_content_format(source: str) -> ContentFormat:
    """vLLM's ``auto``: "openai" when the template loops over a message's content
    (it expects a list of parts), else "string"."""
    from jinja2 import Environment, nodes

    try:
        ast = Environment().parse(source)
    except Exception:  # noqa: BLE001 - an unparsable template fails when rendered
        return "string"

    def is_content(node: Any) -> bool:
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        if isinstance(node, nodes.Getattr):
            return node.attr == "content"
        return False

    for loop in ast.find_all(nodes.For):
        target = loop.iter
        while isinstance(target, nodes.Filter) and target.node is not None:
            target = target.node
        if is_content(target):
            return "openai"
    return "string"
