"""Each algorithm forced through PYCOLL_ALGO in real multi-process jobs, checked by the NumPy-reference cases."""

from __future__ import annotations

import pytest

import harness
from pycoll.algorithms import ALGORITHMS

# Sets of algorithms forced together (one job each); together they cover every flat algorithm.
FORCED = {
    "ring-chain": "allreduce:ring,reduce_scatter:ring,allgather:ring,broadcast:chain,reduce:chain",
    "trees-halving": "allreduce:tree,reduce_scatter:halving,allgather:doubling,broadcast:tree,reduce:tree",
    "rabenseifner": "allreduce:rabenseifner",
    "doubling": "allreduce:doubling",
    "arena-cma": "allreduce:cma,reduce_scatter:cma,allgather:cma,broadcast:cma,reduce:chain",
    "arena-oneshot": "allreduce:oneshot",
    "arena-staged": "allreduce:staged,reduce_scatter:staged,allgather:staged,broadcast:staged,reduce:staged",
    "arena-no-cma": "allreduce:cma,reduce_scatter:cma,allgather:cma,broadcast:cma",
    "arena-staged-python": "allreduce:staged,reduce_scatter:staged,allgather:staged,broadcast:staged,reduce:staged",
}
# Extra settings per set: small arena chunks pull in many steps; a larger slot sends more sizes one-shot;
# without cross-memory attach the cma algorithms must agree to fall back to streams.
ENV = {
    "arena-cma": {"PYCOLL_ARENA_CHUNK": "4K"},
    "arena-oneshot": {"PYCOLL_ARENA_SLOT": "1M"},
    "arena-staged": {"PYCOLL_ARENA_STAGE": "64K", "PYCOLL_ARENA_PIPE_CHUNK": "4K"},  # many rounds, a wrapping ring
    "arena-no-cma": {"PYCOLL_CMA_DISABLE": "1"},
    # the pipelined broadcast's NumPy loop, where Numba is absent
    "arena-staged-python": {"PYCOLL_ARENA_STAGE": "64K", "PYCOLL_ARENA_PIPE_CHUNK": "4K", "PYCOLL_ARENA_JIT": "0"},
}
CASES = ["reduce.allreduce", "reduce.reduce", "reduce.reduce_scatter*", "movement.bcast", "movement.allgather*"]
LARGE = ["large.allreduce"]  # 2**20+3 elements: many chunks in flight
RANKS = (3, 5)  # odd and non-power-of-two; tests/test_algorithms_sim.py covers 1..8 ranks in process
LIGHT = ["reduce.allreduce", "reduce.reduce_scatter_block", "movement.bcast", "movement.allgather"]
LIGHT_RANKS = (1, 2, 8)  # the ends of the 1..8 range, with fewer cases (8 ranks on 2 cores: 10-16 s a job, -m slow)

pytestmark = pytest.mark.ranks


def test_forced_sets_cover_every_flat_algorithm() -> None:
    named = {item for spec in (*FORCED.values(), *MOVEMENT.values()) for item in spec.split(",")}
    named |= {"scan:linear", "scan:doubling", "exscan:linear", "exscan:doubling", "scan:staged", "exscan:staged"}  # forced by tests/cases/scan.py
    named |= {"reduce:ordered", "allreduce:ordered", "reduce_scatter:ordered"}  # forced by tests/cases/user_ops.py
    named |= {"reduce:owner", "allreduce:owner", "reduce_scatter:owner"}  # forced by tests/cases/reproducible.py
    for coll in ALGORITHMS:
        for name in ALGORITHMS[coll]:
            # hierarchical needs several hosts (tests/test_multihost.py); device algorithms: tests/test_cuda_ipc.py
            if name != "hierarchical" and ALGORITHMS[coll][name].memory == "host":
                assert f"{coll}:{name}" in named, f"{coll}:{name} is never forced in a real job"


# The arena sets run in fewer jobs: tests/test_algorithms_sim.py runs the same arena code for real on 2-8 ranks.
ARENA_SETS = [k for k in FORCED if k.startswith("arena-")]
# Five ranks only for the ring and chain: 3 ranks already fold a non-power-of-two rank in the others, and the
# sim tests run every algorithm on 1-8 ranks (CI time goes to tests/faults/ instead).
FORCED_JOBS = [(k, n) for k in FORCED for n in RANKS if n == 3 or k == "ring-chain"]
LIGHT_JOBS = [(k, n) for k in FORCED for n in LIGHT_RANKS if k not in ARENA_SETS or (n == 2 and k not in ("arena-no-cma", "arena-staged-python"))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("label,n", FORCED_JOBS)
def test_forced(label: str, n: int, tmp_path) -> None:
    env = {"PYCOLL_ALGO": FORCED[label], "PYCOLL_CHUNK_SIZE": "4K", **ENV.get(label, {})}  # small chunks: pipelining
    cases = CASES + (LARGE if label not in ("doubling", "arena-oneshot") else [])  # doubling moves n·log2(p): for small messages
    res = harness.run_cases(n, cases, transport="shm", out_dir=str(tmp_path), job_timeout=240, env=env)
    res.assert_ok()
    print(f"{label} n={n}: {res.proc.wall_s:.1f} s")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("label,n", [pytest.param(k, n, marks=pytest.mark.slow if n == 8 else ()) for k, n in LIGHT_JOBS])
def test_forced_light(label: str, n: int, tmp_path) -> None:
    env = {"PYCOLL_ALGO": FORCED[label], "PYCOLL_CHUNK_SIZE": "4K", **ENV.get(label, {})}
    res = harness.run_cases(n, LIGHT, transport="shm", out_dir=str(tmp_path), job_timeout=240, env=env)
    res.assert_ok()
    print(f"{label} n={n}: {res.proc.wall_s:.1f} s")


# Every collective's single-host small-message and cross-memory algorithms, with the cases of every collective they
# serve (the v-forms too: slots and cma refuse them, and the cost model's choice runs instead).
MOVEMENT = {
    "arena-slots": "broadcast:slots,reduce:slots,gather:slots,scatter:slots,allgather:slots,reduce_scatter:slots,"
                   "alltoall:slots,scan:slots,exscan:slots",
    "arena-slots-python": "broadcast:slots,reduce:slots,gather:slots,scatter:slots,allgather:slots,reduce_scatter:slots,"
                          "alltoall:slots,scan:slots,exscan:slots",
    "arena-cma-movement": "gather:cma,scatter:cma,alltoall:cma,broadcast:cma,allgather:cma,barrier:arena",
    "arena-staged-movement": "reduce:staged,scan:staged,exscan:staged",
    "direct": "gather:linear,scatter:linear,alltoall:pairwise,barrier:dissemination",
}
MOVEMENT_ENV = {"arena-slots-python": {"PYCOLL_ARENA_JIT": "0"}, "arena-slots": {"PYCOLL_ARENA_JIT_LOAD": "now"},
                "arena-cma-movement": {"PYCOLL_ARENA_JIT_LOAD": "now"},  # the compiled cma program from the first call
                "arena-staged-movement": {"PYCOLL_ARENA_JIT_LOAD": "now", "PYCOLL_ARENA_STAGE": "64K",
                                          "PYCOLL_ARENA_PIPE_CHUNK": "4K"}}  # many chunks, a wrapping ring
MOVEMENT_CASES = ["movement.*", "reduce.reduce", "reduce.reduce_scatter*", "scan.scan", "scan.exscan"]
# Blocks from 256 KiB split the copies between the root and its peer (cma); long vectors take many chunks (staged).
MOVEMENT_LARGE = {"arena-cma-movement": ["large.movement"], "arena-staged-movement": ["large.reduce_family"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("label,n", [(k, n) for k in MOVEMENT for n in (2, 3)])
def test_forced_movement(label: str, n: int, tmp_path) -> None:
    env = {"PYCOLL_ALGO": MOVEMENT[label], **MOVEMENT_ENV.get(label, {})}
    cases = MOVEMENT_CASES + MOVEMENT_LARGE.get(label, [])
    res = harness.run_cases(n, cases, transport="shm", out_dir=str(tmp_path), job_timeout=240, env=env)
    res.assert_ok()
    print(f"{label} n={n}: {res.proc.wall_s:.1f} s")


SOCKET_SETS = {**FORCED, "direct": MOVEMENT["direct"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("label,n", [("trees-halving", 5), ("doubling", 3), ("ring-chain", 3), ("direct", 4)])
def test_forced_over_sockets(label: str, n: int, tmp_path) -> None:
    """Over tcp, a blocking call's single-chunk messages go straight through the sockets (Steps.now): the short
    forms of the trees, the recursive rounds, the rings and chains, pairwise and dissemination, checked like the
    rest."""
    env = {"PYCOLL_ALGO": SOCKET_SETS[label]}
    cases = LIGHT + ["reduce.reduce"] if label != "direct" else ["movement.alltoall*", "movement.barrier", "movement.gather"]
    res = harness.run_cases(n, cases, transport="tcp", out_dir=str(tmp_path), job_timeout=240, env=env)
    res.assert_ok()
    print(f"{label} n={n} over tcp: {res.proc.wall_s:.1f} s")
