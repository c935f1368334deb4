"""The server's pure pieces, in process: flags, request decoding, field mapping,
logprobs shapes, admission (no engine; the end-to-end tests are test_server_*)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from enginecore.entrypoints.cli import build_parser
from enginecore.entrypoints.cli_common import UserError
from enginecore.entrypoints.openai.admission import Admission
from enginecore.entrypoints.openai.errors import APIError
from enginecore.entrypoints.openai.launcher import engine_args_of, process_capacity
from enginecore.entrypoints.openai.logprobs import TokenText, chat_logprobs, completion_logprobs
from enginecore.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from enginecore.entrypoints.openai.sampling import structured_outputs_of, to_sampling_params
from enginecore.entrypoints.openai.serving_completion import parse_prompts
from enginecore.entrypoints.openai.serving_engine import decode_body
from enginecore.entrypoints.openai.serving_models import ServingModels, parse_lora_module
from enginecore.outputs import Logprob
from enginecore.sampling_params import RequestOutputKind


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_serve_flags_are_vllms_and_every_engine_arg():
    args = serve_args("/models/x", "--host", "0.0.0.0", "--port", "9000", "--api-key", "k",
                      "--served-model-name", "a", "b", "--max-model-len", "512",
                      "--dtype", "float32", "--max-num-seqs", "8", "--data-parallel-size", "2",
                      "--api-server-count", "3", "--max-queued-requests", "10",
                      "--shutdown-timeout", "4", "--lora-modules", "l1=/tmp",
                      '{"name": "l2", "path": "/tmp"}', "--block-size", "32")
    ea = engine_args_of(args)
    assert (ea.model, ea.max_model_len, ea.dtype, ea.max_num_seqs, ea.data_parallel_size,
            ea.block_size) == ("/models/x", 512, "float32", 8, 2, 32)
    assert ea.enable_lora  # --lora-modules turns LoRA on
    assert [m.name for m in args.lora_modules] == ["l1", "l2"]
    assert (args.host, args.port, args.served_model_name) == ("0.0.0.0", 9000, ["a", "b"])
    # (8 seqs x 2 ranks + 10 queued) over 3 API servers, rounded up
    assert process_capacity(args, ea) == 9
    defaults = serve_args()
    assert (defaults.host, defaults.port, engine_args_of(defaults).model) == ("127.0.0.1",
                                                                              8000, None)
    # Without --max-queued-requests: --max-sequences-in-flight, 16 x max_num_seqs by default.
    assert process_capacity(defaults, engine_args_of(defaults)) == 16 * engine_args_of(
        defaults).max_num_seqs
    with pytest.raises(UserError, match="two models given"):
        engine_args_of(serve_args("a", "--model", "b"))
    with pytest.raises(ValueError):
        parse_lora_module("no-equals-sign")


def test_request_bodies_decode_validate_and_ignore_unknown_fields():
    req = decode_body(b'{"prompt": "x", "temperature": 0, "unknown": {"a": 1}, "top_k": 5}',
                      CompletionRequest)
    assert req.temperature == 0.0 and req.top_k == 5 and req.max_tokens == 16
    chat = decode_body(b'{"messages": [{"role": "user", "content": [{"type": "text", '
                       b'"text": "hi"}], "extra": true}], "max_completion_tokens": 3}',
                       ChatCompletionRequest)
    assert chat.messages[0].content[0]["text"] == "hi" and chat.max_tokens is None
    for body, param in ((b'{"prompt": "x", "n": "two"}', "n"),
                        (b'{"messages": [{"content": "x"}]}', "messages[0].role"),
                        (b'{"temperature": 1}', "prompt")):
        with pytest.raises(APIError) as e:
            decode_body(body, CompletionRequest if b"messages" not in body
                        else ChatCompletionRequest)
        assert (e.value.status, e.value.param) == (400, param)
    with pytest.raises(APIError):
        decode_body(b"", CompletionRequest)


def test_prompt_forms():
    assert parse_prompts("a") == ["a"]
    assert parse_prompts(["a", "b"]) == ["a", "b"]
    assert parse_prompts([1, 2]) == [[1, 2]]
    assert parse_prompts([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in ([], [1, "a"], [[1], []]):
        with pytest.raises(APIError):
            parse_prompts(bad)


def _req(**fields) -> CompletionRequest:
    return msgspec.convert({"prompt": "x", **fields}, CompletionRequest)


def test_fields_map_to_sampling_params():
    sp = to_sampling_params(_req(n=2, temperature=0.5, top_p=0.9, top_k=4, min_p=0.1, seed=3,
                                 stop="x", presence_penalty=0.1, frequency_penalty=0.2,
                                 repetition_penalty=1.1, ignore_eos=True, min_tokens=2,
                                 stop_token_ids=[7], include_stop_str_in_output=True),
                            max_tokens=9, logprobs=2, stream=True)
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed, sp.stop,
            sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.ignore_eos,
            sp.min_tokens, sp.stop_token_ids, sp.max_tokens, sp.logprobs) == (
        2, 0.5, 0.9, 4, 0.1, 3, ["x"], 0.1, 0.2, 1.1, True, 2, [7], 9, 2)
    assert sp.include_stop_str_in_output and sp.output_kind == RequestOutputKind.DELTA
    plain = to_sampling_params(_req(), max_tokens=None, logprobs=None, stream=False)
    assert (plain.temperature, plain.output_kind) == (1.0, RequestOutputKind.FINAL_ONLY)
    for bad in (dict(use_beam_search=True), dict(best_of=3), dict(logit_bias={"x": 1.0}),
                dict(top_p=2.0), dict(n=0), dict(truncate_prompt_tokens=0),
                dict(allowed_token_ids=[]), dict(prompt_logprobs=21)):
        with pytest.raises(APIError) as e:
            to_sampling_params(_req(**bad), max_tokens=4, logprobs=None, stream=False)
        assert e.value.status == 400
    with pytest.raises(APIError, match="stream"):
        to_sampling_params(_req(prompt_logprobs=1), max_tokens=4, logprobs=None, stream=True)


def test_vllm_extra_fields_map_to_sampling_params():
    """OpenAI's logit_bias has string keys and biases clamped to [-100, 100] (vLLM);
    vLLM's extra fields pass through."""
    sp = to_sampling_params(_req(logit_bias={"5": 1.5, "7": -300, "9": 250},
                                 allowed_token_ids=[1, 2], bad_words=["no"],
                                 prompt_logprobs=3, truncate_prompt_tokens=-1),
                            max_tokens=4, logprobs=None, stream=False)
    assert sp.logit_bias == {5: 1.5, 7: -100.0, 9: 100.0}
    assert (sp.allowed_token_ids, sp.bad_words, sp.prompt_logprobs,
            sp.truncate_prompt_tokens) == ([1, 2], ["no"], 3, -1)


def test_structured_output_sources():
    schema = {"type": "object"}
    assert structured_outputs_of(_req(response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}})).json == schema
    assert structured_outputs_of(_req(response_format={"type": "json_object"})).json == schema
    assert structured_outputs_of(_req(response_format={"type": "text"})) is None
    assert structured_outputs_of(_req(guided_choice=["a", "b"])).choice == ["a", "b"]
    assert structured_outputs_of(_req(guided_json='{"type": "string"}')).json is not None
    assert structured_outputs_of(_req(structured_outputs={"regex": "a+"})).regex == "a+"
    assert structured_outputs_of(_req(structured_outputs={"grammar": "g"})).grammar == "g"
    assert structured_outputs_of(_req(structured_outputs={"json_object": True})).json == schema
    for bad in (dict(guided_regex="a", guided_choice=["b"]),
                dict(structured_outputs={"regex": "a", "choice": ["b"]}),
                dict(structured_outputs={}), dict(guided_choice=[]),
                dict(response_format={"type": "json_schema"})):
        with pytest.raises(APIError):
            structured_outputs_of(_req(**bad))
    with pytest.raises(msgspec.ValidationError):
        _req(response_format={"type": "yaml"})


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def test_logprobs_shapes():
    # two tokens; the first sampled at rank 1, the second at rank 3 (outside the top 2)
    entries = [{5: Logprob(-0.1, 1, "a"), 6: Logprob(-2.0, 2, "b")},
               {9: Logprob(-3.0, 3, "z"), 5: Logprob(-0.5, 1, "a"), 6: Logprob(-1.0, 2, "b")}]
    text_of = TokenText(_Tok(), as_ids=False)
    comp = completion_logprobs([5, 9], entries, 2, text_of, offset=4)
    assert comp.tokens == ["a", "z"] and comp.token_logprobs == [-0.1, -3.0]
    assert comp.text_offset == [4, 5]
    assert comp.top_logprobs == [{"a": -0.1, "b": -2.0}, {"a": -0.5, "b": -1.0}]
    chat = chat_logprobs([5, 9], entries, 2, text_of).content
    assert [(t.token, t.logprob, t.bytes) for t in chat] == [("a", -0.1, [97]),
                                                             ("z", -3.0, [122])]
    assert [[x.token for x in t.top_logprobs] for t in chat] == [["a", "b"], ["a", "b"]]
    inf = completion_logprobs([5], [{5: Logprob(float("-inf"), 1, None)}], 0,
                              TokenText(_Tok(), as_ids=True), 0)
    assert inf.tokens == ["token_id:5"] and inf.token_logprobs == [-9999.0]
    assert inf.top_logprobs == [None]


def test_admission_bound_and_drain():
    class Engine:
        aborted: list = []

        async def abort(self, ids):
            self.aborted.extend(ids)

    adm = Admission(Engine(), capacity=3)
    a = adm.admit(["a"], 2)
    with pytest.raises(APIError) as e:
        adm.admit(["b"], 2)
    assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
    b = adm.admit(["b"], 1)
    b.release()
    b.release()  # twice is once
    assert adm.in_flight == 2 and adm.live_request_ids == ["a"]
    adm.draining = True
    with pytest.raises(APIError) as e:
        adm.admit(["c"], 1)
    assert e.value.status == 503
    assert not asyncio.run(adm.wait_idle(0.1))
    asyncio.run(adm.abort_all())
    assert Engine.aborted == ["a"]
    a.release()
    assert asyncio.run(adm.wait_idle(0.1))


def test_model_names():
    models = ServingModels(["a", "b"], "/m", 128, [parse_lora_module("l=/tmp")])
    assert models.resolve(None) == ("a", None)
    assert models.resolve("b") == ("b", None)
    name, lora = models.resolve("l")
    assert name == "l" and (lora.lora_name, lora.lora_int_id) == ("l", 1)
    with pytest.raises(APIError) as e:
        models.resolve("zzz")
    assert e.value.status == 404
    assert [c.id for c in models.model_list().data] == ["a", "b", "l"]
    with pytest.raises(ValueError):
        ServingModels(["a"], "/m", 128, [parse_lora_module("a=/tmp")])
