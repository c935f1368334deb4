"""The AVX512_BF16 decode GEMV (csrc/bf16_gemv.cpp ``_C.bf16_gemv``) against its twin
(``kernel_twins.bf16_gemv_py``, the same bits) and the exact sum, and ``Linear``'s use
of it: calls of 1-2 rows (``GEMV_MAX_ROWS``) on the plain weight kept beside oneDNN's packed one."""

from __future__ import annotations

import pytest
import torch

from enginecore import _native
from enginecore.model import kernel_twins
from enginecore.model.linear import GEMV_MAX_ROWS, Linear, gemv_enabled, packing_enabled
from helpers import same_bits

C = _native._ext
has_gemv = C is not None and C.bf16_gemv_available()
needs_gemv = pytest.mark.skipif(not has_gemv, reason="no AVX512_BF16 on this CPU (or no build)")
BOTH = [pytest.param("native", marks=needs_gemv), "python"]


def _fn(path):
    return C.bf16_gemv if path == "native" else kernel_twins.bf16_gemv_py


def _case(rows, n, k, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    return x, w, b


def _run(path, x, w, b, threads=2, out=None):
    out = torch.full((x.shape[0], w.shape[0]), 7.0, dtype=torch.bfloat16) if out is None else out
    _fn(path)(x.data_ptr(), x.stride(0), x.shape[0], w.data_ptr(),
              0 if b is None else b.data_ptr(), out.data_ptr(), out.stride(0), w.shape[1],
              w.shape[0], threads)
    return out


def _within_one_rounding(got, x, w, b):
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    # a float32 sum (a few float32 roundings) rounded once to bf16
    tol = exact.abs().clamp_min(1e-2) * 2.0 ** -7 + 1e-5 * (x.double().abs() @ w.double().abs().T)
    return bool(((got.double() - exact).abs() <= tol).all())


# K around the 32-wide step (tails of 1..31), N around the 16-row group and the 64-row item.
@pytest.mark.parametrize("path", BOTH)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(1, 2), (16, 32), (17, 33), (64, 576), (65, 100), (960, 576),
                                 (130, 1536), (7, 4097)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_is_the_exact_sum_rounded_once(path, rows, n, k, bias):
    x, w, b = _case(rows, n, k, rows * 7919 + n * 31 + k, bias)
    got = _run(path, x, w, b)
    assert _within_one_rounding(got, x, w, b)


@needs_gemv
@pytest.mark.parametrize("rows", [1, 4])
def test_same_bits_on_any_thread_count_and_twin_agrees(rows):
    x, w, b = _case(rows, 1000, 900, rows)
    one = _run("native", x, w, b, threads=1)
    assert torch.equal(one, _run("native", x, w, b, threads=2))
    assert torch.equal(one, _run("native", x, w, b, threads=7))
    twin = _run("python", x, w, b)
    assert torch.equal(one.view(torch.int16), twin.view(torch.int16))  # the twin's bits


@needs_gemv
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(1, 2), (17, 33), (64, 576), (130, 1536), (7, 4097), (49, 31)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_gives_the_twins_bits(rows, n, k, bias):
    x, w, b = _case(rows, n, k, rows * 131 + n + k, bias)
    x[0, 0] = float("nan") if n == 17 else x[0, 0]  # a NaN row stays NaN on both
    native, twin = _run("native", x, w, b), _run("python", x, w, b)
    assert same_bits(native, twin)


@needs_gemv
def test_strided_rows_write_only_their_outputs():
    x_big = torch.randn(4, 300).bfloat16()
    x = x_big[:, :200]  # row stride 300
    w = torch.randn(50, 200).bfloat16()
    out_big = torch.full((4, 80), 3.0, dtype=torch.bfloat16)
    out = out_big[:, :50]
    C.bf16_gemv(x.data_ptr(), x.stride(0), 4, w.data_ptr(), 0, out.data_ptr(), out.stride(0),
                200, 50, 2)
    assert _within_one_rounding(out, x, w, None)
    assert (out_big[:, 50:] == 3.0).all()  # nothing past the row's outputs


@pytest.mark.parametrize("path", BOTH)
def test_bad_sizes_are_refused_alike(path):
    x, w, _ = _case(1, 8, 8, 0)
    out = torch.empty(5, 8, dtype=torch.bfloat16)
    fn = _fn(path)
    for rows, k, n in ((0, 8, 8), (5, 8, 8), (1, 0, 8), (1, 8, 0)):
        with pytest.raises(ValueError):
            fn(x.data_ptr(), 8, rows, w.data_ptr(), 0, out.data_ptr(), 8, k, n, 1)
    with pytest.raises(ValueError):
        fn(x.data_ptr(), 4, 2, w.data_ptr(), 0, out.data_ptr(), 8, 8, 8, 1)  # short stride
    with pytest.raises(ValueError):
        fn(0, 8, 1, w.data_ptr(), 0, out.data_ptr(), 8, 8, 8, 1)


@needs_gemv
@pytest.mark.skipif(packing_enabled(torch.bfloat16, torch.device("cpu")) != "onednn",
                    reason="oneDNN packs no bf16 weights here")
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_runs_decode_rows_on_the_plain_weight(with_bias):
    x_all, w, b = _case(GEMV_MAX_ROWS + 3, 333, 200, 5, with_bias)
    lin = Linear(w, b, pack="onednn", gemv=True)
    plain = Linear(w, b, pack="onednn")
    assert lin.gemv and not plain.gemv and torch.equal(lin.dense(), w)
    assert lin.nbytes() == plain.nbytes() + w.numel() * 2
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 3):  # the last on oneDNN
        x = x_all[:rows]
        assert _within_one_rounding(lin(x), x, w, b)
        assert _within_one_rounding(plain(x), x, w, b)
    three_d = x_all[:2].view(1, 2, 200)
    assert lin(three_d).shape == (1, 2, 333)
    # The Python path runs the GEMV's twin on the same calls: the same bits.
    native = [lin(x_all[:rows]) for rows in range(1, GEMV_MAX_ROWS + 1)]
    _native.set_native(False)
    try:
        for rows, want in enumerate(native, start=1):
            assert same_bits(lin(x_all[:rows]), want)
    finally:
        _native.set_native(True)


def test_gemv_copy_is_kept_by_size_and_switch(monkeypatch):
    monkeypatch.delenv("ENGINECORE_BF16_GEMV", raising=False)
    assert not gemv_enabled(None, 1) and not gemv_enabled("panels", 1)
    monkeypatch.setenv("ENGINECORE_BF16_GEMV", "0")
    assert not gemv_enabled("onednn", 1)
    # By the CPU, not the switch: the Python path keeps the copy where the native
    # one does and runs the GEMV's twin on it (the same tokens either way).
    monkeypatch.setenv("ENGINECORE_BF16_GEMV", "auto")
    on_native = gemv_enabled("onednn", 1 << 20)
    _native.set_native(False)
    try:
        assert gemv_enabled("onednn", 1 << 20) == on_native == has_gemv
    finally:
        _native.set_native(True)
    if has_gemv:
        monkeypatch.setenv("ENGINECORE_BF16_GEMV", "auto")
        assert gemv_enabled("onednn", 1 << 20) and not gemv_enabled("onednn", 1 << 40)
        monkeypatch.setenv("ENGINECORE_BF16_GEMV", "1")
        assert gemv_enabled("onednn", 1 << 40)


@needs_gemv
def test_a_product_past_float32s_range_is_fused_as_the_kernel_fuses_it():
    """The twin replays the FMA (product and sum exact, one rounding): 2^64 * 2^64
    added to -1.5 * 2^127 is 2^126 there; a float32 product would be inf first."""
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, 0], w[0, 0] = -1.5 * 2.0**63, 2.0**64  # lane 0 of chunk 0: -1.5 * 2^127
    x[0, 32], w[0, 32] = 2.0**64, 2.0**64  # lane 0 of chunk 1: 2^128
    native, twin = _run("native", x, w, None), _run("python", x, w, None)
    assert same_bits(native, twin) and native.item() == 2.0**126
