"""The sparse MoE block (``model/moe.moe_mlp``) with its experts packed for the CPU
GEMM (``PackedExperts``: oneDNN or ``_C.bf16_linear`` panels, whichever this CPU
packs) against the stacked weights through ``F.linear`` in bfloat16 and float32:
8 experts, hidden 1024, expert width 1024, top-2, at 1 / 8 / 64 tokens. Prints the
CPU model and the packing kind first.

Run: pytest bench/bench_moe.py --benchmark-group-by=group --benchmark-columns=min,median
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from enginecore.model.arch_config import MoEConfig
from enginecore.model.linear import packing_enabled
from enginecore.model.moe import moe_mlp, pack_experts

CFG = MoEConfig(num_experts=8, top_k=2, intermediate_size=1024, normalize_top_k=True,
                weights_in_model_dtype=True, sparse_layers=[True], naming="qwen")
HIDDEN = 1024
KIND = packing_enabled(torch.bfloat16, torch.device("cpu"))


def setup_module(_module):
    from bench_bf16_linear import setup_module as header

    header(_module)
    print(f"# expert packing: {KIND}")


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator().manual_seed(0)
    router = torch.randn(CFG.num_experts, HIDDEN, generator=g) * 0.05
    gate_up = torch.randn(CFG.num_experts, 2 * CFG.intermediate_size, HIDDEN, generator=g) * 0.03
    down = torch.randn(CFG.num_experts, HIDDEN, CFG.intermediate_size, generator=g) * 0.03
    bf = (router.bfloat16(), gate_up.bfloat16(), down.bfloat16())
    return {
        "packed_bf16": (bf[0], pack_experts(bf[1], KIND), pack_experts(bf[2], KIND)),
        "stacked_bf16": bf,
        "stacked_fp32": (router, gate_up, down),
    }


@pytest.mark.parametrize("tokens", [1, 8, 64])
@pytest.mark.parametrize("layout", ["packed_bf16", "stacked_bf16", "stacked_fp32"])
def test_moe_mlp(benchmark, weights, layout, tokens):
    if layout == "packed_bf16" and KIND is None:
        pytest.skip("this CPU / path packs no bfloat16 weights")
    benchmark.group = f"moe_mlp[{tokens} tokens]"
    router, gate_up, down = weights[layout]
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    x = x.to(router.dtype)
    out = benchmark(moe_mlp, x, router, gate_up, down, CFG, F.silu)
    assert out.shape == x.shape and torch.isfinite(out.float()).all()
