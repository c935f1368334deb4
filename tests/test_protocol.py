import msgspec

from enginecore import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    SamplingParams,
    UtilityOutput,
    UtilityResult,
)
from enginecore.protocol import Logprobs, SchedulerStats


def test_request_round_trip():
    req = EngineCoreRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4), 1.5, cache_salt="s",
                            client_index=2, priority=-1)
    raw = msgspec.msgpack.encode(req)
    back = msgspec.msgpack.decode(raw, type=EngineCoreRequest)
    assert back == req


def test_outputs_round_trip():
    outs = EngineCoreOutputs(
        engine_index=1,
        outputs=[
            EngineCoreOutput("a", [5], Logprobs([[5, 6]], [[-0.1, -2.0]], [1])),
            EngineCoreOutput("b", [7, 8], finish_reason=FinishReason.STOP, stop_reason=8),
        ],
        scheduler_stats=SchedulerStats(num_running_reqs=3),
        utility_output=UtilityOutput(1, result=UtilityResult({"x": [1, 2]})),
        finished_requests={"b"},
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(outs), type=EngineCoreOutputs)
    assert back == outs
    assert back.outputs[1].finished and back.outputs[1].finish_reason is FinishReason.STOP


def test_request_type_bytes_are_single_bytes():
    values = [t.value for t in EngineCoreRequestType]
    assert all(len(v) == 1 for v in values) and len(set(values)) == len(values)
    assert str(FinishReason.LENGTH) == "length"
