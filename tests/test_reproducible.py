"""Reproducible mode: every reduction bit for bit the rank-order left fold (tests/cases/reproducible.py), on 1-5 ranks
over shared memory, over TCP, over RDMA (the fake NIC), with the arena's NumPy paths, and on two virtual hosts blocked
and interleaved. Device buffers: tests/test_cuda_ipc.py (cuda_ipc.reproducible)."""

from __future__ import annotations

import pytest

import harness
from pycoll.algorithms import ALGORITHMS, Call, Layout
from pycoll.algorithms.registry import REDUCTIONS

pytestmark = pytest.mark.ranks

# 4 and 5 ranks, 3 over TCP and the NumPy paths take 20-60 s each on 2 cores: in the full run (-m slow)
JOBS = [pytest.param(n, t, e, marks=pytest.mark.slow if slow else (), id=f"n{n}-{t}{'-numpy' if e else ''}")
        for n, t, e, slow in [(1, "shm", {}, False), (2, "shm", {}, False), (3, "shm", {}, False), (4, "shm", {}, True),
                              (5, "shm", {}, True), (2, "tcp", {}, False), (3, "tcp", {}, True),
                              (3, "shm", {"PYCOLL_ARENA_JIT": "0"}, True)]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,transport,env", JOBS)
def test_every_reduction_is_the_left_fold(n, transport, env, tmp_path):
    res = harness.run_cases(n, ["reproducible.*"], transport=transport, out_dir=str(tmp_path), job_timeout=260,
                            env=env)
    res.assert_ok()


@pytest.mark.slow  # 30 s; the fake NIC's own tests (tests/test_rdma.py) run by default
@pytest.mark.timeout(300)
def test_over_rdma(tmp_path):
    """Shared memory off: every pair of the three ranks talks RDMA through the fake NIC (small rings, so they wrap)."""
    env = {"PYCOLL_IB_FAKE": "1", "PYCOLL_IB_BUFFER": "256K", "PYCOLL_IB_CHUNK": "64K", "PYCOLL_IB_ZCOPY": "128K",
           "PYCOLL_DEBUG": "INFO"}
    res = harness.run_cases(3, ["reproducible.*"], transport="tcp", out_dir=str(tmp_path), job_timeout=260, env=env)
    res.assert_ok()
    assert "0:self, 1:rdma, 2:rdma" in res.proc.stderr, res.proc.stderr[-3000:]


@pytest.mark.timeout(300)
def test_on_two_hosts_blocked_and_interleaved(tmp_path):
    reason = harness.multihost_unavailable()
    if reason:
        pytest.skip(f"no virtual hosts here: {reason}")
    res = harness.run_cases_on_hosts(["reproducible.allreduce", "reproducible.reduce_scatter",
                                      "reproducible.interleaved"], hosts=2, n=4, job_timeout=260,
                                     out_dir=str(tmp_path))
    res.assert_ok()


def test_every_reduction_has_an_algorithm_that_keeps_the_fold_and_the_rest_decline():
    import numpy as np

    from pycoll import ops

    for coll in REDUCTIONS:
        keeping = [name for name, a in ALGORITHMS[coll].items() if a.reproducible]
        assert keeping, f"{coll} has no reproducible algorithm"
        probe = Call(coll, np.dtype(np.float32), send=np.zeros(8, np.float32), recv=np.zeros(8, np.float32),
                     op=ops.SUM, counts=[4, 4], reproducible=True)
        for name, algo in ALGORITHMS[coll].items():
            reason = algo.refusal(probe, Layout.flat(2))
            if not algo.reproducible:
                assert reason and "left fold" in reason, f"{coll}:{name} accepts a reproducible call"
    # movement has nothing to fold: no algorithm declines it for the mode
    probe = Call("allgather", np.dtype(np.float32), send=np.zeros(4, np.float32), recv=np.zeros(8, np.float32),
                 counts=[4, 4], displs=[0, 4], reproducible=True)
    assert all("left fold" not in (a.refusal(probe, Layout.flat(2)) or "") for a in ALGORITHMS["allgather"].values())
