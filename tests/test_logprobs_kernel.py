"""Logprobs of the raw logits (``_C.logprob_rows`` <-> ``kernel_twins.logprob_rows_py`` /
``sampler.logprob_rows_torch``): the same bits on both paths in float32 and bf16, a
float64 log_softmax within one float32 rounding, the top n in (logit desc, index asc)
order with ties (common in bf16) broken by index, the rank as the count of larger
logits, the edge rows (NaN, +inf, everything -inf, -0 / +0), bad input refused alike,
and the engine's sampled and prompt logprobs equal on both paths."""

from __future__ import annotations

import pytest
import torch

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams, _native
from enginecore.model import kernel_twins
from enginecore.model.sampler import logprob_rows, logprob_rows_args, logprob_rows_torch
from tiny_models import make_tiny_model

C = _native._ext
pytestmark = pytest.mark.skipif(C is None, reason="native extension not built")


def both(logits: torch.Tensor, tokens: torch.Tensor, n: int):
    """The four outputs of the kernel and of the twin at the raw boundary."""
    got = []
    for fn in (C.logprob_rows, kernel_twins.logprob_rows_py):
        rows = logits.shape[0]
        out = (torch.full((rows,), -7.0), torch.full((rows,), -7, dtype=torch.int64),
               torch.full((rows, n), -7, dtype=torch.int64), torch.full((rows, n), -7.0))
        fn(*logprob_rows_args(logits, tokens, n, *out))
        got.append(out)
    return got


def reference(x: torch.Tensor, tokens: torch.Tensor, n: int):
    """float64 log_softmax, the rank by counting, the order by a stable sort."""
    x = x.float()
    lp = torch.log_softmax(x.double(), dim=-1)
    t = tokens[:, None]
    order = x.sort(dim=-1, descending=True, stable=True).indices[:, :n]
    return lp.gather(1, t)[:, 0], (x > x.gather(1, t)).sum(-1) + 1, order, lp.gather(1, order)


def assert_same(a, b):
    for p, q in zip(a, b):
        assert torch.equal(p, q) or (p.dtype.is_floating_point and torch.equal(
            torch.nan_to_num(p, nan=123.0), torch.nan_to_num(q, nan=123.0))), (p, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,n", [(1, 0), (1, 1), (7, 7), (300, 5), (2048, 20), (49152, 5)])
def test_kernel_twin_and_a_float64_reference_agree(dtype, vocab, n):
    g = torch.Generator().manual_seed(vocab + n)
    rows = 17
    x = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    if vocab > 4:
        x[::4, 1::3] = float("-inf")  # dropped tokens still have a (-inf) logprob
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    native, twin = both(x, tokens, n)
    assert_same(native, twin)
    assert_same(logprob_rows(x, tokens, n), native)
    assert_same(logprob_rows_torch(x, tokens, n), native)
    ref_lp, ref_rank, ref_ids, ref_top = reference(x, tokens, n)
    finite = torch.isfinite(ref_lp)
    assert torch.equal(native[0][~finite], ref_lp[~finite].float())
    assert torch.allclose(native[0][finite].double(), ref_lp[finite], rtol=2e-7, atol=1e-6)
    assert torch.equal(native[1], ref_rank)
    assert torch.equal(native[2], ref_ids)  # ties (bf16) broken by the lower index
    assert torch.allclose(native[3].double(), ref_top, rtol=2e-7, atol=1e-6)


def test_strided_rows_give_what_their_copies_give():
    x = torch.randn(5, 400, generator=torch.Generator().manual_seed(3))
    view = x[:, 50:350]
    tokens = torch.tensor([0, 1, 299, 150, 7])
    assert_same(both(view, tokens, 4)[0], both(view.contiguous(), tokens, 4)[0])
    assert_same(both(view, tokens, 4)[1], both(view.contiguous(), tokens, 4)[0])


def test_edge_rows_alike():
    """NaN (first in the order, the rank counts only larger numbers), +inf, everything
    -inf: NaN logprobs; -0 is ordered under +0 though they are equal logits."""
    x = torch.zeros(5, 6)
    x[0] = torch.tensor([1.0, float("nan"), 3.0, 2.0, float("nan"), 0.0])
    x[1] = torch.tensor([1.0, float("inf"), 3.0, 2.0, 0.0, 0.0])
    x[2] = float("-inf")
    x[3] = torch.tensor([-0.0, 0.0, -1.0, -0.0, 0.0, -2.0])
    x[4] = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    tokens = torch.tensor([3, 2, 0, 3, 4])
    native, twin = both(x, tokens, 6)
    assert_same(native, twin)
    assert native[2][0].tolist() == [1, 4, 2, 3, 0, 5]
    assert int(native[1][0]) == 2  # only 3.0 is larger than 2.0
    assert bool(torch.isnan(native[0][:3]).all()) and bool(torch.isnan(native[3][:3]).all())
    assert native[2][3].tolist() == [1, 4, 0, 3, 2, 5]
    assert int(native[1][3]) == 1  # nothing larger than -0.0 (+0.0 is equal)
    assert native[2][4].tolist() == [0, 1, 2, 3, 4, 5]
    assert native[3][4].tolist() == pytest.approx([-1.791759] * 6, abs=1e-6)


@pytest.mark.parametrize("fn", [C.logprob_rows if C else None, kernel_twins.logprob_rows_py])
@pytest.mark.parametrize("bad", ["token_high", "token_negative", "n_high", "n_negative",
                                 "dtype", "no_columns", "short_stride"])
def test_kernel_and_twin_refuse_bad_input_alike(fn, bad):
    x = torch.zeros(2, 8)
    tokens = torch.tensor([1, 8 if bad == "token_high" else -1 if bad == "token_negative" else 2])
    out = (torch.empty(2), torch.empty(2, dtype=torch.int64),
           torch.empty(2, 9, dtype=torch.int64), torch.empty(2, 9))
    args = list(logprob_rows_args(x, tokens, 3, *out))
    if bad == "n_high":
        args[6] = 9
    elif bad == "n_negative":
        args[6] = -1
    elif bad == "dtype":
        args[4] = 2
    elif bad == "no_columns":
        args[3] = 0
    elif bad == "short_stride":
        args[1] = 4
    with pytest.raises(ValueError):
        fn(*args)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-lp")), "llama", seed=5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engines_logprobs_are_the_same_on_both_paths(tiny, dtype):
    """Sampled logprobs (greedy and seeded random rows, beside rows without logprobs)
    and prompt logprobs, in one batch: equal on the native and the Python path."""
    def run(native: bool):
        previous = _native._enabled
        _native.set_native(native)
        try:
            eng = EngineCore(EngineArgs(model=tiny, dtype=dtype, block_size=4,
                                        max_model_len=128).create_engine_config())
            kinds = [dict(temperature=0, logprobs=5, prompt_logprobs=3),
                     dict(temperature=0.8, seed=3, logprobs=2), dict(temperature=0),
                     dict(temperature=1.0, seed=9, top_p=0.9, logprobs=0)]
            for i, k in enumerate(kinds):
                eng.add_request(EngineCoreRequest(f"r{i}", [5 + i, 6, 7, 8], SamplingParams(
                    max_tokens=6, ignore_eos=True, **k)))
            got = {}
            while eng.scheduler.has_requests():
                for outs in eng.step()[0].values():
                    for o in outs.outputs:
                        rec = got.setdefault(o.request_id, [])
                        rec.append((o.new_token_ids,
                                    None if o.new_logprobs is None else (
                                        o.new_logprobs.token_ids, o.new_logprobs.logprobs,
                                        o.new_logprobs.ranks),
                                    None if o.new_prompt_logprobs is None else (
                                        o.new_prompt_logprobs.token_ids,
                                        o.new_prompt_logprobs.logprobs,
                                        o.new_prompt_logprobs.ranks)))
            eng.shutdown()
            return got
        finally:
            _native._enabled = previous

    native, python = run(True), run(False)
    assert native == python
    assert any(step[1] for step in native["r0"]) and any(step[2] for step in native["r0"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 3])
def test_no_rows_give_empty_tensors_on_both_paths(hot_path, dtype, n):
    """No rows (a prompt chunk with no position to score): four empty tensors, on the
    native path and the twin alike (the twin's top-n looked for a maximum of nothing)."""
    x = torch.zeros(0, 10, dtype=dtype)
    for fn in (logprob_rows, logprob_rows_torch):
        lp, rank, ids, top = fn(x, torch.zeros(0, dtype=torch.int64), n)
        assert lp.shape == (0,) and rank.shape == (0,)
        assert ids.shape == (0, n) and top.shape == (0, n)


@pytest.mark.parametrize("n", [11, 2**31, 10**12])
def test_a_too_large_n_is_refused_before_anything_is_allocated(hot_path, n):
    """n past the vocabulary: ValueError on both paths (natively the [rows, n] outputs
    were allocated first: MemoryError or a RuntimeError of the allocator)."""
    with pytest.raises(ValueError, match="n must be in"):
        logprob_rows(torch.zeros(2, 10), torch.tensor([0, 1]), n)
