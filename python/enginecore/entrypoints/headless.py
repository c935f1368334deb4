"""``enginecore engine --headless``: run data-parallel ranks on this node that
join a front-end elsewhere (its handshake address is known up front)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing
import os
import signal

from enginecore.entrypoints.cli_common import (
    EXIT_INTERRUPTED,
    UserError,
    add_subcommand,
    user_errors,
)

logger = logging.getLogger(__name__)


def run_headless(args: argparse.Namespace) -> int:
    import msgspec

    from enginecore.config import EngineArgs
    from enginecore.core.engine_process import run_engine_core
    from enginecore.interrupts import children_ignore_sigint
    from enginecore.transport import curve_wanted, default_key_file, read_rank_keys

    with user_errors():
        config = EngineArgs.from_cli_args(args).create_engine_config()
    pc = config.parallel_config
    if not pc.data_parallel_rpc_port:
        raise UserError("--data-parallel-rpc-port is needed: the front-end's handshake port")
    tc = config.transport_config
    try:
        if curve_wanted(tc):
            # The front-end's keys of this launch, out of band: ENGINECORE_CURVE_KEYS or
            # the 0600 file it wrote (--zmq-curve-key-file, default by the RPC port).
            path = tc.curve_key_file or default_key_file(config)
            logger.info("reading the front-end's CURVE keys from %s (waiting up to %.0f s "
                        "for it to write them)", path, args.handshake_timeout)
            tc.curve_keys = read_rank_keys(path, wait_s=args.handshake_timeout)
    # no keys / no CURVE: the operator's to fix
    except (RuntimeError, ValueError, OSError, msgspec.MsgspecError) as e:
        raise UserError(" ".join(str(e).split())) from e
    address = f"tcp://{pc.data_parallel_address}:{pc.data_parallel_rpc_port}"
    ranks = range(pc.data_parallel_start_rank, pc.data_parallel_start_rank +
                  pc.data_parallel_size_local)
    ctx = multiprocessing.get_context("spawn")
    procs = []
    stopped_by: list[int] = []

    def stop(signum, frame):
        stopped_by.append(signum)
        for p in procs:
            if p.is_alive():
                p.terminate()

    # Ctrl-C reaches the engines too; they ignore it and this process stops them.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for rank in ranks:
        rank_config = dataclasses.replace(
            config, parallel_config=dataclasses.replace(pc, data_parallel_rank=rank))
        proc = ctx.Process(target=run_engine_core, name=f"EngineCore_DP{rank}", kwargs=dict(
            config=rank_config, handshake_address=address, engine_index=rank,
            handshake_timeout_s=args.handshake_timeout, parent_pid=os.getpid(),
            log_level=logging.getLogger().getEffectiveLevel()))
        with children_ignore_sigint():
            proc.start()
        procs.append(proc)
        if stopped_by:
            stop(stopped_by[0], None)
            break
    print(f"headless engines for ranks {list(ranks)} joining {address}", flush=True)
    code = 0
    for p in procs:
        p.join()
        code = code or (p.exitcode or 0)
    if signal.SIGINT in stopped_by:
        return EXIT_INTERRUPTED
    return code


def add_parser(sub: argparse._SubParsersAction) -> None:
    from enginecore.config import EngineArgs

    eng = add_subcommand(
        sub, "engine", "run engine processes (headless data-parallel ranks)",
        "Run data-parallel ranks --data-parallel-start-rank .. + --data-parallel-size-local - 1 "
        "on this node; they join the front-end whose handshake listens at "
        "--data-parallel-address:--data-parallel-rpc-port.")
    eng.add_argument("--headless", action="store_true", required=True,
                     help="no front-end here: join the one at --data-parallel-address")
    eng.add_argument("--handshake-timeout", type=float, default=120.0, metavar="S",
                     help="seconds to wait for the front-end's handshake")
    EngineArgs.add_cli_args(eng)
    eng.set_defaults(func=run_headless)
