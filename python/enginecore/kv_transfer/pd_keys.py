"""The CURVE keys of a P/D deployment: one key set shared by its prefill and decode engines.

The engine links' keys are made per launch and handed out inside the launch
(transport.py); a prefill and a decode server are separate launches, so they share a
key set out of band instead, as a file (0600, in a 0700 directory) or an environment
variable, in transport.CurveKeys' JSON with the server secret:

* ``kv_connector_extra_config["curve_key_file"]``, else
* ``ENGINECORE_KV_CURVE_KEYS`` (the file's content), else
* ``<cache dir>/curve/kv-transfer.keys``, made by the first engine that needs it
  (O_EXCL: two engines starting at once agree on one set) -- enough for engines of one
  user on one host; copy the file to the other hosts otherwise.

Producers are the CURVE servers and let in only the set's client key (ZAP), so a peer
without the file can neither pull blocks nor learn that a request exists.
``"curve": false`` in the extra config turns it off (plaintext, with a warning):
never the default.
"""

from __future__ import annotations

import logging
import os

import msgspec
import zmq

from enginecore.paths import default_cache_dir
from enginecore.transport import CurveKeys, make_keys

logger = logging.getLogger(__name__)

KV_KEYS_ENV = "ENGINECORE_KV_CURVE_KEYS"


def default_kv_key_file() -> str:
    return os.path.join(default_cache_dir(), "curve", "kv-transfer.keys")


def load_kv_keys(extra_config: dict) -> CurveKeys | None:
    """The deployment's keys (with the server secret); None when CURVE is turned off."""
    if extra_config.get("curve", True) is False:
        logger.warning("kv transfer: curve=false: KV blocks travel unauthenticated and in "
                       "the clear; any process that reaches the port can read them")
        return None
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support, needed to secure the KV "
                           "transfer; install a pyzmq wheel with libsodium, or set "
                           '"curve": false in kv_connector_extra_config')
    path = extra_config.get("curve_key_file")
    if path is None:
        text = os.environ.get(KV_KEYS_ENV)
        if text is not None:
            return _parse(text, KV_KEYS_ENV)
        path = default_kv_key_file()
        _create_once(path)
    return _read(path)


def _create_once(path: str) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(make_keys()))
    try:
        os.link(tmp, path)  # fails if another engine made the file first: its keys win
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def _read(path: str) -> CurveKeys:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise RuntimeError(f"kv transfer: no CURVE key file at {path}") from None
    if st.st_mode & 0o077:
        raise RuntimeError(f"kv transfer: {path} is readable by others (mode "
                           f"{st.st_mode & 0o777:o}); it must be 0600")
    with open(path, "rb") as f:
        return _parse(f.read().decode(), path)


def _parse(text: str, where: str) -> CurveKeys:
    try:
        keys = msgspec.json.decode(text, type=CurveKeys)
    except msgspec.DecodeError as e:
        raise RuntimeError(f"kv transfer: the CURVE keys in {where} are not valid: {e}"
                           ) from None
    if keys.server_secret is None:
        raise RuntimeError(f"kv transfer: the CURVE keys in {where} lack server_secret "
                           "(a P/D deployment's key set has all four keys)")
    return keys
