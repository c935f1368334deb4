"""Native paged attention (csrc/paged_attention.cpp) against its torch twin and a
float64 reference, on random shapes: decode and chunked prefill in one batch,
grouped-query heads, block sizes, shuffled block tables, sliding windows and
logit soft-capping, float32 and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enginecore import _native
from enginecore.model.attention import (
    make_attention_metadata,
    paged_attention,
    paged_attention_native,
    paged_attention_torch,
)

pytestmark = pytest.mark.skipif(_native._ext is None, reason="native extension not built")

CPU = torch.device("cpu")


def make_case(rng: np.random.Generator, dtype, heads, kv_heads, head_dim, block_size, seqs):
    """seqs: [(cached context, new tokens)]. Returns tensors, metadata and the
    per-sequence context positions -> slots, for the reference."""
    seq_lens = np.array([c + n for c, n in seqs])
    blocks_needed = [-(-int(L) // block_size) for L in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    perm = rng.permutation(num_blocks)  # blocks scattered over the cache
    scratch = num_blocks  # the zeroed extra block, as the runner allocates it
    table = np.full((len(seqs), max(blocks_needed)), scratch, dtype=np.int32)
    k = 0
    for i, m in enumerate(blocks_needed):
        table[i, :m] = perm[k : k + m]
        k += m
    slots_of = [table[i, np.arange(L) // block_size].astype(np.int64) * block_size
                + np.arange(L) % block_size for i, L in enumerate(seq_lens)]
    new_slots = np.concatenate([slots_of[i][c:] for i, (c, _) in enumerate(seqs)])
    qs = np.concatenate([[0], np.cumsum([n for _, n in seqs])])
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    n_slots = (num_blocks + 1) * block_size
    k_cache = torch.randn(n_slots, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(n_slots, kv_heads, head_dim, generator=g).to(dtype)
    k_cache[scratch * block_size :] = 0
    v_cache[scratch * block_size :] = 0
    T = int(qs[-1])
    # q, k, v as views of one fused projection, the way the model hands them over
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(T, heads, head_dim)
    kn = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(T, kv_heads, head_dim)
    vn = qkv[:, (heads + kv_heads) * head_dim :].view(T, kv_heads, head_dim)
    meta = make_attention_metadata(new_slots, qs, seq_lens, table, block_size,
                                   scratch * block_size, CPU)
    return q, kn, vn, k_cache, v_cache, meta, slots_of


def reference(q, k_cache, v_cache, meta, slots_of, scale, window, cap):
    """float64, one sequence at a time, from the cache after the new K/V landed."""
    T, H, D = q.shape
    G = H // k_cache.shape[1]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    qs = meta.query_start_np
    for s, slots in enumerate(slots_of):
        L, n = len(slots), int(qs[s + 1] - qs[s])
        kk = k_cache[torch.from_numpy(slots)].double().repeat_interleave(G, dim=1)  # [L, H, D]
        vv = v_cache[torch.from_numpy(slots)].double().repeat_interleave(G, dim=1)
        qq = q[qs[s] : qs[s + 1]].double()  # [n, H, D]
        scores = torch.einsum("nhd,lhd->hnl", qq, kk) * scale
        if cap:
            scores = torch.tanh(scores / cap) * cap
        qpos = torch.arange(L - n, L)[:, None]
        pos = torch.arange(L)[None, :]
        visible = pos <= qpos
        if window:
            visible &= qpos - pos < window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[qs[s] : qs[s + 1]] = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, -1), vv)
    return out


def assert_native_matches(native, twin, ref):
    """Native = twin bit for bit (both float64 inside, rounded once), and both the
    float64 reference within one rounding to the dtype."""
    assert torch.equal(native, twin)
    if native.dtype == torch.float32:
        torch.testing.assert_close(native.double(), ref, atol=2e-6, rtol=1e-6)
    else:
        torch.testing.assert_close(native.double(), ref, atol=1e-5, rtol=2**-8)


shapes = st.fixed_dictionaries({
    "dtype": st.sampled_from([torch.float32, torch.bfloat16]),
    "kv_heads": st.integers(1, 3),
    "group": st.sampled_from([1, 2, 3, 4, 7]),
    "head_dim": st.sampled_from([16, 64, 80, 128]),
    "block_size": st.sampled_from([1, 4, 16, 32]),
    "seqs": st.lists(st.tuples(st.integers(0, 90), st.sampled_from([1, 1, 2, 5, 17, 40])),
                     min_size=1, max_size=5),
    "window": st.one_of(st.none(), st.integers(1, 60)),
    "cap": st.one_of(st.none(), st.floats(1.0, 50.0)),
    "seed": st.integers(0, 2**31),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes)
def test_native_matches_twin_and_reference(case):
    rng = np.random.default_rng(case["seed"])
    heads = case["kv_heads"] * case["group"]
    q, kn, vn, kc, vc, meta, slots_of = make_case(
        rng, case["dtype"], heads, case["kv_heads"], case["head_dim"], case["block_size"],
        case["seqs"])
    scale = case["head_dim"] ** -0.5
    w, cap = case["window"], case["cap"]
    kc_twin, vc_twin = kc.clone(), vc.clone()
    twin = paged_attention_torch(q, kn, vn, kc_twin, vc_twin, meta, scale, w, cap)
    native = paged_attention_native(_native._ext, q, kn, vn, kc, vc, meta, scale, w, cap)
    # Both wrote the same new K/V into the same slots.
    assert torch.equal(kc, kc_twin) and torch.equal(vc, vc_twin)
    ref = reference(q, kc, vc, meta, slots_of, scale, w, cap).view(native.shape)
    assert_native_matches(native, twin, ref)


def test_poisoned_cache_outside_the_context_is_never_read():
    """NaN in every slot that is not some sequence's context: nothing leaks."""
    rng = np.random.default_rng(1)
    q, kn, vn, kc, vc, meta, slots_of = make_case(rng, torch.float32, 6, 2, 64, 4,
                                                  [(5, 1), (0, 9), (13, 3)])
    used = np.concatenate(slots_of)
    poison = np.setdiff1d(np.arange(kc.shape[0]), used)
    kc[torch.from_numpy(poison)] = float("nan")
    vc[torch.from_numpy(poison)] = float("nan")
    out = paged_attention_native(_native._ext, q, kn, vn, kc, vc, meta, 0.125)
    assert not out.isnan().any()


def test_dispatch_follows_the_switch(monkeypatch, hot_path):
    rng = np.random.default_rng(2)
    q, kn, vn, kc, vc, meta, _ = make_case(rng, torch.float32, 4, 2, 32, 4, [(3, 1), (0, 5)])
    calls = []
    import enginecore.model.attention as attn

    for name in ("paged_attention_native", "paged_attention_torch"):
        real = getattr(attn, name)
        monkeypatch.setattr(attn, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n),
                                                                           _r(*a, **k))[1])
    paged_attention(q, kn, vn, kc, vc, meta, 0.2)
    assert calls == ["paged_attention_native" if hot_path == "native" else "paged_attention_torch"]
    # float16 has no native kernel: the twin takes it on either path.
    calls.clear()
    paged_attention(q.half(), kn.half(), vn.half(), kc.half(), vc.half(), meta, 0.2)
    assert calls == ["paged_attention_torch"]


def test_kernels_split_work_on_torchs_own_openmp():
    """The team torch's ops run on, never a second OpenMP runtime another package
    loaded (scikit-learn ships its own libgomp)."""
    import glob
    import os

    torch_gomp = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*"))
    info = _native._ext.cpu_kernels_info()
    assert info["isa"] in ("avx512", "avx2", "baseline")
    if torch_gomp:  # the CPU wheel bundles it
        assert os.path.realpath(info["openmp"]) in {os.path.realpath(p) for p in torch_gomp}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group,new_tokens", [(1, 1), (3, 1), (4, 2), (7, 1), (8, 1), (3, 2)])
@pytest.mark.parametrize("window,cap", [(None, None), (40, None), (None, 30.0), (None, 1e5)])
def test_decode_rows_on_every_path(dtype, head_dim, group, new_tokens, window, cap):
    """The shapes the AVX-512 register path takes (head_dim 64 / 128, up to 8 rows per
    KV head; attention_decode_avx512.h) and the ones next to it, over contexts that
    end inside, on and past tile (32) and 16-position boundaries, many tiles long:
    native = twin = float64 reference within the float tolerances."""
    rng = np.random.default_rng(head_dim * 1000 + group * 10 + new_tokens)
    seqs = [(c, new_tokens) for c in (0, 15, 31, 32, 33, 100, 257)]
    kv_heads = 2
    q, kn, vn, kc, vc, meta, slots_of = make_case(
        rng, dtype, kv_heads * group, kv_heads, head_dim, 16, seqs)
    scale = head_dim ** -0.5
    kc_twin, vc_twin = kc.clone(), vc.clone()
    twin = paged_attention_torch(q, kn, vn, kc_twin, vc_twin, meta, scale, window, cap)
    native = paged_attention_native(_native._ext, q, kn, vn, kc, vc, meta, scale, window, cap)
    ref = reference(q, kc, vc, meta, slots_of, scale, window, cap).view(native.shape)
    assert_native_matches(native, twin, ref)


def test_decode_path_is_reported():
    """cpu_kernels_info says which decode attention runs: the register path wherever the
    AVX-512 kernels were picked, the generic loops elsewhere."""
    info = _native._ext.cpu_kernels_info()
    expected = "generic" if info["isa"] != "avx512" else info["attention_decode"]
    assert info["attention_decode"] == expected
    assert info["attention_decode"].startswith("avx512") == (info["isa"] == "avx512")


@pytest.mark.parametrize("head_dim,group,new_tokens", [(64, 1, 2), (128, 4, 2), (64, 2, 4),
                                                       (80, 1, 2)])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_poisoned_v_row_outside_a_rows_window_leaves_that_row_alone(head_dim, group,
                                                                      new_tokens, poison):
    """A non-finite V at a cached position only the first new token sees (sliding
    window): the later tokens' rows give what they gave on the clean cache, on the
    register path (head_dim 64 / 128) as on the generic one (a weight of 0 adds
    nothing, even times NaN)."""
    rng = np.random.default_rng(head_dim + group + new_tokens)
    context, window = 40, 8
    q, kn, vn, kc, vc, meta, slots_of = make_case(
        rng, torch.float32, group, 1, head_dim, 16, [(context, new_tokens)])
    scale = head_dim ** -0.5
    clean = paged_attention_native(_native._ext, q, kn, vn, kc, vc, meta, scale, window)
    clean = clean.view(new_tokens, group, head_dim)
    first_only = context + new_tokens - new_tokens - window + 1  # only token 0 sees it
    vc[slots_of[0][first_only], 0, :] = poison
    got = paged_attention_native(_native._ext, q, None, None, kc, vc, meta, scale, window)
    got = got.view(new_tokens, group, head_dim)
    assert torch.equal(got[1:], clean[1:])
    assert not torch.isfinite(got[0]).all()  # the token that sees it does
