"""MoE experts packed for the CPU GEMM like the dense layers (model/moe.py
``PackedExperts``): the same routing and sums as the stacked weights, the plain
weights back for saving, and a tiny Mixtral / Qwen3-MoE in bfloat16 generating
what it generates with packing off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from enginecore.model.arch_config import MoEConfig
from enginecore.model.linear import packing_enabled
from enginecore.model.moe import PackedExperts, moe_mlp, pack_experts
from test_model_llama import PROMPTS, engine_tokens
from tiny_models import make_tiny_model

CPU = torch.device("cpu")


def cfg(num_experts: int = 4, top_k: int = 2, inter: int = 24) -> MoEConfig:
    return MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=inter,
                     normalize_top_k=True, weights_in_model_dtype=True,
                     sparse_layers=[True], naming="qwen")


def small_ints(*shape: int, seed: int) -> torch.Tensor:
    """bf16 values in {-2..2} / 4: every product and partial sum is exact in
    float32, so any summation order gives the same bits."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-2, 3, shape, generator=g).float() / 4).to(torch.bfloat16)


def test_packed_experts_route_and_sum_as_the_stacked_weights(hot_path):
    kind = packing_enabled(torch.bfloat16, CPU)
    if kind is None:
        pytest.skip("this CPU / path packs no bfloat16 weights (plain F.linear runs)")
    c = cfg()
    hidden = 40
    router = small_ints(c.num_experts, hidden, seed=1)
    gate_up = small_ints(c.num_experts, 2 * c.intermediate_size, hidden, seed=2)
    down = small_ints(c.num_experts, hidden, c.intermediate_size, seed=3)
    packed_gu, packed_down = pack_experts(gate_up, kind), pack_experts(down, kind)
    assert isinstance(packed_gu, PackedExperts) and len(packed_gu) == c.num_experts
    # ReLU keeps the activations on the same exact grid (SiLU would not).
    for tokens in (1, 3, 17, 64):
        x = small_ints(tokens, hidden, seed=10 + tokens)
        want = moe_mlp(x, router, gate_up, down, c, F.relu)
        got = moe_mlp(x, router, packed_gu, packed_down, c, F.relu)
        assert torch.equal(got, want), tokens
    assert moe_mlp(x[:0], router, packed_gu, packed_down, c, F.relu).shape == (0, hidden)


def test_packed_experts_give_their_plain_weights_back():
    kind = packing_enabled(torch.bfloat16, CPU)
    if kind is None:
        pytest.skip("this CPU / path packs no bfloat16 weights")
    w = torch.randn(3, 20, 33).to(torch.bfloat16)
    packed = pack_experts(w, kind)
    for e in range(3):
        assert torch.equal(packed[e], w[e])
    assert packed.nbytes() >= w.numel() * w.element_size()
    again = packed.to(CPU)
    assert isinstance(again, PackedExperts) and torch.equal(again[1], w[1])
    # Nothing to pack, or packing off: the stacked tensor as it is.
    assert pack_experts(w, None) is w
    empty = torch.zeros(0, 4, 4, dtype=torch.bfloat16)
    assert pack_experts(empty, kind) is empty


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_bf16_moe_model_packed_generates_as_unpacked(tmp_path, monkeypatch, kind):
    if packing_enabled(torch.bfloat16, CPU) is None:
        pytest.skip("this CPU / path packs no bfloat16 weights")
    model_dir = make_tiny_model(str(tmp_path), kind, seed=3)
    args = dict(dtype="bfloat16", num_gpu_blocks_override=256)
    eng, packed = engine_tokens(model_dir, **args)
    model = eng.model_executor.runner.model
    moe_layers = [L for L in model.layers if L.router_w is not None]
    assert moe_layers and all(isinstance(L.experts_gate_up_w, PackedExperts)
                              and isinstance(L.experts_down_w, PackedExperts)
                              for L in moe_layers)
    saved = model.state_dict_hf()
    monkeypatch.setenv("ENGINECORE_PACK_WEIGHTS", "0")
    eng_plain, plain = engine_tokens(model_dir, **args)
    plain_model = eng_plain.model_executor.runner.model
    assert all(isinstance(L.experts_gate_up_w, torch.Tensor) for L in plain_model.layers
               if L.router_w is not None)
    ref = plain_model.state_dict_hf()
    assert saved.keys() == ref.keys() and all(torch.equal(saved[k], ref[k]) for k in ref)
    assert model.weight_bytes() >= plain_model.weight_bytes()
    # Tiny random weights in bf16: the two GEMMs round alike almost always; the
    # greedy tokens of most prompts agree from the first one on.
    assert sum(packed[r][0] == plain[r][0] for r in PROMPTS) >= len(PROMPTS) - 1


def test_stacked_experts_are_packed_again_back_on_the_cpu(tmp_path):
    """Sleep on CUDA parks weights in host memory and brings them back: experts
    that came back plain are packed again, like the dense Linears."""
    if packing_enabled(torch.bfloat16, CPU) is None:
        pytest.skip("this CPU / path packs no bfloat16 weights")
    model_dir = make_tiny_model(str(tmp_path), "mixtral", seed=3)
    eng, _ = engine_tokens(model_dir, dtype="bfloat16", num_gpu_blocks_override=256)
    model = eng.model_executor.runner.model
    layer = next(L for L in model.layers if L.router_w is not None)
    want = layer.experts_gate_up_w[1]
    # As they come back from a device that packs nothing: plain Linears.
    for name in ("experts_gate_up_w", "experts_down_w"):
        plain = torch.stack([getattr(layer, name)[e] for e in range(len(getattr(layer, name)))])
        setattr(layer, name, PackedExperts(plain, None))
    assert all(lin.kind is None for lin in layer.experts_gate_up_w.linears)
    model.to_device(CPU)
    kind = packing_enabled(torch.bfloat16, CPU)
    assert isinstance(layer.experts_gate_up_w, PackedExperts)
    assert isinstance(layer.experts_down_w, PackedExperts)
    assert all(lin.kind == kind for lin in layer.experts_gate_up_w.linears)
    assert all(lin.kind == kind for lin in layer.experts_down_w.linears)
    assert torch.equal(layer.experts_gate_up_w[1], want)
