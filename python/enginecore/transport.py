"""Socket security and limits shared by front-ends, engines and the DP coordinator.

* Every context caps inbound messages (``ZMQ_MAXMSGSIZE``) for all its sockets.
* TCP links are authenticated and encrypted with CurveZMQ (libzmq's own, through
  pyzmq): the binding side (front-end, coordinator) is the CURVE server; the
  connecting side (engines, a front-end's link to the coordinator) uses one
  client key pair made for this launch. A ZAP handler in each binding process
  lets in only that client key, so a peer without it is refused during the
  handshake, before it can send or receive a single message.
* The keys travel out of band: inside the engine's config through the spawn pipe
  (local ranks), in the actor's arguments (Ray), or an 0600 file / the
  ``ENGINECORE_CURVE_KEYS`` environment variable (headless ranks).
* IPC links keep their private 0700 directory instead (client/sockets.py).
* ZMTP heartbeats only on TCP: a local peer that dies closes its connection at
  once, and a stalled one must not be taken for dead.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import msgspec
import zmq

from enginecore.config import EngineConfig, TransportConfig
from enginecore.paths import default_cache_dir

logger = logging.getLogger(__name__)

KEYS_ENV = "ENGINECORE_CURVE_KEYS"


class CurveKeys(msgspec.Struct, frozen=True):
    """Z85 keys of one launch. ``server_secret`` stays with the binding processes;
    ``for_ranks()`` is what connecting processes get."""

    server_public: str
    client_public: str
    client_secret: str
    server_secret: str | None = None

    def for_ranks(self) -> CurveKeys:
        return CurveKeys(self.server_public, self.client_public, self.client_secret)


def make_keys() -> CurveKeys:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return CurveKeys(server_public.decode(), client_public.decode(), client_secret.decode(),
                     server_secret.decode())


def curve_wanted(tc: TransportConfig) -> bool:
    """Whether TCP links use CURVE; an error when asked for (or defaulted) and
    libzmq was built without it: TCP is not served in the clear by default."""
    if tc.curve is False:
        logger.warning("zmq_curve=False: TCP links are NOT authenticated or encrypted; any "
                       "process that can reach the ports can send requests and read outputs")
        return False
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support, needed to secure TCP links; "
                           "install a pyzmq wheel with libsodium/curve, or set "
                           "zmq_curve=False to serve TCP without authentication")
    return True


def new_context(config: EngineConfig) -> zmq.Context:
    """A context whose sockets all refuse inbound messages over the size cap."""
    ctx = zmq.Context()
    ctx.setsockopt(zmq.MAXMSGSIZE, config.transport_config.max_message_bytes)
    return ctx


def set_heartbeats(sock: zmq.Socket, address: str, tc: TransportConfig) -> None:
    """ZMTP heartbeats on a TCP link (remote peers); none on IPC."""
    if address.startswith("tcp://"):
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(tc.heartbeat_interval_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(tc.heartbeat_timeout_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(tc.heartbeat_timeout_s * 1000))


def secure_server(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Before bind: this socket speaks CURVE as the server (TCP only; no-op without keys)."""
    if keys is None:
        return
    assert keys.server_secret is not None, "only the binding side holds the server secret"
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret.encode()
    sock.curve_publickey = keys.server_public.encode()


def secure_client(sock: zmq.Socket, address: str, keys: CurveKeys | None) -> None:
    """Before connect: CURVE client of the server in ``keys`` when ``address`` is TCP."""
    if keys is None or not address.startswith("tcp://"):
        return
    sock.curve_serverkey = keys.server_public.encode()
    sock.curve_publickey = keys.client_public.encode()
    sock.curve_secretkey = keys.client_secret.encode()


class _AllowClientKey:
    def __init__(self, client_public: str) -> None:
        self._key = client_public.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key == self._key
        if not ok:
            logger.warning("refused a CURVE peer with an unknown key")
        return ok


def start_authenticator(ctx: zmq.Context, keys: CurveKeys | None) -> Any:
    """A ZAP handler on ``ctx`` that lets in only this launch's client key (CURVE
    sockets); NULL (IPC, inproc) connections are not affected. Stop it before the
    context is destroyed."""
    if keys is None:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("enginecore.zap"))
    auth.start()
    auth.configure_curve_callback("*", _AllowClientKey(keys.client_public))
    return auth


def default_key_file(config: EngineConfig) -> str:
    port = config.parallel_config.data_parallel_rpc_port
    return os.path.join(default_cache_dir(), "curve", f"dp-{port}.keys")


def write_rank_keys(keys: CurveKeys, path: str) -> str:
    """The keys a headless rank needs, in an 0600 file (made before anything is
    written to it)."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(keys.for_ranks()))
    return path


def read_rank_keys(path: str | None, wait_s: float = 0.0) -> CurveKeys:
    """A headless rank's keys: ``ENGINECORE_CURVE_KEYS`` (the file's content) wins,
    else the 0600 file the front-end wrote (waiting up to ``wait_s`` for it to
    appear: the ranks may start before the front-end)."""
    text = os.environ.get(KEYS_ENV)
    if text is None:
        if path is None:
            raise RuntimeError(f"no CURVE keys: set {KEYS_ENV} or pass the front-end's key file")
        deadline = time.monotonic() + wait_s
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not os.path.exists(path):
            raise RuntimeError(f"no CURVE keys at {path} (the front-end writes them when it "
                               f"starts; or set {KEYS_ENV})")
        st = os.stat(path)
        if st.st_mode & 0o077:
            raise RuntimeError(f"{path} is readable by others (mode {st.st_mode & 0o777:o}); "
                               "it must be 0600")
        with open(path, "rb") as f:
            text = f.read().decode()
    keys = msgspec.json.decode(text, type=CurveKeys)
    return keys.for_ranks()


__all__ = [
    "KEYS_ENV",
    "CurveKeys",
    "curve_wanted",
    "default_key_file",
    "make_keys",
    "new_context",
    "read_rank_keys",
    "secure_client",
    "secure_server",
    "set_heartbeats",
    "start_authenticator",
    "write_rank_keys",
]
