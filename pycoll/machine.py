"""What one machine gives a job's processes: its identity across network namespaces, the CPUs a process may run on (affinity and cgroup quota), and whether the job's ranks on it outnumber them."""

from __future__ import annotations

import math
import os
import socket
from typing import Iterable, Optional

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def machine_id() -> str:
    """The running kernel's boot id: equal on every process of one (physical or virtual) machine, namespaces and
    containers included, where hostnames may differ; else the machine id, else the hostname."""
    for path in (_BOOT_ID, "/etc/machine-id"):
        try:
            with open(path) as f:
                text = f.read().strip()
            if text:
                return text
        except OSError:
            pass
    return socket.gethostname()


def affinity() -> set[int]:
    """The CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float:
    """The CPUs this process's cgroup grants (a quota over a period: cgroup v2's ``cpu.max``, v1's
    ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``), the tightest on its path up to the root; 0.0 when unlimited or
    unknown."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return 0.0
    limits: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: the unified hierarchy
            for d in _up(os.path.join(root, path.lstrip("/")), root):
                limits.extend(_v2_limit(d))
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            mount = next((os.path.join(root, m) for m in (controllers, "cpu,cpuacct", "cpuacct,cpu", "cpu")
                          if os.path.isdir(os.path.join(root, m))), None)
            if mount is not None:
                for d in _up(os.path.join(mount, path.lstrip("/")), mount):
                    limits.extend(_v1_limit(d))
    return min(limits) if limits else 0.0


def _up(directory: str, top: str) -> Iterable[str]:
    """``directory`` and its parents up to ``top``, both included."""
    top = os.path.normpath(top)
    d = os.path.normpath(directory)
    while True:
        yield d
        if d == top or not d.startswith(top):
            return
        d = os.path.dirname(d)


def _v2_limit(d: str) -> list[float]:
    try:
        with open(os.path.join(d, "cpu.max")) as f:
            quota, *period = f.read().split()
    except (OSError, ValueError):
        return []
    if quota == "max":
        return []
    try:
        return [int(quota) / int(period[0] if period else 100000)]
    except (ValueError, ZeroDivisionError):
        return []


def _v1_limit(d: str) -> list[float]:
    try:
        with open(os.path.join(d, "cpu.cfs_quota_us")) as f:
            quota = int(f.read().strip())
        with open(os.path.join(d, "cpu.cfs_period_us")) as f:
            period = int(f.read().strip())
    except (OSError, ValueError):
        return []
    return [quota / period] if quota > 0 and period > 0 else []


def cores_for(cpu_sets: Iterable[Iterable[int]], quotas: Iterable[float]) -> int:
    """How many cores a machine's processes share: the CPUs any of them may run on, capped by the largest cgroup
    quota among them when each has one (processes of one container share its quota)."""
    cpus: set[int] = set()
    for s in cpu_sets:
        cpus.update(s)
    qs = list(quotas)
    cores = max(len(cpus), 1)
    if qs and all(q > 0 for q in qs):
        cores = min(cores, max(1, math.ceil(max(qs) - 1e-9)))
    return cores


_own_quota: Optional[float] = None


def own_cpu_quota() -> float:
    """This process's ``cpu_quota()``, read once: a container's quota is set when it starts, and the simulator and
    the schedules ask for it on every call."""
    global _own_quota
    if _own_quota is None:
        _own_quota = cpu_quota()
    return _own_quota


def usable_cores() -> int:
    """The cores this process may use: its affinity, capped by its cgroup's quota."""
    return cores_for([affinity()], [own_cpu_quota()])


# (ranks of the job on this machine, the cores they share), once the runtime has counted them
_load: Optional[tuple[int, int]] = None


def set_load(ranks: int, cores: int) -> None:
    """Record the job's ranks on this machine and their cores (the runtime does, from what every rank published)."""
    global _load
    _load = (ranks, cores)


def free_cores(size: int = 1) -> int:
    """The cores of this machine beyond one per rank of the job (negative where the ranks outnumber them): the
    runtime's count once it is up, else ``size`` ranks against this process's usable cores."""
    if _load is not None:
        return _load[1] - _load[0]
    return usable_cores() - size


def oversubscribed(size: int = 0) -> bool:
    """Whether this machine's ranks outnumber their cores: the runtime's count once it is up (the same on every rank
    of the machine), else ``size`` ranks against this process's usable cores."""
    if _load is not None:
        return _load[0] > _load[1]
    return size > usable_cores()
