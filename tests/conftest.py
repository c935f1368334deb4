"""Shared fixtures. ``hot_path`` runs a test on the native and the pure-Python path."""

from __future__ import annotations

import os

import pytest

from enginecore import _native

# `make gpu-check` dry run: the CUDA-marked tests run on the CPU (their CUDA-only
# checks skip themselves), so the script and the tests can be tried without a GPU.
CUDA_TESTS_ON_CPU = os.environ.get("ENGINECORE_CUDA_TESTS_ON_CPU") == "1"


def pytest_collection_modifyitems(config, items):
    """Ray tests last: twice in CI, after the Ray tests had run in the session, a later
    test saw a spawned engine's exit code as None (reaped by something other than
    multiprocessing, most likely state Ray's driver leaves behind); not reproduced
    outside the full suite. Tests marked `cuda` are skipped without a CUDA device."""
    items.sort(key=lambda item: item.nodeid.startswith("tests/test_dp_ray.py"))
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if cuda_items and not CUDA_TESTS_ON_CPU:
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a CUDA device (torch sees none)")
            for item in cuda_items:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda_device() -> str:
    """The device of the CUDA tests: "cuda", or "cpu" in the gpu-check dry run."""
    return "cpu" if CUDA_TESTS_ON_CPU else "cuda"


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


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> str:
    """A tiny random llama with a byte-level tokenizer and a chat template (the
    front-end tests' model: multi-byte characters span tokens)."""
    from tiny_models import make_tiny_chat_model

    return make_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat")))


class BackgroundLoop:
    """An asyncio loop in a thread: async front-ends live on it across tests, and
    every call waits with a timeout (a hang fails the test, never the session)."""

    def __init__(self) -> None:
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="test-asyncio-loop")
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


@pytest.fixture(scope="module")
def aloop():
    bg = BackgroundLoop()
    yield bg
    bg.close()
