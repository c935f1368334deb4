"""The default model on the CPU, end to end, next to its peers in the same run:
the default ``LLM()`` (engine in its own process), the in-process engine on
both paths (native kernels vs their torch twins), and transformers
``generate``; batch 1 / 8 / 64, bfloat16 and float32; the memory-bandwidth
bound measured in the same run; the attention kernel alone (native vs twin) at
context 128 / 1k / 4k; start-up.

Run: pytest bench/bench_model.py --benchmark-group-by=group -s
(64-token prompts, 128 greedy output tokens each; batch B = the first B
prompts; tokens/s = output tokens / wall time, prefill included.)
``BENCH_MODEL_BATCHES=1,64`` and ``BENCH_MODEL_DTYPES=bfloat16`` narrow it.
A table of every number is printed at the end of the session.
"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
import torch

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams, _native
from enginecore.entrypoints.llm import LLM

PROMPT_LEN = 64
OUTPUT_LEN = 128
BATCHES = [int(b) for b in os.environ.get("BENCH_MODEL_BATCHES", "1,8,64").split(",")]
DTYPES = os.environ.get("BENCH_MODEL_DTYPES", "bfloat16,float32").split(",")
RESULTS: dict[tuple[str, str, int], float] = {}


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(n)]


def engine_args(dtype: str) -> EngineArgs:
    return EngineArgs(dtype=dtype, max_model_len=1024, kv_cache_memory_bytes=1 << 30)


def params() -> SamplingParams:
    return SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)


def run_engine(eng: EngineCore, batch: int) -> int:
    tag = str(time.monotonic_ns())
    for i, p in enumerate(prompts(batch)):
        eng.add_request(EngineCoreRequest(f"{tag}-{i}", p, params()))
    n = 0
    while eng.scheduler.has_requests():
        for outs in eng.step()[0].values():
            for o in outs.outputs:
                n += len(o.new_token_ids)
    return n


def run_llm(llm: LLM, batch: int) -> int:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(batch)], params(),
                        use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)


def run_transformers(model, batch: int) -> int:
    ids = torch.tensor(prompts(batch))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=OUTPUT_LEN,
                             min_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=0)
    return (out.shape[1] - PROMPT_LEN) * batch


def timed(benchmark, group: str, impl: str, dtype: str, batch: int, fn) -> float:
    benchmark.group = group
    t0 = time.perf_counter()
    n = benchmark.pedantic(fn, rounds=1, iterations=1)
    tps = n / (time.perf_counter() - t0)
    benchmark.extra_info["output_tokens_per_s"] = round(tps, 1)
    RESULTS[(impl, dtype, batch)] = tps
    print(f"\n{impl} {dtype} batch {batch}: {n} tokens, {tps:.1f} output tokens/s")
    assert n == batch * OUTPUT_LEN
    return tps


@pytest.fixture(scope="module", params=DTYPES)
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def engines(dtype):
    """One engine per path, built outside the timing (as the transformers model is)."""
    out = {}
    previous = _native._enabled
    for path in ("native", "python"):
        _native.set_native(path == "native")
        out[path] = EngineCore(engine_args(dtype).create_engine_config())
        run_engine(out[path], 1)  # warm
    _native._enabled = previous
    yield out
    for eng in out.values():
        eng.shutdown()


# -- the memory-bandwidth bound -------------------------------------------------------
def streaming_read_gbps(nbytes: int = 1 << 30, rounds: int = 5) -> float:
    """Best of `rounds` full reads of a buffer larger than any cache (a sum in torch,
    all threads): what reading the weights once per token can reach."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def test_memory_bandwidth(benchmark):
    benchmark.group = "memory_bandwidth"
    gbps = benchmark.pedantic(streaming_read_gbps, rounds=1, iterations=1)
    RESULTS[("bandwidth", "GB/s", 0)] = gbps
    print(f"\nstreaming read: {gbps:.1f} GB/s")


# -- end to end -----------------------------------------------------------------------
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("path", ["native", "python"])
def test_engine_in_process(benchmark, engines, dtype, batch, path):
    previous = _native._enabled
    _native.set_native(path == "native")
    try:
        timed(benchmark, f"model_tokens_per_s[{dtype} batch {batch}]", f"engine-{path}", dtype,
              batch, lambda: run_engine(engines[path], batch))
    finally:
        _native._enabled = previous


@pytest.mark.parametrize("batch", BATCHES)
def test_llm_default(benchmark, dtype, batch):
    """``LLM()`` with its defaults (the engine in its own process), prompts as ids."""
    llm = LLM(dtype=dtype, max_model_len=1024, kv_cache_memory_bytes=1 << 30)
    try:
        run_llm(llm, 1)  # warm
        timed(benchmark, f"model_tokens_per_s[{dtype} batch {batch}]", "LLM()", dtype, batch,
              lambda: run_llm(llm, batch))
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def hf_model(dtype):
    import transformers

    from enginecore.model.model_info import resolve_model_path

    _, path = resolve_model_path(None)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype)).eval()


@pytest.mark.parametrize("batch", BATCHES)
def test_transformers(benchmark, hf_model, dtype, batch):
    timed(benchmark, f"model_tokens_per_s[{dtype} batch {batch}]", "transformers", dtype, batch,
          lambda: run_transformers(hf_model, batch))


# -- the attention kernel alone --------------------------------------------------------
@pytest.mark.parametrize("context", [128, 1024, 4096])
@pytest.mark.parametrize("kind", ["decode64", "prefill512"])
@pytest.mark.parametrize("path", ["native", "python"])
def test_attention_kernel(benchmark, context, kind, path):
    """One layer's attention at the default model's shape (9 heads, 3 KV heads, dim
    64, bf16, block 16): 64 decodes at `context`, or the last (up to) 512-token
    prefill chunk of a `context`-token prompt."""
    from enginecore.model.attention import (
        make_attention_metadata,
        paged_attention_native,
        paged_attention_torch,
    )

    benchmark.group = f"attention_kernel[{kind} context {context}]"
    H, Hkv, D, bs = 9, 3, 64, 16
    chunk = min(512, context)
    seqs = [(context - 1, 1)] * 64 if kind == "decode64" else [(context - chunk, chunk)]
    nb = sum(-(-(c + n) // bs) for c, n in seqs)
    rng = np.random.default_rng(0)
    table_flat = rng.permutation(nb).astype(np.int32)
    per = -(-context // bs)
    table = table_flat.reshape(len(seqs), per)
    slots = np.concatenate([table[i, np.arange(c, c + n) // bs].astype(np.int64) * bs
                            + np.arange(c, c + n) % bs for i, (c, n) in enumerate(seqs)])
    qs = np.concatenate([[0], np.cumsum([n for _, n in seqs])])
    meta = make_attention_metadata(slots, qs, np.array([c + n for c, n in seqs]), table, bs,
                                   nb * bs, torch.device("cpu"))
    kc = torch.randn((nb + 1) * bs, Hkv, D).bfloat16()
    vc = torch.randn((nb + 1) * bs, Hkv, D).bfloat16()
    T = int(qs[-1])
    q = torch.randn(T, H, D).bfloat16()
    k = torch.randn(T, Hkv, D).bfloat16()
    v = torch.randn(T, Hkv, D).bfloat16()
    if path == "native":
        fn = lambda: paged_attention_native(_native._ext, q, k, v, kc, vc, meta, 0.125)  # noqa: E731
    else:
        fn = lambda: paged_attention_torch(q, k, v, kc, vc, meta, 0.125)  # noqa: E731
    fn()
    benchmark.pedantic(fn, rounds=20, iterations=1, warmup_rounds=2)


def test_startup_time(benchmark):
    """``LLM()`` constructor to the first token (converted weights cached; the
    engine process imports torch and loads the model)."""
    benchmark.group = "startup"

    def start() -> float:
        t0 = time.perf_counter()
        llm = LLM(max_model_len=1024)
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1),
                     use_tqdm=False)
        elapsed = time.perf_counter() - t0
        llm.shutdown()
        return elapsed

    elapsed = benchmark.pedantic(start, rounds=2, iterations=1)
    RESULTS[("startup", "s", 0)] = elapsed
    print(f"\nLLM() start-up to first token: {elapsed:.2f} s")


def test_zz_summary():
    """The session's numbers as one table, with the bandwidth fraction at batch 1."""
    gbps = RESULTS.get(("bandwidth", "GB/s", 0))
    print(f"\ncpu: {_cpu_name()}, torch threads {torch.get_num_threads()}")
    for (impl, dtype, batch), v in sorted(RESULTS.items()):
        if batch:
            print(f"{impl:16s} {dtype:9s} batch {batch:3d}: {v:8.1f} tok/s")
    if gbps:
        from enginecore.model.model_info import resolve_model_path

        weights = _weight_bytes(resolve_model_path(None)[1])
        for dtype in DTYPES:
            size = 2 if dtype == "bfloat16" else 4
            bound = gbps * 1e9 / (weights * size)
            got = RESULTS.get(("engine-native", dtype, 1))
            frac = f", engine batch 1 = {got / bound:.0%} of it" if got else ""
            print(f"bandwidth bound {dtype}: {gbps:.1f} GB/s / {weights * size / 1e6:.0f} MB "
                  f"per token = {bound:.1f} tok/s{frac}")


def _weight_bytes(model_dir: str) -> int:
    """Parameters read per token (the embedding gather excluded, the LM head once)."""
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    d = h // heads
    per_layer = h * (heads * d + 2 * kv * d) + heads * d * h + 3 * h * i + 2 * h
    return n * per_layer + cfg["vocab_size"] * h + h


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
