"""How many intra-op (OpenMP) threads the engine runs, and on which CPUs.

torch starts one intra-op thread per core it sees, and a container sees the host's
cores: a server limited to 1.5 CPUs on a 64-core host would run 64 threads, each
OpenMP barrier then waiting for threads the CFS quota has stopped. The pool is sized
here from the CPUs the process may really use: its affinity mask and its cgroup's CPU
quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, the tightest along
the cgroup's ancestors).

Binding (`--cpu-threads-bind`): each OpenMP thread of the engine's team is pinned to
one CPU, as vLLM's CPU worker pins its own. That pays only on CPUs the process has to
itself: a bound thread whose core another process is using waits there for its turn
while another core may be idle, and every barrier of the step waits with it (another
server that polls while idle is enough). So `auto` binds, one thread per physical core, only when the process was
placed on part of the machine (an affinity mask narrower than the online CPUs: a cpuset,
taskset, a Kubernetes pod with exclusive cores) with whole CPUs (no quota below the
mask); on the whole machine, or under a fractional quota, the threads stay free to run
wherever time is left.

Waiting (`default_wait_policy`): a process kvtier owns (`kvtier serve`, `kvtier generate`)
runs its OpenMP threads with OMP_WAIT_POLICY=PASSIVE unless the environment chooses. By
default libgomp spins for milliseconds at every barrier before it sleeps. On a core of
its own a spinning thread costs nothing; beside other busy processes it burns the time
slices the thread it waits for needs, and a thread that never sleeps loses the wake-up
preference the scheduler gives sleepers, so every barrier of a decode step waits out
other processes' slices. A sleeping waiter pays a futex wake per parallel region
instead, which a quiet decode step feels. The measurements are in
docs/notes/openmp-wait-policy.md and docs/BENCHMARKS.md (neighbours).
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import sys
import threading
from collections.abc import Mapping, MutableMapping
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
CPU_SYSFS = Path("/sys/devices/system/cpu")
BIND_MODES = ("auto", "none")
MAX_CPU_ID = 1 << 16  # Linux's largest NR_CPUS is 8192; a larger id is a typo


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """The CPUs of a list such as `0-3,8,10-11` (the kernel's cpulist syntax), sorted and
    without repeats. Raises ValueError saying what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise ValueError(f"{text!r} is not auto, none or a CPU list such as 0-3,8 (bad part {part!r})") from None
        if low < 0 or high < low:
            raise ValueError(f"{text!r}: {part!r} is not a range of CPU ids (low-high, low <= high, from 0)")
        if high >= MAX_CPU_ID:
            raise ValueError(f"{text!r}: CPU {high} is past the largest id, {MAX_CPU_ID - 1}")
        cpus.update(range(low, high + 1))
    return tuple(sorted(cpus))


def check_bind_value(value: str) -> str:
    """`value` if it is auto, none or a valid CPU list; the list's CPUs must be ones this
    process may run on."""
    if value in BIND_MODES:
        return value
    cpus = parse_cpu_list(value)
    outside = sorted(set(cpus) - os.sched_getaffinity(0))
    if outside:
        allowed = format_cpu_list(sorted(os.sched_getaffinity(0)))
        raise ValueError(f"CPU {outside[0]} is not one this process may run on ({allowed})")
    return value


def format_cpu_list(cpus: list[int] | tuple[int, ...]) -> str:
    """The shortest cpulist spelling of sorted `cpus` (`0-3,8`)."""
    ranges: list[str] = []
    start = previous = None
    for cpu in [*cpus, None]:
        if previous is not None and cpu != previous + 1:
            ranges.append(str(start) if start == previous else f"{start}-{previous}")
            start = None
        if start is None:
            start = cpu
        previous = cpu
    return ",".join(ranges)


# ---- the cgroup's CPU quota -------------------------------------------------------------------


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """CPUs' worth of time the process's cgroup may use (1.5 for `cpu.max` "150000 100000"),
    the smallest along its ancestors; None when nothing limits it or nothing can be read."""
    try:
        memberships = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in memberships:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "" and (root / "cgroup.controllers").exists():  # v2 (unified)
            quotas += _along_ancestors(root, relative, _v2_quota)
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            for mount in (root / controllers, root / "cpu,cpuacct", root / "cpu"):
                if mount.is_dir():
                    quotas += _along_ancestors(mount, relative, _v1_quota)
                    break
    return min(quotas) if quotas else None


def _along_ancestors(mount: Path, relative: str, read_quota) -> list[float]:
    """The quotas of the cgroup at `mount/relative` and of each ancestor up to `mount`. A
    container sees its own cgroup as the mount's root, its path there not existing:
    then the mount's root is the cgroup."""
    directory = mount / relative
    if ".." in Path(relative).parts or not directory.is_dir():
        directory = mount
    quotas = []
    while True:
        quota = read_quota(directory)
        if quota is not None:
            quotas.append(quota)
        if directory == mount:
            return quotas
        directory = directory.parent


def _v2_quota(directory: Path) -> float | None:
    try:
        limit, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
    except OSError:
        return None
    if limit == "max":
        return None
    return int(limit) / int(period or 100000)


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


# ---- how waiting threads wait -------------------------------------------------------------------

# The standard's variable, then libgomp's and Intel OpenMP's own: one set means someone chose.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
KVTIER_WAIT_POLICY = "PASSIVE"


def default_wait_policy(environ: MutableMapping[str, str] = os.environ,
                        modules: Mapping[str, object] = sys.modules) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE in `environ` unless one of WAIT_VARIABLES is set; True
    when it did. libgomp reads it once, when torch's import loads it: call this first in a
    process kvtier owns (the CLI's serve and generate). Once torch is imported (in
    `modules`) it would change nothing in this process, only what its children inherit,
    so it does nothing."""
    if "torch" in modules or any(name in environ for name in WAIT_VARIABLES):
        return False
    environ["OMP_WAIT_POLICY"] = KVTIER_WAIT_POLICY
    return True


def wait_summary(environ: MutableMapping[str, str] = os.environ) -> str:
    """How this process's OpenMP threads wait, for the start-up log."""
    chosen = [f"{name}={environ[name]}" for name in WAIT_VARIABLES if name in environ]
    return f"waiting per {', '.join(chosen)}" if chosen else "waiting threads spin first (libgomp's default)"


# ---- the plan ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ThreadPlan:
    """The engine's intra-op threads: how many, and the CPU of each (thread i on cpus[i];
    None: unbound). `why` says how the count was reached, for the start-up log;
    `cpu_quota`, the cgroup's CPU quota it was planned under (None: none)."""

    num_threads: int
    cpus: tuple[int, ...] | None
    why: str
    cpu_quota: float | None = None

    def summary(self) -> str:
        bound = "unbound" if self.cpus is None else f"bound to CPUs {format_cpu_list(self.cpus)}"
        return f"{self.num_threads} intra-op threads ({self.why}), {bound}, {wait_summary()}"


def plan_threads(bind: str, affinity: set[int], quota: float | None, online: set[int]) -> ThreadPlan:
    """The plan for `--cpu-threads-bind bind` in a process allowed on the CPUs `affinity`
    of the machine's `online` CPUs, with `quota` CPUs' worth of time (None: no quota)."""
    if bind not in BIND_MODES:
        cpus = parse_cpu_list(bind)
        return ThreadPlan(len(cpus), cpus, f"--cpu-threads-bind {bind}", quota)
    cores = one_cpu_per_core(sorted(affinity))
    count, why = len(cores), f"{len(cores)} cores in the affinity mask ({format_cpu_list(sorted(affinity))})"
    if quota is not None and quota < count:
        count, why = max(1, math.floor(quota)), f"the cgroup's CPU quota of {quota:g} CPUs"
    placed = affinity < online  # someone gave the process these CPUs, out of the machine's
    bound = bind == "auto" and placed and count == len(cores)
    return ThreadPlan(count, tuple(cores) if bound else None, why, quota)


def online_cpus(sysfs: Path = CPU_SYSFS) -> set[int]:
    """The machine's online CPUs (whatever this process may use of them)."""
    try:
        return set(parse_cpu_list((sysfs / "online").read_text().strip()))
    except (OSError, ValueError):
        return set(range(os.cpu_count() or 1))


def plan_for_this_process(bind: str) -> ThreadPlan:
    """plan_threads with this process's affinity mask and cgroup quota."""
    return plan_threads(bind, os.sched_getaffinity(0), cgroup_cpu_quota(), online_cpus())


def one_cpu_per_core(cpus: list[int], sysfs: Path = CPU_SYSFS) -> list[int]:
    """The first of `cpus` on each physical core (SMT siblings share a core's units: two
    intra-op threads on one core run no faster than one)."""
    chosen, seen = [], set()
    for cpu in cpus:
        try:
            siblings = (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
        except OSError:
            siblings = str(cpu)
        if siblings not in seen:
            seen.add(siblings)
            chosen.append(cpu)
    return chosen


# ---- applying it ------------------------------------------------------------------------------


_PARALLEL_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def bind_threads(plan: ThreadPlan) -> None:
    """Size the calling thread's intra-op pool, and with `plan.cpus` pin each thread of its
    OpenMP team (the caller is thread 0) to its CPU. Run it on the thread that runs the
    model (libgomp keeps one team per thread that starts parallel regions), after the
    start-up work that spawns processes: a child inherits its parent thread's CPUs."""
    import torch

    torch.set_num_threads(plan.num_threads)
    if plan.cpus is not None:
        _bind_team(plan.cpus)


def _bind_team(cpus: tuple[int, ...]) -> None:
    """One parallel region of len(cpus) threads (the ones torch's ops reuse) in which
    thread i pins itself to cpus[i]; libgomp's own entry points, through ctypes, since
    torch offers no hook that runs in every thread of the team."""
    libgomp = _loaded_libgomp()
    libgomp.omp_get_thread_num.restype = ctypes.c_int
    errors: list[OSError] = []
    lock = threading.Lock()

    def pin(_: int | None) -> None:
        try:
            os.sched_setaffinity(0, {cpus[libgomp.omp_get_thread_num()]})
        except OSError as exc:
            with lock:
                errors.append(exc)

    callback = _PARALLEL_FN(pin)
    libgomp.GOMP_parallel(callback, None, ctypes.c_uint(len(cpus)), ctypes.c_uint(0))
    if errors:
        raise OSError(f"cannot bind the intra-op threads to CPUs {format_cpu_list(cpus)}: {errors[0]}")


def _loaded_libgomp() -> ctypes.CDLL:
    """The libgomp torch loaded (its wheel ships its own; another copy has other teams)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libgomp" in Path(path).name:
                return ctypes.CDLL(path)
    raise OSError("torch runs no libgomp in this process: cannot bind its OpenMP threads")
