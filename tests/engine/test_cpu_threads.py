"""The engine's intra-op threads: sized from the affinity mask and the cgroup's CPU quota
(read from real cgroup files laid out in tmp_path), bound per --cpu-threads-bind, and
really so in a started engine and a started server (read back from /proc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import ConfigError, EngineConfig
from engine.cpu_threads import (
    WAIT_VARIABLES,
    cgroup_cpu_quota,
    default_wait_policy,
    one_cpu_per_core,
    online_cpus,
    parse_cpu_list,
    plan_threads,
    wait_summary,
)
from tests.server.server_helpers import EAGER_OPS, ServerProcess, server_flags

CPUS = sorted(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="binding two threads needs two CPUs")


# ---- the cgroup's quota -----------------------------------------------------------------------


def _v2(root: Path, cgroup: str, cpu_max: dict[str, str]) -> Path:
    """A cgroup v2 tree under `root` with `cpu.max` in the cgroups named (path under root ->
    content), and a /proc/self/cgroup putting the process in `cgroup`."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for path, content in cpu_max.items():
        (root / path).mkdir(parents=True, exist_ok=True)
        (root / path / "cpu.max").write_text(content + "\n")
    proc = root.parent / "proc_self_cgroup"
    proc.write_text(f"0::{cgroup}\n")
    return proc


@pytest.mark.parametrize(("content", "quota"), [("max 100000", None), ("150000 100000", 1.5),
                                                 ("50000 100000", 0.5), ("400000 200000", 2.0)])
def test_cgroup_v2_cpu_max(tmp_path, content, quota):
    root = tmp_path / "cgroup"
    proc = _v2(root, "/kubepods/pod1", {"kubepods/pod1": content})
    assert cgroup_cpu_quota(root, proc) == quota


def test_cgroup_v2_takes_the_tightest_ancestor(tmp_path):
    root = tmp_path / "cgroup"
    proc = _v2(root, "/a/b", {"a": "100000 100000", "a/b": "300000 100000"})
    assert cgroup_cpu_quota(root, proc) == 1.0


def test_cgroup_v2_inside_a_container_reads_the_mounts_root(tmp_path):
    # a container sees its own cgroup mounted as the root, and its path as "/" or a path
    # outside its namespace
    root = tmp_path / "cgroup"
    for cgroup in ("/", "/../../system.slice/docker-1.scope", "/system.slice/docker-1.scope"):
        assert cgroup_cpu_quota(root, _v2(root, cgroup, {".": "150000 100000"})) == 1.5


def _v1(root: Path, quota: str, period: str = "100000", controllers: str = "cpu,cpuacct") -> Path:
    directory = root / controllers / "docker" / "abc"
    directory.mkdir(parents=True)
    (directory / "cpu.cfs_quota_us").write_text(quota + "\n")
    (directory / "cpu.cfs_period_us").write_text(period + "\n")
    proc = root.parent / "proc_self_cgroup"
    proc.write_text(f"4:memory:/docker/abc\n3:{controllers}:/docker/abc\n0::/\n")
    return proc


@pytest.mark.parametrize(("quota", "period", "expected"), [("-1", "100000", None), ("150000", "100000", 1.5),
                                                           ("25000", "50000", 0.5)])
def test_cgroup_v1_cfs_quota(tmp_path, quota, period, expected):
    root = tmp_path / "cgroup"
    proc = _v1(root, quota, period)
    assert cgroup_cpu_quota(root, proc) == expected


def test_cgroup_v1_with_the_cpu_controller_mounted_alone(tmp_path):
    root = tmp_path / "cgroup"
    assert cgroup_cpu_quota(root, _v1(root, "200000", controllers="cpu")) == 2.0


def test_no_cgroup_files_means_no_quota(tmp_path):
    assert cgroup_cpu_quota(tmp_path / "absent", tmp_path / "absent_proc") is None
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("0::/x\n")
    assert cgroup_cpu_quota(tmp_path / "empty", proc) is None


# ---- the plan ---------------------------------------------------------------------------------


MACHINE = set(range(8))


def test_a_quota_of_one_and_a_half_cpus_on_64_cores_runs_one_unbound_thread():
    plan = plan_threads("auto", set(range(64)), 1.5, set(range(64)))
    assert (plan.num_threads, plan.cpus) == (1, None)
    assert "quota of 1.5" in plan.why


def test_auto_binds_one_thread_per_core_of_whole_cpus_the_process_was_given():
    assert plan_threads("auto", {0, 1}, None, MACHINE).cpus == (0, 1)
    assert plan_threads("auto", {2, 3, 5}, 8.0, MACHINE).cpus == (2, 3, 5)  # a quota above the mask: whole CPUs
    assert plan_threads("auto", {2, 3, 5}, 2.5, MACHINE).cpus is None  # fractions of them
    assert plan_threads("none", {0, 1}, None, MACHINE).cpus is None
    assert plan_threads("none", {0, 1}, None, MACHINE).num_threads == 2


def test_auto_leaves_threads_unbound_on_the_whole_machine():
    """Other processes share every core there: a bound thread would wait for its own."""
    plan = plan_threads("auto", MACHINE, None, MACHINE)
    assert (plan.num_threads, plan.cpus) == (8, None)


def test_a_cpu_list_is_one_bound_thread_per_cpu():
    plan = plan_threads("1,3-4", MACHINE, 1.0, MACHINE)
    assert (plan.num_threads, plan.cpus) == (3, (1, 3, 4))


def test_the_online_cpus_come_from_sysfs(tmp_path):
    (tmp_path / "online").write_text("0-3,6\n")
    assert online_cpus(tmp_path) == {0, 1, 2, 3, 6}
    assert online_cpus(tmp_path / "missing") == set(range(os.cpu_count() or 1))


def test_smt_siblings_count_as_one_core(tmp_path):
    for cpu, siblings in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}.items():
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(siblings + "\n")
    assert one_cpu_per_core([0, 1, 2, 3], tmp_path) == [0, 1]


# ---- the flag ---------------------------------------------------------------------------------


def test_cpu_list_syntax():
    assert parse_cpu_list("0-2,5,1") == (0, 1, 2, 5)
    with pytest.raises(ValueError, match="not a range"):
        parse_cpu_list("3-1")


@pytest.mark.parametrize(("value", "message"), [
    ("x", "--cpu-threads-bind: 'x' is not auto, none or a CPU list"),
    ("0,,1", "bad part ''"),
    ("2-1", "'2-1' is not a range of CPU ids"),
    (str(CPUS[-1] + 1), f"--cpu-threads-bind: CPU {CPUS[-1] + 1} is not one this process may run on"),
])
def test_bad_values_are_refused_naming_the_flag(value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        EngineConfig(model="builtin:tiny", cpu_threads_bind=value)


def test_the_cli_refuses_a_bad_value_with_the_flag_and_no_traceback():
    done = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--cpu-threads-bind", "0-"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--cpu-threads-bind: '0-' is not auto, none or a CPU list" in done.stderr
    assert "Traceback" not in done.stderr


# ---- a started engine -------------------------------------------------------------------------

# Builds an engine in a fresh process (binding is per process) and reports its threads.
_ENGINE_CHILD = """
import json, os, sys, threading, torch
from engine import LLM, SamplingParams
torch.set_num_threads(1)  # the caller's own choice, which an LLM without the option keeps
bind = {"cpu_threads_bind": sys.argv[2]} if sys.argv[2] != "-" else {}
llm = LLM(model=sys.argv[1], num_kv_blocks=32, fuse_elementwise=False, **bind)
llm.generate(["hello"], SamplingParams(max_tokens=2))
me = threading.get_native_id()
others = [tid for tid in map(int, os.listdir("/proc/self/task")) if tid != me]
print(json.dumps({"threads": torch.get_num_threads(), "main": sorted(os.sched_getaffinity(0)),
                  "others": [sorted(os.sched_getaffinity(tid)) for tid in others]}))
"""


def _engine_threads(model: str, bind: str, cpus: set[int] | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", _ENGINE_CHILD, model, bind], capture_output=True, text=True,
                          timeout=300, preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_two_cpus
def test_a_bound_engine_pins_its_openmp_team_one_thread_per_cpu(tiny_model_factory):
    seen = _engine_threads(tiny_model_factory(), f"{CPUS[0]},{CPUS[1]}")
    assert seen["threads"] == 2  # the option overrides the caller's torch.set_num_threads
    assert seen["main"] == [CPUS[0]]  # the thread that built the engine is the team's thread 0
    assert [CPUS[1]] in seen["others"]


@needs_two_cpus
def test_an_unbound_engine_runs_as_many_threads_as_cores_on_every_cpu(tiny_model_factory):
    seen = _engine_threads(tiny_model_factory(), "none")
    assert seen["threads"] == len(one_cpu_per_core(CPUS))
    assert seen["main"] == CPUS and all(cpus == CPUS for cpus in seen["others"])


def test_an_llm_not_given_the_option_keeps_its_callers_threads(tiny_model_factory):
    seen = _engine_threads(tiny_model_factory(), "-")
    assert seen["threads"] == 1
    assert seen["main"] == CPUS


def test_auto_sizes_the_pool_from_the_affinity_mask(tiny_model_factory):
    seen = _engine_threads(tiny_model_factory(), "auto", cpus={CPUS[-1]})
    assert seen["threads"] == 1
    assert seen["main"] == [CPUS[-1]]


@needs_two_cpus
def test_a_server_binds_its_engine_thread_and_says_so(model_path_for_server):
    server = ServerProcess(*server_flags(model_path_for_server, "--cpu-threads-bind", str(CPUS[1])))
    try:
        assert f"threads  1 intra-op threads (--cpu-threads-bind {CPUS[1]}), bound to CPUs {CPUS[1]}, " \
            f"{wait_summary(os.environ) if set(WAIT_VARIABLES) & set(os.environ) else 'waiting per OMP_WAIT_POLICY=PASSIVE'}" \
            in server.output
        affinities = [sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{server.pid}/task")]
        assert [CPUS[1]] in affinities  # the engine thread
        assert sorted(os.sched_getaffinity(server.pid)) == CPUS  # the event loop stays free
    finally:
        assert server.stop() == 0


# ---- how waiting threads wait ------------------------------------------------------------------


def test_a_process_kvtier_owns_sleeps_its_waiting_threads():
    environ: dict[str, str] = {"PATH": "/bin"}
    assert default_wait_policy(environ, modules={})
    assert environ == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    assert wait_summary(environ) == "waiting per OMP_WAIT_POLICY=PASSIVE"


@pytest.mark.parametrize("chosen", WAIT_VARIABLES)
def test_a_wait_setting_in_the_environment_is_kept(chosen):
    environ = {chosen: "1000"}
    assert not default_wait_policy(environ, modules={})
    assert environ == {chosen: "1000"}
    assert wait_summary(environ) == f"waiting per {chosen}=1000"


def test_nothing_is_set_once_torch_has_loaded_libgomp():
    environ: dict[str, str] = {}
    assert not default_wait_policy(environ, modules={"torch": object()})
    assert environ == {}
    assert wait_summary(environ) == "waiting threads spin first (libgomp's default)"


def test_the_cli_sets_the_policy_before_torch_loads_libgomp(tiny_model_factory):
    """`kvtier generate` in a fresh process: libgomp, loaded by torch's import, reports
    the policy it read (OMP_DISPLAY_ENV prints its settings as it starts)."""
    code = ("import sys\nfrom engine.cli import main\n"
            "status = main(sys.argv[1:])\nimport os\nprint('POLICY', os.environ.get('OMP_WAIT_POLICY'))\n"
            "sys.exit(status)")
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES} | {"OMP_DISPLAY_ENV": "TRUE"}
    done = subprocess.run([sys.executable, "-c", code, "generate", "--model", tiny_model_factory(),
                           "--max-tokens", "1", "--prompt", "hello", EAGER_OPS], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "POLICY PASSIVE" in done.stdout
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in done.stdout + done.stderr


@pytest.fixture
def model_path_for_server(tiny_model_factory) -> str:
    return tiny_model_factory()
