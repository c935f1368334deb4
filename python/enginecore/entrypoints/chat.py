"""``enginecore chat``: an interactive terminal chat that streams the answer and
keeps the conversation's history.

In process (default): the model (``--model``, default SmolLM2-135M-Instruct) on
an ``AsyncLLM``. With ``--url``: a running OpenAI-compatible server
(``enginecore serve``, vLLM, ...), over HTTP with the standard library (SSE from
/v1/chat/completions), so the command needs nothing the package does not
already install.

Commands at the prompt: ``/reset`` forgets the conversation, ``/system TEXT``
sets the system message, ``/exit`` (or Ctrl-D) quits.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

Message = dict[str, str]


def add_parser(sub: Any) -> None:
    from enginecore.entrypoints.cli_common import add_subcommand

    chat = add_subcommand(sub, "chat", "chat in the terminal (in process, or with --url)")
    chat.add_argument("--url", default=None,
                      help="a server's base URL, e.g. http://127.0.0.1:8000/v1 (default: run "
                           "the model in this process)")
    chat.add_argument("--model", default=None,
                      help="in process: HF directory or .gguf (default model); with --url: "
                           "the model name (default: the server's first)")
    chat.add_argument("--api-key", default=None, help="with --url: the server's API key")
    chat.add_argument("--system", default=None, help="a system message to start with")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--top-p", type=float, default=0.95)
    chat.add_argument("--seed", type=int, default=None)
    chat.set_defaults(func=run_chat)


def _sse_deltas(url: str, body: dict, api_key: str | None) -> Iterator[str]:
    """The content deltas of a streamed /chat/completions answer."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url.rstrip("/") + "/chat/completions",
                                     data=json.dumps(body).encode(), headers=headers)
    try:
        response = urllib.request.urlopen(request, timeout=600)
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise RuntimeError(f"the server answered {e.code}: {detail}") from None
    with response:
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(event["error"].get("message", "the server failed"))
            for choice in event.get("choices", ()):
                text = choice.get("delta", {}).get("content")
                if text:
                    yield text


def _remote_turn(args: argparse.Namespace) -> Callable[[list[Message]], Iterator[str]]:
    def turn(messages: list[Message]) -> Iterator[str]:
        body: dict[str, Any] = {"messages": messages, "stream": True,
                                "max_tokens": args.max_tokens,
                                "temperature": args.temperature, "top_p": args.top_p}
        if args.model:
            body["model"] = args.model
        if args.seed is not None:
            body["seed"] = args.seed
        return _sse_deltas(args.url, body, args.api_key)
    return turn


class _LocalChat:
    """The model in this process (an AsyncLLM on its own event loop)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import asyncio

        from enginecore.config import EngineArgs
        from enginecore.frontend import AsyncLLM

        self.args = args
        self.loop = asyncio.new_event_loop()
        print("loading the model ...", file=sys.stderr, flush=True)
        self.engine = AsyncLLM.from_engine_args(
            EngineArgs(model=args.model, max_num_seqs=4, kv_cache_memory_bytes=512 << 20),
            log_stats=False)
        self.turns = 0

    def turn(self, messages: list[Message]) -> Iterator[str]:
        from enginecore.sampling_params import RequestOutputKind, SamplingParams

        a = self.args
        prompt = self.engine.input_processor.render_chat(messages)
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature,
                                top_p=a.top_p, seed=a.seed, output_kind=RequestOutputKind.DELTA)
        self.turns += 1
        stream = self.engine.generate(prompt, params, f"chat-{self.turns}")
        try:
            while True:
                try:
                    out = self.loop.run_until_complete(anext(stream))
                except StopAsyncIteration:
                    return
                comp = out.outputs[0]
                if comp.finish_reason == "error":
                    raise RuntimeError(str(comp.stop_reason or "the engine failed"))
                if comp.text:
                    yield comp.text
        finally:
            self.loop.run_until_complete(stream.aclose())

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.close()


def chat_loop(turn: Callable[[list[Message]], Iterator[str]], system: str | None,
              read: Callable[[str], str] = input,
              write: Callable[[str], Any] | None = None) -> None:
    """Read a line, stream the answer, remember both; until /exit or end of input."""
    def out(text: str) -> None:
        if write is not None:
            write(text)
        else:
            sys.stdout.write(text)
            sys.stdout.flush()

    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = read("> ").strip()
        except EOFError:
            out("\n")
            return
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            messages = [m for m in messages if m["role"] == "system"]
            out("(conversation cleared)\n")
            continue
        if line.startswith("/system"):
            system = line[len("/system"):].strip() or None
            messages = ([{"role": "system", "content": system}] if system else []) + [
                m for m in messages if m["role"] != "system"]
            out("(system message set)\n")
            continue
        messages.append({"role": "user", "content": line})
        answer = []
        try:
            for delta in turn(messages):
                answer.append(delta)
                out(delta)
        except KeyboardInterrupt:
            out(" [interrupted]")
        except (RuntimeError, OSError) as e:
            out(f"\n[error: {e}]\n")
            messages.pop()
            continue
        out("\n")
        messages.append({"role": "assistant", "content": "".join(answer)})


def run_chat(args: argparse.Namespace) -> int:
    if args.url:
        chat_loop(_remote_turn(args), args.system)
        return 0
    local = _LocalChat(args)
    try:
        chat_loop(local.turn, args.system)
    finally:
        local.close()
    return 0
