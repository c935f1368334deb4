"""Benchmarks run each case on both paths; ``path`` switches the hot paths."""

from __future__ import annotations

import pytest

from enginecore import _native


@pytest.fixture(params=["python", "native"])
def path(request: pytest.FixtureRequest):
    want_native = request.param == "native"
    if want_native and _native._ext is None:
        pytest.skip("native extension not built")
    previous = _native._enabled
    _native.set_native(want_native)
    yield request.param
    _native._enabled = previous
