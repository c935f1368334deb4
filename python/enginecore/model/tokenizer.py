"""Text <-> token ids with `tokenizers`, plus the chat template (jinja2)."""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None,
        add_bos_token: bool = False,
    ) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self._compiled: dict[str, Any] = {}  # template source -> compiled jinja2 template

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

        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(
            tok,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            chat_template=template,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
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
    ) -> str:
        """Render a conversation with the model's chat template (or ``chat_template``)
        in jinja2's immutable sandbox, as transformers does: ``tools``, ``documents``
        and the entries of ``chat_template_kwargs`` are template variables.
        ``continue_final_message`` ends the text inside the last message (to be
        continued) instead of closing it."""
        source = chat_template or self.chat_template
        if not source:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be set")
        template = self._compiled.get(source)
        if template is None:
            template = self._compiled[source] = _sandbox().from_string(source)
        template_kwargs = chat_template_kwargs or {}
        reserved = {"messages", "add_generation_prompt", "tools", "documents"}
        clash = reserved & set(template_kwargs)
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {sorted(clash)}")
        variables = dict(bos_token=self._token(self.bos_token_id),
                         eos_token=self._token(self.eos_token_id))
        variables.update(template_kwargs)
        text = template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               tools=tools, documents=documents, **variables)
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or final.strip() not in text:
                raise ValueError("continue_final_message needs a final message with text "
                                 "content that the template renders")
            text = text[: text.rindex(final.strip()) + len(final.strip())]
        return text

    def _token(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._tok.id_to_token(token_id) or "")


_GIL_FREE_CHARS = 8192


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _sandbox() -> Any:
    """jinja2's immutable sandbox with the helpers HF chat templates use."""
    import datetime

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env
