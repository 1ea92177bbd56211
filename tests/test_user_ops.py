"""MAXLOC/MINLOC, user-defined ops and derived datatypes on 1..4 ranks (tests/cases/user_ops.py), shm and tcp."""

from __future__ import annotations

import pytest

import harness
from pycoll.netns import unavailable

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,transport", [(1, "shm"), (2, "shm"), (3, "shm"), (4, "shm"), (2, "tcp"), (3, "tcp")])
def test_user_ops_cases(n: int, transport: str, tmp_path) -> None:
    res = harness.run_cases(n, ["user_ops.*"], transport=transport, out_dir=str(tmp_path), job_timeout=90)
    res.assert_ok()
    print(f"{res.label}: {res.proc.wall_s:.1f} s; slowest: {res.slowest()}")


@pytest.mark.timeout(120)
@pytest.mark.skipif(not harness.have_mpi4py() or harness.find_mpiexec() is None, reason="needs mpi4py and mpiexec")
def test_user_ops_cases_agree_with_mpich(tmp_path) -> None:
    """The same expectations hold for mpi4py on MPICH (the pycoll-only parts skip themselves there)."""
    res = harness.run_cases(3, ["user_ops.*"], launcher="mpiexec", impl="mpi4py", out_dir=str(tmp_path), job_timeout=90)
    res.assert_ok()


@pytest.mark.timeout(200)
@pytest.mark.skipif(unavailable() is not None, reason=f"no virtual hosts here: {unavailable()}")
def test_user_ops_cases_across_hosts(tmp_path) -> None:
    """On 4 ranks on two virtual hosts, where small calls are composed of each host's and the leaders': a derived
    datatype's packed copy is made on some ranks only (a Bcast root packs its input, the others unpack their
    output), and every rank still composes the call alike (the others had scheduled it flat and waited for ever)."""
    res = harness.run_cases_on_hosts(["user_ops.*"], hosts=2, n=4, out_dir=str(tmp_path), job_timeout=150,
                                     env={"PYCOLL_TIMEOUT": "20"})
    res.assert_ok()
