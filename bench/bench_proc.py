"""Through the process boundary: 256 concurrent requests, synthetic executor at
zero latency (engine-bound), against the same work on EngineCore in process.

Run: pytest bench/bench_proc.py --benchmark-group-by=group
"""

from __future__ import annotations

import pytest

from enginecore import EngineArgs, EngineCore, EngineCoreRequest, SamplingParams, _native
from enginecore.client import SyncMPClient
from enginecore.executor import SyntheticExecutor

NUM_REQS = 256
MAX_TOKENS = 64


def make_requests(tag: str) -> list[EngineCoreRequest]:
    return [EngineCoreRequest(f"{tag}-{i}", [i % 500 + 1, 2, 3, 4, 5, 6, 7, 8],
                              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=i))
            for i in range(NUM_REQS)]


def config():
    return EngineArgs(model="synthetic", max_num_seqs=NUM_REQS,
                      use_native=_native.native_available()).create_engine_config()


def run_inprocess() -> int:
    eng = EngineCore(config(), SyntheticExecutor)
    for r in make_requests("x"):
        eng.add_request(r)
    n = 0
    while eng.scheduler.has_requests():
        for outs in eng.step()[0].values():
            for o in outs.outputs:
                n += len(o.new_token_ids)
    return n


def test_proc_e2e(benchmark, path):
    benchmark.group = f"proc_e2e[{NUM_REQS} concurrent x {MAX_TOKENS} tokens]"
    client = SyncMPClient(config())
    rounds = iter(range(10**6))

    def run() -> int:
        tag = f"r{next(rounds)}"
        for r in make_requests(tag):
            client.add_request(r)
        n = finished = 0
        while finished < NUM_REQS:
            for o in client.get_output(timeout=60).outputs:
                n += len(o.new_token_ids)
                finished += o.finish_reason is not None
        return n

    try:
        n = benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    finally:
        client.shutdown()
    assert n == NUM_REQS * MAX_TOKENS
    s = benchmark.stats.stats.median
    benchmark.extra_info["requests_per_s"] = round(NUM_REQS / s)
    benchmark.extra_info["output_tokens_per_s"] = round(n / s)


def test_inprocess_e2e(benchmark, path):
    benchmark.group = f"proc_e2e[{NUM_REQS} concurrent x {MAX_TOKENS} tokens]"
    n = benchmark.pedantic(run_inprocess, rounds=5, iterations=1, warmup_rounds=1)
    assert n == NUM_REQS * MAX_TOKENS
    s = benchmark.stats.stats.median
    benchmark.extra_info["requests_per_s"] = round(NUM_REQS / s)
    benchmark.extra_info["output_tokens_per_s"] = round(n / s)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
