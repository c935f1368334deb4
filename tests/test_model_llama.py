"""The torch model runner against transformers on the same weights."""

from __future__ import annotations

import pytest

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, FinishReason, SamplingParams
from helpers import collect, run_to_completion
from tiny_models import hf_greedy, make_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen2")), "qwen2", seed=1)


@pytest.fixture(scope="module")
def tiny_llama3_rope(tmp_path_factory):
    return make_tiny_model(
        str(tmp_path_factory.mktemp("llama3")), "llama", seed=2, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )


SHARED = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
PROMPTS = {
    "a": SHARED + [30, 31, 32],
    "b": SHARED + [40, 41],  # shares 16 tokens (4 blocks of 4) with a: prefix-cache hit
    "c": [3, 4, 5],
    "d": list(range(50, 90)),  # long: several prefill chunks
    "e": [99],
}


def engine_tokens(model_dir, max_tokens=12, **kw):
    args = dict(model=model_dir, dtype="float32", device="cpu", block_size=4,
                max_num_batched_tokens=16, max_model_len=128)
    args.update(kw)
    eng = EngineCore(EngineArgs(**args).create_engine_config())
    # a first, alone, so its blocks are cached when b arrives.
    eng.add_request(EngineCoreRequest("a", PROMPTS["a"], SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True)))
    res: dict = {}
    for _ in range(3):
        collect(eng.step()[0], res)
    for rid, p in PROMPTS.items():
        if rid != "a":
            eng.add_request(EngineCoreRequest(rid, p, SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True)))
    for rid, r in run_to_completion(eng).items():
        res.setdefault(rid, {"tokens": []})["tokens"].extend(r["tokens"])
    return eng, {rid: r["tokens"] for rid, r in res.items()}


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen2", "tiny_llama3_rope"])
def test_greedy_matches_transformers_mixed_batch(request, model_fixture, hot_path):
    model_dir = request.getfixturevalue(model_fixture)
    eng, got = engine_tokens(model_dir)
    expected = {rid: hf_greedy(model_dir, p, 12) for rid, p in PROMPTS.items()}
    assert got == expected
    stats = eng.scheduler.kv_cache_manager.make_prefix_cache_stats()
    assert stats.hits >= 16  # b reused a's prefix


def test_greedy_matches_under_preemption(tiny_llama, hot_path):
    eng, got = engine_tokens(tiny_llama, max_tokens=20, num_gpu_blocks_override=20,
                             max_num_batched_tokens=64)
    assert eng.scheduler.num_preempted_total > 0
    expected = {rid: hf_greedy(tiny_llama, p, 20) for rid, p in PROMPTS.items()}
    assert got == expected


def test_bfloat16_runs_and_mostly_agrees(tiny_llama):
    _, got = engine_tokens(tiny_llama, dtype="bfloat16")
    expected = {rid: hf_greedy(tiny_llama, p, 12) for rid, p in PROMPTS.items()}
    first_tokens = sum(got[r][0] == expected[r][0] for r in PROMPTS)
    assert first_tokens >= 4


def test_decode_attention_is_batched(tiny_llama, monkeypatch, hot_path):
    """Many decodes in one step: one attention call per layer covers all of them."""
    import enginecore.model.llama as llama

    calls = []
    real = llama.paged_attention

    def counting(q, k, v, k_cache, v_cache, meta, *a, **kw):
        calls.append((meta.num_seqs, q.shape[0]))
        return real(q, k, v, k_cache, v_cache, meta, *a, **kw)

    eng = EngineCore(EngineArgs(model=tiny_llama, dtype="float32", block_size=4,
                                max_model_len=128).create_engine_config())
    for i in range(16):
        eng.add_request(EngineCoreRequest(str(i), [i + 3, i + 4, 5], SamplingParams(
            max_tokens=4, temperature=0, ignore_eos=True)))
    eng.step()  # prefills
    monkeypatch.setattr(llama, "paged_attention", counting)
    eng.step()  # 16 decodes
    assert calls == [(16, 16), (16, 16)]  # two layers, all 16 requests in each call


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        EngineArgs(model=str(tmp_path)).create_engine_config()
    with pytest.raises(FileNotFoundError, match="never downloads"):
        EngineArgs(model="some-org/some-model").create_engine_config()


def test_sleep_and_wake_keep_tokens(tiny_llama):
    cfg = EngineArgs(model=tiny_llama, dtype="float32", block_size=4,
                     max_model_len=128).create_engine_config()
    eng = EngineCore(cfg)
    prompt = [5, 6, 7, 8, 9]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eng.add_request(EngineCoreRequest("x", prompt, sp))
    before = run_to_completion(eng)["x"]["tokens"]
    eng.sleep(level=2)
    assert eng.model_executor.runner.model is None and not eng.model_executor.runner.kv_caches
    eng.wake_up(["weights"])
    assert eng.is_sleeping()  # kv cache still away
    eng.wake_up(["kv_cache"])
    assert not eng.is_sleeping()
    eng.add_request(EngineCoreRequest("y", prompt, sp))
    res = run_to_completion(eng)["y"]
    assert res["tokens"] == before and res["finish_reason"] is FinishReason.LENGTH


def test_save_sharded_state_round_trips(tiny_llama, tmp_path):
    cfg = EngineArgs(model=tiny_llama, dtype="float32", block_size=4,
                     max_model_len=128).create_engine_config()
    eng = EngineCore(cfg)
    eng.save_sharded_state(str(tmp_path / "saved"), max_size=50_000)
    files = sorted(p.name for p in (tmp_path / "saved").glob("*.safetensors"))
    assert len(files) > 1
    _, got = engine_tokens(str(tmp_path / "saved"))
    _, ref = engine_tokens(tiny_llama)
    assert got == ref


def test_batch_queue_on_the_real_runner_gives_same_tokens(tiny_llama, hot_path):
    _, one = engine_tokens(tiny_llama)
    eng, two = engine_tokens(tiny_llama, max_concurrent_batches=2)
    assert eng.batch_queue is not None and eng.model_executor.max_concurrent_batches == 2
    assert two == one
    eng.shutdown()


def test_unwritten_cache_slots_never_reach_attention(tiny_llama):
    """The KV cache is torch.empty: decode must not read the unwritten tail of a
    request's last block (a NaN there survives the mask as 0 * NaN)."""
    args = dict(model=tiny_llama, dtype="float32", device="cpu", block_size=4,
                max_num_batched_tokens=16, max_model_len=128)
    prompts = {"x": [3, 4, 5], "y": list(range(20, 31)), "z": [9]}
    results = []
    for poison in (False, True):
        eng = EngineCore(EngineArgs(**args).create_engine_config())
        runner = eng.model_executor.runner
        if poison:
            scratch = runner.scratch_slot
            for k, v in runner.kv_caches:
                k[:scratch].fill_(float("nan"))
                v[:scratch].fill_(float("nan"))
        for rid, p in prompts.items():
            eng.add_request(EngineCoreRequest(rid, p, SamplingParams(
                max_tokens=9, temperature=0, ignore_eos=True)))
        results.append({k: r["tokens"] for k, r in run_to_completion(eng).items()})
    assert results[0] == results[1]
