"""Small builders shared by tests."""

from __future__ import annotations

from enginecore import EngineArgs, EngineCore, EngineCoreOutputs, EngineCoreRequest, SamplingParams
from enginecore.executor import SyntheticExecutor


def synthetic_engine(**kwargs) -> EngineCore:
    args = dict(model="synthetic")
    args.update(kwargs)
    log_stats = args.pop("log_stats", False)
    return EngineCore(EngineArgs(**args).create_engine_config(), SyntheticExecutor, log_stats)


def make_request(rid: str, prompt: list[int], **sp) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, SamplingParams(**sp))


def run_to_completion(engine: EngineCore, max_steps: int = 100_000) -> dict[str, dict]:
    """Step until idle; collect tokens and finish reasons per request id."""
    results: dict[str, dict] = {}
    for _ in range(max_steps):
        if not engine.scheduler.has_requests() and not (engine.batch_queue or ()):
            return results
        outputs, executed = engine.step_fn()
        engine.post_step(executed)  # as the busy loop does: hands drafts back
        collect(outputs, results)
    raise AssertionError("engine did not finish")


def collect(outputs: dict[int, EngineCoreOutputs], results: dict[str, dict]) -> None:
    for outs in outputs.values():
        for o in outs.outputs:
            r = results.setdefault(o.request_id, {"tokens": [], "finish_reason": None})
            r["tokens"].extend(o.new_token_ids)
            if o.finish_reason is not None:
                r["finish_reason"] = o.finish_reason
                r["stop_reason"] = o.stop_reason


def same_bits(a, b) -> bool:
    """Kernel and twin gave the same values: equal numbers, NaN where the other has
    NaN (torch's own float -> bf16 NaN bits differ between its scalar and vector
    loops), the same sign on zeros."""
    import torch

    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    zeros = a == 0
    return torch.equal(torch.signbit(a[zeros]), torch.signbit(b[zeros]))
