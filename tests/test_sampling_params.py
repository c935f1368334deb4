import msgspec
import pytest

from enginecore import SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_defaults_and_flags():
    sp = SamplingParams()
    assert sp.max_tokens == 16 and not sp.greedy and not sp.has_penalties
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1).greedy
    assert SamplingParams(repetition_penalty=1.2).has_penalties


def test_wire_round_trip_and_decode_validation():
    sp = SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop_token_ids=[4, 5], logprobs=2)
    raw = msgspec.msgpack.encode(sp)
    assert msgspec.msgpack.decode(raw, type=SamplingParams) == sp
    # array_like: fields travel positionally, a fixed-length array.
    assert msgspec.msgpack.decode(raw)[0] == 7
    bad = msgspec.msgpack.encode([0])  # max_tokens=0
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        msgspec.msgpack.decode(bad, type=SamplingParams)


@pytest.mark.parametrize("kwargs, field", [
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"n": True}, "n"), ({"n": 2.0}, "n"),
    ({"stop": [""]}, "stop"), ({"stop": ["a", 3]}, "stop"), ({"stop": 5}, "stop"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
    ({"spaces_between_special_tokens": "no"}, "spaces_between_special_tokens"),
    ({"output_kind": 7}, "output_kind"),
    ({"max_tokens": -1}, "max_tokens"),
])
def test_front_end_fields_are_validated(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_front_end_fields_travel_and_normalize():
    from enginecore import RequestOutputKind

    sp = SamplingParams(n=4, stop="###", output_kind=1, max_tokens=None, min_tokens=3,
                        skip_special_tokens=False)
    assert sp.stop == ["###"] and sp.output_kind is RequestOutputKind.DELTA
    assert SamplingParams().stop == [] and SamplingParams().n == 1
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams)
    assert back == sp and back.max_tokens is None
