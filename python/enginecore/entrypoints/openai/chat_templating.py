"""The server's chat-template settings (vLLM's flags) and how a request's template
is admitted and rendered.

``--chat-template`` (a file or the template itself) replaces the model's;
``--chat-template-content-format`` (auto / string / openai) says how message
content reaches the template; a request's own ``chat_template`` is refused unless
the server runs with ``--trust-request-chat-template`` (vLLM's flag and message),
and when allowed it renders under the sandbox's strict limits
(model/template_sandbox.py). Every render runs on a small thread pool, not on the
event loop, so a slow template never holds up other clients' streams."""

from __future__ import annotations

import argparse
import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from enginecore.entrypoints.openai.errors import bad_request
from enginecore.model.chat_templates import CONTENT_FORMATS, load_chat_template

UNTRUSTED_TEMPLATE_MESSAGE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template.")

_RENDER_THREADS = 4
_pool: ThreadPoolExecutor | None = None


def add_chat_template_args(group: Any) -> None:
    """vLLM's chat-template flags on ``serve``."""
    group.add_argument("--chat-template", default=None,
                       help="a chat template (a file path, or the template itself) replacing "
                            "the model's (default: the model's own: chat_template.jinja, "
                            "tokenizer_config.json, chat_template.json)")
    group.add_argument("--chat-template-content-format", default="auto",
                       choices=list(CONTENT_FORMATS),
                       help="how message content reaches the template: 'string' (one "
                            "string) or 'openai' (a list of parts); 'auto' detects it "
                            "from the template")
    group.add_argument("--trust-request-chat-template", action="store_true", default=False,
                       help="allow a request's own chat_template (rendered with a time, "
                            "loop and size limit)")


def configure_chat_templates(ctx: Any, engine: Any, args: argparse.Namespace) -> None:
    """The flags onto the server: the tokenizer's template and content format, and
    whether request templates are trusted."""
    ctx.trust_request_chat_template = bool(getattr(args, "trust_request_chat_template", False))
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        return
    template = getattr(args, "chat_template", None)
    if template is not None:
        tokenizer.chat_template = load_chat_template(template)
    tokenizer.content_format = getattr(args, "chat_template_content_format", "auto")


def request_template(chat_template: str | None, chat_template_kwargs: dict | None,
                     trusted: bool) -> str | None:
    """The request's own template (also vLLM's ``chat_template_kwargs.chat_template``),
    or None; a 400 unless the server trusts request templates."""
    kwargs_template = (chat_template_kwargs or {}).get("chat_template")
    given = chat_template if chat_template is not None else kwargs_template
    if given is None:
        return None
    if not trusted:
        raise bad_request(UNTRUSTED_TEMPLATE_MESSAGE, "chat_template")
    if not isinstance(given, str):
        raise bad_request("chat_template must be a string", "chat_template")
    return given


def without_template_kwarg(chat_template_kwargs: dict | None) -> dict | None:
    """chat_template_kwargs without its ``chat_template`` (taken as the template)."""
    if not chat_template_kwargs or "chat_template" not in chat_template_kwargs:
        return chat_template_kwargs
    return {k: v for k, v in chat_template_kwargs.items() if k != "chat_template"}


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_RENDER_THREADS, thread_name_prefix="chat-template")
    return _pool


async def off_loop(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on the render pool (its exceptions re-raised here)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor(), functools.partial(fn, *args, **kwargs))
