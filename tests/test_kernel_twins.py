"""Every ``_C`` function against its ``name_py`` twin (the twin rule), called with the
same arguments, on the same kind of buffers: the model kernels through the rooms' own
marshalling (``*_args``), the output encoder and sender, and the small helpers."""

from __future__ import annotations

import hashlib
import os

import msgspec
import numpy as np
import pytest
import torch
import zmq

from enginecore import _native
from enginecore.model import kernel_twins
from enginecore.model.attention import paged_attention_args, paged_attention_torch
from enginecore.model.fused_ops import rms_norm_args, silu_and_mul_args
from enginecore.model.rope import rope_args
from enginecore.model.sampler import greedy_argmax_args
from enginecore.protocol import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from enginecore.sched import block_hash
from enginecore.serial import OutputEncoder, encode_columnar_py, libzmq_path_py, send_columnar_py
from helpers import same_bits
from test_paged_attention import make_case

C = _native._ext
pytestmark = pytest.mark.skipif(C is None, reason="native extension not built")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,cap", [(0, 0.0), (5, 0.0), (0, 30.0)])
def test_paged_attention_twin_writes_the_cache_and_attends_as_the_kernel(dtype, window, cap):
    rng = np.random.default_rng(7)
    q, k, v, k_cache, v_cache, meta, _ = make_case(rng, dtype, 8, 2, 16, 4,
                                                   [(0, 9), (13, 1), (6, 3), (20, 1)])
    outs, caches = [], []
    for fn in (C.paged_attention, kernel_twins.paged_attention_py):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = q.new_full(q.shape, float("nan"))
        fn(*paged_attention_args(out, q, k, v, kc, vc, meta, 0.25, window, cap))
        outs.append(out)
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert not outs[1].isnan().any()
    assert torch.equal(outs[1], outs[0])  # float64 inside both: the same bits


def _attend_all(q, k, v, k_cache, v_cache, meta, scale=0.25, window=0, cap=0.0):
    """The kernel, its raw twin and the model's tensor twin on copies of the caches."""
    outs = []
    for fn in (C.paged_attention, kernel_twins.paged_attention_py):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = q.new_full(q.shape, 7.0)
        fn(*paged_attention_args(out, q, k, v, kc, vc, meta, scale, window, cap))
        outs.append(out)
    kc, vc = k_cache.clone(), v_cache.clone()
    outs.append(paged_attention_torch(q, k, v, kc, vc, meta, scale, window or None,
                                      cap or None).view(q.shape))
    for other in outs[1:]:
        assert same_bits(outs[0], other)
    return outs[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80])  # the AVX-512 decode path and the generic one
def test_nan_scores_and_rows_with_nothing_visible_are_nan_on_every_path(dtype, head_dim):
    """As torch's softmax: a NaN score (a NaN in q, a whole tile of NaN K, a NaN scale)
    makes the row NaN, and so does a row whose every score is -inf; a broken model
    shows on both paths instead of the native one answering with zeros."""
    rng = np.random.default_rng(head_dim)
    q, k, v, kc, vc, meta, slots = make_case(rng, dtype, 2, 1, head_dim, 16, [(40, 1), (40, 1)])
    q[0, 0, 0] = float("nan")
    out = _attend_all(q, k, v, kc, vc, meta)
    assert out[0, 0].isnan().all() and not out[0, 1].isnan().any() and out[1].isfinite().all()
    kc[torch.from_numpy(slots[1][:32])] = float("nan")  # one whole tile of sequence 1
    assert _attend_all(q, k, v, kc, vc, meta)[1].isnan().all()
    assert _attend_all(q, k, v, kc, vc, meta, scale=float("nan")).isnan().all()
    q2, k2, v2, kc2, vc2, meta2, _ = make_case(rng, dtype, 1, 1, head_dim, 16, [(9, 1)])
    q2.fill_(1.0)
    kc2.fill_(float("-inf"))
    k2.fill_(float("-inf"))
    assert _attend_all(q2, k2, v2, kc2, vc2, meta2).isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_poisoned_v_reaches_only_the_rows_that_see_it_on_every_path(dtype, poison):
    """A non-finite V at the last prefill token: only that token's rows see it (the
    causal mask gives the others a weight of 0, and 0 adds nothing, even times NaN);
    likewise a position whose weight underflows below exp's range."""
    rng = np.random.default_rng(3)
    q, k, v, kc, vc, meta, _ = make_case(rng, dtype, 2, 1, 80, 16, [(0, 12)])
    v[11] = poison
    out = _attend_all(q, k, v, kc, vc, meta)
    assert out[:11].isfinite().all() and not out[11].isfinite().any()
    q2, k2, v2, kc2, vc2, meta2, slots = make_case(rng, dtype, 1, 1, 64, 16, [(20, 1)])
    q2.fill_(0.0)
    q2[..., 0] = 1.0
    kc2[torch.from_numpy(slots[0][:20]), :, 0] = 0.0
    kc2[int(slots[0][5]), :, 0] = -3000.0  # its weight: e^-750, below range
    vc2[int(slots[0][5])] = poison
    k2[..., 0] = 0.0
    assert _attend_all(q2, k2, v2, kc2, vc2, meta2, scale=1.0).isfinite().all()


@pytest.mark.parametrize("cap", [0.0, -2.0, float("nan")])
def test_a_soft_cap_that_is_not_positive_is_none_on_every_path(cap):
    rng = np.random.default_rng(5)
    q, k, v, kc, vc, meta, _ = make_case(rng, torch.float32, 4, 2, 64, 16, [(30, 1), (0, 5)])
    assert torch.equal(_attend_all(q, k, v, kc, vc, meta, cap=cap),
                       _attend_all(q, k, v, kc, vc, meta))


@pytest.mark.parametrize("fn", [C.paged_attention if C else None,
                                kernel_twins.paged_attention_py])
def test_bad_heads_and_short_contexts_are_refused_alike(fn):
    rng = np.random.default_rng(9)
    q, k, v, kc, vc, meta, _ = make_case(rng, torch.float32, 2, 1, 16, 4, [(3, 2)])
    args = list(paged_attention_args(q.clone(), q, k, v, kc, vc, meta, 0.25))
    for heads, kv_heads in ((0, 1), (-4, 2), (2, 0), (3, 2)):
        bad = args.copy()
        bad[23], bad[24] = heads, kv_heads  # num_heads, num_kv_heads
        with pytest.raises(ValueError, match="head"):
            fn(*bad)
    meta.seq_lens[0] = 1  # two query tokens, one context position
    with pytest.raises(ValueError, match="fewer context positions"):
        fn(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_rms_norm_twin_adds_in_place_and_normalises_as_the_kernel(dtype, with_delta):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(5, 96, generator=g).to(dtype)
    delta = torch.randn(5, 96, generator=g).to(dtype) if with_delta else None
    weight = torch.randn(96, generator=g).to(dtype)
    results = []
    for fn in (C.rms_norm, kernel_twins.rms_norm_py):
        x, out = base.clone(), torch.empty_like(base)
        fn(*rms_norm_args(x, delta, weight, out, 1e-6))
        results.append((x, out))
    assert torch.equal(results[0][0], results[1][0])  # the residual add, same bits
    assert torch.equal(results[1][1], results[0][1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_twin_equals_the_kernel(dtype):
    gate_up = torch.randn(7, 2 * 40, generator=torch.Generator().manual_seed(2)).to(dtype)
    results = []
    for fn in (C.silu_and_mul, kernel_twins.silu_and_mul_py):
        out = gate_up.new_empty(7, 40)
        fn(*silu_and_mul_args(gate_up, out))
        results.append(out)
    assert torch.equal(results[1], results[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [16, 8])  # 8 of 16: a partial rotary
def test_rope_twin_rotates_in_place_as_the_kernel(dtype, rotary_dim):
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 3 * 4 * 16, generator=g).to(dtype)
    cos = torch.randn(50, rotary_dim, generator=g).to(dtype)
    sin = torch.randn(50, rotary_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 3, 49, 7, 7, 12], dtype=torch.int64)
    results = []
    for fn in (C.rope, kernel_twins.rope_py):
        x = qkv.clone()[:, : 4 * 16].view(6, 4, 16)  # a view of the fused projection
        fn(*rope_args(x, positions, cos, sin))
        results.append(x)
    assert torch.equal(results[1], results[0])
    untouched = qkv[:, : 4 * 16].view(6, 4, 16)[..., rotary_dim:]
    assert torch.equal(results[1][..., rotary_dim:], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_argmax_twin_picks_the_kernels_tokens(dtype):
    logits = torch.randn(9, 1000, generator=torch.Generator().manual_seed(4)).to(dtype)
    logits[2, 17] = logits[2, 900] = 50.0  # a tie: the first index
    logits[5, 321] = float("nan")  # a NaN counts as the maximum
    picked = []
    for fn in (C.greedy_argmax, kernel_twins.greedy_argmax_py):
        out = torch.full((9,), -1, dtype=torch.int64)
        fn(*greedy_argmax_args(logits, out))
        picked.append(out.tolist())
    assert picked[0] == picked[1] and picked[0][2] == 17 and picked[0][5] == 321


@pytest.mark.parametrize("fn", [C.rms_norm if C else None, kernel_twins.rms_norm_py])
def test_kernel_and_twin_refuse_an_unknown_dtype_alike(fn):
    x = torch.zeros(1, 4)
    with pytest.raises(ValueError):
        fn(*rms_norm_args(x, None, torch.ones(4), torch.empty_like(x), 1e-6)[:-2], 7, 1)


def test_cpu_kernels_info_twin_reports_the_same_keys_and_cpu_features():
    torch.ones(1)  # torch's OpenMP is mapped by now on both sides
    native, twin = C.cpu_kernels_info(), kernel_twins.cpu_kernels_info_py()
    assert set(native) == set(twin) and twin["isa"] == "torch"
    for feature in ("avx2", "avx512f", "avx512_bf16", "amx"):
        assert native[feature] == twin[feature], feature
    if native["openmp"]:
        assert os.path.realpath(native["openmp"]) == os.path.realpath(twin["openmp"])


def _columns():
    enc = msgspec.msgpack.Encoder()
    special = EngineCoreOutput("r-finished", [5, 6], finish_reason=1, stop_reason="stop")
    stats = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1)
    return (2, ["a", None, "bb"], [[1], special, [2, 3]], [enc.encode(special)],
            enc.encode(stats), 1234.5), special, stats


def test_encode_columnar_twin_writes_the_kernels_bytes_and_msgspecs():
    args, special, stats = _columns()
    got = []
    for fn in (C.encode_columnar, encode_columnar_py):
        buf = bytearray(b"old contents are replaced")
        fn(*args, buf)
        got.append(bytes(buf))
    assert got[0] == got[1]
    decoded = msgspec.msgpack.decode(got[1], type=EngineCoreOutputs)
    assert decoded.engine_index == 2 and decoded.timestamp == 1234.5
    assert [o.request_id for o in decoded.outputs] == ["a", "r-finished", "bb"]
    assert decoded.outputs[1] == special and decoded.scheduler_stats == stats
    # and the encoder the output thread uses gives them too, on this path
    buf = bytearray()
    OutputEncoder().encode_into(msgspec.msgpack.decode(got[1], type=EngineCoreOutputs), buf)
    assert bytes(buf) == got[1]


@pytest.mark.parametrize("max_size,sent", [(-1, True), (10, False)])
def test_send_columnar_twin_sends_what_the_kernel_sends(max_size, sent):
    args, _, _ = _columns()
    ctx = zmq.Context()
    try:
        recv = ctx.socket(zmq.PULL)
        port = recv.bind_to_random_port("tcp://127.0.0.1")
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{port}")
        frames = []
        for fn in (C.send_columnar, send_columnar_py):
            assert fn(push.underlying, *args, max_size) is sent
            if sent:
                assert recv.poll(5000)
                frames.append(recv.recv())
        assert not recv.poll(100)  # nothing else arrived (a refused send sends nothing)
        if sent:
            assert frames[0] == frames[1]
        push.send(b"still open")  # the twin's shadow left the socket open
        assert recv.poll(5000) and recv.recv() == b"still open"
        push.close(0)
        recv.close(0)
    finally:
        ctx.term()


def test_small_helpers_equal_their_twins():
    assert _native.version_py() == C.version()
    data = os.urandom(300)
    assert block_hash.sha256_py(data) == C.sha256(data) == hashlib.sha256(data).digest()
    assert C.sha256_impl() in ("sha-ni", "portable") and block_hash.sha256_impl_py() == "hashlib"
    for fn in (C.sha256_force_portable, block_hash.sha256_force_portable_py):
        fn(False)
        with pytest.raises(TypeError):
            fn("yes")
    native_path = C.libzmq_path()
    assert native_path is not None  # zmq is imported by this module
    assert os.path.realpath(libzmq_path_py()) == os.path.realpath(native_path)



def test_public_cpu_kernels_info_follows_the_switch(hot_path):
    """``enginecore.cpu_kernels_info()``: the extension's report, or the twin's."""
    import enginecore

    info = enginecore.cpu_kernels_info()
    if hot_path == "python":
        assert info == kernel_twins.cpu_kernels_info_py()
    else:
        assert info["isa"] == _native._ext.cpu_kernels_info()["isa"] != "torch"
        assert info["attention_decode"] and info["bf16_gemv"] in ("avx512_bf16", "none")


@pytest.mark.parametrize("cap,expect", [("baseline", "baseline"), ("avx2", "avx2"),
                                        ("no-such-isa", None)])
def test_the_cpu_isa_cap_picks_a_lower_variant(cap, expect):
    """ENGINECORE_CPU_ISA caps the kernels' dispatch (how `make test` runs the AVX2 and
    baseline variants on an AVX-512 machine); an unknown value changes nothing."""
    import subprocess
    import sys

    from enginecore.model.cpu_flags import cpu_flags

    if expect == "avx2" and not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("no AVX2 here")
    code = ("import torch\nfrom enginecore import _native\n"
            "print(_native.extension().cpu_kernels_info()['isa'])")
    def isa(cap: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "ENGINECORE_CPU_ISA"}
        if cap is not None:
            env["ENGINECORE_CPU_ISA"] = cap
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, check=True).stdout.strip()

    # (this file also runs under a cap: the uncapped pick comes from a fresh process)
    assert isa(cap) == (expect or isa(None))
