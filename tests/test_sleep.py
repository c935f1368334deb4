"""Sleep mode has a real effect: memory goes back to the OS, and tokens are the
same after wake_up."""

from __future__ import annotations

import gc
import os

import pytest

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams
from helpers import run_to_completion

pytestmark = pytest.mark.slow


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def greedy(eng, rid):
    eng.add_request(EngineCoreRequest(rid, [1, 9690, 198, 2683, 359], SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True)))
    return run_to_completion(eng)[rid]["tokens"]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_memory_and_wakes_with_same_tokens(level, caplog):
    kv_bytes = 256 << 20
    eng = EngineCore(EngineArgs(dtype="float32", max_model_len=1024,
                                kv_cache_memory_bytes=kv_bytes).create_engine_config())
    before_tokens = greedy(eng, "a")
    runner = eng.model_executor.runner
    for k, v in runner.kv_caches:  # make every cache page resident, as a busy server's are
        k.fill_(0)
        v.fill_(0)
    weights = runner.model.weight_bytes()
    gc.collect()  # earlier tests' garbage must not count as freed by sleep
    rss_awake = rss_bytes()
    eng.sleep(level)
    freed = rss_awake - rss_bytes()
    expected = kv_bytes + (weights if level == 2 else 0)
    print(f"\nsleep level {level}: RSS dropped by {freed / 2**20:.0f} MiB "
          f"(KV cache {kv_bytes / 2**20:.0f} MiB, weights {weights / 2**20:.0f} MiB)")
    assert freed > 0.9 * expected
    assert (runner.model is None) == (level == 2)  # level 1 keeps the weights
    eng.wake_up(None)
    assert greedy(eng, "b") == before_tokens
    assert eng.reset_mm_cache() is False and eng.reset_encoder_cache() is False
