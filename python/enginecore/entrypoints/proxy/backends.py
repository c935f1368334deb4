"""The proxy's two sides: a pool of OpenAI servers per side, taken in round robin.

A server that refused a connection (or broke one) is set aside for ``cooldown_s``:
the next requests try the others first, and come back to it only when no other is
left, so one dead server costs one failed connect per cooldown, not one per request.
/health asks every server's own /health (they are cheap and all run at once).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import httpx


class NoBackendError(Exception):
    """No server of a side could be reached (every one refused or broke)."""


@dataclass
class Backend:
    url: str  # http://host:port, no trailing slash
    down_until: float = 0.0
    last_error: str = ""

    def is_up(self, now: float) -> bool:
        return now >= self.down_until


@dataclass
class BackendPool:
    side: str  # "prefill" or "decode": named in errors and /health
    backends: list[Backend]
    cooldown_s: float = 2.0
    _turn: itertools.count = field(default_factory=itertools.count)

    @classmethod
    def of(cls, side: str, urls: list[str], cooldown_s: float = 2.0) -> BackendPool:
        if not urls:
            raise ValueError(f"at least one --{side} URL is needed")
        return cls(side, [Backend(normalize_url(u)) for u in urls], cooldown_s)

    def order(self) -> list[Backend]:
        """Every server once, starting at the next turn; those set aside go last."""
        n = len(self.backends)
        start = next(self._turn) % n
        turn = [self.backends[(start + i) % n] for i in range(n)]
        now = time.monotonic()
        return [b for b in turn if b.is_up(now)] + [b for b in turn if not b.is_up(now)]

    def mark_down(self, backend: Backend, why: str) -> None:
        backend.down_until = time.monotonic() + self.cooldown_s
        backend.last_error = why

    def mark_up(self, backend: Backend) -> None:
        backend.down_until = 0.0
        backend.last_error = ""

    async def health(self, client: httpx.AsyncClient, timeout_s: float) -> list[dict]:
        """Each server's /health: {"url", "healthy", "detail"}."""
        return list(await asyncio.gather(*(
            _probe(client, b, timeout_s) for b in self.backends)))


async def _probe(client: httpx.AsyncClient, backend: Backend, timeout_s: float) -> dict:
    try:
        r = await client.get(backend.url + "/health", timeout=timeout_s)
    except httpx.HTTPError as e:
        return {"url": backend.url, "healthy": False, "detail": describe(e)}
    detail = "" if r.status_code == 200 else f"/health answered {r.status_code}: " \
                                               f"{r.text[:200]}"
    return {"url": backend.url, "healthy": r.status_code == 200, "detail": detail}


def normalize_url(url: str) -> str:
    """'127.0.0.1:8100' or 'http://h:p/' or 'http://h:p/v1' -> 'http://h:p'."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    url = url.removesuffix("/v1")
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"not an http(s) server URL: {url!r}")
    return url


def describe(e: BaseException) -> str:
    """One line for an httpx failure (its class says more than its often empty text)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
