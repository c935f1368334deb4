"""Random sampling by one uniform per row (``_C.sample_rows`` <->
``kernel_twins.sample_rows_py`` / ``sampler.sample_rows_torch``): the same tokens on
both paths, the softmax's distribution, the edge rows (NaN, inf, everything
dropped), bad input refused alike, and the engine's seeded sampling equal on both
paths."""

from __future__ import annotations

import math

import pytest
import torch

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams, _native
from enginecore.model import kernel_twins
from enginecore.model.sampler import sample_rows, sample_rows_args, sample_rows_torch
from helpers import run_to_completion
from tiny_models import make_tiny_model

C = _native._ext
pytestmark = pytest.mark.skipif(C is None, reason="native extension not built")

ONE_BELOW_1 = 1.0 - 2.0**-53


def both(logits: torch.Tensor, u: torch.Tensor) -> tuple[list[int], list[int]]:
    """(kernel's tokens, twin's tokens) at the raw boundary, on the same buffers."""
    got = []
    for fn in (C.sample_rows, kernel_twins.sample_rows_py):
        out = torch.full((logits.shape[0],), -1, dtype=torch.int64)
        fn(*sample_rows_args(logits, u, out))
        got.append(out.tolist())
    return got[0], got[1]


@pytest.mark.parametrize("vocab", [1, 2, 63, 64, 65, 1000, 49152])
@pytest.mark.parametrize("spread", [0.1, 3.0, 40.0])
def test_kernel_and_twin_draw_the_same_tokens(vocab, spread):
    g = torch.Generator().manual_seed(vocab * 7 + int(spread))
    rows = 33
    logits = torch.randn(rows, vocab, generator=g) * spread
    if vocab > 3:
        logits[::2, 1::3] = float("-inf")  # top-k / top-p / min-p drops
    u = torch.rand(rows, dtype=torch.float64, generator=g)
    u[0] = 0.0
    # (Not u within an ulp of 1 here: u * sum then sits within rounding of the sum,
    # where sums in another order may end on another token: a 2**-53 event.)
    native, twin = both(logits, u)
    assert native == twin
    assert sample_rows(logits, u).tolist() == native == sample_rows_torch(logits, u).tolist()
    for r, t in enumerate(native):
        assert 0 <= t < vocab and logits[r, t] > float("-inf")


def test_strided_rows_draw_what_their_copies_draw():
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(6, 300, generator=g)
    view = wide[:, 20:220]  # row stride 300, 200 columns
    u = torch.rand(6, dtype=torch.float64, generator=g)
    assert both(view, u)[0] == both(view.contiguous(), u)[0] == both(view, u)[1]


def test_draws_follow_the_softmax():
    """u on an even grid: each token's share of the draws is its probability, to within
    one grid step per boundary."""
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf"), 0.5, -30.0]])
    n = 20000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tokens = both(logits.expand(n, -1).contiguous(), u)[0]
    share = torch.bincount(torch.tensor(tokens), minlength=6).double() / n
    probs = torch.softmax(logits[0].double(), dim=-1)
    assert torch.allclose(share, probs, atol=2.0 / n)
    assert share[3] == 0.0  # dropped: never drawn


def test_the_ends_of_u_draw_the_first_and_the_last_token():
    logits = torch.zeros(2, 10)
    u = torch.tensor([0.0, ONE_BELOW_1], dtype=torch.float64)
    assert both(logits, u) == ([0, 9], [0, 9])


def test_tokens_of_zero_weight_are_never_drawn():
    """A single surviving token, and weights that underflow double: whatever u is."""
    logits = torch.full((4, 100), float("-inf"))
    logits[:, 42] = 3.0
    logits[2, 7] = 3.0 - 800.0  # exp(-800) is 0 in double
    u = torch.tensor([0.0, 0.5, ONE_BELOW_1, 0.999], dtype=torch.float64)
    assert both(logits, u) == ([42] * 4, [42] * 4)


@pytest.mark.parametrize("special,expected", [
    (float("nan"), 11),  # torch.argmax's rule: the first NaN
    (float("inf"), 11),  # the first +inf
])
def test_rows_without_a_distribution_give_their_argmax(special, expected):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    logits[1, 11] = logits[1, 30] = special
    logits[2] = float("-inf")  # everything dropped: argmax is 0
    u = torch.tensor([0.3, 0.3, 0.3], dtype=torch.float64)
    native, twin = both(logits, u)
    assert native == twin and native[1] == expected and native[2] == 0


@pytest.mark.parametrize("fn", [C.sample_rows if C else None, kernel_twins.sample_rows_py])
@pytest.mark.parametrize("bad", ["u_one", "u_negative", "u_nan", "no_columns", "short_stride"])
def test_kernel_and_twin_refuse_bad_input_alike(fn, bad):
    logits = torch.zeros(2, 8)
    u = torch.tensor([0.5, 0.5], dtype=torch.float64)
    out = torch.empty(2, dtype=torch.int64)
    args = list(sample_rows_args(logits, u, out))
    if bad == "u_one":
        u[1] = 1.0
    elif bad == "u_negative":
        u[0] = -0.0 - 1e-300
    elif bad == "u_nan":
        u[0] = math.nan
    elif bad == "no_columns":
        args[3] = 0
    else:
        args[1] = 4
    with pytest.raises(ValueError):
        fn(*args)


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
