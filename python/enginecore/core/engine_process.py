"""The engine process: its entry point (``run_engine_core``), signals, exit.

Its own module, above both EngineCoreProc and DPEngineCoreProc, so the choice
between them (``engine_core_proc_class``) needs neither to know the other.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from typing import Any

from enginecore.config import EngineConfig
from enginecore.core.dp_engine_core_proc import DPEngineCoreProc
from enginecore.core.engine_core_proc import EngineCoreProc, RankRemoved
from enginecore.core.liveness import remove_private_dir, watch_parent
from enginecore.executor.abstract import Executor
from enginecore.interrupts import ignore_sigint

logger = logging.getLogger(__name__)


def engine_core_proc_class(config: EngineConfig) -> type[EngineCoreProc]:
    """One engine per rank: a data-parallel rank joins waves and agreed calls."""
    if config.parallel_config.data_parallel_size > 1:
        return DPEngineCoreProc
    return EngineCoreProc


class _Shutdown(BaseException):
    pass


def run_engine_core(
    config: EngineConfig,
    handshake_address: str,
    executor_class: type[Executor] | None = None,
    log_stats: bool = False,
    engine_index: int = 0,
    handshake_timeout_s: float = 60.0,
    parent_pid: int | None = None,
    log_level: int = logging.WARNING,
    visible_devices: str | None = None,
    ipc_dir: str | None = None,
) -> None:
    """Entry point of the engine process. ``ipc_dir``: the front-end's private socket
    directory, removed here if the front-end dies first."""
    if visible_devices is not None:
        # Before anything imports torch's CUDA runtime: this rank sees only its device.
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s engine{engine_index} "
                        "%(name)s: %(message)s")

    def on_signal(signum: int, frame: Any) -> None:
        _stop_taking_signals()  # one shutdown: a second SIGTERM must not cut it short
        raise _Shutdown(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    if parent_pid is None:
        signal.signal(signal.SIGINT, on_signal)
    else:
        ignore_sigint()  # Ctrl-C is the front-end's; it stops us (interrupts.py)
    parent_gone = []
    if parent_pid is not None:
        # Liveness from the parent's death (a pidfd), not from a heartbeat: a
        # front-end that is only stalled (SIGSTOP, swap) is not taken for dead.
        watch_parent(parent_pid, lambda: parent_gone.append(True))
    engine: EngineCoreProc | None = None
    exit_code = 1
    try:
        try:
            engine = engine_core_proc_class(config)(config, handshake_address, executor_class,
                                                    log_stats, engine_index, handshake_timeout_s)
            engine.run_busy_loop()
            exit_code = 0
        except _Shutdown as e:
            exit_code = 0
            logger.info("engine %d shutting down on %s", engine_index, e)
        except RankRemoved:
            exit_code = 0
            logger.info("engine %d left the data-parallel group; exiting", engine_index)
        except BaseException:  # noqa: BLE001 - any death is reported, then the same exit
            _stop_taking_signals()
            logger.error("engine %d died:\n%s", engine_index, traceback.format_exc())
            if engine is not None and hasattr(engine, "_stop"):
                engine.send_engine_dead()
        finally:
            _stop_taking_signals()
            if engine is not None:
                try:
                    engine.shutdown(process_exit=True,
                                    front_end_gone=bool(parent_gone) or engine.owner_gone)
                except BaseException:
                    logger.exception("engine %d shutdown failed", engine_index)
            if ipc_dir is not None and (parent_gone or (engine is not None and engine.owner_gone)):
                remove_private_dir(ipc_dir)  # the front-end is gone: nobody else will
    finally:
        # Whatever got here (a signal during the cleanup above included) leaves through
        # _exit: an exception escaping to multiprocessing would exit through interpreter
        # finalization, which took seconds when the front-end was killed (its SIGTERM and
        # the front-end's closed socket arrive together, one inside the other's cleanup).
        _exit(exit_code)


def _stop_taking_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _exit(exit_code: int) -> None:
    """Everything is closed: leave without interpreter finalization, where library
    finalizers (torch, zmq) have been seen to stall a dying engine for seconds."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
