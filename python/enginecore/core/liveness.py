"""Local liveness from process death, not from heartbeats.

A child process (engine, DP coordinator) learns that the front-end that
started it is gone from a pidfd of the parent (readable the moment it exits;
``getppid`` polling where pidfds are missing). A stalled parent (SIGSTOP, a
frozen VM, swap, a long GC) is not gone, so nothing happens then. The child
also removes the front-end's private IPC directory in that case: whichever side
outlives the other cleans up.

(PR_SET_PDEATHSIG is not used: it fires when the *thread* that spawned the child
exits, which a front-end spawning from a worker thread would trip.)
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# The private socket directories the front-end makes (client/sockets.py).
PRIVATE_DIR_PREFIX = "enginecore-"


def wait_for_exit(pid: int, poll_s: float = 0.5) -> None:
    """Block until process ``pid`` (our parent) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (old kernel, not Linux)
        fd = None
    try:
        while os.getppid() == pid:
            if fd is None:
                time.sleep(poll_s)
            elif select.select([fd], [], [], 5.0)[0]:
                return
    finally:
        if fd is not None:
            os.close(fd)


def watch_parent(parent_pid: int, on_gone: Callable[[], None] | None = None,
                 grace_s: float = 5.0) -> threading.Thread:
    """When the parent exits: ``on_gone()``, then SIGTERM to this process (a clean
    shutdown), and a hard exit if that has not finished within ``grace_s``."""
    def watch() -> None:
        wait_for_exit(parent_pid)
        logger.warning("parent process %d is gone; shutting down", parent_pid)
        if on_gone is not None:
            on_gone()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    thread = threading.Thread(target=watch, daemon=True, name="enginecore-parent-watch")
    thread.start()
    return thread


def remove_private_dir(path: str) -> None:
    """Remove a front-end's private socket directory (only such a directory: under
    the temp dir, named by the front-end, owned by this user)."""
    real = os.path.realpath(path)
    if (os.path.dirname(real) != os.path.realpath(tempfile.gettempdir())
            or not os.path.basename(real).startswith(PRIVATE_DIR_PREFIX)):
        logger.warning("not removing %s: not a private enginecore socket directory", path)
        return
    try:
        if os.stat(real).st_uid != os.getuid():
            return
    except FileNotFoundError:
        return
    shutil.rmtree(real, ignore_errors=True)
    logger.info("removed the front-end's socket directory %s", real)


__all__ = ["remove_private_dir", "wait_for_exit", "watch_parent"]
