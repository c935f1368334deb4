"""Input processing without an engine: tokenization, chat templates, and every
check that makes a bad request fail at the caller."""

from __future__ import annotations

import json
import os

import pytest

from enginecore import EngineArgs, SamplingParams
from enginecore.frontend.async_llm import load_tokenizer
from enginecore.frontend.input_processor import InputProcessor
from enginecore.protocol import LoRARequest, PoolingParams
from enginecore.sampling_params import StructuredOutputsParams


def processor(model: str, **kw) -> InputProcessor:
    config = EngineArgs(model=model, max_model_len=64, **kw).create_engine_config()
    return InputProcessor(config, load_tokenizer(config))


@pytest.fixture(scope="module")
def ip(tiny_chat_model) -> InputProcessor:
    return processor(tiny_chat_model)


def test_prompts_of_every_shape(ip):
    ids = ip.tokenizer.encode("héllo")
    for prompt in ("héllo", {"prompt": "héllo"}, {"prompt_token_ids": ids},
                   {"prompt": "héllo", "prompt_token_ids": ids, "cache_salt": "s"}):
        text, req = ip.process_inputs("r", prompt, SamplingParams(max_tokens=5))
        assert req.prompt_token_ids == ids and req.request_id == "r"
        assert text == (None if prompt == {"prompt_token_ids": ids} else "héllo")
    assert req.cache_salt == "s"


def test_max_tokens_none_is_the_room_left_and_params_are_copied(ip):
    sp = SamplingParams(max_tokens=None, stop="x")
    _, req = ip.process_inputs("r", {"prompt_token_ids": [5] * 10}, sp)
    assert req.sampling_params.max_tokens == 54 and sp.max_tokens is None
    assert req.sampling_params.stop == ["x"]


@pytest.mark.parametrize("prompt, params, kwargs, exc, match", [
    ({"prompt_token_ids": [5] * 64}, SamplingParams(), {}, ValueError, "no room"),
    ({"prompt_token_ids": [5] * 60}, SamplingParams(max_tokens=5), {}, ValueError,
     "maximum context length is 64"),
    ({"prompt_token_ids": [5, 320]}, SamplingParams(), {}, ValueError, r"\[0, 320\)"),
    ({"prompt_token_ids": [5, -1]}, SamplingParams(), {}, ValueError, "vocabulary"),
    ({"prompt_token_ids": [5, True]}, SamplingParams(), {}, TypeError, "ints"),
    ({"prompt_token_ids": "5 6"}, SamplingParams(), {}, TypeError, "list of ints"),
    ({"prompt_token_ids": []}, SamplingParams(), {}, ValueError, "empty"),
    ("", SamplingParams(), {}, ValueError, "empty"),
    ({}, SamplingParams(), {}, ValueError, "needs 'prompt'"),
    ({"prompt": 5}, SamplingParams(), {}, TypeError, "must be a str"),
    (["a"], SamplingParams(), {}, TypeError, "a prompt is"),
    ("hi", {"max_tokens": 3}, {}, TypeError, "SamplingParams"),
    ("hi", PoolingParams(), {}, ValueError, "'embed' task"),
    ("hi", SamplingParams(stop_token_ids=[400]), {}, ValueError, "stop_token_ids"),
    ("hi", SamplingParams(seed=2**63 - 2, n=3), {}, ValueError, "seed"),
    ("hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")), {},
     ValueError, "invalid regex"),
    ("hi", SamplingParams(), {"priority": 1}, ValueError, "priority"),
    ("hi", SamplingParams(), {"priority": "1"}, TypeError, "priority"),
    ("hi", SamplingParams(), {"data_parallel_rank": 1}, ValueError, "data_parallel_rank"),
    ("hi", SamplingParams(), {"cache_salt": ""}, ValueError, "cache_salt"),
    ("hi", SamplingParams(), {"lora_request": LoRARequest("a", 1, "/nope")}, ValueError,
     "LoRA is not enabled"),
    ("hi", SamplingParams(), {"lora_request": "a"}, TypeError, "LoRARequest"),
])
def test_bad_requests_raise_at_the_caller(ip, prompt, params, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ip.process_inputs("r", prompt, params, **kwargs)


def test_request_id_must_be_a_string(ip):
    with pytest.raises(TypeError, match="request_id"):
        ip.process_inputs(3, "hi", SamplingParams())


def test_a_mutated_params_object_is_checked_again(ip):
    sp = SamplingParams()
    sp.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        ip.process_inputs("r", "hi", sp)


def test_lora_adapter_is_checked_when_enabled(tiny_chat_model, tmp_path):
    ip = processor(tiny_chat_model, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="PEFT format"):
        ip.process_inputs("r", "hi", SamplingParams(),
                          lora_request=LoRARequest("a", 1, str(tmp_path)))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 16,
                                                              "target_modules": ["q_proj"]}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="rank 16"):
        ip.process_inputs("r", "hi", SamplingParams(),
                          lora_request=LoRARequest("a", 1, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_int_id"):
        ip.process_inputs("r", "hi", SamplingParams(), lora_request=LoRARequest("a", 0, ""))


def test_no_tokenizer_means_token_ids_only():
    config = EngineArgs(model="synthetic", max_model_len=64).create_engine_config()
    ip = InputProcessor(config, None)
    _, req = ip.process_inputs("r", {"prompt_token_ids": [1, 2]}, SamplingParams())
    assert req.prompt_token_ids == [1, 2]
    with pytest.raises(ValueError, match="no tokenizer"):
        ip.process_inputs("r", "text", SamplingParams())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        ip.process_inputs("r", {"prompt_token_ids": [1]}, SamplingParams(stop="x"))


def test_chat_template_variables_pass_through(ip):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "text", "text": "there"}]}]
    p = ip.render_chat(msgs, tools=[{"name": "f"}])
    assert p["prompt"] == '<s>user\nhi\nthere</s>\n<s>tools\n[{"name": "f"}]</s>\n<s>assistant\n'
    assert p["prompt_token_ids"] == ip.tokenizer.encode(p["prompt"], add_special_tokens=False)
    assert not ip.render_chat(msgs, add_generation_prompt=False)["prompt"].endswith(
        "assistant\n")
    custom = "{{ greeting }} {{ messages[0]['content'] }}"
    assert ip.render_chat([{"role": "user", "content": "x"}], chat_template=custom,
                          chat_template_kwargs={"greeting": "hello"})["prompt"] == "hello x"
    cont = ip.render_chat([{"role": "user", "content": "q"},
                           {"role": "assistant", "content": "The answer is"}],
                          add_generation_prompt=False, continue_final_message=True)
    assert cont["prompt"].endswith("<s>assistant\nThe answer is")


@pytest.mark.parametrize("messages, kwargs, match", [
    ([], {}, "non-empty list"),
    ([{"content": "x"}], {}, "role"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], {}, "not supported"),
    ([{"role": "user"}], {}, "a 'user' message needs 'content'"),
    ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"messages": []}},
     "may not set"),
    ([{"role": "user", "content": "x"}], {"chat_template": "{{ raise_exception('no') }}"},
     "chat template error: no"),
])
def test_bad_chats(ip, messages, kwargs, match):
    # (an assistant turn may omit content: it carried tool calls)
    with pytest.raises(ValueError, match=match):
        ip.render_chat(messages, **kwargs)


def test_the_template_runs_in_a_sandbox(ip):
    from jinja2.exceptions import SecurityError

    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(SecurityError):
        ip.render_chat([{"role": "user", "content": "x"}], chat_template=evil)
    assert os.path.exists(os.path.join(ip.config.model_config.model_path, "tokenizer.json"))
