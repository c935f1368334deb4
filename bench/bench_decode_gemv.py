"""A decode step's projections with their weights in memory, not in cache: the
default model's four projections x 30 layers (212 MB of bf16 weights, beyond any
L3 here) run one after the other at 1-4 rows, through oneDNN's packed GEMM
(``Linear`` kind "onednn") and through ``_C.bf16_gemv`` on the plain weight
(``Linear(..., gemv=True)``), at 2 and 1 threads, side by side in one run. Prints
the CPU model first, then ms per 30 layers and the weights' GB/s.

Run: python bench/bench_decode_gemv.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import time

import torch

from enginecore import _native
from enginecore.model.linear import Linear, packing_enabled

# The default model's (SmolLM2-135M) qkv, o, gate|up, down.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def main() -> None:
    from bench_bf16_linear import setup_module as header

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--rows", default="1,2,3,4", help="rows per call, comma-separated")
    args = ap.parse_args()
    header(None)
    ext = _native.extension()
    if packing_enabled(torch.bfloat16, torch.device("cpu")) != "onednn" or ext is None \
            or not ext.bf16_gemv_available():
        print("# no oneDNN bf16 packing or no AVX512_BF16 here: nothing to compare")
        return
    torch.manual_seed(0)
    weights = [[(torch.randn(n, k) * 0.05).bfloat16() for n, k in SHAPES] for _ in range(LAYERS)]
    total = sum(w.numel() * w.element_size() for layer in weights for w in layer)
    kinds = {"onednn": [[Linear(w, pack="onednn") for w in layer] for layer in weights],
             "gemv": [[Linear(w, pack="onednn", gemv=True) for w in layer] for layer in weights]}
    print(f"# {LAYERS} layers x {SHAPES}: {total / 1e6:.0f} MB of bf16 weights")
    print("| threads | rows | oneDNN ms | GB/s | bf16_gemv ms | GB/s | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for threads in (2, 1):
        torch.set_num_threads(threads)
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in SHAPES}}
            best = {}
            for _ in range(args.rounds):  # the two kinds alternate
                for name, layers in kinds.items():
                    t0 = time.perf_counter()
                    for layer in layers:
                        for lin in layer:
                            lin(xs[lin.in_features])
                    dt = time.perf_counter() - t0
                    best[name] = min(best.get(name, dt), dt)
            a, b = best["onednn"], best["gemv"]
            print(f"| {threads} | {rows} | {a * 1e3:.2f} | {total / a / 1e9:.1f} | "
                  f"{b * 1e3:.2f} | {total / b / 1e9:.1f} | {a / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
