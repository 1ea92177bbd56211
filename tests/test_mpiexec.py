"""The same rank-side cases under MPICH's `mpiexec -n 4`: pycoll bootstrapping through mpi4py, and real mpi4py as a reference."""

from __future__ import annotations

import pytest

import harness

# every non-error case module: the same cases the pycoll-launcher tests run
CASES = ["reduce.*", "movement.*", "nonblocking.*", "specs.*", "objects.*", "p2p.*", "comm_mgmt.*", "large.*"]
N = 4

pytestmark = [pytest.mark.mpiexec, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def _need_mpiexec():
    if harness.find_mpiexec() is None:
        pytest.skip("mpiexec not found next to sys.executable or on PATH")
    if not harness.have_mpi4py():
        pytest.skip("mpi4py is not installed (pycoll bootstraps through it under mpiexec)")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_pycoll_under_mpiexec(transport, tmp_path):
    """`mpiexec -n 4 python tests/rank_main.py <cases>` with pycoll (shm, and tcp via PYCOLL_SHM_DISABLE=1)."""
    cases = CASES if transport == "shm" else ["reduce.allreduce", "movement.*", "p2p.*", "comm_mgmt.*"]
    res = harness.run_cases(N, cases, launcher="mpiexec", transport=transport, out_dir=str(tmp_path), job_timeout=240)
    res.assert_ok()
    print(f"{res.label}: {res.proc.wall_s:.1f} s; slowest: {res.slowest()}; notes: {res.notes()}")


def test_cases_on_reference_mpi4py(tmp_path):
    """The cases themselves are right: they pass on real MPI (mpi4py + MPICH; AVG and bfloat16 skipped there)."""
    res = harness.run_cases(N, CASES, launcher="mpiexec", impl="mpi4py", out_dir=str(tmp_path), job_timeout=240)
    res.assert_ok()
    print(f"{res.label}: {res.proc.wall_s:.1f} s; slowest: {res.slowest()}")
