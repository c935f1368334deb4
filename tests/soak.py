"""The soak: mixed load on one engine with two front-ends, random aborts (duplicate
ids among them), bad requests (refused by the client, or sent raw and answered by
the engine), poisoned requests and transient executor faults, bad utility calls.

Checks at the end: every request finished exactly once (none lost, none twice),
every request that ran to its end has exactly its tokens (the synthetic
instrument's tokens are a function of seed and position, so recompute after a
fault isolation must reproduce them), the engine never died, and its RSS.
``tests/test_soak.py`` runs it for ~25 s; ``bench/bench_soak.py`` for 10 minutes.
"""

from __future__ import annotations

import dataclasses
import random
import time

import msgspec
import psutil

from enginecore import EngineArgs, EngineCoreRequest, FinishReason, SamplingParams
from enginecore.client import SyncMPClient
from enginecore.executor.synthetic import request_seed, synthetic_token
from enginecore.protocol import EngineCoreRequestType
from proc_executors import LATE_AFTER, LATE_POISON, POISON, FaultInjectingExecutor

VOCAB = 32000
IN_FLIGHT = 48


class SoakFaultExecutor(FaultInjectingExecutor):
    """Poisoned requests, plus a transient fault (no request's doing) every 509
    model steps: rarer than the isolation forgives (256 healthy steps)."""

    transient_every = 509


@dataclasses.dataclass
class SoakResult:
    requests: int = 0
    finishes: int = 0
    duplicates: int = 0
    lost: int = 0
    wrong_tokens: int = 0
    by_reason: dict = dataclasses.field(default_factory=dict)
    refused_by_client: int = 0
    raw_malformed: int = 0
    poisoned: int = 0
    aborts_sent: int = 0
    utility_calls: int = 0
    engine_deaths: int = 0
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0
    seconds: float = 0.0


def expected_tokens(prompt: list[int], seed: int, max_tokens: int) -> list[int]:
    s = request_seed(seed, prompt)
    return [synthetic_token(s, len(prompt) + i, VOCAB) for i in range(max_tokens)]


def run_soak(duration_s: float, seed: int = 0, use_native: bool | None = None) -> SoakResult:
    rng = random.Random(seed)
    cfg = EngineArgs(model="synthetic", block_size=4, max_model_len=256, use_native=use_native,
                     num_gpu_blocks_override=512, synthetic_step_latency_s=0.001,
                     max_num_seqs=64).create_engine_config()
    first = SyncMPClient(cfg, SoakFaultExecutor, client_count=2)
    fronts = [first, first.attach(1)]
    res = SoakResult()
    # (front-end, request id) -> dict(prompt, seed, max_tokens, tokens, finishes, kind)
    reqs: dict[tuple[int, str], dict] = {}
    live: list[set[str]] = [set(), set()]
    engine = psutil.Process(first.proc.pid)
    t0 = time.monotonic()
    warm, n = t0 + min(5.0, duration_s / 10), 0
    try:
        while time.monotonic() - t0 < duration_s:
            if not res.rss_start_mb and time.monotonic() > warm:
                res.rss_start_mb = engine.memory_info().rss / 2**20
            f = rng.randrange(2)
            c = fronts[f]
            while len(live[0]) + len(live[1]) < IN_FLIGHT:
                n += 1
                send_one(rng, fronts, reqs, live, res, n)
            roll = rng.random()
            if roll < 0.05 and live[f]:  # random aborts, duplicate ids in one list
                ids = rng.sample(sorted(live[f]), min(len(live[f]), rng.randint(1, 3)))
                c.abort_requests(ids + ids[:1])
                res.aborts_sent += 1
            elif roll < 0.07:
                res.utility_calls += 1
                try:
                    c.call_utility("sleep", 7, timeout=10)
                except RuntimeError:
                    pass
                assert c.call_utility("echo", n, timeout=10) == n
            read_outputs(fronts, reqs, live, res, timeout=0.005)
        deadline = time.monotonic() + 60
        while (live[0] or live[1]) and time.monotonic() < deadline:
            read_outputs(fronts, reqs, live, res, timeout=0.05)
        res.rss_end_mb = engine.memory_info().rss / 2**20
        res.engine_deaths = int(not first.proc.is_alive() or first._dead)
    finally:
        fronts[1].shutdown()
        first.shutdown()
    res.seconds = time.monotonic() - t0
    for r in reqs.values():
        res.lost += r["finishes"] == 0
        res.duplicates += max(r["finishes"] - 1, 0)
        if r["kind"] == "good" and r["reason"] in (FinishReason.LENGTH, FinishReason.ABORT):
            want = expected_tokens(r["prompt"], r["seed"], r["max_tokens"])
            ok = r["tokens"] == want if r["reason"] is FinishReason.LENGTH else \
                r["tokens"] == want[:len(r["tokens"])]
            res.wrong_tokens += not ok
    return res


def send_one(rng, fronts, reqs, live, res, n) -> None:
    f = rng.randrange(2)
    c = fronts[f]
    rid = f"q{n}" if rng.random() < 0.9 else f"shared{n // 2}"  # ids both front-ends use
    if rid in live[f] or (f, rid) in reqs:
        rid = f"q{n}"
    prompt = [rng.randrange(1, 30000) for _ in range(rng.randint(1, 40))]
    seed, max_tokens = rng.randrange(2**31), rng.randint(1, 80)
    kind, roll = "good", rng.random()
    if roll < 0.03:
        kind, prompt = "poison", prompt + [rng.choice([POISON, LATE_POISON])]
        max_tokens = max(max_tokens, LATE_AFTER + 4)
    elif roll < 0.06:  # refused by the client before sending: never live
        bad = SamplingParams(max_tokens=3)
        bad.max_tokens = 2**64
        try:
            c.add_request(EngineCoreRequest(rid, prompt, bad))
        except ValueError:
            res.refused_by_client += 1
        return
    elif roll < 0.09:  # sent raw: the engine answers ERROR
        kind = "malformed"
        payload = msgspec.msgpack.encode([rid, prompt, [2**63]])
        c.router.register(EngineCoreRequest(rid, [1]))
        c._send([c.identity, EngineCoreRequestType.ADD.value, payload])
    res.requests += 1
    reqs[(f, rid)] = dict(prompt=prompt, seed=seed, max_tokens=max_tokens, tokens=[],
                          finishes=0, kind=kind, reason=None)
    live[f].add(rid)
    if kind != "malformed":
        c.add_request(EngineCoreRequest(rid, prompt, SamplingParams(
            max_tokens=max_tokens, seed=seed)))
    if kind == "poison":
        res.poisoned += 1
    if kind == "malformed":
        res.raw_malformed += 1


def read_outputs(fronts, reqs, live, res, timeout: float) -> None:
    for f, c in enumerate(fronts):
        try:
            outs = c.get_output(timeout=timeout)
        except Exception as e:  # queue.Empty
            if type(e).__name__ == "Empty":
                continue
            raise
        for o in outs.outputs:
            r = reqs[(f, o.request_id)]
            r["tokens"].extend(o.new_token_ids)
            if o.finish_reason is not None:
                r["finishes"] += 1
                r["reason"] = o.finish_reason
                res.finishes += 1
                key = str(o.finish_reason)
                res.by_reason[key] = res.by_reason.get(key, 0) + 1
                live[f].discard(o.request_id)
