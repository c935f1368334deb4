"""The offline LLM on the front-end's processors (engine in process, tiny model,
both paths): stop strings, n > 1, logprobs with decoded tokens, special tokens,
chat template variables, validation before sending, metrics."""

from __future__ import annotations

import pytest

from enginecore import LLM, SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture
def llm(tiny_chat_model, hot_path):
    with LLM(tiny_chat_model, multiprocess_mode=False, max_model_len=128,
             kv_cache_memory_bytes=8 << 20, disable_log_stats=False) as llm:
        assert llm.output_processor.uses_native_loop == (hot_path == "native")
        yield llm


def test_stop_strings_n_and_logprobs(llm):
    tok = llm.get_tokenizer()
    (ref,) = llm.generate("héllo", SamplingParams(max_tokens=30, **GREEDY), use_tqdm=False)
    ids = ref.outputs[0].token_ids
    assert ref.outputs[0].text == tok.decode(ids) and len(ids) == 30
    stop = tok.decode(ids[12:14])
    (cut,) = llm.generate("héllo", SamplingParams(max_tokens=30, stop=[stop], **GREEDY),
                          use_tqdm=False)
    text = ref.outputs[0].text
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert (cut.outputs[0].finish_reason, cut.outputs[0].stop_reason) == ("stop", stop)
    (kept,) = llm.generate("héllo", SamplingParams(max_tokens=30, stop=[stop],
                                                   include_stop_str_in_output=True, **GREEDY),
                           use_tqdm=False)
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]

    sp = SamplingParams(n=3, seed=5, max_tokens=8, ignore_eos=True, logprobs=2)
    a, _b = llm.generate(["one", "two"], sp, use_tqdm=False)
    assert [c.index for c in a.outputs] == [0, 1, 2]
    (again,) = llm.generate("one", sp, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in a.outputs]
    for comp in a.outputs:
        assert len(comp.logprobs) == 8
        for tid, pos in zip(comp.token_ids, comp.logprobs):
            assert pos[tid].decoded_token == tok.decode([tid], skip_special_tokens=False)
            assert len(pos) >= 2
        assert comp.cumulative_logprob == pytest.approx(
            sum(pos[t].logprob for t, pos in zip(comp.token_ids, comp.logprobs)))


def test_special_tokens_and_eos(llm):
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    prompt = {"prompt_token_ids": tok.encode("héllo")}
    for skip in (True, False):
        (out,) = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0,
                                                     skip_special_tokens=skip),
                              use_tqdm=False)
        comp = out.outputs[0]
        ids = comp.token_ids
        stopped = comp.finish_reason == "stop"
        assert not stopped or ids[-1] == eos
        assert comp.text == tok.decode(ids[:-1] if stopped else ids, skip_special_tokens=skip)


def test_chat_and_validation(llm):
    outs = llm.chat([[{"role": "user", "content": "hi"}]] * 2,
                    SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False,
                    tools=[{"name": "lookup"}], chat_template_kwargs={"unused": 1})
    assert len(outs) == 2 and outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert "lookup" in outs[0].prompt and outs[0].prompt.endswith("<s>assistant\n")
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate(["fine", "too long"], [SamplingParams(max_tokens=4),
                                            SamplingParams(max_tokens=500)], use_tqdm=False)
    # Nothing of the failed batch went to the engine.
    assert not llm.output_processor.has_unfinished_requests()
    assert llm.client.call_utility("get_request_counts") == (0, 0)


def test_get_metrics(llm):
    llm.generate(["a", "b"], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    names = {m.name for m in llm.get_metrics()}
    assert {"enginecore:time_to_first_token_seconds", "enginecore:generation_tokens",
            "enginecore:num_requests_running", "enginecore:prefix_cache_queries"} <= names
