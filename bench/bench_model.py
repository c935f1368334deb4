"""Decode throughput of the default model on CPU, next to transformers `generate`
on the same prompts in the same run, and start-up time.

Run: pytest bench/bench_model.py --benchmark-group-by=group -s
(64 prompts of 64 tokens, 128 greedy output tokens each; batch 1 = one prompt.)
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams

PROMPT_LEN = 64
OUTPUT_LEN = 128


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(n)]


def make_engine(dtype: str) -> EngineCore:
    return EngineCore(EngineArgs(dtype=dtype, max_model_len=1024,
                                 kv_cache_memory_bytes=1 << 30).create_engine_config())


def run_enginecore(batch: int, dtype: str, eng: EngineCore | None = None) -> int:
    eng = eng or make_engine(dtype)
    for i, p in enumerate(prompts(batch)):
        eng.add_request(EngineCoreRequest(str(i), p, SamplingParams(
            max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)))
    n = 0
    while eng.scheduler.has_requests():
        for outs in eng.step()[0].values():
            for o in outs.outputs:
                n += len(o.new_token_ids)
    return n


def run_transformers(batch: int, model) -> int:
    ids = torch.tensor(prompts(batch))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=OUTPUT_LEN,
                             min_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=0)
    return (out.shape[1] - PROMPT_LEN) * batch


@pytest.fixture(scope="module")
def hf_model():
    import transformers

    from enginecore.model.model_info import resolve_model_path

    _, path = resolve_model_path(None)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("impl", ["enginecore-bf16", "enginecore-fp32", "transformers-fp32"])
def test_decode_throughput(benchmark, batch, impl, hf_model):
    benchmark.group = f"default_model_throughput[batch {batch}]"
    if impl == "transformers-fp32":
        fn = lambda: run_transformers(batch, hf_model)  # noqa: E731
    else:
        dtype = "bfloat16" if impl.endswith("bf16") else "float32"
        eng = make_engine(dtype)  # built outside the timing, as the transformers model is
        fn = lambda: run_enginecore(batch, dtype, eng)  # noqa: E731
    t0 = time.perf_counter()
    n = benchmark.pedantic(fn, rounds=1, iterations=1)
    tps = n / (time.perf_counter() - t0)
    benchmark.extra_info["output_tokens_per_s"] = round(tps, 1)
    print(f"\n{impl} batch {batch}: {n} tokens, {tps:.1f} output tokens/s")
    assert n == batch * OUTPUT_LEN


def test_startup_time(benchmark):
    """Constructor to the first token possible (converted weights cached)."""
    benchmark.group = "startup"

    def start() -> float:
        t0 = time.perf_counter()
        eng = EngineCore(EngineArgs(max_model_len=1024).create_engine_config())
        eng.add_request(EngineCoreRequest("s", [1, 2, 3], SamplingParams(max_tokens=1)))
        while eng.scheduler.has_requests():
            eng.step()
        return time.perf_counter() - t0

    elapsed = benchmark.pedantic(start, rounds=3, iterations=1)
    print(f"\nstart-up to first token: {elapsed:.2f} s")
