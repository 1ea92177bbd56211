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
}
CASES = ["reduce.allreduce", "reduce.reduce", "reduce.reduce_scatter*", "movement.bcast", "movement.allgather*"]
LARGE = ["large.allreduce"]  # 2**20+3 elements: many chunks in flight
RANKS = (3, 5)  # odd and non-power-of-two; tests/test_algorithms_sim.py covers 1..8 ranks in process
LIGHT = ["reduce.allreduce", "reduce.reduce_scatter_block", "movement.bcast", "movement.allgather"]
LIGHT_RANKS = (1, 2, 8)  # the ends of the 1..8 range, with fewer cases (8 ranks share 2 cores in CI)

pytestmark = pytest.mark.ranks


def test_forced_sets_cover_every_flat_algorithm() -> None:
    named = {item for spec in FORCED.values() for item in spec.split(",")}
    for coll in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"):
        for name in ALGORITHMS[coll]:
            if name != "hierarchical":  # needs several hosts: tests/test_multihost.py
                assert f"{coll}:{name}" in named, f"{coll}:{name} is never forced in a real job"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("label", list(FORCED))
def test_forced(label: str, n: int, tmp_path) -> None:
    env = {"PYCOLL_ALGO": FORCED[label], "PYCOLL_CHUNK_SIZE": "4K"}  # small chunks: pipelining on every size
    cases = CASES + (LARGE if label != "doubling" else [])  # doubling moves n·log2(p): for small messages
    res = harness.run_cases(n, cases, transport="shm", out_dir=str(tmp_path), job_timeout=240, env=env)
    res.assert_ok()
    print(f"{label} n={n}: {res.proc.wall_s:.1f} s")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", LIGHT_RANKS)
@pytest.mark.parametrize("label", list(FORCED))
def test_forced_light(label: str, n: int, tmp_path) -> None:
    env = {"PYCOLL_ALGO": FORCED[label], "PYCOLL_CHUNK_SIZE": "4K"}
    res = harness.run_cases(n, LIGHT, transport="shm", out_dir=str(tmp_path), job_timeout=240, env=env)
    res.assert_ok()
    print(f"{label} n={n}: {res.proc.wall_s:.1f} s")
