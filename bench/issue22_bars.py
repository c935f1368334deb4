"""Every bar of issue 22 on this machine, in one run, as one table: what a session (or
a reviewer) on a CPU kind nobody has measured yet runs first.

    .venv/bin/python bench/issue22_bars.py --vllm-python /tmp/vllm-venv/bin/python

(vLLM's CPU build in its own venv, as bench/bench_vs_vllm.py says.) Parts, in order,
each a subprocess of the benchmark that owns it; ``--only`` picks some:

    offline    bench_vs_vllm.py offline: LLM() bf16, 64 in / 128 out, batch 1 and 64
    serve      bench_vs_vllm.py serve --levels 32 under `vllm bench serve` (the reviewers'
               client, default sampling): tok/s, TTFT p50, ITL p99, CPU / token
    contention bench_contention.py --policies default: c=1 with a busy neighbour / idle
    step       bench_engine_core.py test_engine_step (native) against bench_vllm_scheduler.py
    hashing    bench_engine_core.py test_block_hash (native): fraction of openssl's rate
    twins      tests/test_default_model_twin_tokens.py: native = torch twin, token for token

Without ``--vllm-python`` the parts that need vLLM are skipped. ~15-20 minutes on 2
cores. Prints the CPU model and ISA flags first; writes the table and the raw figures
as JSON with ``--json``. A run is one sample of a shared machine: report it beside
the command and the CPU, as docs/benchmarks.md does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_vs_vllm import cpu_description  # noqa: E402 - a sibling script, not a package

ROOT = os.path.dirname(HERE)
PARTS = ("offline", "serve", "contention", "step", "hashing", "twins")
NEEDS_VLLM = {"offline", "serve", "step"}


def run(cmd: list[str], env: dict | None = None, timeout: int = 3600) -> str:
    """A benchmark's stdout; its failure (with the tail of its output) raises."""
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[1:3]} exited {proc.returncode}:\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout


def vs_vllm(vllm_python: str, what: list[str]) -> dict:
    # The parts first: --levels takes every number that follows it.
    out = run([sys.executable, os.path.join(HERE, "bench_vs_vllm.py"), *what, "--vllm-python",
               vllm_python, "--batches", "1,64", "--levels", "32"])
    line = next(x for x in out.splitlines() if x.startswith("ALL "))
    return json.loads(line[4:])


def contention() -> dict:
    out = run([sys.executable, os.path.join(HERE, "bench_contention.py"), "--tokens", "64",
               "--rounds", "2", "--policies", "default"])
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "default":
            return {"idle_tok_s": float(parts[1]), "busy_tok_s": float(parts[2]),
                    "ratio": float(parts[3])}
    raise RuntimeError(f"no summary in bench_contention's output:\n{out[-2000:]}")


def pytest_bench(select: str) -> list[dict]:
    """pytest-benchmark's records of the selected benchmarks (its JSON report)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "bench.json")
        run([sys.executable, "-m", "pytest", "bench/bench_engine_core.py", "-k", select, "-q",
             "-p", "no:cacheprovider", f"--benchmark-json={report}"])
        with open(report) as f:
            return json.load(f)["benchmarks"]


def engine_step(vllm_python: str) -> dict:
    ours = {b["params"]["num_reqs"]: b["stats"] for b in
            pytest_bench("test_engine_step and native")}
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "vllm.json")
        run([vllm_python, os.path.join(HERE, "bench_vllm_scheduler.py"), "--log-stats", "off",
             "--json", report], env={"VLLM_CPU_KVCACHE_SPACE": "4"})
        with open(report) as f:
            theirs = {r["num_reqs"]: r for r in json.load(f)["results"]}
    return {str(n): {"ours_min_us": ours[n]["min"] * 1e6, "ours_median_us": ours[n]["median"] * 1e6,
                     "vllm_min_us": theirs[n]["min_us"], "vllm_median_us": theirs[n]["median_us"]}
            for n in sorted(ours) if n in theirs}


def hashing() -> dict:
    (b,) = pytest_bench("test_block_hash and native")
    info = b.get("extra_info", {})
    return {"tokens_per_s": info.get("tokens_per_s"),
            "sha256_limit_tokens_per_s": info.get("sha256_limit_tokens_per_s"),
            "fraction": info.get("fraction_of_limit")}


def twins() -> dict:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_default_model_twin_tokens.py"], capture_output=True,
                          text=True, cwd=ROOT, timeout=3600)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    return {"passed": proc.returncode == 0, "summary": tail}


def bars(res: dict) -> list[tuple[str, str, str, bool | None]]:
    """(bar, measured, goal, met) for every figure that was measured."""
    rows: list[tuple[str, str, str, bool | None]] = []
    off = res.get("offline")
    if off:
        for b in (64, 1):
            ours, theirs = off["enginecore"][f"batch{b}_tok_s"], off["vllm"][f"batch{b}_tok_s"]
            rows.append((f"offline batch {b} tok/s", f"{ours:.1f} vs {theirs:.1f} = "
                         f"{ours / theirs:.2f}x", ">= 1.3x", ours >= 1.3 * theirs))
    srv = res.get("serve")
    if srv:
        ours, theirs = srv["enginecore"]["levels"][0], srv["vllm"]["levels"][0]
        r = ours["output_tok_s"] / theirs["output_tok_s"]
        rows.append(("serve c=32 tok/s", f"{ours['output_tok_s']:.1f} vs "
                     f"{theirs['output_tok_s']:.1f} = {r:.2f}x", ">= 1.3x", r >= 1.3))
        for key, name in (("ttft_p50_ms", "TTFT p50 ms"), ("itl_p99_ms", "ITL p99 ms"),
                          ("server_cpu_ms_per_tok", "server CPU ms/token")):
            rows.append((f"serve c=32 {name}", f"{ours[key]:.1f} vs {theirs[key]:.1f}",
                         "<= vLLM's", ours[key] <= theirs[key]))
    con = res.get("contention")
    if con:
        rows.append(("c=1 with a busy neighbour / idle", f"{con['busy_tok_s']:.1f} / "
                     f"{con['idle_tok_s']:.1f} = {con['ratio']:.2f}", ">= 0.4",
                     con["ratio"] >= 0.4))
    step = res.get("step", {}).get("256")
    if step:
        by_min = step["vllm_min_us"] / step["ours_min_us"]
        by_median = step["vllm_median_us"] / step["ours_median_us"]
        rows.append(("engine step, 256 decodes", f"{step['ours_median_us']:.1f} vs "
                     f"{step['vllm_median_us']:.1f} µs median: {by_median:.1f}x "
                     f"({by_min:.1f}x by min)", ">= 40x", by_median >= 40))
    h = res.get("hashing")
    if h and h.get("fraction") is not None:
        rows.append(("block_hashes(list, 16) / openssl SHA-256",
                     f"{h['tokens_per_s'] / 1e6:.1f} / {h['sha256_limit_tokens_per_s'] / 1e6:.1f}"
                     f" M tokens/s = {100 * h['fraction']:.0f} %", ">= 80 %",
                     h["fraction"] >= 0.8))
    tw = res.get("twins")
    if tw:
        rows.append(("native = twin tokens (default model)", tw["summary"], "all pass",
                     tw["passed"]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", help="a Python with vLLM's CPU build (its own venv)")
    ap.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--json", help="write the raw figures and the table here")
    a = ap.parse_args()
    print(f"# {cpu_description()}", flush=True)
    parts = [p for p in PARTS if p in a.only]
    if a.vllm_python is None:
        skipped = [p for p in parts if p in NEEDS_VLLM]
        if skipped:
            print(f"# no --vllm-python: skipping {', '.join(skipped)}", flush=True)
        parts = [p for p in parts if p not in NEEDS_VLLM]
    res: dict = {"cpu": cpu_description()}
    side_by_side = [p for p in ("offline", "serve") if p in parts]
    if side_by_side:
        res.update(vs_vllm(a.vllm_python, side_by_side))
    if "contention" in parts:
        res["contention"] = contention()
    if "step" in parts:
        res["step"] = engine_step(a.vllm_python)
    if "hashing" in parts:
        res["hashing"] = hashing()
    if "twins" in parts:
        res["twins"] = twins()
    table = bars(res)
    print(f"\n# {res['cpu']}")
    print("| bar | measured (enginecore vs vLLM) | goal | met |\n|---|---|---|---|")
    for name, measured, goal, met in table:
        print(f"| {name} | {measured} | {goal} | {'yes' if met else 'NO'} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**res, "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
