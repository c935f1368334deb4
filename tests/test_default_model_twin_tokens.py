"""The default model's greedy tokens in float32 are the same on the native path
and the pure-Python one (ENGINECORE_NATIVE=0): the native kernels (RMSNorm,
SiLU-and-mul, RoPE, paged attention, greedy argmax) against their torch twins,
end to end through the real engine. (bfloat16 is not asserted: an fp32 sum in
another order lands on the other side of a bf16 rounding now and then, and the
tokens part after a few dozen; docs/benchmarks.md has the measurement.)"""

from __future__ import annotations

import pytest

from enginecore import SamplingParams, _native
from enginecore.entrypoints.llm import LLM

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three prime numbers:"]


def greedy_tokens(native: bool) -> list[list[int]]:
    previous = _native._enabled
    _native.set_native(native)
    try:
        with LLM(dtype="float32", multiprocess_mode=False, max_model_len=512,
                 kv_cache_memory_bytes=64 << 20) as llm:
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32,
                                                        ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        _native._enabled = previous


def test_float32_greedy_tokens_native_equal_twin():
    if _native._ext is None:
        pytest.fail("the native extension is not built; `pip install .` first")
    native = greedy_tokens(True)
    assert all(len(t) == 32 for t in native)
    assert native == greedy_tokens(False)
