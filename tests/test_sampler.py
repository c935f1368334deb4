"""Sampling through the engine on a tiny model: seeds, top-k, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams
from enginecore.model.sampler import Sampler, SamplingRow
from helpers import run_to_completion
from tiny_models import hf_logits, make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "llama", seed=3)


def run(model_dir, reqs, **kw):
    eng = EngineCore(EngineArgs(model=model_dir, dtype="float32", block_size=4,
                                max_model_len=128, **kw).create_engine_config())
    for rid, prompt, sp in reqs:
        eng.add_request(EngineCoreRequest(rid, prompt, sp))
    return run_to_completion(eng)


def test_seeded_sampling_is_reproducible_across_batches(tiny, hot_path):
    sp = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    alone = run(tiny, [("s", [5, 6, 7], sp)])["s"]["tokens"]
    crowd = [(f"o{i}", [i + 10, i + 11], SamplingParams(max_tokens=7, temperature=0.8,
                                                        ignore_eos=True)) for i in range(6)]
    crowded = run(tiny, crowd[:3] + [("s", [5, 6, 7], sp)] + crowd[3:])["s"]["tokens"]
    assert alone == crowded
    other = run(tiny, [("s", [5, 6, 7], SamplingParams(max_tokens=10, seed=99,
                                                       ignore_eos=True))])["s"]["tokens"]
    assert other != alone


def test_top_k_1_equals_greedy(tiny):
    greedy = run(tiny, [("g", [9, 8, 7], SamplingParams(max_tokens=8, temperature=0,
                                                        ignore_eos=True))])["g"]["tokens"]
    topk = run(tiny, [("k", [9, 8, 7], SamplingParams(max_tokens=8, temperature=1.3, top_k=1,
                                                      ignore_eos=True))])["k"]["tokens"]
    assert greedy == topk


def test_logprobs_match_reference_log_softmax(tiny):
    prompt = [4, 5, 6, 7]
    res = run(tiny, [("l", prompt, SamplingParams(max_tokens=3, temperature=0, logprobs=5,
                                                  ignore_eos=True))])
    eng_lp = res["l"]
    tokens = eng_lp["tokens"]
    ref = torch.log_softmax(hf_logits(tiny, prompt + tokens[:-1]), dim=-1)
    # run_to_completion keeps tokens only; re-run through LLM-shaped logprobs below.
    eng = EngineCore(EngineArgs(model=tiny, dtype="float32", block_size=4,
                                max_model_len=128).create_engine_config())
    eng.add_request(EngineCoreRequest("l", prompt, SamplingParams(
        max_tokens=3, temperature=0, logprobs=5, ignore_eos=True)))
    rows = []
    while eng.scheduler.has_requests():
        for outs in eng.step()[0].values():
            for o in outs.outputs:
                if o.new_logprobs:
                    rows += list(zip(o.new_logprobs.token_ids, o.new_logprobs.logprobs,
                                     o.new_logprobs.ranks))
    assert len(rows) == 3
    for pos, (ids, vals, rank) in enumerate(rows):
        ref_row = ref[len(prompt) - 1 + pos]
        assert ids[0] == tokens[pos] and rank == 1
        assert vals[0] == pytest.approx(float(ref_row[ids[0]]), abs=1e-4)
        top = torch.topk(ref_row, 5)
        assert ids[1:] == top.indices.tolist()
        assert vals[1:] == pytest.approx(top.values.tolist(), abs=1e-4)


def row(params, out=(), prompt=(1,), pos=10, eos=None):
    return SamplingRow(params, list(prompt), list(out), pos, eos)


def test_penalties_change_the_distribution_as_documented():
    s = Sampler(8)
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0]])
    # repetition: seen tokens (prompt 0, output 2) divided if >0, multiplied if <0
    p = SamplingParams(repetition_penalty=2.0)
    got = s._apply_penalties(logits, [row(p, out=[2], prompt=[0])])
    assert got[0, 0] == 1.0 and got[0, 2] == -2.0 and got[0, 1] == 1.0
    # presence/frequency: output tokens only, frequency scales with the count
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = s._apply_penalties(logits, [row(p, out=[3, 3, 1], prompt=[0])])
    assert got[0, 3] == pytest.approx(0.5 - 0.5 - 0.5)
    assert got[0, 1] == pytest.approx(1.0 - 0.5 - 0.25)
    assert got[0, 0] == 2.0
    # a strong repetition penalty moves greedy off the repeated token
    out = s(logits, [row(SamplingParams(temperature=0, repetition_penalty=5.0),
                         out=[0], prompt=[7])])
    assert out.token_ids == [1]


def test_min_tokens_blocks_eos_and_stop_tokens():
    s = Sampler(4)
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert s(logits, [row(p, out=[], eos=1)]).token_ids == [3]
    assert s(logits, [row(p, out=[3, 3], eos=1)]).token_ids == [1]


def test_top_p_and_min_p_restrict_support():
    s = Sampler(4)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen_p, seen_m = set(), set()
    for seed in range(200):
        seen_p |= set(s(logits, [row(SamplingParams(top_p=0.7, seed=seed))]).token_ids)
        seen_m |= set(s(logits, [row(SamplingParams(min_p=0.4, seed=seed))]).token_ids)
    assert seen_p == {0, 1}
    assert seen_m == {0, 1}


def test_temperature_sampling_follows_the_distribution():
    s = Sampler(3)
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs)[None, :]
    counts = [0, 0, 0]
    n = 3000
    for i in range(n):
        counts[s(logits, [row(SamplingParams(seed=i), pos=i)]).token_ids[0]] += 1
    for c, p in zip(counts, probs.tolist()):
        assert abs(c / n - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_top_k_keeps_the_values_at_least_the_kth_largest_without_a_sort():
    """Top-k by ``topk`` (no sort of the vocabulary): every value >= the k-th largest
    stays (ties at the k-th included), k <= 0 or >= V keeps the row; top-p touches only
    the rows that set it."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(6, 50, generator=g) * 4).round() / 2  # ties
    top_k = [1, 5, 0, -1, 50, 7]
    top_p = [1.0, 1.0, 1.0, 0.5, 1.0, 1.0]
    out = Sampler._top_k_top_p(logits.clone(), top_k, top_p)  # masks its argument in place
    for r, k in enumerate(top_k):
        kept = ~torch.isinf(out[r])
        if r == 3:  # top-p only: the most likely kept, less likely ones dropped
            assert kept[logits[r].argmax()] and 0 < int(kept.sum()) < 50
            continue
        if not 0 < k < 50:
            assert torch.equal(out[r], logits[r])
            continue
        kth = logits[r].sort(descending=True).values[k - 1]
        assert torch.equal(kept, logits[r] >= kth)
        assert torch.equal(out[r][kept], logits[r][kept])


def _mixed_rows(n: int) -> list[SamplingRow]:
    kinds = [dict(temperature=0), dict(temperature=0.7, top_p=0.9),
             dict(temperature=1.0, top_k=20), dict(min_p=0.05),
             dict(temperature=1.3, top_k=40, top_p=0.8), {}]
    return [row(SamplingParams(seed=100 + i, **kinds[i % len(kinds)]), pos=i + 3)
            for i in range(n)]


def test_the_sampler_reuses_its_scratch_without_touching_the_callers_logits(hot_path):
    """The scaled logits live in memory the Sampler reuses step after step (scratch.py)
    and top-k / top-p / min-p drop tokens there in place: the caller's logits stay as
    they were, and a reused Sampler draws what a fresh one draws, whatever batch
    shapes came before (a larger one, then a smaller one)."""
    g = torch.Generator().manual_seed(11)
    reused = Sampler(300)
    for n in (7, 12, 3, 7):
        logits = torch.randn(n, 300, generator=g) * 3
        before = logits.clone()
        rows = _mixed_rows(n)
        first = reused(logits, rows).token_ids
        assert torch.equal(logits, before)
        assert first == Sampler(300)(logits, rows).token_ids
        assert reused(logits, rows).token_ids == first  # seeded rows: the same draw again
    # all-random rows (no greedy row: the scaled logits are the whole batch)
    logits = torch.randn(5, 300, generator=g)
    rows = [row(SamplingParams(temperature=0.9, top_p=0.95, seed=i)) for i in range(5)]
    assert reused(logits, rows).token_ids == Sampler(300)(logits.clone(), rows).token_ids


def test_scratch_tensor_reuses_its_memory_until_it_must_grow():
    from enginecore.model.scratch import ScratchTensor

    s = ScratchTensor()
    a = s.take((4, 10), torch.float32)
    assert a.shape == (4, 10) and a.is_contiguous()
    b = s.take((2, 10), torch.float32)
    assert b.data_ptr() == a.data_ptr()  # smaller: the same memory
    c = s.take((8, 10), torch.float32)
    assert c.shape == (8, 10)  # larger: grown
    assert s.take((8, 10), torch.float32).data_ptr() == c.data_ptr()
    d = s.take((8, 10), torch.bfloat16)
    assert d.dtype == torch.bfloat16 and d.shape == (8, 10)
    s.release()
    assert s.take((1, 3), torch.float32).shape == (1, 3)


def test_bf16_logits_give_the_draws_and_logprobs_of_their_float32_widening(hot_path):
    """The runner hands the sampler the model's bf16 logits; rows that only take the
    argmax or the temperature's race read them as they are (the kernel widens and
    divides), the others get a float32 copy: the same tokens and logprobs as the
    float32 logits, row for row, for every kind of row in one batch."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(9, 300, generator=g) * 3).bfloat16()
    kinds = [dict(temperature=0), dict(temperature=0.7), dict(temperature=1.0, top_p=0.9),
             dict(temperature=1.2, top_k=30), dict(min_p=0.1), dict(temperature=0.9, logprobs=3),
             dict(temperature=0, logprobs=2), dict(repetition_penalty=1.3), {}]
    for plain_only in (False, True):
        chosen = [k for k in kinds if set(k) <= {"temperature"}] if plain_only else kinds
        rows = [row(SamplingParams(seed=7 + i, **k), out=[3, 4], pos=20 + i)
                for i, k in enumerate(chosen)]
        x = logits[: len(rows)]
        got, want = Sampler(300)(x, rows), Sampler(300)(x.float(), rows)
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs


@pytest.mark.parametrize("kind", [dict(), dict(top_p=0.99), dict(top_k=3)])
def test_a_temperature_past_float32s_range_draws_not_raises(hot_path, kind):
    """SamplingParams takes any finite temperature; one past float32's largest (1e39)
    must not become inf (the race refused it: the request ended in an error; x / inf
    turned the dropped tokens' -inf into NaN). It draws near-uniformly from the tokens
    not dropped, beside a row of an ordinary temperature."""
    logits = torch.tensor([[8.0, 0.0, 0.0, 0.0], [8.0, 0.0, 0.0, 0.0]]).bfloat16()
    seen = set()
    for seed in range(40):
        rows = [row(SamplingParams(temperature=1e39, seed=seed, min_tokens=1,
                                   stop_token_ids=[3], **kind)),
                row(SamplingParams(temperature=0.5, seed=seed))]
        out = Sampler(4)(logits, rows).token_ids
        seen.add(out[0])
        assert out[1] == 0
    assert seen == {0, 1, 2}  # 3 is banned (min_tokens)


def _penalties_one_row_at_a_time(logits, rows):
    """The penalties row by row, as the sampler applied them before they were batched."""
    logits = logits.clone()
    V = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if not p.has_penalties:
            continue
        out_ids = torch.tensor(r.output_ids, dtype=torch.long)
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(V, dtype=torch.bool)
            seen[torch.tensor(r.prompt_ids, dtype=torch.long)] = True
            if out_ids.numel():
                seen[out_ids] = True
            row = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty,
                                                row * p.repetition_penalty), row)
        if out_ids.numel() and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(out_ids, minlength=V)[:V].to(row.dtype)
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        logits[i] = row
    return logits


def test_batched_penalties_equal_them_one_row_at_a_time():
    g = torch.Generator().manual_seed(8)
    V = 500
    logits = torch.randn(8, V, generator=g) * 3
    logits[2, ::7] = float("-inf")
    kinds = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.7), {},
             dict(presence_penalty=-0.4, frequency_penalty=0.2, repetition_penalty=0.8),
             dict(presence_penalty=1.5), dict(repetition_penalty=2.0), {},
             dict(frequency_penalty=-1.1, repetition_penalty=1.05)]
    rows = []
    for i, k in enumerate(kinds):
        out = torch.randint(0, V, (i * 5,), generator=g).tolist() + [3, 3, 3][: i % 4]
        rows.append(row(SamplingParams(**k), out=out,
                        prompt=torch.randint(0, V, (20,), generator=g).tolist()))
    before = logits.clone()
    got = Sampler(V)._apply_penalties(logits, rows)
    assert torch.equal(logits, before)
    assert torch.equal(got, _penalties_one_row_at_a_time(logits, rows))
    every = [row(SamplingParams(repetition_penalty=1.2, frequency_penalty=0.1), out=[1, 1, 4])] * 3
    assert torch.equal(Sampler(V)._apply_penalties(logits[:3], every),
                       _penalties_one_row_at_a_time(logits[:3], every))
