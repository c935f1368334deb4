"""Native fused element-wise ops (csrc/fused_ops.cpp) against their torch twins:
the same arithmetic and roundings (sums and exps in float64 on both sides), so
the results are the twin's bits in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from enginecore import _native
from enginecore.model import fused_ops
from enginecore.model.rope import RotaryStep, apply_rope
from helpers import same_bits

pytestmark = pytest.mark.skipif(_native._ext is None, reason="native extension not built")


@pytest.fixture
def native():
    previous = _native._enabled
    _native.set_native(True)
    yield
    _native._enabled = previous


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (300, 256)])
def test_rms_norm_and_residual_add(native, dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    got = fused_ops.rms_norm(x, w, 1e-6)
    want = fused_ops.rms_norm_torch(x, w, 1e-6)
    h_want = x + delta
    h_got, y_got = fused_ops.add_rms_norm(x.clone(), delta, w, 1e-6)
    assert torch.equal(h_got, h_want)  # one rounding of the same sum
    y_want = fused_ops.rms_norm_torch(h_want, w, 1e-6)
    assert same_bits(got, want) and same_bits(y_got, y_want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(native, dtype):
    gu = (torch.randn(33, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    got, want = fused_ops.silu_and_mul(gu), fused_ops.silu_and_mul_torch(gu)
    assert same_bits(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 7, 255, 256, 257, 1000])
def test_silu_and_mul_at_the_edges_of_exp(native, dtype, width):
    # huge negative gates reach -0 (exp overflows to inf), -inf gives NaN, inf
    # and NaN pass through, tiny results go subnormal: the twin's bits everywhere
    edges = torch.tensor([-3e38, -1e36, -1e4, -100.0, -89.0, -88.7, -88.5, -88.0, -87.0,
                          -20.0, -1e-30, -0.0, 0.0, 1e-30, 20.0, 88.0, 1e4, 3e38,
                          float("-inf"), float("inf"), float("nan")])
    gate = edges.repeat(width // len(edges) + 1)[:width]
    gu = torch.cat([gate, torch.full((width,), 2.0)]).reshape(1, -1).to(dtype)
    got, want = fused_ops.silu_and_mul(gu), fused_ops.silu_and_mul_torch(gu)
    assert same_bits(got, want)


@pytest.mark.parametrize("native_path", [True, False])
def test_silu_and_mul_refuses_an_odd_width_on_both_paths(native_path):
    previous = _native._enabled
    _native.set_native(native_path)
    try:
        with pytest.raises(ValueError, match="even width"):
            fused_ops.silu_and_mul(torch.ones(3, 5))
    finally:
        _native._enabled = previous


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_gives_the_twins_bits(native, dtype):
    g = torch.Generator().manual_seed(3)
    cos = torch.randn(50, 64, generator=g).to(dtype)
    sin = torch.randn(50, 64, generator=g).to(dtype)
    cos[:, 32:], sin[:, 32:] = cos[:, :32], sin[:, :32]  # halves repeated, as the tables are
    positions = torch.tensor([0, 7, 49, 7, 3])
    qkv = torch.randn(5, 14 * 64, generator=g).to(dtype)
    want = apply_rope(qkv[:, : 12 * 64].view(5, 12, 64), cos[positions], sin[positions])
    x = qkv.clone()[:, : 12 * 64].view(5, 12, 64)  # a strided view, rotated in place
    got = RotaryStep(cos, sin, positions)(x)
    assert got.data_ptr() == x.data_ptr()
    assert torch.equal(got, want)


def test_ops_take_the_twin_off_the_native_path():
    previous = _native._enabled
    try:
        _native.set_native(False)
        x = torch.randn(4, 64)
        w = torch.randn(64)
        h, _ = fused_ops.add_rms_norm(x, x, w, 1e-5)
        assert h.data_ptr() != x.data_ptr()  # the twin never adds in place
    finally:
        _native._enabled = previous
