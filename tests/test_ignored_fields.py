"""Fields a request body carries that the server does not know: ignored (the
request still runs) and named in the log, as vLLM's server does."""

import logging

import msgspec
import pytest

from enginecore.entrypoints.openai import ignored_fields as ig
from enginecore.entrypoints.openai.errors import APIError
from enginecore.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from enginecore.entrypoints.openai.serving_engine import decode_body

LOGGER = "enginecore.entrypoints.openai.ignored_fields"


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(ig, "_warned", set())


def test_unknown_top_level_fields_are_named_once(caplog):
    body = (b'{"model": "m", "prompt": "hi", "max_tokens": 3, "max_completion_token": 5, '
            b'"zz_extra": {"nested": [1, 2]}}')
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        req = decode_body(body, CompletionRequest)
        decode_body(body, CompletionRequest)
    assert req.max_tokens == 3 and req.prompt == "hi"
    records = [r for r in caplog.records if r.name == LOGGER]
    assert [r.levelno for r in records] == [logging.WARNING, logging.DEBUG]
    assert "present in the request but ignored" in records[0].getMessage()
    assert "max_completion_token" in records[0].getMessage()
    assert "zz_extra" in records[0].getMessage()


def test_known_fields_and_vllm_extras_are_not_reported(caplog):
    body = msgspec.json.encode({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": 5,
        "min_p": 0.1, "repetition_penalty": 1.1, "max_completion_tokens": 4, "seed": 1,
        "stream": False, "stream_options": None, "tools": None, "tool_choice": "none",
    })
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        decode_body(body, ChatCompletionRequest)
    assert not [r for r in caplog.records if r.name == LOGGER]
    assert ig.ignored_fields(body, ChatCompletionRequest) == []


def test_nested_unknown_keys_are_not_top_level():
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x", "name2": 1}]}'
    assert ig.ignored_fields(body, ChatCompletionRequest) == []
    assert ig.ignored_fields(b'{"model": "m", "b": 1, "a": 2}', ChatCompletionRequest) == ["a", "b"]


def test_bodies_that_are_not_objects_report_nothing():
    assert ig.ignored_fields(b"[1, 2]", CompletionRequest) == []
    assert ig.ignored_fields(b"not json", CompletionRequest) == []


def test_a_huge_body_of_unknown_keys_costs_one_bounded_scan(monkeypatch):
    # a body past the full-scan bound names only its first unknown field, and
    # never builds a dict of its keys
    monkeypatch.setattr(ig, "FULL_SCAN_MAX_BYTES", 1000)
    keys = ", ".join(f'"k{i}": {i}' for i in range(5000))
    body = ('{"model": "m", "prompt": "hi", ' + keys + "}").encode()

    def refuse(_body):
        raise AssertionError("the key dict was built for a body past the bound")

    monkeypatch.setattr(ig, "_key_decoder", type("D", (), {"decode": staticmethod(refuse)}))
    assert ig.ignored_fields(body, CompletionRequest) == ["k0"]


def test_renamed_fields_count_as_known():
    # a field whose body name differs from its Python name (msgspec rename)
    for f in msgspec.structs.fields(ChatCompletionRequest):
        body = msgspec.json.encode({"model": "m", "messages": [], f.encode_name: None})
        assert ig.ignored_fields(body, ChatCompletionRequest) == [], f.encode_name


def test_what_is_logged_and_kept_is_bounded(caplog):
    names = [f"k{i}" for i in range(100)] + ["x" * 100_000]
    body = msgspec.json.encode({"model": "m", "prompt": "hi", **{n: 1 for n in names}})
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        decode_body(body, CompletionRequest)
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    message = record.getMessage()
    assert len(message) < 4000 and "more" in message
    assert all(len(k) <= 67 for s in ig._warned for k in s)


def test_listing_failures_never_fail_the_request(monkeypatch, caplog):
    def deep(_body, _kind):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(ig, "ignored_fields", deep)
    body = b'{"model": "m", "prompt": "hi", "zz": 1}'
    assert decode_body(body, CompletionRequest).prompt == "hi"


def test_a_body_nested_near_the_limit_still_runs():
    # unknown field holding JSON nested just under what the real decode accepts
    for depth in range(900, 1100, 7):
        body = ('{"model": "m", "prompt": "hi", "zz": ' + "[" * depth + "]" * depth + "}").encode()
        try:
            req = decode_body(body, CompletionRequest)
        except APIError as e:  # the real decode's own 400 for too deep a body
            assert e.status == 400, repr(e)
        else:
            assert req.prompt == "hi"
