"""Servers for the API tests: a tiny chat model (random weights, a byte-level
tokenizer, a chat template) and ``enginecore serve`` as a real subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from tiny_models import make_tiny_model

_SPECIALS = ["<unk>", "<s>", "</s>"]
TINY_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in of each byte (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def make_tiny_chat_model(path: str, seed: int = 0) -> str:
    """A tiny Llama (vocab 256) with a byte-level tokenizer: ids 0-2 are <unk>, <s>,
    </s> (special; bos 1, eos 2), ids 3-255 the bytes 3-255, so any text without
    bytes 0-2 round-trips; a chat template for /v1/chat/completions."""
    make_tiny_model(path, "llama", seed=seed)
    vocab = {tok: i for i, tok in enumerate(_SPECIALS)}
    for b, ch in enumerate(_byte_chars()):
        if b >= len(_SPECIALS):
            vocab[ch] = b
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for i, t in enumerate(_SPECIALS)],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": TINY_TEMPLATE}, f)
    return path


class ServerProcess:
    """``enginecore serve ARGS`` (or another serving subcommand: ``proxy``) in a
    subprocess; its URL once it announces itself."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 startup_timeout_s: float = 180.0, command: str = "serve") -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="enginecore-serve-",
                                               suffix=".log", delete=False)
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "enginecore.entrypoints.cli", "--log-level", "INFO",
             command, "--port", "0", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=full_env)
        self.url = self._wait_announced(startup_timeout_s)
        self.base_url = self.url + "/v1"

    def _wait_announced(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.output()
            match = re.search(r"serving on (http://[0-9.]+:\d+)", text)
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{text}")
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"the server did not start in {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def engine_pids(self) -> list[int]:
        """The engine processes (spawned children that are not multiprocessing's
        resource tracker)."""
        import psutil

        pids = []
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            cmd = " ".join(child.cmdline())
            if "multiprocessing" in cmd and "resource_tracker" not in cmd:
                pids.append(child.pid)
        return pids

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then the exit code (killed if it does not exit in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"the server ignored SIGTERM for {timeout_s} s:\n"
                                 f"{self.output()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.terminate(30)
            except AssertionError:
                pass
        self.log.close()
        os.unlink(self.log.name)
