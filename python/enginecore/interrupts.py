"""Ctrl-C belongs to the front-end.

A terminal sends SIGINT to its whole foreground process group: the front-end and
every engine / coordinator process it started. The children ignore it; the
front-end handles it (KeyboardInterrupt -> shutdown) and stops them (SIGTERM, or
their parent watch), so an interrupted run ends with one orderly shutdown: no
child traceback, and no child exiting early, which the front-end's monitor
would have to report as a dead engine.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Start child processes inside this: they begin life with SIGINT ignored (an
    ignored disposition survives fork and exec), so a Ctrl-C during their start-up
    cannot kill them with a traceback before ``ignore_sigint`` runs in them.

    A Ctrl-C within these few milliseconds is lost for this process too (a
    blocked SIGINT would wait, but multiprocessing's spawn clears the calling
    thread's signal mask). Off the main thread dispositions cannot change;
    children are then covered from their ``ignore_sigint`` on."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def ignore_sigint() -> None:
    """In a child that a front-end started: leave the terminal's Ctrl-C to it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
