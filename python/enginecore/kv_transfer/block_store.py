"""BlockStore: KV-cache blocks as files under a directory, named by their chained hash.

One file per full block: ``<dir>/<hash[:2]>/<hash>.kvblock``, holding every layer's K and
V of that block. A file is a fixed magic, a 4-byte little-endian header length, a JSON
header, then the raw tensor bytes::

    b"ENGINECORE-KV\\x01" | len(header) | {"layout": "LKBHD", "dtype": ..., "block_size":
    ..., "num_layers": ..., "num_kv_heads": ..., "head_dim": ..., "model": <identity>,
    "hash_algo": ..., "payload_bytes": ...} | [num_layers, 2 (K, V), block_size,
    num_kv_heads, head_dim] in dtype

The directory holds ``enginecore_kv_store.json`` with the same identity fields: an engine
whose model, dtype, block size or layout differ is refused at start (ValueError naming
both), and every file's header is checked again before its bytes are used.

Writes are crash-safe: a temporary file in the same directory, then ``os.replace``; a
reader sees a whole file or none. ``max_bytes`` caps the directory: after a save pushes
it over, the least recently used files (mtime, refreshed on every load) go until it is
under 90% of the cap.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"ENGINECORE-KV\x01"
LAYOUT = "LKBHD"  # layers, K/V, block tokens, kv heads, head dim
STORE_FILE = "enginecore_kv_store.json"
SUFFIX = ".kvblock"
_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class StoreIdentity:
    """What must match for a stored block to be this engine's KV."""

    model: str  # model_identity(): a digest of the model's config and weight files
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hash_algo: str
    layout: str = LAYOUT

    @property
    def payload_bytes(self) -> int:
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def describe(self) -> str:
        return (f"model {self.model[:16]}, dtype {self.dtype}, block_size {self.block_size}, "
                f"{self.num_layers} layers x {self.num_kv_heads} kv heads x {self.head_dim}, "
                f"hash {self.hash_algo}, layout {self.layout}")


def model_identity(model_path: str) -> str:
    """A digest of the model's config.json and of each weight file's name, size and
    first 64 KiB: two models with the same config but other weights differ."""
    h = hashlib.sha256()
    path = Path(model_path)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir()
        if p.name == "config.json" or p.suffix in (".safetensors", ".gguf", ".bin"))
    for p in files:
        h.update(p.name.encode() + b"\0" + str(p.stat().st_size).encode() + b"\0")
        with open(p, "rb") as f:
            h.update(f.read(1 << 16))
    return h.hexdigest()


class BlockStore:
    def __init__(self, root: str, identity: StoreIdentity, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < identity.payload_bytes:
            raise ValueError(f"shared storage max size {max_bytes} bytes holds no block "
                             f"({identity.payload_bytes} bytes each)")
        self.root = Path(root)
        self.identity = identity
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._header = self._encode_header()
        self._check_or_claim()
        self._bytes_estimate: int | None = None

    # -- identity ---------------------------------------------------------------------
    def _check_or_claim(self) -> None:
        marker = self.root / STORE_FILE
        mine = asdict(self.identity)
        try:
            theirs = json.loads(marker.read_text())
        except FileNotFoundError:
            self._atomic_write(marker, json.dumps(mine, sort_keys=True).encode())
            return
        except (OSError, ValueError) as e:
            raise ValueError(f"KV store {self.root}: unreadable {STORE_FILE} ({e}); "
                             "point shared_storage_path at another directory") from None
        if theirs != mine:
            other = StoreIdentity(**theirs) if set(theirs) == set(mine) else None
            raise ValueError(
                f"KV store {self.root} holds blocks of another engine setup "
                f"({other.describe() if other else theirs}); this engine is "
                f"{self.identity.describe()}: its blocks cannot be used here. Use another "
                "shared_storage_path (or empty this one)")

    def _encode_header(self) -> bytes:
        fields = {**asdict(self.identity), "payload_bytes": self.identity.payload_bytes}
        body = json.dumps(fields, sort_keys=True).encode()
        return MAGIC + _LEN.pack(len(body)) + body

    # -- blocks -----------------------------------------------------------------------
    def path_of(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def contains(self, block_hash: bytes) -> bool:
        return self.path_of(block_hash).is_file()

    def read(self, block_hash: bytes) -> bytes:
        """The block's payload; ValueError (and the file removed) when its header is not
        this store's or it is cut short; FileNotFoundError when it is gone."""
        path = self.path_of(block_hash)
        with open(path, "rb") as f:
            data = f.read()
        header = self._header
        if not data.startswith(header) or len(data) != len(header) + self.identity.payload_bytes:
            if not data.startswith(MAGIC):
                why = "not a KV block file"
            elif not data.startswith(header):
                why = "its header (model, dtype, block size, layout) is not this store's"
            else:
                why = "cut short"
            self._discard(path)
            raise ValueError(f"KV block file {path} refused: {why}")
        try:
            os.utime(path)  # recency for LRU eviction
        except OSError:
            pass
        return data[len(header):]

    def write(self, block_hash: bytes, payload: bytes | memoryview) -> None:
        if len(payload) != self.identity.payload_bytes:
            raise ValueError(f"block payload is {len(payload)} bytes, expected "
                             f"{self.identity.payload_bytes}")
        path = self.path_of(block_hash)
        if path.exists():
            return
        path.parent.mkdir(exist_ok=True)
        self._atomic_write(path, self._header, payload)
        if self.max_bytes is not None:
            if self._bytes_estimate is None:
                self._bytes_estimate = self._scan_bytes()
            else:
                self._bytes_estimate += len(self._header) + len(payload)
            if self._bytes_estimate > self.max_bytes:
                self.evict()

    def _atomic_write(self, path: Path, *parts: bytes | memoryview) -> None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _discard(self, path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass

    # -- size cap ---------------------------------------------------------------------
    def _files(self) -> list[os.DirEntry]:
        out = []
        for sub in os.scandir(self.root):
            if sub.is_dir():
                out.extend(e for e in os.scandir(sub.path) if e.name.endswith(SUFFIX)
                           and not e.name.startswith(".tmp-"))
        return out

    def _scan_bytes(self) -> int:
        total = 0
        for e in self._files():
            try:
                total += e.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def evict(self) -> int:
        """Remove least recently used files until the store is under 90% of its cap."""
        assert self.max_bytes is not None
        entries = []
        for e in self._files():
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime_ns, st.st_size, e.path))
        total = sum(size for _, size, _ in entries)
        target = int(self.max_bytes * 0.9)
        removed = 0
        for _, size, path in sorted(entries):
            if total <= target:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            total -= size
            removed += 1
        self._bytes_estimate = total
        if removed:
            logger.info("KV store %s: evicted %d least recently used blocks (cap %d bytes)",
                        self.root, removed, self.max_bytes)
        return removed
