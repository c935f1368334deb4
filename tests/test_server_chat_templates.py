"""`enginecore serve` on folders saved by transformers' save_pretrained (template in
chat_template.jinja; named templates), --chat-template, and request templates:
refused unless --trust-request-chat-template, then cut off without stalling the
other clients' streams."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from server_helpers import ServerProcess, make_tiny_chat_model
from test_chat_templates import DEFAULT, NESTED, TOOL_USE, TOOLS, _hf_tokenizer

ARGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(32 << 20),
        "--dtype", "float32"]


def _saved_folder(tmp_path_factory, template) -> str:
    from transformers import AutoTokenizer

    src = make_tiny_chat_model(str(tmp_path_factory.mktemp("src")))
    tok = _hf_tokenizer(src)
    tok.chat_template = template
    tok.save_pretrained(src)  # over the hand-written files: chat_template.jinja now
    assert AutoTokenizer.from_pretrained(src).chat_template is not None
    return src


@pytest.fixture(scope="module")
def named_server(tmp_path_factory):
    folder = _saved_folder(tmp_path_factory, {"default": DEFAULT, "tool_use": TOOL_USE})
    srv = ServerProcess([folder, *ARGS])
    yield srv, folder
    srv.stop()


@pytest.fixture(scope="module")
def trusting_server(tmp_path_factory):
    folder = _saved_folder(tmp_path_factory, DEFAULT)
    override = tmp_path_factory.mktemp("tpl") / "override.jinja"
    override.write_text("OVERRIDE{% for m in messages %}{{ m['content'] }}{% endfor %}")
    srv = ServerProcess([folder, *ARGS, "--trust-request-chat-template",
                         "--chat-template", str(override)])
    yield srv
    srv.stop()


def _prompt_of(srv, **body) -> str:
    """The rendered prompt, as the byte-level tokenizer's prompt token count says."""
    with srv.client() as http:
        r = http.post("/v1/chat/completions", json={"max_tokens": 1, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_chat_on_a_save_pretrained_folder_with_named_templates(named_server):
    from transformers import AutoTokenizer

    srv, folder = named_server
    client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "hello"}]
    out = client.chat.completions.create(model=folder, messages=messages, max_tokens=3,
                                         temperature=0)
    hf = AutoTokenizer.from_pretrained(folder)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(text.encode())
    with_tools = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                        add_generation_prompt=True)
    assert with_tools.startswith("TOOLS=")
    assert _prompt_of(srv, messages=messages, tools=TOOLS, tool_choice="none") == \
        len(with_tools.encode())


def test_request_template_refused_by_default(named_server):
    srv, _ = named_server
    with srv.client() as http:
        for body in ({"chat_template": "{{ 'x' }}"},
                     {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}):
            r = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **body})
            assert r.status_code == 400
            assert "--trust-request-chat-template" in r.json()["error"]["message"]


def test_chat_template_flag_replaces_the_models(trusting_server):
    assert _prompt_of(trusting_server, messages=[{"role": "user", "content": "ab"}]) == \
        len("OVERRIDEab")


def test_trusted_request_template_renders(trusting_server):
    assert _prompt_of(trusting_server, messages=[{"role": "user", "content": "ab"}],
                      chat_template="T:{{ messages[0]['content'] }}") == len("T:ab")


def test_nested_loop_probe_is_cut_off_and_streams_keep_flowing(trusting_server):
    """The issue's probe: 400 quickly, while a stream held open keeps its chunks
    coming (inter-chunk gap under 0.5 s)."""
    gaps: list[float] = []
    done = threading.Event()

    def stream() -> None:
        with httpx.Client(base_url=trusting_server.url, timeout=120) as http, http.stream(
                "POST", "/v1/completions", json={
                    "prompt": "x", "max_tokens": 400, "ignore_eos": True,
                    "stream": True}) as r:
            last = time.monotonic()
            for line in r.iter_lines():
                if line.startswith("data:"):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
        done.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    time.sleep(1.0)  # the stream is flowing
    answers = []
    with trusting_server.client() as http:
        for _ in range(2):
            t0 = time.monotonic()
            r = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                "chat_template": NESTED})
            answers.append((r.status_code, r.json()["error"]["message"],
                            time.monotonic() - t0))
    t.join(120)
    assert done.is_set()
    for status, message, seconds in answers:
        assert status == 400 and "chat template" in message
        assert seconds < 4
    assert len(gaps) > 100
    assert max(gaps[3:]) < 0.5, sorted(gaps)[-5:]
