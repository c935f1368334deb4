"""The fault suite with real models (issue 13): a request that makes the torch
model runner raise ends alone; the temperature floor. (Bounds and a pathological
constraint through ``LLM.generate`` on the default model: test_structured_outputs.py,
which has that engine up already.)"""

from __future__ import annotations

import pytest
import torch

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, FinishReason, SamplingParams
from enginecore.model.sampler import Sampler, SamplingRow
from helpers import run_to_completion


def test_a_tiny_temperature_samples_greedily():
    """1e-45 is a valid temperature; dividing by it gave inf/NaN logits and token 0
    forever. Below the floor (1e-5) sampling is greedy."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 10
    rows = [SamplingRow(SamplingParams(temperature=t, seed=1), [1], [], 5, None)
            for t in (1e-45, 1e-30, 1e-6, 0.0)]
    out = Sampler(50)(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert not SamplingParams(temperature=2e-5).greedy and SamplingParams(temperature=9e-6).greedy


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny_models import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-faults")), "llama", seed=3,
                           vocab_size=16)


def test_a_request_that_makes_the_model_runner_raise_ends_alone(tiny_dir, hot_path):
    """20 logprobs of a 16-token vocabulary make the logprob kernel's check raise
    inside the runner's step: that request ends with ERROR and the message, the
    batch's other requests finish with exactly the tokens they get without it."""
    cfg = EngineArgs(model=tiny_dir, dtype="float32", block_size=4, max_model_len=64,
                     kv_cache_memory_bytes=4 << 20).create_engine_config()

    def greedy(i):
        return EngineCoreRequest(f"m{i}", [i % 13 + 3, 5, 7, i % 5 + 1], SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True))

    ref = EngineCore(cfg)
    for i in range(6):
        ref.add_request(greedy(i))
    expected = {k: v["tokens"] for k, v in run_to_completion(ref).items()}
    ref.shutdown()
    eng = EngineCore(cfg)
    for i in range(6):
        eng.add_request(greedy(i))
        if i == 2:
            eng.add_request(EngineCoreRequest("bad", [4, 5], SamplingParams(
                max_tokens=8, logprobs=20)))
    res = run_to_completion(eng)
    assert res["bad"]["finish_reason"] is FinishReason.ERROR
    assert ("model runner failed on this request: ValueError: n must be in [0, 16], got 20"
            in res["bad"]["stop_reason"])
    assert {k: v["tokens"] for k, v in res.items() if k != "bad"} == expected
    assert eng.fault_isolation.num_culprits == 1
    eng.shutdown()
