"""Qwen2-VL through the EngineCore: the scheduler's encoder budget and encoder
cache, the runner's encoder runs, embedding merge and M-RoPE positions over
prefill chunks (ending inside placeholders), decode and preemption; greedy
tokens against transformers' generate on a tiny random model, native and
Python paths."""

from __future__ import annotations

import pytest

from enginecore import EngineArgs, EngineCore
from enginecore.model.qwen2_vl import split_image_items
from helpers import collect, run_to_completion
from mm_requests import mm_request
from tiny_qwen2_vl import hf_generate, hf_inputs, make_tiny_qwen2_vl, random_image

PROMPT_ONE = "<s>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?</s>\n<s>assistant\n"
PROMPT_TWO = ("<s>user\nCompare <|vision_start|><|image_pad|><|vision_end|> and "
              "<|vision_start|><|image_pad|><|vision_end|></s>\n<s>assistant\n")
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_qwen2_vl(tmp_path_factory) -> str:
    return make_tiny_qwen2_vl(str(tmp_path_factory.mktemp("tiny-qwen2-vl-engine")))


def engine(model_dir: str, **kw) -> EngineCore:
    args = {"model": model_dir, "dtype": "float32", "block_size": 8, "max_model_len": 256,
            "max_num_batched_tokens": 64, "num_gpu_blocks_override": 64, "log_stats": True}
    args.update(kw)
    log_stats = args.pop("log_stats")
    return EngineCore(EngineArgs(**args).create_engine_config(), log_stats=log_stats)


def request(model_dir: str, rid: str, prompt: str, images: list):
    inputs = hf_inputs(model_dir, prompt, images)
    ids = inputs["input_ids"][0].tolist()
    if not images:
        return mm_request(rid, ids, [], -1, MAX_TOKENS), inputs
    items = split_image_items(inputs["pixel_values"], inputs["image_grid_thw"])
    image_id = ids[next(i for i, f in enumerate(inputs["mm_token_type_ids"][0].tolist()) if f)]
    return mm_request(rid, ids, items, image_id, MAX_TOKENS), inputs


def steps_with_encoder_inputs(eng: EngineCore) -> list[int]:
    """Run to completion, recording the encoder tokens each step scheduled."""
    seen: list[int] = []
    schedule = eng.scheduler.schedule

    def spy():
        so = schedule()
        seen.append(eng.scheduler.last_iteration.num_encoder_output_tokens)
        return so

    eng.scheduler.schedule = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("prompt,sizes", [(PROMPT_ONE, [(60, 90)]),
                                          (PROMPT_TWO, [(60, 90), (112, 56)])])
@pytest.mark.parametrize("batched", [64, 7])
def test_greedy_matches_transformers(hot_path, tiny_qwen2_vl, prompt, sizes, batched):
    """batched=7: prefill chunks of 7 tokens start and end inside placeholders."""
    images = [random_image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    req, inputs = request(tiny_qwen2_vl, "r", prompt, images)
    eng = engine(tiny_qwen2_vl, max_num_batched_tokens=batched, max_num_encoder_input_tokens=64,
                 encoder_cache_size=64)
    eng.add_request(req)
    out = run_to_completion(eng)
    assert out["r"]["tokens"] == hf_generate(tiny_qwen2_vl, inputs, MAX_TOKENS)
    assert eng.model_executor.runner.mm.num_encoded == len(images)


def _runner(eng: EngineCore):
    return eng.model_executor.runner


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_same_image_in_8_requests_is_encoded_once(hot_path, tiny_qwen2_vl, prefix_caching):
    """Without prefix caching every other request is an encoder-cache hit; with
    it, the blocks past the image are prefix hits and need no encoder output."""
    image = random_image(60, 90, seed=3)
    # (no stats reporting: the prefix-cache counters then add up over the run)
    eng = engine(tiny_qwen2_vl, enable_prefix_caching=prefix_caching, log_stats=False)
    for i in range(8):
        req, inputs = request(tiny_qwen2_vl, f"r{i}", PROMPT_ONE, [image])
        eng.add_request(req)
    ref = hf_generate(tiny_qwen2_vl, inputs, MAX_TOKENS)
    out = run_to_completion(eng)
    assert all(out[f"r{i}"]["tokens"] == ref for i in range(8))
    assert _runner(eng).mm.num_encoded == 1
    ec = eng.scheduler.encoder_cache_manager
    if prefix_caching:
        assert eng.scheduler.kv_cache_manager.prefix_cache_stats.hits >= 7 * 8
    else:
        # (a request whose chunks overlap the image in two steps looks it up twice)
        assert ec.hits >= 7
    assert ec.queries - ec.hits == 1  # the one miss: the first request
    assert not ec.refs  # every reference dropped; the entry stays, freeable
    assert len(ec.cached) == 1 and ec.usage > 0


def test_two_images_of_one_size_never_share_an_entry(hot_path, tiny_qwen2_vl):
    a, b = random_image(60, 90, seed=1), random_image(60, 90, seed=2)
    eng = engine(tiny_qwen2_vl)
    ra, ia = request(tiny_qwen2_vl, "a", PROMPT_ONE, [a])
    rb, ib = request(tiny_qwen2_vl, "b", PROMPT_ONE, [b])
    assert ra.mm_features[0].identifier != rb.mm_features[0].identifier
    eng.add_request(ra)
    eng.add_request(rb)
    out = run_to_completion(eng)
    ref_a, ref_b = hf_generate(tiny_qwen2_vl, ia, MAX_TOKENS), hf_generate(tiny_qwen2_vl, ib,
                                                                           MAX_TOKENS)
    assert ref_a != ref_b
    assert out["a"]["tokens"] == ref_a and out["b"]["tokens"] == ref_b
    assert _runner(eng).mm.num_encoded == 2


def test_encoder_budget_is_respected(hot_path, tiny_qwen2_vl):
    """A budget of one image's tokens: the second image of the prompt waits for
    the next step, the chunk stopping before its placeholder."""
    images = [random_image(60, 90, seed=0), random_image(112, 56, seed=1)]
    req, inputs = request(tiny_qwen2_vl, "r", PROMPT_TWO, images)
    lengths = [f.mm_position.length for f in req.mm_features]
    budget = max(lengths)
    eng = engine(tiny_qwen2_vl, max_num_encoder_input_tokens=budget, encoder_cache_size=budget * 2,
                 log_iteration_details=True)
    seen = steps_with_encoder_inputs(eng)
    eng.add_request(req)
    out = run_to_completion(eng)
    assert out["r"]["tokens"] == hf_generate(tiny_qwen2_vl, inputs, MAX_TOKENS)
    assert max(seen) <= budget and sorted(x for x in seen if x) == sorted(lengths)


def test_item_over_the_budget_is_rejected_engine_keeps_serving(tiny_qwen2_vl):
    req, _ = request(tiny_qwen2_vl, "big", PROMPT_ONE, [random_image(60, 90, 0)])
    eng = engine(tiny_qwen2_vl, max_num_encoder_input_tokens=req.mm_features[0].mm_position.length
                 - 1)
    eng.add_request(req)
    ok, inputs = request(tiny_qwen2_vl, "ok", "<s>user\nhi</s>\n<s>assistant\n", [])
    eng.add_request(ok)
    out = run_to_completion(eng)
    assert "encoder budget" in out["big"]["stop_reason"]
    assert out["ok"]["tokens"] == hf_generate(tiny_qwen2_vl, inputs, MAX_TOKENS)


def test_preemption_reuses_cached_encoder_output(hot_path, tiny_qwen2_vl):
    """Without prefix caching the recompute needs the image again: a cache hit."""
    req, inputs = request(tiny_qwen2_vl, "r", PROMPT_ONE, [random_image(60, 90, 4)])
    eng = engine(tiny_qwen2_vl, enable_prefix_caching=False)
    eng.add_request(req)
    outs: dict = {}

    for _ in range(3):  # prefill and two decodes, then preempted and recomputed
        collect(eng.step()[0], outs)
    assert eng.scheduler.preempt_all() == 1
    rest = run_to_completion(eng)
    assert _runner(eng).mm.num_encoded == 1
    assert eng.scheduler.encoder_cache_manager.hits >= 1
    tokens = outs["r"]["tokens"] + rest.get("r", {}).get("tokens", [])
    assert tokens == hf_generate(tiny_qwen2_vl, inputs, MAX_TOKENS)


def test_reset_encoder_cache_refused_while_needed(tiny_qwen2_vl):
    req, _ = request(tiny_qwen2_vl, "r", PROMPT_ONE, [random_image(60, 90, 4)])
    eng = engine(tiny_qwen2_vl, max_num_batched_tokens=7, enable_prefix_caching=False)
    eng.add_request(req)
    eng.step()  # the first chunk ends inside the placeholder: the entry is needed
    assert eng.scheduler.encoder_cache_manager.refs
    assert eng.reset_encoder_cache() is False
    run_to_completion(eng)
    assert eng.reset_encoder_cache() is True
    assert not eng.scheduler.encoder_cache_manager.cached
    eng.add_request(request(tiny_qwen2_vl, "again", PROMPT_ONE, [random_image(60, 90, 4)])[0])
    run_to_completion(eng)
    assert _runner(eng).mm.num_encoded == 2  # encoded again after the reset
    assert not (_runner(eng).mm.encoder_cache.keys()
                - eng.scheduler.encoder_cache_manager.cached.keys())
