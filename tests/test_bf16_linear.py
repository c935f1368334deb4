"""The AVX2 bf16 GEMM (csrc/bf16_gemm.cpp ``_C.bf16_linear``) against its twin
(``kernel_twins.bf16_linear_py``) on the same buffers, and ``Linear``'s panel layout."""

from __future__ import annotations

import pytest
import torch

from enginecore import _native
from enginecore.model import kernel_twins
from enginecore.model.linear import (
    Linear,
    bf16_linear_args,
    bf16_linear_torch,
    pack_panels,
    packing_enabled,
    unpack_panels,
)

C = _native._ext
needs_native = pytest.mark.skipif(C is None, reason="native extension not built")
BOTH = [pytest.param("native", marks=needs_native), "python"]


def _fn(path):
    return C.bf16_linear if path == "native" else kernel_twins.bf16_linear_py


def _case(rows, n, k, seed, bias=True, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * scale).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    return x, w, b


def _run(path, x, w, b, threads=None, out=None):
    out = torch.full((x.shape[0], w.shape[0]), 7.0, dtype=torch.bfloat16) if out is None else out
    args = list(bf16_linear_args(x, panels := pack_panels(w), b, out))
    if threads is not None:
        args[-1] = threads
    _fn(path)(*args)
    del panels
    return out


# Row counts on the direct path (1-4), around the 3-row register tile, the 72-row block
# and the widening chunk (16 MiB of doubles); features around the 16-wide panel; K
# around the 128 block.
@needs_native
@pytest.mark.parametrize("rows,n,k", [(1, 16, 8), (2, 40, 100), (3, 17, 513), (4, 64, 64),
                                      (5, 33, 80), (6, 100, 256), (7, 130, 257),
                                      (72, 48, 300), (73, 1000, 513), (200, 17, 64),
                                      (1010, 20, 4096)])  # x widened in 1008-row chunks
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_gives_its_twins_bits(rows, n, k, bias):
    x, w, b = _case(rows, n, k, rows * 1000 + n, bias)
    native, twin = _run("native", x, w, b), _run("python", x, w, b)
    assert torch.equal(native, twin)  # float64 sums on both, rounded the same way
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    # the float64 sum rounded to float32, the bias added, rounded to bf16: within one
    # bf16 ulp of the exact value
    ulp = exact.abs().clamp_min(1e-3) * 2.0 ** -7
    assert ((native.double() - exact).abs() <= ulp).all()


@pytest.mark.parametrize("path", BOTH)
def test_exact_sums_give_the_same_bits_on_both_paths(path):
    # small integers: every product and partial sum is exact in float32
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 5, (9, 70), generator=g).bfloat16()
    w = torch.randint(-4, 5, (37, 70), generator=g).bfloat16()
    b = torch.randint(-8, 9, (37,), generator=g).bfloat16()
    expected = (x.float() @ w.float().T + b.float()).bfloat16()
    assert torch.equal(_run(path, x, w, b), expected)


@needs_native
def test_the_same_bits_for_any_thread_count():
    x, w, b = _case(80, 700, 600, 11)
    results = [_run("native", x, w, b, threads=t) for t in (1, 2, 3, 8)]
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("path", BOTH)
def test_strided_rows_in_and_out_and_nothing_written_outside(path):
    x_big, w, b = _case(6, 40, 50, 5)
    x_wide = torch.randn(6, 64).bfloat16()
    x_wide[:, :50] = x_big
    x = x_wide[:, :50]  # rows 64 apart
    out_wide = torch.full((6, 48), 3.0, dtype=torch.bfloat16)
    _run(path, x, w, b, out=out_wide[:, :40])
    assert torch.equal(out_wide[:, 40:], torch.full((6, 8), 3.0, dtype=torch.bfloat16))
    ref = bf16_linear_torch(x_big, w, b).float()
    assert torch.allclose(out_wide[:, :40].float(), ref, rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("path", BOTH)
def test_nan_and_inf_propagate(path):
    x, w, _ = _case(3, 20, 16, 9, bias=False)
    x[1, 4] = float("nan")
    w[7, :] = 0
    w[7, 0] = float("inf")
    x[2, 0] = 1.0
    out = _run(path, x, w, None)
    assert out[1].isnan().all()
    assert out[2, 7] == float("inf")


@pytest.mark.parametrize("path", BOTH)
def test_bad_sizes_are_refused_alike(path):
    x, w, b = _case(2, 16, 8, 1)
    out = torch.empty(2, 16, dtype=torch.bfloat16)
    args = list(bf16_linear_args(x, pack_panels(w), b, out))
    for i, bad in ((1, 4), (6, 3), (7, 0), (8, 0), (2, -1)):
        broken = list(args)
        broken[i] = bad
        with pytest.raises(ValueError):
            _fn(path)(*broken)
    args[2] = 0  # no rows: nothing to do
    _fn(path)(*args)


def test_panels_round_trip_the_weight():
    w = torch.randn(37, 11).bfloat16()
    panels = pack_panels(w)
    assert panels.shape == (3, 11, 16) and panels.is_contiguous()
    assert torch.equal(panels[2, :, 5:], torch.zeros(11, 11, dtype=torch.bfloat16))
    assert torch.equal(unpack_panels(panels, 37), w)


@needs_native
def test_linear_with_panels_keeps_no_plain_copy_and_gives_the_weight_back():
    x, w, b = _case(4, 50, 24, 2)
    lin = Linear(w, b, pack="panels")
    assert lin.weight is None and lin.kind == "panels"
    assert torch.equal(lin.dense(), w)
    y = lin(x.view(2, 2, 24))  # leading dims kept
    assert y.shape == (2, 2, 50)
    assert torch.equal(y.view(4, 50), _run("native", x, w, b))
    assert lin.nbytes() == 64 * 24 * 2 + 50 * 2  # panels padded to 16 features
    moved = lin.to(torch.device("cpu"))
    assert torch.equal(moved.dense(), w)


@needs_native
def test_linear_with_panels_takes_what_f_linear_takes_and_refuses_the_rest():
    x, w, b = _case(5, 40, 64, 8)
    lin = Linear(w, b, pack="panels")
    ref = bf16_linear_torch(x, w, b).float()
    close = {"rtol": 2 ** -7, "atol": 1e-2}
    # broadcast, overlapping and transposed rows are read as F.linear reads them
    row = x[:1].expand(5, 64)
    assert torch.allclose(lin(row).float(), bf16_linear_torch(row.contiguous(), w, b).float(),
                          **close)
    wide = torch.randn(64 + 4).bfloat16()
    overlapping = wide.unfold(0, 64, 1)
    assert torch.allclose(lin(overlapping).float(),
                          bf16_linear_torch(overlapping.contiguous(), w, b).float(), **close)
    assert torch.allclose(lin(x.T.contiguous().T).float(), ref, **close)
    with pytest.raises(ValueError, match="features"):
        lin(torch.randn(10, 32).bfloat16())  # 320 elements: divisible, still wrong
    with pytest.raises(ValueError, match="float32"):
        lin(x.float())
    with pytest.raises(ValueError, match="bias"):
        Linear(w, b.float(), pack="panels")
    with pytest.raises(ValueError, match="bias"):
        Linear(w, b[:30], pack="panels")
    with pytest.raises(ValueError, match="bfloat16"):
        Linear(w.float(), pack="panels")
    empty = Linear(torch.empty(0, 64, dtype=torch.bfloat16), pack="panels")
    assert lin(x[:0]).shape == (0, 40) and empty(x).shape == (5, 0)


@needs_native
def test_a_packed_linear_still_answers_when_the_native_path_is_switched_off():
    x, w, b = _case(3, 20, 16, 12)
    lin = Linear(w, b, pack="panels")
    native = lin(x)
    was = _native.native_available()
    _native.set_native(False)
    try:
        assert torch.allclose(lin(x).float(), native.float(), rtol=2 ** -7, atol=1e-2)
    finally:
        _native.set_native(was)


def test_packing_picks_panels_only_where_onednn_has_no_bf16_path(monkeypatch):
    cpu = torch.device("cpu")
    kind = packing_enabled(torch.bfloat16, cpu)
    info = C.cpu_kernels_info() if C is not None else {}
    if C is None:
        assert kind in (None, "onednn")
    elif info["bf16_linear"] == "avx2" and not info["avx512f"]:
        assert kind == "panels"
    assert packing_enabled(torch.float32, cpu) is None
    monkeypatch.setenv("ENGINECORE_PACK_WEIGHTS", "0")
    assert packing_enabled(torch.bfloat16, cpu) is None


@needs_native
def test_a_starved_team_runs_serially_with_the_same_bits():
    """Every core busy with another process: the kernels' OpenMP team keeps its
    members waiting at the join barrier, parallel_for notices and runs the next
    calls on one thread (csrc/cpu_threads.cpp): the same bits throughout."""
    import os
    import subprocess
    import sys
    import time

    x, w, _ = _case(1, 4864, 896, 21, bias=False)
    want = _run("native", x, w, None, threads=1)
    spells = C.cpu_kernels_info()["starved_team_spells"]
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"])
            for _ in range(min(os.cpu_count() or 1, 8))]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert torch.equal(_run("native", x, w, None, threads=2), want)
            if C.cpu_kernels_info()["starved_team_spells"] > spells:
                break
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert C.cpu_kernels_info()["starved_team_spells"] > spells
    for _ in range(50):  # serial for a while, then the team again: same bits
        assert torch.equal(_run("native", x, w, None, threads=2), want)
