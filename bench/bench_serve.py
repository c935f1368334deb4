"""`enginecore serve` under load: streamed /v1/completions from the openai async
client at fixed concurrency (1, 8, 32, 64), 64-token prompts, 128 output tokens
(ignore_eos), on the default model. Per level: output tokens/s, TTFT / TPOT / ITL
p50 and p99, and the CPU time the API server process and the engine process
spent per output token. Also: process start to the first answer.

As pytest (starts its own server):
    pytest bench/bench_serve.py -s -p no:randomly
Against any OpenAI-compatible server (e.g. `vllm serve`, for a side-by-side run):
    python bench/bench_serve.py --url http://127.0.0.1:8000/v1 --model NAME \
        --concurrency 1 8 32 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field

PROMPT_LEN = 64
OUTPUT_LEN = 128
LEVELS = (1, 8, 32, 64)


def requests_for(concurrency: int) -> int:
    """Enough requests for a steady state, few enough to stay short at 2 cores."""
    return max(4, 2 * concurrency)


@dataclass
class RequestResult:
    ttft: float
    itls: list[float]
    latency: float
    tokens: int


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    wall_s: float
    results: list[RequestResult] = field(default_factory=list)
    server_cpu_s: float | None = None
    engine_cpu_s: float | None = None

    @property
    def output_tokens(self) -> int:
        return sum(r.tokens for r in self.results)

    def pct(self, values: list[float], q: float) -> float:
        values = sorted(values)
        if not values:
            return float("nan")
        k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
        return values[k]

    def row(self) -> dict:
        ttfts = [r.ttft for r in self.results]
        tpots = [(r.latency - r.ttft) / (r.tokens - 1) for r in self.results if r.tokens > 1]
        itls = [x for r in self.results for x in r.itls]
        out = {
            "concurrency": self.concurrency, "requests": self.requests,
            "output_tok_s": self.output_tokens / self.wall_s,
            "ttft_p50_ms": 1e3 * self.pct(ttfts, 50), "ttft_p99_ms": 1e3 * self.pct(ttfts, 99),
            "tpot_p50_ms": 1e3 * self.pct(tpots, 50), "tpot_p99_ms": 1e3 * self.pct(tpots, 99),
            "itl_p50_ms": 1e3 * self.pct(itls, 50), "itl_p99_ms": 1e3 * self.pct(itls, 99),
        }
        if self.server_cpu_s is not None:
            out["server_cpu_ms_per_tok"] = 1e3 * self.server_cpu_s / self.output_tokens
        if self.engine_cpu_s is not None:
            out["engine_cpu_ms_per_tok"] = 1e3 * self.engine_cpu_s / self.output_tokens
        return out


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token-id prompts of PROMPT_LEN tokens (vLLM's random dataset, in ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(PROMPT_LEN)] for _ in range(n)]


class _RequestClock:
    """One request's timing: time to first text, the gaps between text chunks."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.ttft: float | None = None
        self.itls: list[float] = []

    def text(self) -> None:
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self.t0
        else:
            self.itls.append(now - self.last)
        self.last = now

    def result(self, tokens: int) -> RequestResult:
        latency = time.perf_counter() - self.t0
        return RequestResult(self.ttft if self.ttft is not None else latency, self.itls,
                             latency, tokens)


async def _one(client, model: str, prompt: list[int]) -> RequestResult:
    clock = _RequestClock()
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=OUTPUT_LEN, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            clock.text()
    return clock.result(tokens)


async def run_level(base_url: str, model: str, concurrency: int, vocab: int,
                    api_key: str = "none", num_requests: int | None = None) -> LevelResult:
    import openai

    n = num_requests or requests_for(concurrency)
    todo = prompts(n, vocab, seed=concurrency)
    sem = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                  timeout=600) as client:
        await _one(client, model, todo[0][:8])  # warm the connection pool and the engine

        async def limited(p: list[int]) -> RequestResult:
            async with sem:
                return await _one(client, model, p)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in todo))
        wall = time.perf_counter() - t0
    return LevelResult(concurrency, n, wall, list(results))


async def run_level_direct(engine, concurrency: int, vocab: int,
                           num_requests: int | None = None) -> LevelResult:
    """The same load on an in-process AsyncLLM (no HTTP): what the server adds is the
    difference."""
    from enginecore import RequestOutputKind, SamplingParams

    n = num_requests or requests_for(concurrency)
    todo = prompts(n, vocab, seed=concurrency)
    sem = asyncio.Semaphore(concurrency)
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    ids = iter(range(10**9))

    async def one(p: list[int]) -> RequestResult:
        async with sem:
            clock, tokens = _RequestClock(), 0
            async for out in engine.generate({"prompt_token_ids": p}, params,
                                             f"direct-{concurrency}-{next(ids)}"):
                comp = out.outputs[0]
                tokens += len(comp.token_ids)
                if comp.text:
                    clock.text()
            return clock.result(tokens)

    await one(todo[0][:8])
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in todo))
    return LevelResult(concurrency, n, time.perf_counter() - t0, list(results))


def _cpu(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def start_server(extra: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str,
                                                                     float]:
    """`enginecore serve` (default model) on a free port; (process, base URL,
    seconds from the process start to the first answered request)."""
    import httpx

    t0 = time.monotonic()
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench_serve.log"), "w+")
    proc = subprocess.Popen([sys.executable, "-m", "enginecore.entrypoints.cli", "serve",
                             "--port", "0", *extra], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    url = None
    while time.monotonic() - t0 < 300:
        log.seek(0)
        match = re.search(r"serving on (http://[0-9.]+:\d+)", log.read())
        if match:
            url = match.group(1)
            break
        if proc.poll() is not None:
            log.seek(0)
            text = log.read()
            log.close()
            raise RuntimeError(f"the server exited:\n{text}")
        time.sleep(0.05)
    if url is None:
        proc.kill()
        proc.wait(60)
        log.close()
        raise TimeoutError("the server did not start")
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                       timeout=60)
        r.raise_for_status()
    except BaseException:
        proc.kill()
        proc.wait(60)
        log.close()
        raise
    # The server keeps writing its log: the file closes when the server is stopped
    # (stop_server), not here.
    proc.log_file = log  # type: ignore[attr-defined]
    return proc, url + "/v1", time.monotonic() - t0


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(60)
    log = getattr(proc, "log_file", None)
    if log is not None:
        log.close()


def server_pids(proc: subprocess.Popen) -> tuple[list[int], list[int]]:
    """(API server processes, engine processes) of a server started here."""
    import psutil

    api, engines = [proc.pid], []
    for child in psutil.Process(proc.pid).children(recursive=True):
        cmd = " ".join(child.cmdline())
        if "resource_tracker" in cmd:
            continue
        engines.append(child.pid)
    return api, engines


def format_table(rows: list[dict]) -> str:
    cols = ["concurrency", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
            "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms", "server_cpu_ms_per_tok",
            "engine_cpu_ms_per_tok"]
    cols = [c for c in cols if any(c in r for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r.get(c), float)
                                       else str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines)


# -- pytest entry --------------------------------------------------------------------------

def test_serve_load(benchmark):
    """The server at every level, then the same load on an in-process AsyncLLM
    (side by side in one run: the ratio is what HTTP + SSE + the API process cost).
    Pedantic, one round: a level is seconds to minutes of load, not a microbenchmark."""
    import pytest

    pytest.importorskip("openai")
    proc, base_url, startup_s = start_server(["--max-model-len", "1024"])
    rows, direct_rows = [], []
    try:
        api, engines = server_pids(proc)

        def all_levels() -> None:
            for c in LEVELS:
                cpu0, ecpu0 = _cpu(api), _cpu(engines)
                level = asyncio.run(run_level(base_url, "SmolLM2-135M-Instruct", c, 49152))
                level.server_cpu_s = _cpu(api) - cpu0
                level.engine_cpu_s = _cpu(engines) - ecpu0
                assert level.output_tokens == level.requests * OUTPUT_LEN
                rows.append(level.row())
                print(format_table(rows[-1:]), flush=True)

        benchmark.group = "serve_load[default model, 64-token prompts, 128 tokens out]"
        benchmark.pedantic(all_levels, rounds=1, iterations=1)
    finally:
        stop_server(proc)

    async def direct() -> None:
        from enginecore import AsyncLLM, EngineArgs

        engine = AsyncLLM.from_engine_args(EngineArgs(max_model_len=1024))
        try:
            for c in LEVELS:
                level = await run_level_direct(engine, c, 49152)
                direct_rows.append(level.row())
        finally:
            engine.shutdown()

    asyncio.run(direct())
    benchmark.extra_info["startup_to_first_answer_s"] = round(startup_s, 2)
    benchmark.extra_info["server"] = rows
    benchmark.extra_info["direct"] = direct_rows
    ratio = [{"concurrency": r["concurrency"],
              "server/direct tok/s": r["output_tok_s"] / d["output_tok_s"],
              "ttft_p50 server-direct ms": r["ttft_p50_ms"] - d["ttft_p50_ms"],
              "itl_p99 server-direct ms": r["itl_p99_ms"] - d["itl_p99_ms"]}
             for r, d in zip(rows, direct_rows)]
    print(f"\nprocess start to first answer: {startup_s:.1f} s\nserver:\n{format_table(rows)}"
          f"\nAsyncLLM in process:\n{format_table(direct_rows)}\n{ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--concurrency", type=int, nargs="+", default=list(LEVELS))
    ap.add_argument("--num-requests", type=int, default=None,
                    help="per level (default: max(4, 2 x concurrency))")
    ap.add_argument("--vocab", type=int, default=49152,
                    help="prompt token ids are drawn below this (the model's vocabulary)")
    ap.add_argument("--pid", type=int, nargs="*", default=[],
                    help="server processes whose CPU time to count (optional)")
    a = ap.parse_args()
    rows = []
    for c in a.concurrency:
        cpu0 = _cpu(a.pid) if a.pid else None
        level = asyncio.run(run_level(a.url, a.model, c, a.vocab, a.api_key, a.num_requests))
        if cpu0 is not None:
            level.server_cpu_s = _cpu(a.pid) - cpu0
        rows.append(level.row())
        print(format_table(rows[-1:]), flush=True)
    print(format_table(rows))


if __name__ == "__main__":
    main()
