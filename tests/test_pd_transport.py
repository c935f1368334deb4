"""The P/D block transport (kv_transfer/pd_block_*.py) on loopback: blocks arrive byte
for byte into other block ids (chunked, windowed, runs split and merged), only
registered blocks are served, CURVE keeps out a peer without the deployment's key and a
plaintext one, another KV layout is refused, a producer killed mid-transfer fails the
transfer after the timeout (never a hang), and an unpulled lease is freed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
import torch

from enginecore.kv_transfer.pd_block_client import BlockClient, PullJob
from enginecore.kv_transfer.pd_block_server import BlockServer
from enginecore.kv_transfer.pd_block_views import CacheBlockBytes
from enginecore.kv_transfer.pd_keys import load_kv_keys
from enginecore.transport import make_keys

LAYERS, BLOCK, HEADS, DIM, BLOCKS = 3, 4, 2, 8, 24


def cache(seed: int | None, dtype=torch.float32, heads: int = HEADS):
    """Per layer (K, V) [slots, heads, dim]; random (seed) or zeros (None)."""
    g = torch.Generator().manual_seed(seed or 0)
    shape = ((BLOCKS + 1) * BLOCK, heads, DIM)
    make = (lambda: torch.randn(shape, generator=g).to(dtype)) if seed is not None else \
        (lambda: torch.zeros(shape, dtype=dtype))
    return [(make(), make()) for _ in range(LAYERS)]


def block(t: torch.Tensor, b: int) -> torch.Tensor:
    return t[b * BLOCK:(b + 1) * BLOCK]


def key_file(tmp_path, name: str = "kv.keys") -> str:
    path = str(tmp_path / name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(make_keys()))
    return path


def wait_done(client: BlockClient, timeout_s: float = 30.0):
    ok, failed = set(), {}
    deadline = time.monotonic() + timeout_s
    while not ok and not failed:
        assert time.monotonic() < deadline, "the transfer neither finished nor failed"
        time.sleep(0.01)
        ok, failed = client.take_done()
    return ok, failed


def pair(keys_p, keys_c, kv_p, kv_c, timeout_s=30.0, layout_c=None, **kw):
    bp, bc = CacheBlockBytes(kv_p, BLOCK), CacheBlockBytes(kv_c, BLOCK)
    server = BlockServer(bp, bp.layout("tiny"), keys_p, register_grace_s=0.5)
    client = BlockClient(bc, layout_c or bc.layout("tiny"), keys_c, "decode-0",
                         timeout_s=timeout_s, **kw)
    return server, client


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_arrive_byte_for_byte(tmp_path, dtype):
    keys = load_kv_keys({"curve_key_file": key_file(tmp_path)})
    kv_p, kv_c = cache(1, dtype), cache(None, dtype)
    server, client = pair(keys, keys, kv_p, kv_c, chunk_blocks=2, window=2)
    try:
        remote = [3, 4, 5, 9, 1, 2, 17]
        local = [0, 1, 7, 8, 2, 20, 21]
        server.register("p-req", remote + [11])
        client.start(PullJob("d-req", "127.0.0.1", server.port, "p-req", remote, local))
        ok, failed = wait_done(client)
        assert ok == {"d-req"} and not failed
        for (kp, vp), (kc, vc) in zip(kv_p, kv_c):
            for r, loc in zip(remote, local):
                assert torch.equal(block(kc, loc), block(kp, r))
                assert torch.equal(block(vc, loc), block(vp, r))
            untouched = set(range(BLOCKS + 1)) - set(local)
            assert all(not block(kc, b).any() and not block(vc, b).any() for b in untouched)
        deadline = time.monotonic() + 10
        finished = set()
        while not finished and time.monotonic() < deadline:
            finished = server.take_finished()
            time.sleep(0.01)
        assert finished == {"p-req"} and server.num_leases() == 0  # released by DONE
        assert server.stats["chunks_sent"] == 4  # 7 blocks in chunks of 2
    finally:
        client.close()
        server.close()


def test_only_registered_blocks_are_served(tmp_path):
    keys = load_kv_keys({"curve_key_file": key_file(tmp_path)})
    kv_c = cache(None)
    server, client = pair(keys, keys, cache(1), kv_c)
    try:
        server.register("p-req", [1, 2])
        client.start(PullJob("a", "127.0.0.1", server.port, "p-req", [1, 2, 3], [4, 5, 6]))
        assert wait_done(client) == (set(), {"a": [4, 5, 6]})
        client.start(PullJob("b", "127.0.0.1", server.port, "nobody", [1], [4]))
        assert wait_done(client) == (set(), {"b": [4]})
        assert all(not k.any() and not v.any() for k, v in kv_c)
    finally:
        client.close()
        server.close()


def test_a_pull_may_overtake_its_registration(tmp_path):
    keys = load_kv_keys({"curve_key_file": key_file(tmp_path)})
    kv_p, kv_c = cache(1), cache(None)
    server, client = pair(keys, keys, kv_p, kv_c)
    try:
        client.start(PullJob("d", "127.0.0.1", server.port, "p-req", [2, 3], [5, 6]))
        time.sleep(0.2)  # the pull waits at the producer, within its grace
        server.register("p-req", [2, 3])
        assert wait_done(client) == ({"d"}, {})
        assert torch.equal(block(kv_c[0][0], 5), block(kv_p[0][0], 2))
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("who", ["other key set", "plaintext"])
def test_curve_keeps_out_a_peer_without_the_key(tmp_path, who):
    keys = load_kv_keys({"curve_key_file": key_file(tmp_path)})
    other = None if who == "plaintext" else \
        load_kv_keys({"curve_key_file": key_file(tmp_path, "other.keys")})
    kv_c = cache(None)
    server, client = pair(keys, other, cache(1), kv_c, timeout_s=1.0)
    try:
        server.register("p-req", [1, 2])
        client.start(PullJob("d", "127.0.0.1", server.port, "p-req", [1, 2], [3, 4]))
        assert wait_done(client) == (set(), {"d": [3, 4]})
        assert server.stats["chunks_sent"] == 0
        assert all(not k.any() for k, _ in kv_c)
    finally:
        client.close()
        server.close()


def test_another_layout_is_refused(tmp_path):
    keys = load_kv_keys({"curve_key_file": key_file(tmp_path)})
    kv_c = cache(None)
    bc = CacheBlockBytes(kv_c, BLOCK)
    server, client = pair(keys, keys, cache(1), kv_c, layout_c=bc.layout("another-model"))
    try:
        server.register("p-req", [1])
        t0 = time.monotonic()
        client.start(PullJob("d", "127.0.0.1", server.port, "p-req", [1], [3]))
        assert wait_done(client) == (set(), {"d": [3]})
        assert time.monotonic() - t0 < 10  # refused at once, not timed out
        assert server.stats["chunks_sent"] == 0
    finally:
        client.close()
        server.close()


def test_unpulled_lease_is_freed(tmp_path):
    keys = load_kv_keys({"curve_key_file": key_file(tmp_path)})
    bp = CacheBlockBytes(cache(1), BLOCK)
    server = BlockServer(bp, bp.layout("tiny"), keys, lease_s=0.2)
    try:
        server.register("p-req", [1, 2])
        deadline = time.monotonic() + 10
        finished = set()
        while not finished and time.monotonic() < deadline:
            finished = server.take_finished()
            time.sleep(0.02)
        assert finished == {"p-req"} and server.stats["expired"] == 1
    finally:
        server.close()


PRODUCER = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    from test_pd_transport import cache, BLOCK
    from enginecore.kv_transfer.pd_block_server import BlockServer
    from enginecore.kv_transfer.pd_block_views import CacheBlockBytes
    from enginecore.kv_transfer.pd_keys import load_kv_keys
    b = CacheBlockBytes(cache(1), BLOCK)
    s = BlockServer(b, b.layout("tiny"), load_kv_keys({{"curve_key_file": {keys!r}}}))
    s.register("p-req", list(range(20)))
    print(s.port, flush=True)
    time.sleep(600)
""")


def test_producer_killed_mid_transfer_fails_the_pull(tmp_path):
    path = key_file(tmp_path)
    code = PRODUCER.format(tests=os.path.dirname(__file__), keys=path)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    client = None
    try:
        port = int(proc.stdout.readline())
        kv_c = cache(None)
        bc = CacheBlockBytes(kv_c, BLOCK)
        client = BlockClient(bc, bc.layout("tiny"), load_kv_keys({"curve_key_file": path}),
                             "decode-0", timeout_s=1.5, chunk_blocks=1, window=1)
        # First a transfer that works: the link and the keys are right.
        client.start(PullJob("warm", "127.0.0.1", port, "p-req", [0], [0]))
        assert wait_done(client) == ({"warm"}, {})
        # Then the producer stops mid-transfer (its pull outstanding) and is killed.
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        client.start(PullJob("d", "127.0.0.1", port, "p-req", list(range(1, 20)),
                             list(range(1, 20))))
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        assert wait_done(client) == (set(), {"d": list(range(1, 20))})
        assert 1.4 < time.monotonic() - t0 < 15
        # A later transfer to the dead address fails the same way, it does not hang.
        client.start(PullJob("e", "127.0.0.1", port, "p-req", [2], [2]))
        assert wait_done(client) == (set(), {"e": [2]})
    finally:
        if client is not None:
            client.close()
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_key_file_is_made_once_and_must_be_private(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINECORE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ENGINECORE_KV_CURVE_KEYS", raising=False)
    a, b = load_kv_keys({}), load_kv_keys({})
    assert a == b and a.server_secret is not None
    path = tmp_path / "curve" / "kv-transfer.keys"
    assert (path.stat().st_mode & 0o777) == 0o600
    monkeypatch.setenv("ENGINECORE_KV_CURVE_KEYS", json.dumps(msgspec.to_builtins(a)))
    assert load_kv_keys({}) == a
    os.chmod(path, 0o644)
    with pytest.raises(RuntimeError, match="readable by others"):
        load_kv_keys({"curve_key_file": str(path)})
    assert load_kv_keys({"curve": False}) is None
