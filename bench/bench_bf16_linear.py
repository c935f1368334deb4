"""The bf16-weight GEMM (``_C.bf16_linear``, model/linear.py "panels") side by side
with its twin (``kernel_twins.bf16_linear_py``: float64 matmul on widened weights),
torch's bfloat16 ``F.linear`` and its float32 one on the same weights, at the default
model's four projection shapes and 1 / 8 / 64 / 256 rows (decode batches, a prefill
chunk). Prints the CPU model and flags first; GFLOP/s in ``extra_info``.

Run: pytest bench/bench_bf16_linear.py --benchmark-group-by=group --benchmark-columns=min,median
"""

from __future__ import annotations

import subprocess

import pytest
import torch
import torch.nn.functional as F

from enginecore import _native
from enginecore.model import kernel_twins
from enginecore.model.linear import bf16_linear_args, pack_panels

C = _native._ext
# (out_features, in_features): qkv, gate_up, down, LM head of Qwen2.5-0.5B
SHAPES = {"qkv": (1152, 896), "gate_up": (9728, 896), "down": (896, 4864),
          "lm_head": (151936, 896)}
ROWS = [1, 8, 64, 256]
PATHS = ["native", "twin", "torch_bf16", "torch_fp32"]


def setup_module(_module):
    out = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                  if ln.startswith("Model name")), "?")
    flags = next((ln for ln in out.splitlines() if ln.startswith("Flags")), "")
    picked = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    isa = C.cpu_kernels_info()["bf16_linear"] if C is not None else "none"
    print(f"\n# {model}; flags: {' '.join(picked)}; torch threads {torch.get_num_threads()}; "
          f"bf16_linear: {isa}")


@pytest.fixture(scope="module", params=list(SHAPES))
def layer(request):
    n, k = SHAPES[request.param]
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    return request.param, w, pack_panels(w), w.float()


@pytest.mark.skipif(C is None, reason="native extension not built")
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("path", PATHS)
def test_bf16_linear(benchmark, layer, rows, path):
    name, w, panels, wf = layer
    n, k = w.shape
    if name == "lm_head" and rows > 64 and path != "native":
        pytest.skip("seconds per call; the smaller rows say the same")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    args = bf16_linear_args(x, panels, None, out)
    calls = {"native": lambda: C.bf16_linear(*args),
             "twin": lambda: kernel_twins.bf16_linear_py(*args),
             "torch_bf16": lambda: F.linear(x, w),
             "torch_fp32": lambda: F.linear(x.float(), wf)}
    benchmark.group = f"bf16_linear[{name} {n}x{k}, {rows} rows]"
    benchmark.pedantic(calls[path], rounds=5, warmup_rounds=1)
    benchmark.extra_info["gflops"] = 2 * rows * n * k / benchmark.stats.stats.min / 1e9
