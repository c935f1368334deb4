"""The soak, short (tests/soak.py; bench/bench_soak.py runs it for 10 minutes):
zero lost or duplicated finishes, exact tokens, no engine death, flat RSS."""

from __future__ import annotations

import pytest

from soak import run_soak

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("path", ["native", "python"])
def test_soak_short(path):
    res = run_soak(25.0, seed=13, use_native=path == "native")
    print(res)
    assert res.engine_deaths == 0
    assert res.lost == 0 and res.duplicates == 0 and res.wrong_tokens == 0, res
    assert res.requests > 500 and res.poisoned > 0 and res.raw_malformed > 0, res
    # >: poisoned requests end with ERROR too (unless an abort came first)
    assert res.by_reason.get("error", 0) > res.raw_malformed, res
    assert res.rss_end_mb - res.rss_start_mb < 40, res
