"""LoRA adapters (PEFT format) on a tiny Llama against transformers + peft."""

from __future__ import annotations

import json
import os

import pytest
import torch

from enginecore import (
    EngineArgs,
    EngineCore,
    EngineCoreRequest,
    FinishReason,
    LoRARequest,
    SamplingParams,
)
from helpers import run_to_completion
from tiny_models import make_tiny_model

PROMPTS = {"none": [5, 6, 7, 8, 9], "a": [5, 6, 7, 8, 9], "b": [11, 12, 13, 14],
           "a2": [20, 21, 22]}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("lora-base")), "llama", seed=11)


def make_adapter(base_dir: str, out_dir: str, seed: int, targets: list[str], r: int = 4) -> str:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0)
    pm = peft.get_peft_model(model, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    pm.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(base, str(root / "a"), 1, ["q_proj", "k_proj", "v_proj", "o_proj"]),
        "b": make_adapter(base, str(root / "b"), 2, ["gate_proj", "up_proj", "down_proj",
                                                     "q_proj"]),
    }


def peft_greedy(base_dir: str, adapter_dir: str | None, prompt: list[int], n: int) -> list[int]:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def engine(base, **kw):
    args = dict(model=base, dtype="float32", block_size=4, max_model_len=128, enable_lora=True,
                max_loras=2, max_lora_rank=8)
    args.update(kw)
    return EngineCore(EngineArgs(**args).create_engine_config(), log_stats=True)


def req(rid, prompt, lora=None, n=10):
    return EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=n, temperature=0,
                                                         ignore_eos=True), lora_request=lora)


def test_mixed_batch_matches_peft(base, adapters, hot_path):
    la = LoRARequest("a", 1, adapters["a"])
    lb = LoRARequest("b", 2, adapters["b"])
    eng = engine(base)
    eng.add_request(req("none", PROMPTS["none"]))
    eng.add_request(req("a", PROMPTS["a"], la))
    eng.add_request(req("b", PROMPTS["b"], lb))
    eng.add_request(req("a2", PROMPTS["a2"], la))
    got = {k: v["tokens"] for k, v in run_to_completion(eng).items()}
    expected = {
        "none": peft_greedy(base, None, PROMPTS["none"], 10),
        "a": peft_greedy(base, adapters["a"], PROMPTS["a"], 10),
        "b": peft_greedy(base, adapters["b"], PROMPTS["b"], 10),
        "a2": peft_greedy(base, adapters["a"], PROMPTS["a2"], 10),
    }
    assert got == expected
    assert got["a"] != got["none"]  # the adapter changes the output
    # Same prompt with and without an adapter: no prefix shared across them.
    assert eng.scheduler.kv_cache_manager.make_prefix_cache_stats().hits == 0
    assert eng.list_loras() == {1, 2}


def test_eviction_and_reload_with_one_slot(base, adapters):
    la = LoRARequest("a", 1, adapters["a"])
    lb = LoRARequest("b", 2, adapters["b"])
    eng = engine(base, max_loras=1)
    eng.add_request(req("a", PROMPTS["a"], la))
    eng.add_request(req("b", PROMPTS["b"], lb))
    got = {k: v["tokens"] for k, v in run_to_completion(eng).items()}
    assert got["a"] == peft_greedy(base, adapters["a"], PROMPTS["a"], 10)
    assert got["b"] == peft_greedy(base, adapters["b"], PROMPTS["b"], 10)
    assert len(eng.list_loras()) == 1


def test_pinned_adapter_is_not_evicted(base, adapters):
    eng = engine(base, max_loras=1)
    assert eng.add_lora(LoRARequest("a", 1, adapters["a"]))
    assert eng.pin_lora(1)
    eng.add_request(req("b", PROMPTS["b"], LoRARequest("b", 2, adapters["b"])))
    res = run_to_completion(eng)
    assert res["b"]["finish_reason"] is FinishReason.ERROR
    assert "pinned" in res["b"]["stop_reason"]
    assert eng.list_loras() == {1}
    assert eng.remove_lora(1) and eng.list_loras() == set()


def test_bad_adapters_fail_only_their_request(base, adapters, tmp_path):
    wrong_target = tmp_path / "wrong_target"
    wrong_target.mkdir()
    with open(os.path.join(adapters["a"], "adapter_config.json")) as f:
        cfg = json.load(f)
    for name in os.listdir(adapters["a"]):
        if name.endswith(".safetensors"):
            os.link(os.path.join(adapters["a"], name), wrong_target / name)
    cfg["target_modules"] = ["embed_tokens"]
    (wrong_target / "adapter_config.json").write_text(json.dumps(cfg))
    eng = engine(base, max_lora_rank=2)  # adapter a has rank 4
    eng.add_request(req("rank", [1, 2], LoRARequest("a", 1, adapters["a"])))
    eng.add_request(req("missing", [1, 2], LoRARequest("x", 7, str(tmp_path / "nope"))))
    eng.add_request(req("ok", [1, 2]))
    res = run_to_completion(eng)
    eng8 = engine(base)
    eng8.add_request(req("target", [1, 2], LoRARequest("t", 8, str(wrong_target))))
    res |= run_to_completion(eng8)
    assert "rank 4" in res["rank"]["stop_reason"]
    assert "PEFT format" in res["missing"]["stop_reason"]
    assert "unsupported target modules ['embed_tokens']" in res["target"]["stop_reason"]
    assert all(res[k]["finish_reason"] is FinishReason.ERROR for k in ("rank", "missing",
                                                                        "target"))
    assert res["ok"]["finish_reason"] is FinishReason.LENGTH


def test_lora_disabled_is_a_clear_error(base, adapters):
    eng = engine(base, enable_lora=False)
    eng.add_request(req("a", [1, 2], LoRARequest("a", 1, adapters["a"])))
    res = run_to_completion(eng)
    assert "not enabled" in res["a"]["stop_reason"]


def test_lora_and_spec_decode_through_the_process(base, adapters):
    from enginecore.client import SyncMPClient

    la = LoRARequest("a", 1, adapters["a"])
    cfg = EngineArgs(model=base, dtype="float32", block_size=4, max_model_len=128,
                     enable_lora=True, max_loras=2, max_lora_rank=8,
                     num_speculative_tokens=3, prompt_lookup_min=1).create_engine_config()
    c = SyncMPClient(cfg)
    try:
        assert c.call_utility("add_lora", la) is True
        assert c.call_utility("list_loras") == {1}
        c.add_request(req("a", PROMPTS["a"], la))
        c.add_request(req("none", PROMPTS["none"] * 3))
        got: dict[str, list[int]] = {}
        done = 0
        while done < 2:
            for o in c.get_output(timeout=60).outputs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                done += o.finish_reason is not None
        stats = c.call_utility("make_stats")
    finally:
        c.shutdown()
    assert got["a"] == peft_greedy(base, adapters["a"], PROMPTS["a"], 10)
    assert got["none"] == peft_greedy(base, None, PROMPTS["none"] * 3, 10)
    assert stats.spec_num_draft_tokens > 0


def test_sleep_and_wake_through_the_process_keep_tokens(base):
    from enginecore.client import SyncMPClient

    cfg = EngineArgs(model=base, dtype="float32", block_size=4, max_model_len=128,
                     kv_cache_memory_bytes=16 << 20).create_engine_config()
    c = SyncMPClient(cfg)

    def tokens(rid):
        c.add_request(req(rid, PROMPTS["b"]))
        out: list[int] = []
        while True:
            for o in c.get_output(timeout=60).outputs:
                out.extend(o.new_token_ids)
                if o.finish_reason is not None:
                    return out

    try:
        before = tokens("x")
        c.call_utility("sleep", 2)
        assert c.call_utility("is_sleeping") is True
        c.add_request(req("asleep", PROMPTS["b"]))  # waits, is not lost
        c.call_utility("wake_up", None)
        got: list[int] = []
        while True:
            outs = c.get_output(timeout=60).outputs
            done = False
            for o in outs:
                got.extend(o.new_token_ids)
                done = done or o.finish_reason is not None
            if done:
                break
        assert got == before
    finally:
        c.shutdown()
