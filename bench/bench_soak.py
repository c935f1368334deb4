"""The 10-minute soak (tests/soak.py; tests/test_soak.py runs 25 s of it in CI).

Mixed load on one engine with two front-ends: random aborts (duplicate ids in
them), bad requests refused by the client or sent raw and answered by the
engine, poisoned requests and transient executor faults, bad utility calls.
Reports finishes, lost and duplicated finishes, wrong tokens, engine deaths and
the engine's RSS after warm-up and at the end. Path: the environment's
(ENGINECORE_NATIVE=0 for Python); length: ENGINECORE_SOAK_S (default 600).

    flock /tmp/ec-suite.lock flock /tmp/ec-bench.lock \\
        .venv/bin/python -m pytest bench/bench_soak.py -s
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from soak import run_soak


def test_soak(benchmark):
    seconds = float(os.environ.get("ENGINECORE_SOAK_S", "600"))
    res = benchmark.pedantic(run_soak, args=(seconds,), kwargs={"seed": 1}, rounds=1,
                             iterations=1)
    benchmark.extra_info.update(dataclasses.asdict(res))
    print(res)
    assert res.engine_deaths == 0
    assert res.lost == 0 and res.duplicates == 0 and res.wrong_tokens == 0
