"""The seat keeper (engine/cpu_seat.py): a child process of the engine's session that
yields the CPU while the engine has requests, and costs nothing otherwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from engine.cpu_seat import SeatKeeper, wants_seat_keeper
from engine.cpu_threads import ThreadPlan, plan_threads

CPUS = sorted(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="a team of two threads needs two CPUs")


def cpu_ticks(pid: int) -> int:
    """User and system clock ticks the process has run."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def started(pid: int) -> bool:
    """The keeper ignores SIGINT: it ran its first line (or inherited the disposition, as
    a background job of a non-interactive shell does)."""
    with open(f"/proc/{pid}/status") as status:
        ignored = next(line for line in status if line.startswith("SigIgn:"))
    return bool(int(ignored.split()[1], 16) & (1 << (signal.SIGINT - 1)))


def settles(pid: int, interval_s: float = 0.3) -> bool:
    """The process ran no CPU for `interval_s` (an idle keeper blocks on its pipe)."""
    before = cpu_ticks(pid)
    time.sleep(interval_s)
    return cpu_ticks(pid) == before


def wait_for(condition, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.parametrize(("enabled", "threads", "bound", "quota", "expected"), [
    (True, 2, False, None, True),
    (True, 16, False, None, True),
    (False, 2, False, None, False),  # not asked for (the default)
    (True, 1, False, None, False),  # one thread computing alone never sleeps mid-step
    (True, 2, True, None, False),  # threads bound to CPUs of their own
    (True, 2, False, 2.5, False),  # a yield would spend the container's quota
])
def test_which_plans_get_a_keeper(enabled, threads, bound, quota, expected):
    plan = ThreadPlan(threads, tuple(range(threads)) if bound else None, "test", quota)
    assert wants_seat_keeper(enabled, plan) is expected


def test_the_keeper_runs_only_while_it_holds():
    keeper = SeatKeeper()
    try:
        assert os.getsid(keeper.pid) == os.getsid(0)  # in the engine's session: its scheduling group
        assert wait_for(lambda: settles(keeper.pid))  # past its start-up, blocked on its pipe
        keeper.hold(True)
        start = cpu_ticks(keeper.pid)
        assert wait_for(lambda: cpu_ticks(keeper.pid) > start + 2)
        keeper.hold(False)
        assert wait_for(lambda: settles(keeper.pid))  # it reads the pipe within a few hundred yields
        keeper.hold(True)  # and again
        start = cpu_ticks(keeper.pid)
        assert wait_for(lambda: cpu_ticks(keeper.pid) > start + 2)
    finally:
        keeper.close()
    assert keeper.process.returncode == 0
    keeper.close()  # twice is harmless
    keeper.hold(True)  # and a closed keeper holds nothing


def test_a_ctrl_c_to_the_process_group_leaves_the_keeper_to_end_with_its_engine():
    keeper = SeatKeeper()
    try:
        assert wait_for(lambda: started(keeper.pid))
        os.kill(keeper.pid, signal.SIGINT)
        time.sleep(0.5)
        assert keeper.process.poll() is None
    finally:
        keeper.close()
    assert keeper.process.returncode == 0  # ended by its pipe, not by the signal


_DYING_ENGINE = """
import os, sys
from engine.cpu_seat import SeatKeeper
keeper = SeatKeeper()
keeper.hold(sys.argv[1] == "held")
print(keeper.pid, flush=True)
os._exit(0)  # killed, as far as the keeper can tell: nobody closes it
"""


@pytest.mark.parametrize("state", ["held", "idle"])
def test_the_keeper_ends_with_its_engines_process(state):
    done = subprocess.run([sys.executable, "-c", _DYING_ENGINE, state], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    assert wait_for(lambda: gone(pid)), f"the seat keeper {pid} outlived its engine"


# Builds engines one after the other in a fresh process (threads are per process; a bound
# one last, as binding stays) and reports each one's keeper.
_ENGINE_CHILD = """
import json, sys
from engine import LLM, SamplingParams
for options in json.loads(sys.argv[2]):
    llm = LLM(model=sys.argv[1], num_kv_blocks=32, fuse_elementwise=False, **options)
    keeper = llm.engine.seat_keeper
    held_while_running = []
    if keeper is not None:
        real_step = llm.engine._step
        def step():
            held_while_running.append(keeper.holding)
            return real_step()
        llm.engine._step = step
    llm.generate(["hello"], SamplingParams(max_tokens=3))
    print(json.dumps({"keeper": keeper is not None, "held_while_running": held_while_running,
                      "held_after": keeper is not None and keeper.holding,
                      "pid": keeper.pid if keeper else None}))
    llm.engine.shutdown()
"""


@needs_two_cpus
def test_an_unbound_team_asked_for_a_keeper_holds_its_seat_only_while_requests_run(tiny_model_factory):
    configs = [{"cpu_seat_keeper": True}, {"cpu_threads_bind": "none"},
               {"cpu_threads_bind": "none", "cpu_seat_keeper": True},
               {"cpu_threads_bind": f"{CPUS[0]},{CPUS[1]}", "cpu_seat_keeper": True}]
    done = subprocess.run([sys.executable, "-c", _ENGINE_CHILD, tiny_model_factory(), json.dumps(configs)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    unmanaged, by_default, unbound, bound = map(json.loads, done.stdout.strip().splitlines()[-4:])
    assert not unmanaged["keeper"]  # an LLM not given the thread options leaves its caller's process alone
    assert not by_default["keeper"]  # asked for only
    assert not bound["keeper"]
    assert unbound["keeper"]
    assert unbound["held_while_running"] and all(unbound["held_while_running"])
    assert not unbound["held_after"]  # the request finished: the keeper blocks again
    assert wait_for(lambda: gone(unbound["pid"]))  # shut down with its engine


def test_a_thread_plan_carries_the_quota_the_keeper_asks_about():
    machine = set(range(8))
    assert plan_threads("auto", machine, 3.0, machine).cpu_quota == 3.0
    assert plan_threads("none", machine, None, machine).cpu_quota is None
