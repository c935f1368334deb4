"""Greedy sampling from model-dtype logits (csrc/greedy_sampler.cpp <->
sampler.greedy_argmax_torch): the same tokens as torch.argmax over the float32
logits, ties and NaNs included, and the same tokens through the engine as the
full sampler path."""

from __future__ import annotations

import pytest
import torch

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams
from enginecore.model.sampler import SamplingRow, greedy_argmax, plain_greedy
from helpers import run_to_completion
from tiny_models import hf_greedy, make_tiny_model


def reference(logits: torch.Tensor) -> list[int]:
    return logits.float().argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 49152), (7, 1000), (64, 300), (3, 1), (2, 257)])
def test_argmax_equals_torch(hot_path, dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(dtype)
    assert greedy_argmax(x) == reference(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_nans_and_infinities_as_torch(hot_path, dtype):
    x = torch.randn(8, 2000, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[0, [5, 900, 1999]] = 50.0  # ties across blocks: the first wins
    x[1, [300, 301]] = 50.0  # ties in one block
    x[2] = float("-inf")  # all -inf: index 0
    x[3, 1500] = float("nan")  # a NaN is the maximum
    x[3, 10] = 80.0
    x[4, [700, 40]] = float("nan")  # the first NaN
    x[5, 1234] = float("inf")
    x[6] = 0.0
    x[6, 999] = -0.0  # -0 == +0: the first index
    x[7, 1999] = 60.0  # the last column
    assert greedy_argmax(x) == reference(x) == x.argmax(dim=-1).tolist()


def test_strided_rows(hot_path):
    base = torch.randn(6, 512, generator=torch.Generator().manual_seed(2)).bfloat16()
    view = base[::2, :300]  # row stride 1024 elements, contiguous columns
    assert greedy_argmax(view) == reference(view)


def _row(**kw) -> SamplingRow:
    params = SamplingParams(**{"temperature": 0, "max_tokens": 4, **kw})
    return SamplingRow(params, [1, 2], [], 2, eos_token_id=0)


def test_plain_greedy_only_when_nothing_reads_the_logits():
    assert plain_greedy([_row(), _row(ignore_eos=True)])
    assert not plain_greedy([_row(), _row(temperature=0.7)])
    assert not plain_greedy([_row(logprobs=0)])
    assert not plain_greedy([_row(repetition_penalty=1.2)])
    assert not plain_greedy([_row(logit_bias={3: 1.0})])
    assert not plain_greedy([_row(allowed_token_ids=[3, 4])])
    assert not plain_greedy([_row(bad_words_token_ids=[[3]])])
    assert not plain_greedy([_row(min_tokens=2)])  # EOS still banned
    assert plain_greedy([_row(min_tokens=2, ignore_eos=True)])  # nothing to ban


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "llama", seed=5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_fast_path_gives_the_sampler_tokens(tiny, hot_path, dtype):
    """logprobs=0 takes the full sampler (float32 logits); plain greedy the fast path."""
    prompts = {"a": [5, 6, 7], "b": [9, 3], "c": [11, 12, 13, 14, 15]}

    def run(**kw):
        eng = EngineCore(EngineArgs(model=tiny, dtype=dtype, block_size=4,
                                    max_model_len=128).create_engine_config())
        for rid, p in prompts.items():
            eng.add_request(EngineCoreRequest(rid, p, SamplingParams(
                max_tokens=10, temperature=0, ignore_eos=True, **kw)))
        out = run_to_completion(eng)
        eng.shutdown()
        return {rid: out[rid]["tokens"] for rid in prompts}

    fast = run()
    assert fast == run(logprobs=0)
    if dtype == "float32":
        assert fast == {rid: hf_greedy(tiny, p, 10) for rid, p in prompts.items()}
