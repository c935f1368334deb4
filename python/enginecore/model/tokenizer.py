"""Text <-> token ids with `tokenizers`, plus the chat template (jinja2)."""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from enginecore.model.chat_templates import (
    CONTENT_FORMATS,
    ChatTemplates,
    detect_content_format,
    find_chat_templates,
)
from enginecore.model.template_sandbox import (
    MODEL_LIMITS,
    REQUEST_LIMITS,
    GuardedSandbox,
    TemplateCache,
)


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None,
        add_bos_token: bool = False,
        chat_templates: ChatTemplates | None = None,
    ) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_templates = chat_templates or ChatTemplates(
            {"default": chat_template} if chat_template else {})
        self.add_bos_token = add_bos_token
        self.content_format: str = "auto"  # --chat-template-content-format
        self._env = GuardedSandbox()
        self._cache = TemplateCache(self._env)  # bounded: request templates pass through it

    @property
    def chat_template(self) -> str | None:
        """The default template (transformers' ``tokenizer.chat_template`` when single)."""
        return self.chat_templates.default

    @chat_template.setter
    def chat_template(self, source: str | None) -> None:
        """``--chat-template``: replaces every template the model folder had."""
        self.chat_templates = ChatTemplates({"default": source} if source else {},
                                            origin="--chat-template")

    def resolve_content_format(self, source: str, given: str | None = None) -> str:
        """"string" or "openai" for ``source`` (``given`` or the server's setting;
        "auto" detects it from the template, as vLLM)."""
        fmt = given or self.content_format
        if fmt not in CONTENT_FORMATS:
            raise ValueError(f"chat template content format must be one of {CONTENT_FORMATS}, "
                             f"got {fmt!r}")
        return detect_content_format(source) if fmt == "auto" else fmt

    @classmethod
    def from_dir(cls, model_dir: str) -> Tokenizer:
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        tok = HFTokenizer.from_file(path)
        # Some tokenizer.json files ship fixed padding/truncation (sentence-transformers):
        # the engine wants exactly the prompt's tokens.
        tok.no_padding()
        tok.no_truncation()
        cfg: dict[str, Any] = {}
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)

        def token_id(key: str) -> int | None:
            value = cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return tok.token_to_id(value) if isinstance(value, str) else None

        templates = find_chat_templates(model_dir, cfg)
        return cls(
            tok,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            chat_template=None,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            chat_templates=templates,
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _GIL_FREE_CHARS:
            # encode_batch releases the GIL (encode holds it): a long prompt tokenized
            # in a worker thread does not stall the server's event loop.
            ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of an id (byte-level form, e.g. 'Ġthe'), None if unknown."""
        return self._tok.id_to_token(token_id)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        untrusted_template: bool = False,
        content_format: str | None = None,
    ) -> str:
        """Render a conversation with the model's chat template (or ``chat_template``)
        in a budgeted jinja2 sandbox (template_sandbox.py), as transformers does:
        ``tools``, ``documents`` and the entries of ``chat_template_kwargs`` are
        template variables; with named templates, ``tool_use`` when there are tools.
        ``continue_final_message`` ends the text inside the last message (to be
        continued) instead of closing it. ``untrusted_template``: ``chat_template``
        came from a request, and renders under the strict limits. ``content_format``
        (vLLM's --chat-template-content-format): "openai" hands the template each
        message's content as a list of parts, "string" as one string."""
        source = chat_template or self.chat_templates.select(tools)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be set")
        limits = REQUEST_LIMITS if untrusted_template and chat_template else MODEL_LIMITS
        template = self._cache.get(source, limits)
        template_kwargs = chat_template_kwargs or {}
        reserved = {"messages", "add_generation_prompt", "tools", "documents"}
        clash = reserved & set(template_kwargs)
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {sorted(clash)}")
        rendered = [template_message(m) for m in messages]
        if self.resolve_content_format(source, content_format) == "openai":
            rendered = [{**m, "content": [{"type": "text", "text": m["content"]}]}
                        if isinstance(m.get("content"), str) else m for m in rendered]
        variables = {"bos_token": self._token(self.bos_token_id),
                     "eos_token": self._token(self.eos_token_id), **template_kwargs,
                     "messages": rendered, "add_generation_prompt": add_generation_prompt,
                     "tools": tools, "documents": documents}
        text = self._env.render(template, limits, variables)
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or final.strip() not in text:
                raise ValueError("continue_final_message needs a final message with text "
                                 "content that the template renders")
            text = text[: text.rindex(final.strip()) + len(final.strip())]
        return text

    def _token(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._tok.id_to_token(token_id) or "")


# Names a message's reasoning goes by; templates read the first (transformers' list).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to a chat template: keys whose value is None
    dropped (OpenAI clients send ``"tool_calls": null``; templates test ``is defined``),
    and reasoning under any of its names also under ``thinking`` and
    ``reasoning_content``."""
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


_GIL_FREE_CHARS = 8192
