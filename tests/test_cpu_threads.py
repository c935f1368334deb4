"""The engine's CPU thread policy: the wait policy set before torch loads
OpenMP (omp_env.py), the thread plan from vLLM's knobs (executor/cpu_threads.py),
and binding torch's team to cores (native and twin)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from enginecore import omp_env
from enginecore.executor.cpu_threads import parse_cpu_list, plan_threads


def test_wait_policy_is_set_unless_the_user_chose_one():
    env: dict[str, str] = {}
    added = omp_env.apply_default_wait_policy(env)
    assert env["GOMP_SPINCOUNT"] == str(omp_env.DEFAULT_GOMP_SPINCOUNT) == added["GOMP_SPINCOUNT"]
    assert env["KMP_BLOCKTIME"] == "1"
    mine = {"OMP_WAIT_POLICY": "ACTIVE"}
    omp_env.apply_default_wait_policy(mine)
    assert "GOMP_SPINCOUNT" not in mine and mine["OMP_WAIT_POLICY"] == "ACTIVE"
    off = {"ENGINECORE_CPU_THREAD_POLICY": "off"}
    assert omp_env.apply_default_wait_policy(off) == {} and "GOMP_SPINCOUNT" not in off


def test_importing_enginecore_sets_it_for_torch_and_children():
    env = {k: v for k, v in os.environ.items() if k not in omp_env.USER_WAIT_VARS}
    code = ("import os, sys, enginecore, torch; from enginecore import omp_env; "
            "print(os.environ['GOMP_SPINCOUNT'], omp_env.policy_effective())")
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    assert out == [str(omp_env.DEFAULT_GOMP_SPINCOUNT), "True"]


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8, 10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("2,2,1") == [2, 1]
    for bad in ("", "a", "3-1", "-1"):
        with pytest.raises(ValueError, match="bad CPU list"):
            parse_cpu_list(bad)


def test_small_machine_binds_and_reserves_nothing():
    plan = plan_threads(None, None, allowed=[0, 1], environ={})
    assert plan.num_threads == 2 and plan.cpus is None
    assert plan_threads(1, "auto", allowed=[0, 1], environ={}).num_threads == 1


def test_auto_leaves_one_core_to_the_front_end_and_splits_ranks():
    cpus = list(range(8))
    plan = plan_threads(None, None, allowed=cpus, environ={})
    assert plan.num_threads == len(plan.cpus) and set(plan.cpus) <= set(cpus)
    assert len(plan.cpus) == len(set(plan.cpus)) and cpus[-1] not in plan.cpus
    r0 = plan_threads(None, "auto", 0, 2, allowed=cpus, environ={})
    r1 = plan_threads(None, "auto", 1, 2, allowed=cpus, environ={})
    assert not set(r0.cpus or ()) & set(r1.cpus or ())
    capped = plan_threads(2, None, allowed=cpus, environ={})
    assert capped.num_threads == 2 and len(capped.cpus) == 2
    none_reserved = plan_threads(None, None, allowed=cpus,
                                 environ={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    assert len(none_reserved.cpus) == len(plan.cpus) + 1 or plan.cpus is None


def test_vllm_bind_spelling():
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}
    assert plan_threads(None, None, 1, 2, allowed=[0, 1, 2, 3], environ=env).cpus == (2, 3)
    assert plan_threads(None, "1", allowed=[0, 1], environ=env).cpus == (1,)  # the flag wins
    nobind = plan_threads(None, "nobind", allowed=[0, 1, 2, 3], environ={})
    assert nobind.cpus is None
    with pytest.raises(ValueError, match="rank 2"):
        plan_threads(None, None, 2, 3, allowed=[0, 1, 2, 3], environ=env)
    with pytest.raises(ValueError, match="affinity mask"):
        plan_threads(None, "0,99", allowed=[0, 1], environ={})
    with pytest.raises(ValueError, match="cpu_threads"):
        plan_threads(0, None, allowed=[0, 1], environ={})


BIND = r"""
import os, sys, torch
from enginecore import _native
from enginecore.executor.cpu_threads import bind_openmp_threads_py
torch.set_num_threads(2)
torch.ones(1 << 20).sum()  # the team exists
cpus = [0, 1] if len(os.sched_getaffinity(0)) > 1 else [0, 0]
if sys.argv[1] == "native":
    tids = _native._ext.bind_openmp_threads(cpus)
    assert len(set(tids)) == 2 and -1 not in tids, tids
    for tid, cpu in zip(tids, cpus):
        assert os.sched_getaffinity(tid) == {cpu}, (tid, cpu)
    assert tids[0] == __import__("threading").get_native_id()  # thread 0: the caller
else:
    tids = bind_openmp_threads_py(cpus)
    assert all(os.sched_getaffinity(t) == set(cpus) for t in tids)
print("ok")
"""


def test_binding_pins_each_team_thread(hot_path):
    out = subprocess.run([sys.executable, "-c", BIND, hot_path], check=True,
                         capture_output=True, text=True)
    assert out.stdout.strip() == "ok"


def test_vllm_cpu_kvcache_space_sizes_the_cache(tmp_path, monkeypatch):
    from enginecore import EngineArgs, EngineCore
    from tiny_models import make_tiny_model

    model = make_tiny_model(str(tmp_path / "m"), "llama", seed=1)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.001")  # ~1 MiB
    eng = EngineCore(EngineArgs(model=model, dtype="float32", block_size=4,
                                max_model_len=64).create_engine_config())
    spec = eng.model_executor.get_kv_cache_specs()
    blocks = eng.config.cache_config.num_gpu_blocks
    eng.shutdown()
    assert blocks == int(0.001 * 2**30) // spec.page_size_bytes
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
        EngineCore(EngineArgs(model=model, dtype="float32", block_size=4,
                              max_model_len=64).create_engine_config())


class FakeSchedstat:
    """A clock and a runqueue-wait counter the test advances step by step."""

    def __init__(self) -> None:
        self.now = 100.0
        self.waited_ns = 0

    def step(self, seconds: float, starved_share: float) -> None:
        self.now += seconds
        self.waited_ns += int(seconds * starved_share * 1e9)


@pytest.fixture
def governor(monkeypatch):
    from enginecore.executor import cpu_threads

    calls: list[int] = []
    monkeypatch.setattr(cpu_threads.torch, "set_num_threads", calls.append)
    fake = FakeSchedstat()
    gov = cpu_threads.StarvationGovernor(2, wait_ns=lambda: fake.waited_ns,
                                         clock=lambda: fake.now)
    return gov, fake, calls


def run_steps(gov, fake, n: int, share: float, seconds: float = 0.02) -> None:
    for _ in range(n):
        gov.before_step()
        fake.step(seconds, share)


def test_an_idle_team_is_left_alone(governor):
    gov, fake, calls = governor
    run_steps(gov, fake, 500, 0.01)
    # Our own API server beside the engine: some steps over the threshold, not in a row.
    for _ in range(100):
        run_steps(gov, fake, gov.STRIKES - 1, 0.5)
        run_steps(gov, fake, 1, 0.15)
    assert not gov.serial and gov.spells == 0 and calls == []


def test_a_starved_team_runs_torch_on_one_thread_then_is_tried_again(governor):
    gov, fake, calls = governor
    run_steps(gov, fake, 1, 0.0)
    run_steps(gov, fake, gov.STRIKES - 1, 0.5)  # a few bad steps are not a spell
    assert not gov.serial and calls == []
    run_steps(gov, fake, 2, 0.5)
    assert gov.serial and calls == [1] and gov.spells == 1
    # The spell lasts FIRST_SPELL_S, then torch gets its team back.
    run_steps(gov, fake, int(gov.FIRST_SPELL_S / 0.02) + 1, 0.0)
    assert not gov.serial and calls == [1, 2]
    run_steps(gov, fake, 50, 0.01)
    assert gov.spells == 1 and calls == [1, 2]


def test_a_neighbour_that_stays_makes_spells_longer_up_to_a_cap(governor):
    gov, fake, calls = governor
    lengths = []
    for _ in range(8):
        run_steps(gov, fake, 1, 0.5)
        while not gov.serial:
            run_steps(gov, fake, 1, 0.5)
        start = fake.now
        while gov.serial:
            run_steps(gov, fake, 1, 0.0)
        lengths.append(round(fake.now - start, 1))
    assert lengths[0] < lengths[1] < lengths[2]
    assert max(lengths) <= gov.MAX_SPELL_S + 0.1 and lengths[-1] == lengths[-2]
    assert calls == [1, 2] * 8
    # Once the team holds for a while, the next spell is short again.
    run_steps(gov, fake, 10, 0.0)
    run_steps(gov, fake, gov.STRIKES + 1, 0.5)
    assert gov.serial and gov._spell_s == gov.FIRST_SPELL_S


@pytest.mark.parametrize("step_s", [0.02, 0.4, 1.5])
def test_spells_grow_however_long_a_step_takes(governor, step_s):
    """A neighbour that stays: the team spends little time starved, slow steps too."""
    gov, fake, _ = governor
    starved_s = serial_s = 0.0
    for _ in range(4000):
        serial = gov.serial
        run_steps(gov, fake, 1, 0.0 if serial else 0.5, step_s)
        if serial:
            serial_s += step_s
        else:
            starved_s += step_s
        if fake.now > 100.0 + 600 * step_s / 0.02 and gov._spell_s == gov.MAX_SPELL_S:
            break
    assert gov._spell_s == gov.MAX_SPELL_S
    assert starved_s < serial_s


def test_close_gives_torch_its_team_back(governor):
    gov, fake, calls = governor
    run_steps(gov, fake, gov.STRIKES + 2, 0.5)
    assert gov.serial and calls == [1]
    gov.close()
    assert calls == [1, 2] and not gov.serial
    run_steps(gov, fake, 20, 0.5)  # closed: nothing is read or set again
    assert calls == [1, 2]


def test_one_thread_has_nothing_to_govern(monkeypatch):
    from enginecore.executor import cpu_threads

    monkeypatch.setattr(cpu_threads.torch, "set_num_threads", pytest.fail)
    gov = cpu_threads.StarvationGovernor(1)
    gov.before_step()
    assert not gov.serial


GOVERN = r"""
import os, sys, threading, torch
from enginecore import _native
from enginecore.executor.cpu_threads import StarvationGovernor, read_runqueue_wait_ns
_native.set_native(sys.argv[1] == "native")
torch.set_num_threads(2)
torch.ones(1 << 20).sum()  # the team exists
if _native.extension() is not None:
    tids = _native.extension().team_thread_ids(2)
    assert len(set(tids)) == 2 and tids[0] == threading.get_native_id(), tids
gov = StarvationGovernor(2)
for _ in range(3):
    gov.before_step()
assert gov._fds and not gov.serial
assert read_runqueue_wait_ns(gov._fds) >= 0
gov.close()
print("ok")
"""


def test_the_governor_reads_the_teams_schedstat(hot_path):
    """The real source: the team's thread ids (native) or every thread (twin), each
    read through /proc/self/task/TID/schedstat."""
    if not os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat"):
        pytest.skip("no schedstat in /proc (kernel without CONFIG_SCHED_INFO)")
    out = subprocess.run([sys.executable, "-c", GOVERN, hot_path], check=True,
                         capture_output=True, text=True)
    assert out.stdout.strip() == "ok"
