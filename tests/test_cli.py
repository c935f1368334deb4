"""The ``enginecore`` command: flags generated from EngineArgs, --log-level
anywhere, one-line user errors with exit 2, Ctrl-C with exit 130 and no
traceback or ERROR line (the engine processes included)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from enginecore import EngineArgs, __version__
from enginecore.config_aliases import ALIASES
from enginecore.config_cli import human_int
from enginecore.entrypoints.cli import build_parser, main

CLI = [sys.executable, "-m", "enginecore"]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def engine_args(*argv: str) -> EngineArgs:
    return EngineArgs.from_cli_args(parse("engine", "--headless", *argv))


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout)


# -- flags from the typed config ------------------------------------------------------------

def test_every_field_is_a_flag_with_its_description_and_default(capsys):
    with pytest.raises(SystemExit) as e:
        main(["engine", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    flat = "".join(text.split())  # help wraps lines (also at hyphens)
    for f in dataclasses.fields(EngineArgs):
        assert f"--{f.name.replace('_', '-')}" in text, f.name
        assert "".join(f.metadata["help"].split()) in flat, f.name
    assert "(default:16)" in flat and "(default:0.9)" in flat
    for group in ("Model:", "KV cache:", "Scheduler:", "Data parallel:", "vLLM spellings:"):
        assert group in text
    for name in ALIASES:
        assert f"--{name.replace('_', '-')}" in text


def test_no_flags_round_trip_to_the_defaults():
    assert engine_args() == EngineArgs()


def test_flags_round_trip():
    args = engine_args(
        "--model", "synthetic", "--max-num-seqs", "3", "--no-enable-prefix-caching",
        "--max-model-len", "4K", "--kv-cache-memory-bytes", "256M", "--use-native",
        "--max_num_batched_tokens=1k", "-dp", "2", "--data-parallel-size-local", "None",
        "--scheduling-policy", "priority", "--log-stats")
    assert args == EngineArgs(
        model="synthetic", max_num_seqs=3, enable_prefix_caching=False, max_model_len=4096,
        kv_cache_memory_bytes=256 << 20, use_native=True, max_num_batched_tokens=1000,
        data_parallel_size=2, scheduling_policy="priority", log_stats=True)


def test_vllm_flags_on_the_command_line():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    args = engine_args("--speculative-config", json.dumps(spec), "--disable-log-stats",
                       "-tp", "1", "--enable-sleep-mode", "--async-scheduling",
                       "--trust-remote-code", "--enforce-eager")
    assert (args.num_speculative_tokens, args.prompt_lookup_min, args.prompt_lookup_max,
            args.log_stats, args.max_concurrent_batches) == (3, 1, 3, False, 2)
    # Only the spellings that were used are passed on.
    assert not any(hasattr(parse("engine", "--headless"), name) for name in ALIASES)


def test_a_vllm_flag_wins_over_a_subcommand_default():
    """`serve` may default log_stats to on (as vLLM does); --disable-log-stats still
    turns it off, and a vLLM flag overrides our spelling on the same line."""
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices["engine"]
    sub.set_defaults(log_stats=True)
    assert EngineArgs.from_cli_args(parser.parse_args(["engine", "--headless"])).log_stats
    args = parser.parse_args(["engine", "--headless", "--disable-log-stats"])
    assert EngineArgs.from_cli_args(args).log_stats is False


def test_human_readable_sizes():
    assert [human_int(s) for s in ("2048", "1k", "1K", "25.6k", "2M", "1G")] == [
        2048, 1000, 1024, 25600, 2 << 20, 1 << 30]
    for bad in ("1.5K", "abc", "-1", "0.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            human_int(bad)


@pytest.mark.parametrize("argv", [
    ["--log-level", "debug", "synthetic"],
    ["synthetic", "--log-level", "debug"],
    ["--log-level", "error", "synthetic", "--log-level", "DEBUG"],
    ["generate", "hi", "--log-level", "debug"],
])
def test_log_level_anywhere(argv):
    assert parse(*argv).log_level == "debug"


def test_log_level_default():
    assert parse("synthetic").log_level == "warning"


# -- user errors: one line, exit 2 ----------------------------------------------------------

@pytest.mark.parametrize("argv, says", [
    (["generate", "hi", "--max-tokens", "-3"], "error: --max-tokens must be "),
    (["generate", "hi", "--temperature", "-1"],
     "--temperature must be a finite number in [0.0, inf), got -1.0"),
    (["generate", "hi", "--top-p", "0"], "--top-p must be a finite number in (0.0, 1.0], got 0.0"),
    (["generate", "hi", "--max-tokens", "x"], "argument --max-tokens: invalid int value"),
    (["generate", "hi", "--dtype", "float99"], "unsupported dtype 'float99'"),
    (["generate", "hi", "--device", "tpu"], "unsupported device 'tpu'"),
    (["--log-level", "loud", "generate", "hi"], "argument --log-level: invalid choice: 'loud'"),
    (["generate", "hi", "--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    (["generate", "hi", "--model", "/no/such/model"], "model '/no/such/model' not found"),
    (["generate", "hi", "--speculative-config", "{bad"], "--speculative-config: not valid JSON"),
    (["generate", "hi", "--speculative-config", "[1]"], "not a JSON object"),
    (["generate", "hi", "-tp", "2"], "tensor_parallel_size must be 1"),
    (["generate", "hi", "--block-size", "3"], "--block-size must be a power of two"),
    (["generate", "hi", "--model", "synthetic"], "generate needs a real model"),
    (["engine", "--headless", "--model", "synthetic"], "--data-parallel-rpc-port is needed"),
    (["synthetic", "--num-requests", "0"], "--num-requests and --prompt-len must be >= 1"),
    (["nosuch"], "invalid choice: 'nosuch'"),
    (["serve", "/no/such/model", "--port", "0"], "model '/no/such/model' not found"),
    (["serve", "--port", "99999"], "--port must be in [0, 65535]"),
    (["serve", "--dtype", "float99", "--port", "0"], "unsupported dtype 'float99'"),
    (["serve", "--api-server-count", "2", "--model", "/no/such/model", "--port", "0"],
     "model '/no/such/model' not found"),
    (["generate", "hi", "--max-mode-len", "5"], "unrecognized arguments: --max-mode-len 5"),
])
def test_user_errors_are_one_line_and_exit_2(argv, says, capsys):
    code = run_main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert says in err
    # A serve that failed in this process leaves no metrics dir behind for later servers.
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ


def run_main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's errors (usage, type, choices)
        return e.code


def test_sampling_values_are_checked_before_the_model(capsys):
    """The bad --max-tokens is reported although the model would not load either."""
    assert run_main(["generate", "hi", "--max-tokens", "0", "--model", "/no/such/model"]) == 2
    assert "--max-tokens" in capsys.readouterr().err


def test_directory_without_config_json(tmp_path):
    proc = run_cli("generate", "hi", "--model", str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "config.json" in proc.stderr and str(tmp_path) in proc.stderr


def test_version_and_python_m():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"enginecore {__version__}"
    proc = run_cli("generate", "hi", "--max-tokens", "-1")
    assert proc.returncode == 2 and proc.stderr.startswith("enginecore generate: error:")
    assert proc.stderr.count("\n") == 1


def test_synthetic_runs_and_logs_stats_with_one_flag():
    proc = run_cli("synthetic", "--num-requests", "4", "--max-tokens", "8", "--prompt-len",
                   "16", "--log-stats", "--block-size", "8")
    assert proc.returncode == 0, proc.stderr
    assert "synthetic engine run: 4 requests x 8 tokens" in proc.stdout
    assert "32 tokens" in proc.stdout
    assert "Engine 000: Avg prompt throughput" in proc.stderr


# -- Ctrl-C: exit 130, no traceback, no ERROR -------------------------------------------------

def _sigint_as_from_a_terminal() -> None:
    # A suite started in the background by a non-interactive shell inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler; a command run
    # from a terminal has the default disposition.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(argv: list[str], after: float | None = None, wait_for: str | None = None,
              script: list[str] | None = None) -> tuple[int, str]:
    """Start the command in its own process group, then SIGINT the whole group
    as a terminal's Ctrl-C does (its engine processes get it too)."""
    proc = subprocess.Popen(script or [*CLI, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_sigint_as_from_a_terminal)  # noqa: PLW1509 - intended
    try:
        if wait_for is not None:
            deadline = time.monotonic() + 120
            seen = ""
            while wait_for not in seen and time.monotonic() < deadline:
                char = proc.stdout.read(1)
                if not char:
                    break  # it ended on its own
                seen += char
            assert wait_for in seen, (seen, proc.communicate(timeout=60))
        if after:
            time.sleep(after)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, err


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_clean(code: int, err: str) -> None:
    assert code == 130, err
    assert "Traceback" not in err and "ERROR" not in err, err


@pytest.mark.slow
def test_ctrl_c_while_generating():
    code, err = interrupt(["generate", "Tell me a long story about a dragon.", "--max-tokens",
                           "2000"], wait_for=" ")
    assert_clean(code, err)


@pytest.mark.parametrize("after", [0.1, 3.0])
def test_ctrl_c_headless_engines_starting_and_waiting(after, tmp_path):
    """0.1 s after they were started the engine processes are still importing; at
    3 s they wait for the front-end's handshake. The engines ignore the terminal's
    SIGINT and this process stops them. (The key file stands for a front-end that
    has started and written this launch's CURVE keys.)"""
    from enginecore.transport import make_keys, write_rank_keys

    keys = write_rank_keys(make_keys(), str(tmp_path / "dp.keys"))
    port = free_port()
    code, err = interrupt(["--log-level", "info", "engine", "--headless", "--model",
                           "synthetic", "-dp", "2", "-dpl", "1", "-dpr", "1", "-dpp", str(port),
                           "--zmq-curve-key-file", keys], wait_for="joining", after=after)
    assert_clean(code, err)


def test_ctrl_c_headless_waiting_for_the_front_ends_keys(tmp_path):
    """Ranks started before the front-end wait for its key file; Ctrl-C then is clean."""
    port = free_port()
    code, err = interrupt(["--log-level", "info", "engine", "--headless", "--model",
                           "synthetic", "-dp", "2", "-dpl", "1", "-dpr", "1", "-dpp", str(port),
                           "--zmq-curve-key-file", str(tmp_path / "later.keys")], after=3.0)
    assert_clean(code, err)
    assert "later.keys" in err


def test_headless_without_the_front_ends_keys_is_one_line(tmp_path, capsys):
    missing = str(tmp_path / "never.keys")
    assert run_main(["engine", "--headless", "--model", "synthetic", "-dpp", "29999",
                     "--zmq-curve-key-file", missing, "--handshake-timeout", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and missing in err, err


_CLIENT_SCRIPT = """
import sys
from enginecore import EngineArgs, EngineCoreRequest, SamplingParams
from enginecore.client import make_client
if __name__ == "__main__":
    client = None
    print("starting", flush=True)
    try:
        cfg = EngineArgs(model="synthetic", synthetic_step_latency_s=0.005,
                         data_parallel_size=int(sys.argv[1])).create_engine_config()
        client = make_client(True, False, cfg)
        client.add_request(EngineCoreRequest("r", [1, 2, 3], SamplingParams(
            max_tokens=1_000_000, ignore_eos=True)))
        print("generating", flush=True)
        while True:
            client.get_output(timeout=30)
    except KeyboardInterrupt:
        if client is not None:
            client.shutdown()
        sys.exit(130)
"""


@pytest.mark.parametrize("dp, after, wait", [(1, 0.3, "starting"), (1, 0.3, "generating"),
                                             (2, 0.6, "starting"), (2, 0.3, "generating")])
def test_ctrl_c_front_end_with_engine_processes(tmp_path, dp, after, wait):
    """A front-end interrupted while its engine processes (and the DP coordinator)
    start or generate: they leave quietly, and the front-end's shutdown sees no
    engine die before it. (Timed from the script's own output: a Ctrl-C while
    Python still imports enginecore is Python's traceback, not ours.)"""
    script = tmp_path / "front_end.py"
    script.write_text(_CLIENT_SCRIPT)
    code, err = interrupt([], after=after, wait_for=wait,
                          script=[sys.executable, str(script), str(dp)])
    assert_clean(code, err)
