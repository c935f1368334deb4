"""Random sampling, the exponential race on hashed Exp(1) variables (``_C.sample_rows``
<-> ``kernel_twins.sample_rows_py`` / ``sampler.sample_rows_torch``): the same tokens on
both paths, the hash's bits, the softmax's distribution, the edge rows (NaN, inf,
everything dropped), bad input refused alike, draws that a batch-sized change of the
logits leaves alone, and the engine's seeded sampling equal on both paths. Top-p
(``_C.top_p_rows`` <-> ``top_p_rows_py`` / ``top_p_rows_torch``): the same masks, the
nucleus vLLM's rule keeps."""

from __future__ import annotations

import pytest
import torch

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams, _native
from enginecore.model import kernel_twins
from enginecore.model.sampler import (
    Sampler,
    race_uniforms,
    sample_rows,
    sample_rows_args,
    sample_rows_torch,
    top_p_rows,
    top_p_rows_args,
    top_p_rows_torch,
)
from helpers import run_to_completion
from tiny_models import make_tiny_model

C = _native._ext
pytestmark = pytest.mark.skipif(C is None, reason="native extension not built")

INT64 = (-(1 << 63), (1 << 63) - 1)


def keys_for(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(*INT64, (rows,), dtype=torch.int64, generator=g)
    keys[0], keys[-1] = INT64
    return keys


def both(logits: torch.Tensor, keys: torch.Tensor) -> tuple[list[int], list[int]]:
    """(kernel's tokens, twin's tokens) at the raw boundary, on the same buffers."""
    got = []
    for fn in (C.sample_rows, kernel_twins.sample_rows_py):
        out = torch.full((logits.shape[0],), -1, dtype=torch.int64)
        fn(*sample_rows_args(logits, keys, out))
        got.append(out.tolist())
    return got[0], got[1]


def splitmix_uniform(key: int, j: int) -> float:
    """The hash in Python integers: splitmix64's finalizer of key + (j + 1) * golden."""
    mask = (1 << 64) - 1
    z = (key + (j + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return ((z >> 12) + 0.5) * 2.0**-52


def test_the_twins_uniforms_are_the_hash_bit_for_bit():
    keys = torch.tensor([0, 1, -1, 12345, *INT64], dtype=torch.int64)
    u = race_uniforms(keys, 300)
    for r, key in enumerate(keys.tolist()):
        assert u[r].tolist() == [splitmix_uniform(key % (1 << 64), j) for j in range(300)]
    assert bool(((u > 0) & (u < 1)).all())


@pytest.mark.parametrize("vocab", [1, 2, 7, 255, 256, 257, 1000, 49152])
@pytest.mark.parametrize("spread", [0.1, 3.0, 40.0])
def test_kernel_and_twin_draw_the_same_tokens(vocab, spread):
    g = torch.Generator().manual_seed(vocab * 7 + int(spread))
    rows = 33
    logits = torch.randn(rows, vocab, generator=g) * spread
    if vocab > 3:
        logits[::2, 1::3] = float("-inf")  # top-k / top-p / min-p drops
    keys = keys_for(rows, vocab)
    native, twin = both(logits, keys)
    assert native == twin
    assert sample_rows(logits, keys).tolist() == native == sample_rows_torch(logits, keys).tolist()
    for r, t in enumerate(native):
        assert 0 <= t < vocab and logits[r, t] > float("-inf")


def test_strided_rows_draw_what_their_copies_draw():
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(6, 300, generator=g)
    view = wide[:, 20:220]  # row stride 300, 200 columns
    keys = keys_for(6, 5)
    assert both(view, keys)[0] == both(view.contiguous(), keys)[0] == both(view, keys)[1]


def test_draws_follow_the_softmax():
    """40000 keys: each token's share of the draws is its probability (within 5 sigma)."""
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf"), 0.5, -30.0]])
    n = 40000
    tokens = both(logits.expand(n, -1).contiguous(), torch.arange(n, dtype=torch.int64))[0]
    share = torch.bincount(torch.tensor(tokens), minlength=6).double() / n
    probs = torch.softmax(logits[0].double(), dim=-1)
    sigma = (probs * (1 - probs) / n).sqrt()
    assert bool(((share - probs).abs() <= 5 * sigma + 1e-12).all()), (share, probs)
    assert share[3] == 0.0  # dropped: never drawn


def test_tokens_of_zero_weight_are_never_drawn():
    """A single surviving token, and a weight that underflows double: whatever the key."""
    logits = torch.full((64, 100), float("-inf"))
    logits[:, 42] = 3.0
    logits[::2, 7] = 3.0 - 800.0  # exp(-800) is 0 in double
    assert both(logits, keys_for(64, 3)) == ([42] * 64, [42] * 64)


@pytest.mark.parametrize("special,expected", [
    (float("nan"), 11),  # torch.argmax's rule: the first NaN
    (float("inf"), 11),  # the first +inf
])
def test_rows_without_a_distribution_give_their_argmax(special, expected):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    logits[1, 11] = logits[1, 30] = special
    logits[2] = float("-inf")  # everything dropped: argmax is 0
    native, twin = both(logits, keys_for(3, 1))
    assert native == twin and native[1] == expected and native[2] == 0


def test_a_batch_sized_change_of_the_logits_rarely_moves_a_draw():
    """Why the race and not the inverse of the running sum: logits nudged as a bf16
    model's are by another batch shape (1e-3 relative) keep ~99.7 % of the draws here;
    the inverse of the running sum kept ~95 % (measured in round 10)."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4000, 320, generator=g) * 3
    nudged = logits * (1 + 1e-3 * torch.randn(logits.shape, generator=g))
    keys = keys_for(4000, 9)
    moved = sum(a != b for a, b in zip(both(logits, keys)[0], both(nudged, keys)[0]))
    assert moved <= 40, moved  # 1 %


@pytest.mark.parametrize("fn", [C.sample_rows if C else None, kernel_twins.sample_rows_py])
@pytest.mark.parametrize("bad", ["no_columns", "negative_rows", "short_stride"])
def test_kernel_and_twin_refuse_bad_input_alike(fn, bad):
    logits = torch.zeros(2, 8)
    out = torch.empty(2, dtype=torch.int64)
    args = list(sample_rows_args(logits, keys_for(2, 0), out))
    if bad == "no_columns":
        args[3] = 0
    elif bad == "negative_rows":
        args[2] = -1
    else:
        args[1] = 4
    with pytest.raises(ValueError):
        fn(*args)


def both_scaled(logits: torch.Tensor, keys: torch.Tensor,
                temps: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """``both`` with the kernel reading ``logits`` (float32 or bf16) and dividing by
    ``temps`` itself."""
    got = []
    for fn in (C.sample_rows, kernel_twins.sample_rows_py):
        out = torch.full((logits.shape[0],), -1, dtype=torch.int64)
        fn(*sample_rows_args(logits, keys, out, temps))
        got.append(out.tolist())
    return got[0], got[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 7, 257, 49152])
def test_bf16_logits_and_a_temperature_draw_what_the_widened_divided_rows_draw(dtype, vocab):
    """The kernel widens bf16 (exact) and divides by each row's temperature in float32
    as it reads: the same tokens as the float32 rows divided beforehand (torch's
    ``logits.float() / t``), on both paths, whatever the temperature."""
    g = torch.Generator().manual_seed(vocab + 3)
    rows = 24
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    if vocab > 3:
        logits[::3, ::4] = float("-inf")
    temps = torch.tensor([0.05, 0.3, 0.7, 1.0, 1.3, 3.0] * 4, dtype=torch.float32)
    keys = keys_for(rows, vocab)
    divided = logits.float() / temps[:, None]
    expect = both(divided, keys)[0]
    assert both_scaled(logits, keys, temps) == (expect, expect)
    assert sample_rows(logits, keys, temps).tolist() == expect
    assert sample_rows_torch(logits, keys, temps).tolist() == expect
    # no temperature: the widened rows as they are
    assert both_scaled(logits, keys, None) == both(logits.float(), keys)


@pytest.mark.parametrize("fn", [C.sample_rows if C else None, kernel_twins.sample_rows_py])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "dtype"])
def test_kernel_and_twin_refuse_a_bad_temperature_or_dtype_alike(fn, bad):
    logits = torch.zeros(2, 8)
    out = torch.empty(2, dtype=torch.int64)
    temps = torch.tensor([1.0, 1.0 if bad == "dtype" else bad], dtype=torch.float32)
    args = list(sample_rows_args(logits, keys_for(2, 0), out, temps))
    if bad == "dtype":
        args[4] = 2
    with pytest.raises(ValueError):
        fn(*args)


def both_top_p(logits: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel's logits, twin's logits) after top-p, each on its own copy."""
    got = []
    for fn in (C.top_p_rows, kernel_twins.top_p_rows_py):
        out = logits.clone()
        fn(*top_p_rows_args(out, p))
        got.append(out)
    return got[0], got[1]


@pytest.mark.parametrize("vocab", [1, 2, 17, 2048, 49152])
@pytest.mark.parametrize("spread", [0.0, 0.5, 4.0, 60.0])
def test_top_p_kernel_and_twin_keep_the_same_tokens(vocab, spread):
    g = torch.Generator().manual_seed(vocab + int(spread * 10))
    rows = 12
    logits = torch.randn(rows, vocab, generator=g) * spread
    logits[::3] = (logits[::3] * 2).round() / 2  # ties across the boundary
    if vocab > 3:
        logits[1::4, ::5] = float("-inf")  # top-k's drops before top-p
    p = torch.rand(rows, dtype=torch.float64, generator=g) * 0.99 + 0.005
    p[0] = 1.0
    native, twin = both_top_p(logits, p)
    assert torch.equal(native, twin)
    assert torch.equal(top_p_rows(logits, p), native)
    assert torch.equal(top_p_rows_torch(logits, p), native)
    assert torch.equal(native[0], logits[0])  # p = 1: the whole row
    kept = ~torch.isinf(native)
    assert bool(kept.gather(1, logits.argmax(dim=-1, keepdim=True)).all())  # the top stays
    assert torch.equal(native[kept], logits[kept])


def test_top_p_keeps_vllms_nucleus():
    """The kept set is vLLM's (drop from the least likely while the ascending cumulative
    probability stays <= 1 - p) away from rounding ties; the most likely always."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(16, 3000, generator=g) * 3
    p = torch.linspace(0.05, 0.99, 16, dtype=torch.float64)
    ours = ~torch.isinf(both_top_p(logits, p)[0])
    ls, order = logits.sort(dim=-1)
    drop = ls.double().softmax(dim=-1).cumsum(dim=-1) <= 1 - p[:, None]
    drop[:, -1] = False
    theirs = torch.empty_like(drop).scatter_(1, order, ~drop)
    assert torch.equal(ours, theirs)
    tiny_p = torch.full((1,), 1e-9, dtype=torch.float64)
    assert int((~torch.isinf(both_top_p(logits[:1], tiny_p)[0])).sum()) == 1


def test_top_p_leaves_rows_without_a_distribution_alone():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(6))
    logits[0, 3] = float("nan")
    logits[1, 5] = float("inf")
    logits[2] = float("-inf")
    native, twin = both_top_p(logits, torch.full((3,), 0.5, dtype=torch.float64))
    assert torch.equal(native.isnan(), logits.isnan()) and torch.equal(twin.isnan(), logits.isnan())
    keep = ~logits.isnan()
    assert torch.equal(native[keep], logits[keep]) and torch.equal(twin[keep], logits[keep])


@pytest.mark.parametrize("fn", [C.top_p_rows if C else None, kernel_twins.top_p_rows_py])
@pytest.mark.parametrize("bad", ["p_zero", "p_above_one", "p_nan", "no_columns", "short_stride"])
def test_top_p_kernel_and_twin_refuse_bad_input_alike(fn, bad):
    logits = torch.zeros(2, 8)
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    args = list(top_p_rows_args(logits, p))
    if bad == "p_zero":
        p[1] = 0.0
    elif bad == "p_above_one":
        p[0] = 1.5
    elif bad == "p_nan":
        p[0] = float("nan")
    elif bad == "no_columns":
        args[3] = 0
    else:
        args[1] = 4
    with pytest.raises(ValueError):
        fn(*args)


def test_sampler_top_p_touches_only_the_rows_that_set_it():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 500, generator=g) * 3
    out = Sampler._top_k_top_p(logits, [0, 0, 10, 0], [1.0, 0.6, 1.0, 0.9])
    assert torch.equal(out[0], logits[0])
    assert int((~out[2].isinf()).sum()) == 10
    assert 0 < int((~out[1].isinf()).sum()) < 500 and 0 < int((~out[3].isinf()).sum()) < 500


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "llama", seed=11)


def test_seeded_temperature_sampling_is_the_same_on_both_paths(tiny):
    """Seeded draws with temperature, top-k, top-p and min-p beside greedy rows: the same
    tokens with the native path on and off."""
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.7, top_k=20, seed=8, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.3, top_p=0.9, seed=9, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, min_p=0.05, seed=10,
                             ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]
    results = []
    previous = _native._enabled
    try:
        for native in (True, False):
            _native.set_native(native)
            eng = EngineCore(EngineArgs(model=tiny, dtype="float32", block_size=4,
                                        max_model_len=128).create_engine_config())
            for i, sp in enumerate(params):
                eng.add_request(EngineCoreRequest(f"r{i}", [5 + i, 6, 7], sp))
            done = run_to_completion(eng)
            results.append({rid: done[rid]["tokens"] for rid in sorted(done)})
            eng.shutdown()
    finally:
        _native._enabled = previous
    assert results[0] == results[1]
    assert all(len(t) == 12 for t in results[0].values())


def test_a_key_per_row_and_broadcast_rows():
    """Keys (and top-p values) must match the rows, on both paths alike; broadcast rows
    (stride 0) draw what their copies draw."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    for keys in (torch.arange(2), torch.tensor(7), torch.arange(4)):
        for fn in (sample_rows, sample_rows_torch):
            with pytest.raises((ValueError, RuntimeError, IndexError)):
                fn(logits, keys)
        with pytest.raises(ValueError):
            sample_rows(logits, keys)
    with pytest.raises(ValueError):
        top_p_rows(logits, torch.full((2,), 0.5, dtype=torch.float64))
    row = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))
    keys = torch.arange(4)
    assert torch.equal(sample_rows(row.expand(4, -1), keys),
                       sample_rows(row.expand(4, -1).contiguous(), keys))
