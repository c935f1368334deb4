"""Where a front-end binds (a private IPC directory, or TCP on a given host), and
which device each local data-parallel rank may see."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

import zmq

from enginecore.config import EngineConfig


class Addresses:
    """Where the client binds; a private directory for IPC sockets."""

    def __init__(self, transport: str, host: str = "127.0.0.1") -> None:
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        self.transport = transport
        self.host = host
        self.dir = tempfile.mkdtemp(prefix="enginecore-") if transport == "ipc" else None
        if self.dir:
            os.chmod(self.dir, 0o700)

    def bind(self, sock: zmq.Socket, name: str, port: int = 0) -> str:
        if self.dir is not None:
            addr = f"ipc://{os.path.join(self.dir, name)}"
            sock.bind(addr)
            return addr
        if port:
            sock.bind(f"tcp://{self.host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{self.host}")
        return f"tcp://{self.host}:{port}"

    def reserve(self, name: str) -> str:
        """An address another process will bind: a path in the private directory,
        or a loopback port free now (TCP: a small window in which another program
        could take it; the bind in the other process then fails loudly)."""
        if self.dir is not None:
            return f"ipc://{os.path.join(self.dir, name)}"
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((self.host, 0))
            port = s.getsockname()[1]
        return f"tcp://{self.host}:{port}"

    def cleanup(self) -> None:
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def rank_devices(config: EngineConfig) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES for each local DP rank (None on CPU). Checked here,
    before any engine touches a device, with an error when the ranks do not fit."""
    dp = config.parallel_config.data_parallel_size
    if dp == 1 or not config.model_config.device.startswith("cuda"):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    if len(ids) < dp:
        raise ValueError(f"data_parallel_size={dp} needs {dp} devices, but only {len(ids)} are "
                         f"visible (CUDA_VISIBLE_DEVICES={visible!r})")
    return ids[:dp]
