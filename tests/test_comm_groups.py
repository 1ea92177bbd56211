"""Groups, Create / Create_group, Split_type, Compare and Cartesian topologies (tests/cases/comm_groups.py) on
1-4 ranks; Split_type across two (pretended) hosts; and the same cases under mpiexec with mpi4py and MPICH, which
shows their expectations are MPI's."""

from __future__ import annotations

import json

import pytest

import harness

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(180)]


@pytest.mark.parametrize("n", [1, 2, 3, 4], ids=lambda n: f"n{n}")
def test_comm_groups(n, tmp_path):
    res = harness.run_cases(n, ["comm_groups.*"], transport="shm", out_dir=str(tmp_path), job_timeout=120)
    res.assert_ok()
    print(f"{res.label}: {res.proc.wall_s:.1f} s; slowest: {res.slowest()}")


def test_comm_groups_tcp(tmp_path):
    """The same cases with every peer over TCP (the new communicators' collectives take the network paths)."""
    res = harness.run_cases(3, ["comm_groups.*"], transport="tcp", out_dir=str(tmp_path), job_timeout=120)
    res.assert_ok()


# Each rank claims a host before pycoll starts: even ranks "host-a", odd ranks "host-b" (interleaved on purpose).
TWO_HOSTS = r"""
import json, os, sys
rank = int(os.environ["PYCOLL_RANK"])
os.environ["PYCOLL_HOSTID"] = "host-" + "ab"[rank % 2]
import numpy as np
from pycoll import MPI
comm = MPI.COMM_WORLD
node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=-rank)
x = np.full(8, float(rank + 1))
total = np.zeros(8)
node.Allreduce(x, total, op=MPI.SUM)
leaders = comm.Split(0 if node.Get_rank() == 0 else MPI.UNDEFINED, key=rank)
out = {"rank": rank, "node": node.allgather(rank), "node_rank": node.Get_rank(), "sum": total.tolist(),
       "leaders": leaders.allgather(rank) if leaders != MPI.COMM_NULL else None}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as fh:
    json.dump(out, fh)
"""


def test_split_type_two_hosts(tmp_path):
    """COMM_TYPE_SHARED follows the runtime's host identity: ranks 0, 2 on one host and 1, 3 on the other."""
    n = 4
    script = tmp_path / "two_hosts.py"
    script.write_text(TWO_HOSTS)
    cmd = harness.launcher_cmd(n, [harness.PYTHON, str(script), str(tmp_path)], timeout=90)
    proc = harness.launch(cmd, harness.rank_env("shm"), timeout=120)
    assert proc.returncode == 0 and not proc.timed_out, proc.stderr[-4000:]
    for rank in range(n):
        with open(tmp_path / f"rank{rank}.json") as fh:
            got = json.load(fh)
        mates = [q for q in range(n) if q % 2 == rank % 2]
        order = sorted(mates, key=lambda q: -q)  # key=-rank: the highest rank first
        assert got["node"] == order, got
        assert got["node_rank"] == order.index(rank), got
        assert got["sum"] == [float(sum(q + 1 for q in mates))] * 8, got
        # the first rank of each host (3 and 2, by key) form the leaders' communicator, in world rank order
        assert got["leaders"] == ([2, 3] if rank in (2, 3) else None), got


@pytest.mark.mpiexec
def test_cases_match_mpich(tmp_path):
    """The cases' expectations hold under mpi4py with MPICH (pycoll-only checks skip themselves there)."""
    if harness.find_mpiexec() is None or not harness.have_mpi4py():
        pytest.skip("needs mpiexec and mpi4py")
    res = harness.run_cases(3, ["comm_groups.*"], launcher="mpiexec", impl="mpi4py", out_dir=str(tmp_path), job_timeout=120)
    res.assert_ok()
    done = set(res.ranks[0]["done"])
    assert {"comm_groups.cart_2d", "comm_groups.create", "comm_groups.group_algebra"} <= done, res.ranks[0]
