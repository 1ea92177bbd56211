"""Tests of pycoll.machine: cgroup quotas, the cores a machine's ranks share, and oversubscription as the job sees it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pycoll import machine

import harness
from test_launcher import REPO, clean_env


def _tree(tmp_path: Path, cgroup: str, files: dict[str, str]) -> tuple[str, str]:
    proc = tmp_path / "cgroup"
    proc.write_text(cgroup)
    root = tmp_path / "fs"
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return str(proc), str(root)


def test_cgroup_v2_quota_is_the_tightest_on_the_path(tmp_path):
    proc, root = _tree(tmp_path, "0::/job/rank\n", {"job/rank/cpu.max": "150000 100000\n", "job/cpu.max": "max 100000\n",
                                                   "cpu.max": "max\n"})
    assert machine.cpu_quota(proc, root) == pytest.approx(1.5)
    Path(root, "job/cpu.max").write_text("50000 100000\n")
    assert machine.cpu_quota(proc, root) == pytest.approx(0.5)


def test_cgroup_v1_quota_and_no_limit(tmp_path):
    proc, root = _tree(tmp_path, "5:memory:/m\n3:cpu,cpuacct:/job\n", {
        "cpu,cpuacct/job/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert machine.cpu_quota(proc, root) == pytest.approx(2.0)
    Path(root, "cpu,cpuacct/job/cpu.cfs_quota_us").write_text("-1\n")
    assert machine.cpu_quota(proc, root) == 0.0
    assert machine.cpu_quota(str(tmp_path / "missing"), root) == 0.0


def test_cores_are_the_cpus_any_rank_may_use_capped_by_the_quota():
    assert machine.cores_for([{0}, {1}], [0.0, 0.0]) == 2  # pinned apart: two cores
    assert machine.cores_for([{0}, {0}], [0.0, 0.0]) == 1  # pinned together: one
    assert machine.cores_for([{0, 1, 2, 3}] * 4, [1.5] * 4) == 2  # a container granted 1.5 CPUs
    assert machine.cores_for([{0, 1, 2, 3}] * 2, [1.0, 0.0]) == 4  # one rank unlimited: no cap
    assert machine.cores_for([], []) == 1


def test_a_process_reads_its_cgroup_quota_once(monkeypatch):
    reads = []
    monkeypatch.setattr(machine, "_own_quota", None)
    monkeypatch.setattr(machine, "cpu_quota", lambda: reads.append(1) or 1.5)
    monkeypatch.setattr(machine, "affinity", lambda: {0, 1, 2, 3})
    assert [machine.usable_cores() for _ in range(3)] == [2, 2, 2]  # 1.5 CPUs: two cores' worth
    assert machine.own_cpu_quota() == 1.5 and len(reads) == 1


def test_oversubscribed_follows_the_runtimes_count_once_set(monkeypatch):
    monkeypatch.setattr(machine, "_load", None)
    cores = machine.usable_cores()
    assert machine.oversubscribed(cores) is False and machine.oversubscribed(cores + 1) is True
    machine.set_load(4, 2)
    assert machine.oversubscribed(1) is True  # the machine's count wins over the communicator's size
    machine.set_load(2, 2)
    assert machine.oversubscribed(64) is False


def test_machine_id_is_the_boot_id():
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert machine.machine_id() == f.read().strip()


_REPORT = """
import json, os, sys
from pycoll import MPI, machine, runtime
MPI.COMM_WORLD.Barrier()
rt = runtime.current()
print("LOAD " + json.dumps([MPI.COMM_WORLD.rank, len(rt.machine_ranks), rt.machine_cores, rt.engine.oversubscribed]))
"""


def _loads(stdout: str) -> list[list]:
    return sorted(json.loads(m) for m in re.findall(r"LOAD (\[[^\]]*\])", stdout))  # ranks' lines may interleave


def test_ranks_pinned_to_one_core_know_they_share_it():
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", "2", "--", sys.executable, "-c", _REPORT]
    free = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert free.returncode == 0, free.stderr
    cores = len(os.sched_getaffinity(0))
    assert _loads(free.stdout) == [[r, 2, cores, cores < 2] for r in range(2)]
    one = sorted(os.sched_getaffinity(0))[0]
    pinned = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120,
                            preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert pinned.returncode == 0, pinned.stderr
    assert _loads(pinned.stdout) == [[r, 2, 1, True] for r in range(2)]


def test_ranks_on_namespace_hosts_of_one_machine_count_together():
    reason = harness.multihost_unavailable()
    if reason:
        pytest.skip(reason)
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", "4", "--hosts", "2", "--", sys.executable, "-c", _REPORT]
    res = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    cores = len(os.sched_getaffinity(0))
    # two hosts by their network namespaces, one machine: four ranks share this machine's cores
    assert _loads(res.stdout) == [[r, 4, cores, cores < 4] for r in range(4)]


def test_hosts_that_share_a_machine_share_its_cores_in_the_cost_model() -> None:
    from pycoll.runtime import shared_machine_cores
    from pycoll.transport import PeerInfo

    def peer(rank: int, host: str, box: str, cpus: str = "0-1", quota: float = 0.0) -> PeerInfo:
        return PeerInfo(rank=rank, host_id=host, hostname="vm", pid=rank, transports=[], machine=box, cpus=cpus,
                        cpu_quota=quota)

    # two namespace hosts of one 2-core machine, 2 ranks each: a host gets 1 core
    assert shared_machine_cores([peer(0, "a", "m"), peer(1, "a", "m"), peer(2, "b", "m"), peer(3, "b", "m")]) == 1
    # uneven (3 + 1 ranks on 8 cores): the crowded host's share bounds it
    eight = "0-7"
    assert shared_machine_cores([peer(r, "a" if r < 3 else "b", "m", eight) for r in range(4)]) == 2
    # a cgroup quota caps the machine's cores before they are shared
    assert shared_machine_cores([peer(r, "ab"[r % 2], "m", eight, quota=2.0) for r in range(4)]) == 1
    # real hosts, one machine each: nothing to correct
    assert shared_machine_cores([peer(0, "a", "m1"), peer(1, "b", "m2")]) is None
    assert shared_machine_cores([peer(0, "a", "m1"), peer(1, "a", "m1")]) is None


def test_hosts_that_share_a_machine_share_its_memory_rate_in_the_cost_model() -> None:
    """The host steps of a composed call run on every host of the machine at once: a host's copies get its share of
    the machine's memory rate (by ranks); the model prices the most crowded host's."""
    from pycoll.runtime import shared_machine_memory
    from pycoll.transport import PeerInfo

    def peer(rank: int, host: str, box: str) -> PeerInfo:
        return PeerInfo(rank=rank, host_id=host, hostname="vm", pid=rank, transports=[], machine=box, cpus="0-1")

    assert shared_machine_memory([peer(0, "a", "m"), peer(1, "a", "m"), peer(2, "b", "m"), peer(3, "b", "m")]) == 0.5
    assert shared_machine_memory([peer(r, "a" if r < 3 else "b", "m") for r in range(4)]) == 0.75
    assert shared_machine_memory([peer(0, "a", "m1"), peer(1, "b", "m2")]) is None
