"""Output processing on the default model's tokenizer (a real byte-level BPE) and
a SentencePiece-style one: incremental text equals tokenizer.decode, stop strings
across token boundaries, output kinds, n > 1 fan-in, logprobs, abort; every test
on both step loops (Cython and Python), and hypothesis checks that the two agree
on random streams."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enginecore import _native
from enginecore.frontend.output_processor import OutputProcessor
from enginecore.frontend.parallel_sampling import ParentRequest
from enginecore.model.model_info import resolve_model_path
from enginecore.model.tokenizer import Tokenizer
from enginecore.outputs import RequestMetrics
from enginecore.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason, Logprobs
from enginecore.sampling_params import RequestOutputKind, SamplingParams

CUM, DELTA, FINAL = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, \
    RequestOutputKind.FINAL_ONLY
TEXTS = ["Hello wörld, ça va? 日本語のテキスト 🎉🚀 done.",
         "The capital of France is Paris. The capital of Italy is Rome.",
         "def f(x):\n    return x ** 2  # naïve café ☕"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model_path(None)[1])


def make_processor(tok, native: bool) -> OutputProcessor:
    previous = _native._enabled
    _native.set_native(native)
    try:
        return OutputProcessor(tok)
    finally:
        _native._enabled = previous


def add(op: OutputProcessor, rid: str = "r", prompt=(1, 2, 3), **sp) -> None:
    op.add_request(EngineCoreRequest(rid, list(prompt), SamplingParams(**sp)), "prompt",
                   metrics=RequestMetrics(0.0, 0.0))


def feed(op, ids, chunks, rid="r", finish=FinishReason.LENGTH, stop_reason=None, now=1.0):
    """Stream ``ids`` in steps of the given sizes (the last step carries the finish);
    all outputs and the ids the processor asked to abort."""
    outs, aborts, i = [], [], 0
    sizes = list(chunks)
    while i < len(ids):
        k = sizes.pop(0) if sizes else 1
        last = i + k >= len(ids)
        eo = EngineCoreOutput(rid, ids[i:i + k], finish_reason=finish if last else None,
                              stop_reason=stop_reason if last else None)
        res = op.process_outputs([eo], now + i)
        outs += res.request_outputs
        aborts += res.reqs_to_abort
        i += k
    return outs, aborts


def random_ids(tok, rng: random.Random) -> list[int]:
    text = rng.choice(TEXTS)
    ids = tok.encode(text[rng.randrange(len(text)):], add_special_tokens=False)
    # Splice in raw byte tokens and special tokens (ids 0..16 are special here).
    for _ in range(rng.randrange(4)):
        ids.insert(rng.randrange(len(ids) + 1), rng.choice([rng.randrange(17),
                                                           rng.randrange(49152)]))
    return ids or [42]


@pytest.mark.parametrize("skip", [True, False])
def test_text_is_tokenizer_decode_for_every_kind(tok, hot_path, skip):
    rng = random.Random(7)
    for _ in range(40):
        ids = random_ids(tok, rng)
        chunks = [rng.randint(1, 4) for _ in ids]
        want = tok.decode(ids, skip_special_tokens=skip)
        texts = {}
        for kind in (CUM, DELTA, FINAL):
            op = make_processor(tok, hot_path == "native")
            add(op, skip_special_tokens=skip, output_kind=kind, max_tokens=None)
            outs, _ = feed(op, ids, chunks)
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
            if kind == DELTA:
                texts[kind] = "".join(o.outputs[0].text for o in outs)
                assert [t for o in outs for t in o.outputs[0].token_ids] == ids
            else:
                texts[kind] = outs[-1].outputs[0].text
                assert outs[-1].outputs[0].token_ids == ids
            if kind == FINAL:
                assert len(outs) == 1
            assert not op.has_unfinished_requests()
        assert texts == dict.fromkeys((CUM, DELTA, FINAL), want)


@pytest.mark.parametrize("include", [False, True])
def test_eos_is_not_text_unless_asked(tok, hot_path, include):
    ids = tok.encode("Paris.", add_special_tokens=False) + [tok.eos_token_id]
    op = make_processor(tok, hot_path == "native")
    add(op, skip_special_tokens=False, include_stop_str_in_output=include)
    outs, aborts = feed(op, ids, [1] * len(ids), finish=FinishReason.STOP)
    comp = outs[-1].outputs[0]
    assert comp.text == tok.decode(ids if include else ids[:-1], skip_special_tokens=False)
    assert comp.finish_reason == "stop" and comp.stop_reason is None and not aborts


def test_stop_token_id_is_the_stop_reason(tok, hot_path):
    ids = tok.encode("a b c", add_special_tokens=False)
    op = make_processor(tok, hot_path == "native")
    add(op, stop_token_ids=[ids[-1]])
    outs, _ = feed(op, ids, [1] * len(ids), finish=FinishReason.STOP, stop_reason=ids[-1])
    comp = outs[-1].outputs[0]
    assert comp.stop_reason == ids[-1] and comp.text == tok.decode(ids[:-1])


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tok, hot_path, include):
    text = TEXTS[1]
    ids = tok.encode(text, add_special_tokens=False)
    stop = "is Paris"  # spans several tokens
    assert not any(stop in tok.decode([t]) for t in ids)
    for chunk in (1, 2, 5):
        op = make_processor(tok, hot_path == "native")
        add(op, stop=[stop, "never"], include_stop_str_in_output=include, output_kind=DELTA)
        outs, aborts = feed(op, ids, [chunk] * len(ids))
        final = text[: text.index(stop) + (len(stop) if include else 0)]
        streamed = ""
        for o in outs:
            streamed += o.outputs[0].text
            assert final.startswith(streamed)  # nothing released is ever taken back
        assert streamed == final
        comp = outs[-1].outputs[0]
        assert (comp.finish_reason, comp.stop_reason) == ("stop", stop)
        assert outs[-1].finished and aborts == ["r"]
        assert not op.has_unfinished_requests()


def test_partial_stop_string_is_held_then_released(tok, hot_path):
    ids = tok.encode("The capital of France", add_special_tokens=False)
    op = make_processor(tok, hot_path == "native")
    add(op, stop=["capital city"], output_kind=DELTA)
    outs, _ = feed(op, ids, [1] * len(ids))
    by_step = [o.outputs[0].text for o in outs]
    # "capital" could begin "capital city": held until " of" proves it does not.
    held = by_step[ids.index(tok.encode(" capital", add_special_tokens=False)[0])]
    assert "capital" not in held
    assert "".join(by_step) == "The capital of France"
    assert outs[-1].outputs[0].finish_reason == "length"


def test_min_tokens_ignores_early_stop_strings(tok, hot_path):
    text = "stop here, then stop again"
    ids = tok.encode(text, add_special_tokens=False)
    op = make_processor(tok, hot_path == "native")
    add(op, stop=["stop"], min_tokens=2, max_tokens=50)
    outs, _ = feed(op, ids, [1] * len(ids))
    assert outs[-1].outputs[0].text == "stop here, then "


def test_logprobs_carry_decoded_tokens(tok, hot_path):
    ids = tok.encode("héllo 🎉", add_special_tokens=False)
    op = make_processor(tok, hot_path == "native")
    add(op, logprobs=2, output_kind=DELTA)
    outs = []
    total = 0.0
    for i, t in enumerate(ids):
        lp = Logprobs([[t, 5, t]], [[-0.5 - i, -1.0, -0.5 - i]], [3])
        total += -0.5 - i
        res = op.process_outputs([EngineCoreOutput("r", [t], lp,
                                                   FinishReason.LENGTH if i == len(ids) - 1
                                                   else None)])
        outs += res.request_outputs
    assert all(len(o.outputs[0].logprobs) == 1 for o in outs)
    for t, o in zip(ids, outs):
        entry = o.outputs[0].logprobs[0]
        assert list(entry) == [t, 5]  # sampled first; a repeat in the top-N is not doubled
        assert entry[t].rank == 3 and entry[5].rank == 1
        assert entry[t].decoded_token == tok.decode([t], skip_special_tokens=False)
    assert outs[-1].outputs[0].cumulative_logprob == pytest.approx(total)


@pytest.mark.parametrize("kind", [DELTA, CUM, FINAL])
def test_n_children_merge_into_one_parent(tok, hot_path, kind):
    op = make_processor(tok, hot_path == "native")
    sp = SamplingParams(n=3, seed=10, output_kind=kind)
    parent = ParentRequest("p", sp, "prompt", [1, 2], None, RequestMetrics(0.0, 0.0))
    seqs = [tok.encode(t, add_special_tokens=False)[:6] for t in TEXTS]
    for i, cid in enumerate(parent.child_ids):
        child_sp = ParentRequest.child_params(sp, i)
        assert child_sp.n == 1 and child_sp.seed == 10 + i
        op.add_request(EngineCoreRequest(cid, [1, 2], child_sp), "prompt", external_id="p",
                       parent=parent, index=i, metrics=RequestMetrics(0.0, 0.0))
    outs = []
    for step in range(6):
        # Children in reverse order, child 1 one step ahead of finishing.
        step_outs = [EngineCoreOutput(parent.child_ids[i], [seqs[i][step]],
                                      finish_reason=FinishReason.LENGTH
                                      if step == (4 if i == 1 else 5) else None)
                     for i in (2, 1, 0) if not (i == 1 and step == 5)]
        outs += op.process_outputs(step_outs, float(step)).request_outputs
    assert all(o.request_id == "p" for o in outs)
    if kind == FINAL:
        assert len(outs) == 1
    else:
        assert len(outs) == 6  # one merged output per step
        assert [c.index for c in outs[0].outputs] == [0, 1, 2]
        assert [c.index for c in outs[5].outputs] == [0, 2]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    texts = {}
    for o in outs:
        for c in o.outputs:
            texts[c.index] = texts.get(c.index, "") + c.text if kind == DELTA else c.text
    lens = [6, 5, 6]
    assert texts == {i: tok.decode(seqs[i][:lens[i]]) for i in range(3)}
    assert not op.has_unfinished_requests() and not op.parent_requests


def test_abort_ends_the_stream_with_abort(tok, hot_path):
    op = make_processor(tok, hot_path == "native")
    sp = SamplingParams(n=2, output_kind=CUM)
    parent = ParentRequest("p", sp, None, [1], None, RequestMetrics(0.0, 0.0))
    for i, cid in enumerate(parent.child_ids):
        op.add_request(EngineCoreRequest(cid, [1], ParentRequest.child_params(sp, i)), None,
                       external_id="p", parent=parent, index=i)
    add(op, "solo", output_kind=DELTA)
    ids = tok.encode("Hello there", add_special_tokens=False)
    op.process_outputs([EngineCoreOutput(r, ids[:2]) for r in (*parent.child_ids, "solo")])
    res = op.abort_requests(["p", "solo", "unknown"])
    assert sorted(res.reqs_to_abort) == sorted([*parent.child_ids, "solo"])
    by_id = {o.request_id: o for o in res.request_outputs}
    assert by_id["p"].finished and [c.finish_reason for c in by_id["p"].outputs] == ["abort"] * 2
    assert by_id["p"].outputs[0].text == tok.decode(ids[:2])
    assert by_id["solo"].outputs[0].finish_reason == "abort"
    assert by_id["solo"].outputs[0].text == "" and by_id["solo"].finished
    # The engine's own ABORT confirmations that follow are ignored.
    late = op.process_outputs([EngineCoreOutput("solo", [], finish_reason=FinishReason.ABORT)])
    assert late.request_outputs == [] and not op.has_unfinished_requests()


def test_engine_error_is_an_error_output(tok, hot_path):
    op = make_processor(tok, hot_path == "native")
    add(op)
    res = op.process_outputs([EngineCoreOutput("r", [], finish_reason=FinishReason.ERROR,
                                               stop_reason="prompt too long")])
    comp = res.request_outputs[0].outputs[0]
    assert (comp.finish_reason, comp.stop_reason) == ("error", "prompt too long")


def _metaspace_tokenizer(tmp_path) -> Tokenizer:
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HF(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    hf.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=200, show_progress=False,
                                                      special_tokens=["<unk>", "</s>"]))
    hf.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer.from_dir(str(tmp_path))


def test_sentencepiece_style_decoding_in_context(tmp_path, hot_path):
    mtok = _metaspace_tokenizer(tmp_path)
    prompt = mtok.encode("The capital of")
    out_ids = mtok.encode("The capital of France is Paris.")[len(prompt):]
    op = make_processor(mtok, hot_path == "native")
    assert not op.detokenizers.byte_level
    add(op, prompt=prompt, output_kind=DELTA)
    outs, _ = feed(op, out_ids, [1] * len(out_ids))
    text = "".join(o.outputs[0].text for o in outs)
    # The first token keeps its leading space: it is decoded after the prompt.
    assert text == mtok.decode(prompt + out_ids)[len(mtok.decode(prompt)):]
    assert text.startswith(" France")


# -- the two loops agree, and match a reference, on random streams ---------------------------

_PIECES = ["a", "b", "ab", " ", "é", "日本", "🎉", "x", "\n", "Paris", "STOP"]


@st.composite
def streams(draw):
    text = "".join(draw(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=30)))
    stops = draw(st.lists(st.one_of(st.sampled_from(["STOP", "ab", "é日", "🎉 ", "zz"]),
                                    st.text(alphabet="abé日🎉 x", min_size=1, max_size=4)),
                          max_size=3))
    return dict(text=text, stop=stops,
                include=draw(st.booleans()), skip=draw(st.booleans()),
                kind=draw(st.sampled_from([CUM, DELTA, FINAL])),
                min_tokens=draw(st.sampled_from([0, 0, 2])),
                eos=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(case=streams())
def test_twins_agree_and_match_reference(tok, case):
    ids = tok.encode(case["text"], add_special_tokens=False)
    rng = random.Random(case["seed"])
    if case["eos"]:
        ids.append(tok.eos_token_id)
    chunks = [rng.randint(1, 3) for _ in ids]
    finish = FinishReason.STOP if case["eos"] else FinishReason.LENGTH
    results = []
    for native in (True, False):
        op = make_processor(tok, native)
        assert op.uses_native_loop == native
        add(op, stop=case["stop"], include_stop_str_in_output=case["include"],
            skip_special_tokens=case["skip"], output_kind=case["kind"],
            min_tokens=case["min_tokens"], max_tokens=None)
        results.append(feed(op, ids, chunks, finish=finish))
    assert results[0] == results[1]
    outs, _ = results[0]
    if case["min_tokens"]:
        return
    # Reference: the whole text, cut at the stop string that ends first.
    text_ids = ids[:-1] if case["eos"] and not case["include"] else ids
    full = tok.decode(text_ids, skip_special_tokens=case["skip"])
    hits = [(full.index(s) + len(s), k, s) for k, s in enumerate(case["stop"]) if s in full]
    want = full
    if hits:
        end, _, s = min(hits)
        want = full[:end] if case["include"] else full[:end - len(s)]
    got = ("".join(o.outputs[0].text for o in outs) if case["kind"] == DELTA
           else outs[-1].outputs[0].text)
    assert got == want
