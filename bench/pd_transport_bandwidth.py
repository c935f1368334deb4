"""P/D block transport bandwidth on loopback against a memcpy of the same bytes.

    PYTHONPATH=python python bench/pd_transport_bandwidth.py [--curve 0|1]

Pulls 256 blocks x 4 layers (K and V; 16 tokens x 8 heads x 64 dims, float32: 64 MiB)
from a BlockServer into a BlockClient in the same process, three times, and prints the
best GB/s beside torch's copy of the same bytes (the memcpy bound)."""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time

import torch

from enginecore.kv_transfer.pd_block_client import BlockClient, PullJob
from enginecore.kv_transfer.pd_block_server import BlockServer
from enginecore.kv_transfer.pd_block_views import CacheBlockBytes
from enginecore.kv_transfer.pd_keys import load_kv_keys

LAYERS, BLOCKS, BS, HEADS, DIM = 4, 256, 16, 8, 64


def cache(fill: bool):
    shape = ((BLOCKS + 1) * BS, HEADS, DIM)
    make = torch.randn if fill else torch.zeros
    return [(make(shape), make(shape)) for _ in range(LAYERS)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--curve", type=int, default=1)
    args = ap.parse_args()
    print(subprocess.run("lscpu | grep 'Model name'", shell=True, check=False,
                         capture_output=True,
                         text=True).stdout.strip())
    os.environ["ENGINECORE_CACHE_DIR"] = tempfile.mkdtemp()  # a throwaway key set
    keys = load_kv_keys({} if args.curve else {"curve": False})
    src, dst = cache(True), cache(False)
    bp, bc = CacheBlockBytes(src, BS), CacheBlockBytes(dst, BS)
    server = BlockServer(bp, bp.layout("bench"), keys)
    client = BlockClient(bc, bc.layout("bench"), keys, "bench")
    nbytes = LAYERS * 2 * BLOCKS * bp.block_bytes
    best = float("inf")
    for i in range(3):
        server.register(f"r{i}", list(range(BLOCKS)))
        t0 = time.perf_counter()
        client.start(PullJob(f"d{i}", "127.0.0.1", server.port, f"r{i}",
                             list(range(BLOCKS)), list(range(BLOCKS))))
        while True:
            ok, failed = client.take_done()
            assert not failed
            if ok:
                break
            time.sleep(0.0005)
        best = min(best, time.perf_counter() - t0)
    n = BLOCKS * BS
    assert all(torch.equal(a[0][:n], b[0][:n]) for a, b in zip(src, dst))
    copy_best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for (k, v), (k2, v2) in zip(src, dst):
            k2.copy_(k)
            v2.copy_(v)
        copy_best = min(copy_best, time.perf_counter() - t0)
    print(f"curve={bool(args.curve)}: {nbytes / 2**20:.0f} MiB pulled in {best * 1e3:.1f} ms "
          f"= {nbytes / best / 1e9:.2f} GB/s; memcpy {nbytes / copy_best / 1e9:.2f} GB/s "
          f"(transport / memcpy = {copy_best / best:.3f})")
    client.close()
    server.close()


if __name__ == "__main__":
    main()
