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
