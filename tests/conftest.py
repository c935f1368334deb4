"""Shared fixtures. ``hot_path`` runs a test on the native and the pure-Python path."""

from __future__ import annotations

import pytest

from enginecore import _native


def pytest_collection_modifyitems(config, items):
    """Ray tests last: twice in CI, after the Ray tests had run in the session, a later
    test saw a spawned engine's exit code as None (reaped by something other than
    multiprocessing, most likely state Ray's driver leaves behind); not reproduced
    outside the full suite."""
    items.sort(key=lambda item: item.nodeid.startswith("tests/test_dp_ray.py"))


@pytest.fixture(params=["native", "python"])
def hot_path(request: pytest.FixtureRequest):
    """Switch every hot path for the duration of one test."""
    want_native = request.param == "native"
    if want_native and _native._ext is None:
        pytest.fail("the native extension is not built; `pip install .` first")
    previous = _native._enabled
    _native.set_native(want_native)
    try:
        yield request.param
    finally:
        _native._enabled = previous
