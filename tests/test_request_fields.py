"""vLLM's per-request fields on both paths (tiny model, engine in process; one
multiprocess run checks the wire): eos_token_id, prompt_logprobs, logit_bias,
allowed_token_ids, bad_words, truncate_prompt_tokens, and their validation."""

from __future__ import annotations

import msgspec
import pytest
import torch

from enginecore import (
    LLM,
    EngineArgs,
    EngineCore,
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
)
from enginecore.model.sampler import Sampler, SamplingRow
from enginecore.protocol import decode_request, encode_request
from helpers import collect, run_to_completion
from tiny_models import hf_logits

GREEDY = dict(temperature=0, ignore_eos=True)
LONG_TEXT = "The capital of France is Paris. héllo wörld, ça va? naïve café"


def make_llm(model: str, **kw) -> LLM:
    args = dict(multiprocess_mode=False, max_model_len=128, kv_cache_memory_bytes=8 << 20,
                dtype="float32", max_num_batched_tokens=16)  # 16: prompts prefill in chunks
    args.update(kw)
    return LLM(model, **args)


@pytest.fixture
def llm(tiny_chat_model, hot_path):
    with make_llm(tiny_chat_model) as llm:
        yield llm


def gen(llm, prompt, **sp):
    (out,) = llm.generate(prompt, SamplingParams(**sp), use_tqdm=False)
    return out


# -- prompt_logprobs ------------------------------------------------------------------------
def test_prompt_logprobs_match_transformers_over_chunks(llm, tiny_chat_model):
    ids = llm.get_tokenizer().encode(LONG_TEXT)
    assert len(ids) > 2 * 16  # three prefill chunks
    out = gen(llm, {"prompt_token_ids": ids}, max_tokens=3, prompt_logprobs=2, **GREEDY)
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    ref = torch.log_softmax(hf_logits(tiny_chat_model, ids), dim=-1)
    tok = llm.get_tokenizer()
    for pos in range(1, len(ids)):
        entry, row = plp[pos], ref[pos - 1]
        actual = entry[ids[pos]]
        assert actual.logprob == pytest.approx(row[ids[pos]].item(), abs=1e-4)
        assert actual.rank == int((row > row[ids[pos]]).sum()) + 1
        assert actual.decoded_token == tok.decode([ids[pos]], skip_special_tokens=False)
        top = row.topk(2).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= 3
        for r, t in enumerate(top, 1):
            if t != ids[pos]:
                assert entry[t].rank == r
    # The same again: the prompt is in the prefix cache, but prompt_logprobs skips it.
    again = gen(llm, {"prompt_token_ids": ids}, max_tokens=3, prompt_logprobs=2, **GREEDY)
    assert again.prompt_logprobs == plp and again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    # Off by default; n > 1 computes them once.
    assert gen(llm, {"prompt_token_ids": ids}, max_tokens=2).prompt_logprobs is None
    both = gen(llm, {"prompt_token_ids": ids}, max_tokens=2, n=2, seed=3, prompt_logprobs=2)
    assert len(both.outputs) == 2  # batched otherwise: equal up to float rounding
    assert_close_logprobs(both.prompt_logprobs, plp)
    # A one-token prompt has no position to score.
    assert gen(llm, {"prompt_token_ids": ids[:1]}, max_tokens=1,
               prompt_logprobs=0).prompt_logprobs == [None]


def assert_close_logprobs(got, want, tol=1e-5):
    assert len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert list(g) == list(w)
        for t in g:
            assert g[t].logprob == pytest.approx(w[t].logprob, abs=tol)


def test_prompt_logprobs_zero_is_the_prompt_token_only(llm):
    ids = llm.get_tokenizer().encode("héllo wörld")
    plp = gen(llm, {"prompt_token_ids": ids}, max_tokens=1, prompt_logprobs=0).prompt_logprobs
    assert [list(e) for e in plp[1:]] == [[t] for t in ids[1:]]


def test_prompt_logprobs_in_delta_streams_come_once(tiny_chat_model, hot_path, aloop):
    from enginecore import AsyncLLM
    from enginecore.sampling_params import RequestOutputKind

    engine = AsyncLLM.from_engine_args(EngineArgs(
        model=tiny_chat_model, max_model_len=128, kv_cache_memory_bytes=8 << 20,
        dtype="float32", max_num_batched_tokens=16))
    try:
        async def collect():
            sp = SamplingParams(max_tokens=5, prompt_logprobs=1,
                                output_kind=RequestOutputKind.DELTA, **GREEDY)
            return [o async for o in engine.generate(LONG_TEXT, sp, "d1")]

        outs = aloop.run(collect())
        with_plp = [o for o in outs if o.prompt_logprobs is not None]
        assert len(with_plp) == 1 and with_plp[0] is outs[0]
        assert len(outs[0].prompt_logprobs) == len(outs[0].prompt_token_ids)
    finally:
        aloop.run(_shutdown(engine))


async def _shutdown(engine):
    engine.shutdown()


# -- logit_bias, allowed_token_ids, bad_words ----------------------------------------------
def test_logit_bias_steers_and_bans(llm):
    plain = gen(llm, "héllo", max_tokens=10, **GREEDY).outputs[0].token_ids
    assert gen(llm, "héllo", max_tokens=10, logit_bias={7: 100.0},
               **GREEDY).outputs[0].token_ids == [7] * 10
    banned = gen(llm, "héllo", max_tokens=10, logit_bias={plain[0]: -100.0},
                 **GREEDY).outputs[0].token_ids
    assert banned[0] != plain[0]


def test_allowed_token_ids_limit_sampling(llm):
    allowed = [10, 11, 12, 40, 41]
    for seed in range(3):
        toks = gen(llm, "héllo", max_tokens=12, temperature=5.0, seed=seed, ignore_eos=True,
                   allowed_token_ids=allowed).outputs[0].token_ids
        assert set(toks) <= set(allowed) and len(toks) == 12


def test_bad_words_ban_a_sequence_as_vllm_does(llm):
    tok = llm.get_tokenizer()
    plain = gen(llm, "héllo", max_tokens=30, **GREEDY).outputs[0].token_ids
    # A two-token word of the greedy output that tokenizes back to those tokens.
    for k in range(len(plain) - 1):
        word = tok.decode(plain[k:k + 2])
        if (tok.encode(word.lstrip(), add_special_tokens=False) == plain[k:k + 2]
                and word.strip() and word == word.lstrip()
                and all(plain[j:j + 2] != plain[k:k + 2] for j in range(k))):
            break
    else:
        pytest.skip("no two-token word in this greedy output")
    out = gen(llm, "héllo", max_tokens=30, bad_words=[word], **GREEDY).outputs[0].token_ids
    assert out[:k + 1] == plain[:k + 1] and out[k + 1] != plain[k + 1]
    # vLLM's tokenization: the word, and with a leading space when that is a new token.
    words = llm.input_processor.bad_words_token_ids([word])
    assert words[0] == plain[k:k + 2]
    spaced = tok.encode(" " + word, add_special_tokens=False)
    assert (spaced in words) == (spaced[0] != words[0][0] and len(spaced) == 2)


def test_bad_words_sampler_rule():
    """The last token of a bad word is banned exactly when the output ends with the
    word's other tokens (a one-token word: always)."""
    sampler = Sampler(8)
    sp = SamplingParams(temperature=0, bad_words_token_ids=[[3, 4], [6]])
    logits = torch.zeros(2, 8)
    logits[:, 4] = logits[:, 6] = 5.0
    rows = [SamplingRow(sp, [1], [2, 3], 3, None), SamplingRow(sp, [1], [3, 2], 3, None)]
    processed = sampler._apply_token_controls(logits, rows)
    assert processed[0, 4] == float("-inf") and processed[0, 6] == float("-inf")
    assert processed[1, 4] == 5.0 and processed[1, 6] == float("-inf")
    assert sampler(logits, rows).token_ids == [0, 4]


# -- truncate_prompt_tokens, eos_token_id ---------------------------------------------------
def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = llm.get_tokenizer().encode(LONG_TEXT)
    cut = gen(llm, LONG_TEXT, max_tokens=6, truncate_prompt_tokens=5, **GREEDY)
    assert cut.prompt_token_ids == ids[-5:]
    direct = gen(llm, {"prompt_token_ids": ids[-5:]}, max_tokens=6, **GREEDY)
    assert cut.outputs[0].token_ids == direct.outputs[0].token_ids
    whole = gen(llm, LONG_TEXT, max_tokens=2, truncate_prompt_tokens=-1)  # max_model_len
    assert whole.prompt_token_ids == ids
    with pytest.raises(ValueError, match="greater than the maximum model length"):
        gen(llm, LONG_TEXT, truncate_prompt_tokens=129)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=-2)


def test_per_request_eos_token_id(tiny_chat_model, hot_path):
    eng = EngineCore(EngineArgs(model=tiny_chat_model, dtype="float32", max_model_len=128,
                                kv_cache_memory_bytes=8 << 20).create_engine_config())
    prompt = [5, 6, 7, 8]
    eng.add_request(EngineCoreRequest("plain", prompt, SamplingParams(max_tokens=12,
                                                                      **GREEDY)))
    plain = run_to_completion(eng)["plain"]["tokens"]
    eos = plain[4]
    first = plain.index(eos)
    sp = SamplingParams(max_tokens=12, temperature=0)
    # Through the wire encoding, as the process engine decodes it.
    wire = msgspec.msgpack.Encoder()
    for rid, min_tokens in (("eos", 0), ("eos-min", first + 1)):
        req = EngineCoreRequest(rid, prompt, msgspec.structs.replace(sp, min_tokens=min_tokens),
                                eos_token_id=eos)
        eng.add_request(decode_request(encode_request(wire, req)))
    res = run_to_completion(eng)
    assert res["eos"]["tokens"] == plain[:first + 1]
    assert res["eos"]["finish_reason"] == FinishReason.STOP
    # min_tokens bans the request's own EOS (not the model's) until it is reached.
    later = res["eos-min"]["tokens"]
    assert eos not in later[:first + 1] and len(later) > first + 1


# -- validation -----------------------------------------------------------------------------
def test_front_end_validation(llm):
    vocab = llm.config.model_config.vocab_size
    bad = [
        (dict(logit_bias={vocab: 1.0}), "logit_bias keys must be in"),
        (dict(logit_bias={1: float("nan")}), "logit_bias"),
        (dict(allowed_token_ids=[1, vocab + 5]), "allowed_token_ids must be in"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(bad_words_token_ids=[[vocab]]), "bad_words_token_ids must be in"),
    ]
    for fields, message in bad:
        with pytest.raises(ValueError, match=message):
            gen(llm, "hi", **fields)
    assert not llm.output_processor.has_unfinished_requests()


def test_engine_refuses_out_of_vocab_fields(tiny_chat_model):
    eng = EngineCore(EngineArgs(model=tiny_chat_model, dtype="float32", max_model_len=128,
                                kv_cache_memory_bytes=8 << 20).create_engine_config())
    vocab = eng.config.model_config.vocab_size
    eng.add_request(EngineCoreRequest("a", [5, 6], SamplingParams(allowed_token_ids=[vocab])))
    eng.add_request(EngineCoreRequest("e", [5, 6], SamplingParams(), eos_token_id=vocab))
    res: dict[str, dict] = {}
    collect(eng.scheduler.take_pending_outputs(), res)  # rejections: owed at once
    for rid, field in (("a", "allowed_token_ids"), ("e", "eos_token_id")):
        assert res[rid]["finish_reason"] == FinishReason.ERROR
        assert field in res[rid]["stop_reason"]


def test_fields_through_the_process_boundary(tiny_chat_model, hot_path):
    """The multiprocess engine (msgpack both ways, native encoder) gives what the
    in-process engine gives."""
    ids_sp = [
        SamplingParams(max_tokens=6, prompt_logprobs=2, logit_bias={9: 3.5}, **GREEDY),
        SamplingParams(max_tokens=6, allowed_token_ids=[10, 11, 12], temperature=1.0,
                       seed=4, ignore_eos=True),
        SamplingParams(max_tokens=6, bad_words=["Paris"], truncate_prompt_tokens=7, **GREEDY),
    ]
    prompts = [LONG_TEXT] * 3
    native = hot_path == "native"
    with make_llm(tiny_chat_model, use_native=native) as local:
        want = local.generate(prompts, ids_sp, use_tqdm=False)
    with make_llm(tiny_chat_model, multiprocess_mode=True, use_native=native) as remote:
        got = remote.generate(prompts, ids_sp, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.prompt_token_ids == w.prompt_token_ids
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.prompt_logprobs == w.prompt_logprobs
    assert got[0].prompt_logprobs is not None and len(got[2].prompt_token_ids) == 7


def test_both_paths_agree_bit_for_bit(tiny_chat_model):
    """Native and pure-Python hot paths (scheduler update, encoder, step loop,
    kernels) give the same tokens, texts and logprobs for every new field."""
    from enginecore import _native

    params = [
        SamplingParams(max_tokens=8, prompt_logprobs=3, logprobs=2, logit_bias={9: 2.5},
                       **GREEDY),
        SamplingParams(max_tokens=8, allowed_token_ids=[10, 11, 12, 40], temperature=1.0,
                       seed=4, ignore_eos=True, n=2),
        SamplingParams(max_tokens=8, bad_words=["Paris", "café"], truncate_prompt_tokens=9,
                       **GREEDY),
    ]
    results = {}
    previous = _native._enabled
    try:
        for path in ("native", "python"):
            _native.set_native(path == "native")
            with make_llm(tiny_chat_model, use_native=path == "native") as llm:
                assert llm.output_processor.uses_native_loop == (path == "native")
                outs = llm.generate([LONG_TEXT] * 3, params, use_tqdm=False)
            results[path] = outs
    finally:
        _native._enabled = previous
    # The model's native kernels (attention, fused norms) round differently from their
    # torch twins, so logprob values agree to float precision; all else is exact.
    for a, b in zip(results["native"], results["python"]):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert [(c.token_ids, c.text) for c in a.outputs] == [(c.token_ids, c.text)
                                                               for c in b.outputs]
        if a.prompt_logprobs is not None:
            assert_close_logprobs(a.prompt_logprobs, b.prompt_logprobs)
            assert [{t: lp.rank for t, lp in e.items()} for e in a.prompt_logprobs[1:]] == \
                [{t: lp.rank for t, lp in e.items()} for e in b.prompt_logprobs[1:]]
        for ca, cb in zip(a.outputs, b.outputs):
            if ca.logprobs is not None:
                assert_close_logprobs([None, *ca.logprobs], [None, *cb.logprobs])
