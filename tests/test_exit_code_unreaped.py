"""The launcher's monitor reads a dead engine's exit code without reaping it: the
owner's own ``proc.join()`` / ``proc.exitcode`` racing a reaping monitor lost the
code (``exitcode`` None for good: a CI failure of test_executor_failure_is_engine_dead_fast)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading

import pytest

from enginecore.client.engine_launcher import exit_code_unreaped

_fork = multiprocessing.get_context("fork")


def _exit_with(code: int) -> None:
    os._exit(code)


def _killed_by(signum: int) -> None:
    os.kill(os.getpid(), signum)


@pytest.mark.parametrize(("target", "arg", "expected"), [
    (_exit_with, 0, 0), (_exit_with, 3, 3), (_killed_by, signal.SIGKILL, -signal.SIGKILL),
])
def test_reads_the_code_and_leaves_the_child_to_its_owner(target, arg, expected):
    proc = _fork.Process(target=target, args=(arg,))
    proc.start()
    multiprocessing.connection.wait([proc.sentinel])
    assert exit_code_unreaped(proc) == expected
    assert exit_code_unreaped(proc) == expected  # still there: nothing reaped it
    proc.join(5)
    assert proc.exitcode == expected


def test_a_concurrent_owner_join_keeps_the_exit_code():
    """The monitor's thread and the owner's join race on every iteration; a reaping
    monitor lost the owner's code in ~10 % of them on a 2-core machine."""
    lost = []
    for i in range(200):
        proc = _fork.Process(target=_exit_with, args=(1 + i % 5,))
        proc.start()
        seen = []

        def monitor(p=proc, seen=seen):
            multiprocessing.connection.wait([p.sentinel])
            seen.append(exit_code_unreaped(p))

        t = threading.Thread(target=monitor)
        t.start()
        proc.join(5)
        t.join(5)
        if proc.exitcode != 1 + i % 5 or seen != [1 + i % 5]:
            lost.append((i, proc.exitcode, seen))
    assert lost == []


def test_an_already_reaped_child_gives_the_owner_s_code():
    proc = _fork.Process(target=_exit_with, args=(7,))
    proc.start()
    proc.join(5)
    assert exit_code_unreaped(proc) == 7
