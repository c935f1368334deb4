"""Qwen3, Gemma 2, Phi-3, Mixtral and Qwen3-MoE against transformers on tiny random
weights (tests/tiny_models.py), and a real MoE model under data-parallel lockstep."""

from __future__ import annotations

import time

import pytest
import torch

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams
from enginecore.client import make_client
from helpers import run_to_completion
from test_model_llama import PROMPTS, engine_tokens
from tiny_models import hf_greedy, hf_logits, make_tiny_model

FAMILIES = ["qwen3", "gemma2", "phi3", "mixtral", "qwen3_moe"]
# A KV cache the size these tests need: the CPU default (a quarter of free RAM, up to
# 4 GiB) is millions of tiny-model blocks, seconds of start-up each.
FEW_BLOCKS = {"num_gpu_blocks_override": 512}
# Phi-3's tiny LongRoPE covers 64 positions (original_max_position_embeddings).
EXTRA = {"phi3": {"max_model_len": 64}}


@pytest.fixture(scope="module")
def family_model(tmp_path_factory):
    made: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in made:
            made[kind] = make_tiny_model(str(tmp_path_factory.mktemp(kind)), kind, seed=3)
        return made[kind]

    return get


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_matches_transformers(family_model, kind, hot_path):
    model_dir = family_model(kind)
    eng, got = engine_tokens(model_dir, **FEW_BLOCKS, **EXTRA.get(kind, {}))
    assert eng.model_executor.runner.arch.family == kind
    assert got == {rid: hf_greedy(model_dir, p, 12) for rid, p in PROMPTS.items()}
    assert eng.scheduler.kv_cache_manager.make_prefix_cache_stats().hits >= 16


def logprob_rows(model_dir: str, prompt: list[int], n: int, **kw):
    eng = EngineCore(EngineArgs(model=model_dir, dtype="float32", block_size=4,
                                max_model_len=128, **FEW_BLOCKS, **kw).create_engine_config())
    eng.add_request(EngineCoreRequest("l", prompt, SamplingParams(
        max_tokens=n, temperature=0, logprobs=5, ignore_eos=True)))
    rows = []
    while eng.scheduler.has_requests():
        for outs in eng.step()[0].values():
            for o in outs.outputs:
                if o.new_logprobs:
                    rows += list(zip(o.new_logprobs.token_ids, o.new_logprobs.logprobs))
    return rows


def test_gemma2_final_soft_cap_shows_in_logprobs(family_model):
    """tanh capping keeps the argmax, so greedy tokens cannot see it; logprobs do."""
    model_dir = family_model("gemma2")
    prompt = list(range(10, 30))  # past the 6-token window
    rows = logprob_rows(model_dir, prompt, 3)
    tokens = [ids[0] for ids, _ in rows]
    ref = torch.log_softmax(hf_logits(model_dir, prompt + tokens[:-1]), dim=-1)
    for pos, (ids, vals) in enumerate(rows):
        ref_row = ref[len(prompt) - 1 + pos]
        assert vals == pytest.approx([float(ref_row[i]) for i in ids], abs=1e-4)
    # The cap is what bounds them: every logit within +-8, so no logprob below -16.
    assert float(ref.min()) > -16


def test_longrope_limit(family_model):
    model_dir = family_model("phi3")
    cfg = EngineArgs(model=model_dir, dtype="float32", **FEW_BLOCKS).create_engine_config()
    assert cfg.model_config.max_model_len == 64  # capped at the short factors' range
    with pytest.raises(ValueError, match="LongRoPE.*original_max_position_embeddings=64"):
        EngineArgs(model=model_dir, max_model_len=128).create_engine_config()


@pytest.mark.parametrize("kind", ["gemma2", "qwen3_moe"])
def test_bfloat16_runs_and_mostly_agrees(family_model, kind):
    model_dir = family_model(kind)
    _, got = engine_tokens(model_dir, dtype="bfloat16", **FEW_BLOCKS)
    expected = {rid: hf_greedy(model_dir, p, 12) for rid, p in PROMPTS.items()}
    assert sum(got[r][0] == expected[r][0] for r in PROMPTS) >= 4


def test_moe_is_detected_and_dp2_lockstep_gives_dp1_tokens(family_model, hot_path):
    model_dir = family_model("qwen3_moe")
    prompts = {f"m{i}": [3 + i, 9, 27, 4 + i % 5, 11] for i in range(6)}
    args = dict(model=model_dir, dtype="float32", device="cpu", block_size=4, max_model_len=64,
                **FEW_BLOCKS)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    one = EngineCore(EngineArgs(**args).create_engine_config())  # DP=1
    for rid, p in prompts.items():
        one.add_request(EngineCoreRequest(rid, p, params))
    dp1 = {rid: r["tokens"] for rid, r in run_to_completion(one).items()}
    assert dp1 == {rid: hf_greedy(model_dir, p, 6) for rid, p in prompts.items()}

    cfg = EngineArgs(**args, data_parallel_size=2).create_engine_config()
    assert cfg.model_config.is_moe and cfg.parallel_config.data_parallel_lockstep
    c = make_client(True, False, cfg)
    try:
        for rid, p in prompts.items():
            c.add_request(EngineCoreRequest(rid, p, params))
        got: dict[str, list[int]] = {}
        served = [0, 0]
        done = 0
        while done < len(prompts):
            outs = c.get_output(timeout=60)
            for o in outs.outputs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    done += 1
                    served[outs.engine_index] += 1
        assert min(served) > 0, served  # both ranks ran the MoE model
        assert got == dp1
        # Lockstep: both ranks stepped in the same waves.
        # (The last outputs can reach us before the other rank has closed the wave:
        # once both are idle their wave counters agree.)
        deadline = time.monotonic() + 20
        while True:
            states = [c.call_utility_on(e, "get_dp_state", timeout=10) for e in range(2)]
            if states[0]["current_wave"] == states[1]["current_wave"] or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert all(s["lockstep"] for s in states)
        assert states[0]["current_wave"] == states[1]["current_wave"], states
    finally:
        c.shutdown()
