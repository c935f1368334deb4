"""N-gram speculative decoding: same greedy tokens with and without it."""

from __future__ import annotations

import pytest

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams
from enginecore.model.ngram_proposer import NgramProposer
from helpers import run_to_completion
from tiny_models import make_tiny_model


def test_proposer_finds_the_latest_match():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]
    assert p.propose([5, 6, 7, 8]) == []
    assert p.propose([9, 1, 2, 7, 1, 2, 8, 1, 2]) == [8, 1, 2]  # most recent earlier match
    assert p.propose([256, 1, 256]) == [1, 256]  # byte-level false matches are skipped
    assert p.propose([1, 2, 3, 1, 2, 3], limit=1) == [1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("spec")), "llama", seed=7)


PROMPTS = [[5, 6, 7, 8, 9, 10] * 4, [11, 12, 13] * 6 + [14], list(range(20, 40)),
           [3, 4] * 10]


def run(model, spec_k, **kw):
    eng = EngineCore(EngineArgs(model=model, dtype="float32", block_size=4, max_model_len=256,
                                num_speculative_tokens=spec_k, prompt_lookup_min=1,
                                **kw).create_engine_config(), log_stats=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(EngineCoreRequest(f"s{i}", p, SamplingParams(
            max_tokens=40, temperature=0, ignore_eos=True)))
    res = run_to_completion(eng)
    return {k: v["tokens"] for k, v in res.items()}, eng.scheduler.make_stats()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_tokens_identical_with_and_without_spec(tiny, hot_path, k):
    plain, stats0 = run(tiny, 0)
    spec, stats = run(tiny, k)
    assert spec == plain
    assert all(len(t) == 40 for t in spec.values())
    assert stats0.spec_num_draft_tokens == 0
    assert stats.spec_num_draft_tokens > 0
    assert 0 <= stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens


def test_spec_with_small_budget_and_batch_queue(tiny):
    plain, _ = run(tiny, 0)
    spec, _ = run(tiny, 4, max_num_batched_tokens=8)
    assert spec == plain


@pytest.mark.slow
def test_default_model_greedy_identical_and_accepts_drafts():
    from enginecore.entrypoints.llm import LLM

    prompt = [{"role": "user", "content": "Repeat this list exactly three times: "
               "apple, banana, cherry, date, elderberry, fig, grape."}]
    sp = SamplingParams(max_tokens=64, temperature=0)
    outs = {}
    for k in (0, 4):
        with LLM(multiprocess_mode=False, dtype="float32", max_model_len=512,
                 kv_cache_memory_bytes=64 << 20, num_speculative_tokens=k) as llm:
            outs[k] = llm.chat(prompt, sp)[0].outputs[0].token_ids
            stats = llm.client.engine.make_stats()
            if k:
                assert stats.spec_num_accepted_tokens > 0
    assert outs[4] == outs[0]
