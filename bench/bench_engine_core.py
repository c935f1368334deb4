"""EngineCore step time (synthetic executor, zero latency) and block hashing.

Run: pytest bench/ --benchmark-group-by=group --benchmark-columns=min,median,mean,rounds
"""

from __future__ import annotations

import random
import subprocess

import pytest

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams, block_hashes
from enginecore.executor import SyntheticExecutor


def decoding_engine(num_reqs: int) -> EngineCore:
    cfg = EngineArgs(
        model="synthetic", max_model_len=1 << 16, kv_cache_memory_bytes=16 << 30,
        max_num_seqs=max(num_reqs, 1), max_num_batched_tokens=max(8192, num_reqs),
    ).create_engine_config()
    eng = EngineCore(cfg, SyntheticExecutor)
    rng = random.Random(0)
    for i in range(num_reqs):
        prompt = [rng.randrange(32000) for _ in range(32)]
        eng.add_request(EngineCoreRequest(
            f"req-{i}", prompt, SamplingParams(max_tokens=60000, ignore_eos=True, seed=i)))
    while any(r.num_output_tokens == 0 for r in eng.scheduler.requests.values()):
        eng.step()
    return eng


@pytest.mark.parametrize("num_reqs", [1, 64, 256])
def test_engine_step(benchmark, path, num_reqs):
    benchmark.group = f"engine_step[{num_reqs} decodes]"
    eng = decoding_engine(num_reqs)
    outputs, executed = benchmark(eng.step)
    assert executed and len(outputs[0].outputs) == num_reqs


def sha256_limit_tokens_per_s(block_size: int = 16) -> float | None:
    """The machine's chained-block SHA-256 limit, from `openssl speed` in this run:
    a 16-token block plus its parent is two 64-byte compressions (128 bytes)."""
    try:
        out = subprocess.run(["openssl", "speed", "-evp", "sha256", "-bytes", "16384",
                              "-seconds", "1"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        if line.startswith("sha256"):
            kbytes = float(line.split()[-1].rstrip("k"))
            return kbytes * 1000 / 128 * block_size
    return None


@pytest.fixture(scope="module")
def sha_limit():
    return sha256_limit_tokens_per_s()


def test_block_hash(benchmark, path, sha_limit):
    benchmark.group = "block_hash[32k tokens, block 16]"
    rng = random.Random(0)
    tokens = [rng.randrange(150000) for _ in range(32768)]
    hashes = benchmark(block_hashes, tokens, 16)
    assert len(hashes) == 2048
    tps = 32768 / benchmark.stats.stats.median
    benchmark.extra_info["tokens_per_s"] = round(tps)
    if sha_limit:
        benchmark.extra_info["sha256_limit_tokens_per_s"] = round(sha_limit)
        benchmark.extra_info["fraction_of_limit"] = round(tps / sha_limit, 3)
    print(f"\nblock_hash[{path}]: {tps / 1e6:.1f} M tokens/s; SHA-256 limit from openssl "
          f"{(sha_limit or 0) / 1e6:.1f} M tokens/s")


def test_prompt_hash_in_request_table(benchmark, path, sha_limit):
    """A 32k-token prompt arriving in the request table: its ids copied into the
    row's token store once, then every full block hashed from there (no Python
    int per token, no bytes object per block; hashes are made bytes on demand)."""
    from enginecore.sched.request_table import request_table_class

    benchmark.group = "prompt_hash_in_request_table[32k tokens, block 16]"
    rng = random.Random(0)
    tokens = [rng.randrange(150000) for _ in range(32768)]
    table = request_table_class()(None, 16)

    def add_and_release():
        slot = table.add("r", tokens, 0, 1, 0, -1, False, [], 0, 0.0, b"", True)
        table.release(slot)

    benchmark(add_and_release)
    slot = table.add("r", tokens, 0, 1, 0, -1, False, [], 0, 0.0, b"", True)
    assert table.get_block_hashes(slot) == block_hashes(tokens, 16)
    tps = 32768 / benchmark.stats.stats.median
    benchmark.extra_info["tokens_per_s"] = round(tps)
    if sha_limit:
        benchmark.extra_info["fraction_of_limit"] = round(tps / sha_limit, 3)
    print(f"\nprompt_hash_in_request_table[{path}]: {tps / 1e6:.1f} M tokens/s; SHA-256 limit "
          f"from openssl {(sha_limit or 0) / 1e6:.1f} M tokens/s")
