"""The default model's greedy tokens are the same on the native path and the
pure-Python one (ENGINECORE_NATIVE=0), in float32 and in bfloat16 (the dtype
``auto`` picks on AVX-512 BF16 / AMX CPUs): the native kernels (RMSNorm,
SiLU-and-mul, RoPE, paged attention, the decode GEMV, greedy argmax) against
their torch twins, end to end through the real engine. Batch 1 runs the decode
GEMV (1-2 rows) where the CPU has it; three prompts decode on oneDNN's GEMM. The
AVX2 CPUs' bf16 GEMM (``_C.bf16_linear``, "panels") runs here too, forced where
oneDNN would pack."""

from __future__ import annotations

import pytest
import torch

from enginecore import SamplingParams, _native
from enginecore.entrypoints.llm import LLM
from enginecore.model import linear
from enginecore.model.cpu_flags import cpu_flags

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three prime numbers:"]


def greedy_tokens(native: bool, dtype: str, max_num_seqs: int) -> list[list[int]]:
    previous = _native._enabled
    _native.set_native(native)
    try:
        with LLM(dtype=dtype, multiprocess_mode=False, max_model_len=512,
                 kv_cache_memory_bytes=64 << 20, max_num_seqs=max_num_seqs) as llm:
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32,
                                                        ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        _native._enabled = previous


@pytest.mark.parametrize("dtype,max_num_seqs", [("float32", 8), ("bfloat16", 8),
                                                ("bfloat16", 1)])
def test_greedy_tokens_native_equal_twin(dtype, max_num_seqs):
    if _native._ext is None:
        pytest.fail("the native extension is not built; `pip install .` first")
    native = greedy_tokens(True, dtype, max_num_seqs)
    assert all(len(t) == 32 for t in native)
    assert native == greedy_tokens(False, dtype, max_num_seqs)


@pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(), reason="the panels GEMM needs AVX2")
@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_bf16_panels_tokens_native_equal_twin(monkeypatch, max_num_seqs):
    if _native._ext is None:
        pytest.fail("the native extension is not built; `pip install .` first")
    monkeypatch.setattr(linear, "cpu_packs_bf16", lambda: False)  # as on an AVX2-only CPU
    assert linear.packing_enabled(torch.bfloat16, torch.device("cpu")) == "panels"
    native = greedy_tokens(True, "bfloat16", max_num_seqs)
    assert native == greedy_tokens(False, "bfloat16", max_num_seqs)
