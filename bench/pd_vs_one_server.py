"""P/D (prefill server + decode server + enginecore proxy) against one server: TTFT of a
streamed request alone, and the wall time of 16 concurrent requests. Tiny random model.

    PYTHONPATH=python:tests python bench/pd_vs_one_server.py
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time

import httpx

from server_helpers import ServerProcess, make_tiny_chat_model

PROMPT = "alpha beta gamma delta " * 18  # ~430 byte tokens


def serve(model: str, kv: dict | None) -> ServerProcess:
    extra = ["--kv-transfer-config", json.dumps(kv)] if kv else []
    return ServerProcess([model, "--max-model-len", "512", "--kv-cache-memory-bytes",
                          str(64 << 20), "--dtype", "float32", "--served-model-name", "tiny",
                          *extra])


async def ttft(url: str) -> float:
    async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
        t0 = time.perf_counter()
        async with c.stream("POST", url + "/v1/completions", json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return time.perf_counter() - t0
    raise AssertionError("no token")


async def burst(url: str, n: int = 16) -> float:
    async with httpx.AsyncClient(timeout=300, trust_env=False) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(c.post(url + "/v1/completions", json={
            "model": "tiny", "prompt": f"{i} " + PROMPT, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}) for i in range(n)))
        return time.perf_counter() - t0


def measure(url: str) -> tuple[float, float]:
    ttfts = [asyncio.run(ttft(url)) for _ in range(5)]
    return statistics.median(ttfts[1:]), asyncio.run(burst(url))


def main() -> None:
    print(subprocess.run("lscpu | grep 'Model name'", shell=True, check=False,
                         capture_output=True, text=True).stdout.strip())
    os.environ["ENGINECORE_CACHE_DIR"] = tempfile.mkdtemp()  # a throwaway key set
    model = make_tiny_chat_model(tempfile.mkdtemp())
    one = serve(model, None)
    p = serve(model, {"kv_connector": "PDConnector", "kv_role": "kv_producer"})
    d = serve(model, {"kv_connector": "PDConnector", "kv_role": "kv_consumer"})
    proxy = ServerProcess(["--prefill", p.url, "--decode", d.url], command="proxy")
    try:
        for name, url in (("one server", one.url), ("P/D via proxy", proxy.url)):
            t, b = measure(url)
            print(f"{name}: TTFT {t * 1e3:.0f} ms (median of 4, ~430-token prompt); "
                  f"16 concurrent x 16 tokens: {b:.2f} s")
    finally:
        for s in (proxy, d, p, one):
            s.stop()


if __name__ == "__main__":
    main()
