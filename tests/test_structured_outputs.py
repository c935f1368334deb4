"""Structured outputs (llguidance) with the default model: JSON schema, regex,
choice, grammar; identical greedy output with a batch queue; bad constraints
fail only their request."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from enginecore import EngineCoreRequest, SamplingParams
from enginecore.entrypoints.llm import LLM
from enginecore.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with name, age and city."}]


@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=1024, kv_cache_memory_bytes=128 << 20) as engine:
        yield engine


def test_json_schema_20_generations_validate(llm):
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=i,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA))
              for i in range(20)]
    outs = llm.chat([ASK] * 20, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # sampling still samples inside the constraint


def test_regex_and_choice_hold_on_every_output(llm):
    regex = r"\d{3}-\d{4}"
    outs = llm.generate(["Call me at"] * 8, [SamplingParams(
        max_tokens=20, temperature=1.0, seed=i,
        structured_outputs=StructuredOutputsParams(regex=regex)) for i in range(8)],
        use_tqdm=False)
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outs)
    choices = ["yes", "no", "maybe"]
    outs = llm.generate(["Is Paris in France? Answer:"] * 8, [SamplingParams(
        max_tokens=10, temperature=1.0, seed=i,
        structured_outputs=StructuredOutputsParams(choice=choices)) for i in range(8)],
        use_tqdm=False)
    assert all(o.outputs[0].text in choices for o in outs)
    grammar = 'start: "A" ("B" | "C")+ "."'
    (out,) = llm.generate(["Letters:"], SamplingParams(
        max_tokens=12, temperature=0, structured_outputs=StructuredOutputsParams(grammar=grammar)),
        use_tqdm=False)
    assert re.fullmatch(r"A[BC]+\.", out.outputs[0].text)


def test_invalid_schema_fails_only_that_request(llm):
    bad = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(json="{bad"))
    good = SamplingParams(max_tokens=5, temperature=0)
    # The front-end compiles the constraint first: the caller gets the error, and
    # nothing of the batch is sent.
    with pytest.raises(ValueError, match="invalid json constraint"):
        llm.generate(["a", "b"], [bad, good], use_tqdm=False)
    assert not llm.output_processor.has_unfinished_requests()
    # Sent past the front-end, the engine still fails only that request.
    ids = llm.get_tokenizer().encode("a")
    llm.client.add_request(EngineCoreRequest("raw-bad", ids, bad))
    llm.client.add_request(EngineCoreRequest("raw-good", ids, good))
    finish = {}
    while len(finish) < 2:
        for o in llm.client.get_output().outputs:
            if o.finish_reason is not None:
                finish[o.request_id] = (str(o.finish_reason), o.stop_reason)
    assert finish["raw-bad"][0] == "error" and "invalid json constraint" in finish["raw-bad"][1]
    assert finish["raw-good"][0] == "length"
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])


def test_greedy_constrained_identical_with_batch_queue():
    params = SamplingParams(max_tokens=120, temperature=0,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    texts = {}
    for batches in (1, 2):
        with LLM(multiprocess_mode=False, max_model_len=1024, kv_cache_memory_bytes=64 << 20,
                 max_concurrent_batches=batches) as llm:
            outs = llm.chat([ASK, [{"role": "user", "content": "A JSON person from Rome."}]],
                            params, use_tqdm=False)
            texts[batches] = [o.outputs[0].text for o in outs]
    assert texts[1] == texts[2]
    for t in texts[1]:
        jsonschema.validate(json.loads(t), SCHEMA)


def test_structured_outputs_on_both_paths_in_process(hot_path):
    with LLM(multiprocess_mode=False, max_model_len=512, kv_cache_memory_bytes=32 << 20) as llm:
        (out,) = llm.generate(["Answer:"], SamplingParams(
            max_tokens=8, temperature=0,
            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"])),
            use_tqdm=False)
    assert out.outputs[0].text in ("alpha", "beta")


def test_bounds_and_a_pathological_constraint_through_llm_generate(llm):
    """Issue 13: a SamplingParams changed after construction is refused before it is
    sent; a regex whose masks cost ~15-50 ms each (it would slow every request on
    the engine) is refused, while a sane constraint in the same batch is served.
    (The temperature floor: test_faults_model.py.)"""
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=2**63)
    sp = SamplingParams(max_tokens=4, temperature=0)
    sp.max_tokens = 2**63
    with pytest.raises(ValueError, match=r"max_tokens must be an int in \[1, "):
        llm.generate("Hello", sp, use_tqdm=False)
    # The front-end compiles the constraint as the engine would and refuses it at
    # the caller (issue 12: nothing travels to the engine only to be dropped there);
    # sent past the front-end, the engine refuses it alone (below).
    slow = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        regex="a{100000}"))
    with pytest.raises(ValueError, match="over the per-step budget"):
        llm.generate("Say a:", slow, use_tqdm=False)
    ids = llm.get_tokenizer().encode("Say a:")
    llm.client.add_request(EngineCoreRequest("raw-slow", ids, slow))
    llm.client.add_request(EngineCoreRequest("raw-sane", ids, SamplingParams(
        max_tokens=3, temperature=0)))
    finish = {}
    while len(finish) < 2:
        for o in llm.client.get_output().outputs:
            if o.finish_reason is not None:
                finish[o.request_id] = (str(o.finish_reason), o.stop_reason)
    assert finish["raw-slow"][0] == "error" and "per-step budget" in finish["raw-slow"][1]
    assert finish["raw-sane"][0] == "length"
    outs = llm.generate(["Say a:", "Digits:"], [
        SamplingParams(max_tokens=8, temperature=0),
        SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(
            regex=r"\d{3}"))], use_tqdm=False)
    assert len(outs[1].outputs[0].text) == 3 and outs[1].outputs[0].text.isdigit()
