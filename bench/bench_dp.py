"""Data parallel: engine-bound throughput at DP=1 and DP=2 (synthetic executor at
zero latency, independent and lockstep ranks), and the cost of the wave-end
all-reduce the lockstep ranks run every 32 steps.

Run: pytest bench/bench_dp.py --benchmark-group-by=group -s
"""

from __future__ import annotations

import multiprocessing

import pytest

from enginecore import EngineArgs, EngineCoreRequest, SamplingParams
from enginecore.client import SyncMPClient
from enginecore.core.dp_engine_core_proc import SYNC_EVERY
from enginecore.core.dp_group import StatelessDPGroup, host_store

NUM_REQS = 512
MAX_TOKENS = 64
ALLREDUCE_ROUNDS, ALLREDUCE_ITERS = 20, 50


def requests(tag: str) -> list[EngineCoreRequest]:
    return [EngineCoreRequest(f"{tag}-{i}", [i % 500 + 1, 2, 3, 4, 5, 6, 7, 8],
                              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=i))
            for i in range(NUM_REQS)]


@pytest.mark.parametrize("dp,lockstep", [(1, False), (2, False), (2, True)],
                         ids=["dp1", "dp2-independent", "dp2-lockstep"])
def test_dp_throughput(benchmark, dp, lockstep):
    benchmark.group = f"dp_throughput[{NUM_REQS} concurrent x {MAX_TOKENS} tokens]"
    config = EngineArgs(model="synthetic", max_num_seqs=NUM_REQS, data_parallel_size=dp,
                        data_parallel_lockstep=lockstep).create_engine_config()
    client = SyncMPClient(config)
    rounds = iter(range(10**6))

    def run() -> int:
        tag = f"r{next(rounds)}"
        for r in requests(tag):
            client.add_request(r)
        n = finished = 0
        while finished < NUM_REQS:
            for o in client.get_output(timeout=120).outputs:
                n += len(o.new_token_ids)
                finished += o.finish_reason is not None
        return n

    try:
        n = benchmark.pedantic(run, rounds=4, iterations=1, warmup_rounds=1)
    finally:
        client.shutdown()
    assert n == NUM_REQS * MAX_TOKENS
    tok_s = n / benchmark.stats.stats.median
    benchmark.extra_info["tokens_per_s"] = round(tok_s)
    print(f"\ndp={dp} lockstep={lockstep}: {tok_s:,.0f} tokens/s")


def _peer(address: str) -> None:
    group = StatelessDPGroup(address, 1, 2)
    try:
        while True:  # as many calls as the benchmark makes; it ends by leaving
            group.all_reduce_min([0, 1, 2, 3, 4, 5, 6])
    except RuntimeError:
        pass


def test_wave_allreduce_cost(benchmark):
    """The every-SYNC_EVERY-steps all-reduce between two ranks (gloo, loopback),
    with the vector the ranks really reduce (work, 3 calls x fewest/most)."""
    benchmark.group = "dp_allreduce[2 ranks, gloo loopback]"
    _store, address = host_store("127.0.0.1")
    peer = multiprocessing.get_context("spawn").Process(target=_peer, args=(address,))
    peer.start()
    try:
        group = StatelessDPGroup(address, 0, 2)
        benchmark.pedantic(group.all_reduce_min, args=([0, 1, 2, 3, 4, 5, 6],),
                           rounds=ALLREDUCE_ROUNDS, iterations=ALLREDUCE_ITERS)
        group.destroy()
    finally:
        peer.join(timeout=10)
        if peer.is_alive():
            peer.kill()
    per_call = benchmark.stats.stats.median
    benchmark.extra_info["per_step_us"] = round(per_call / SYNC_EVERY * 1e6, 2)
    print(f"\nall-reduce {per_call * 1e6:.0f} us per call = "
          f"{per_call / SYNC_EVERY * 1e6:.1f} us per step at one call per {SYNC_EVERY} steps")
