"""Collectives on 1..5 ranks over shm (2, 3 and 5 over tcp): every case module checked against NumPy references."""

from __future__ import annotations

import pytest

import harness

# One job (one spawn of N ranks) per group: batching many cases per spawn keeps the suite fast.
GROUPS = {
    "reduce": (["reduce.*"], 240),
    "movement": (["movement.*"], 240),
    # a one-element, then a zero-count Gatherv/Scatterv/Alltoallv, many times (issue 24)
    "vector_zero": (["vector_zero.*"], 180),
    "nonblocking": (["nonblocking.*"], 180),
    "specs_objects": (["specs.*", "objects.*"], 180),
    # 2**20+3 elements: all ops on float32 and all dtypes with SUM (see tests/cases/large.py)
    "large": (["large.*"], 420),
}

pytestmark = pytest.mark.ranks


def _params():
    for group, (_, limit) in GROUPS.items():
        marks = [pytest.mark.timeout(limit)]
        if group == "large":
            marks.append(pytest.mark.large)
        for n, transport in harness.jobs():
            yield pytest.param(group, n, transport, id=f"{group}-n{n}-{transport}", marks=marks)


@pytest.mark.parametrize("group,n,transport", list(_params()))
def test_collectives(group, n, transport, tmp_path):
    patterns, limit = GROUPS[group]
    res = harness.run_cases(n, patterns, transport=transport, out_dir=str(tmp_path), job_timeout=limit - 40)
    res.assert_ok()
    print(f"{res.label}: {res.proc.wall_s:.1f} s; slowest: {res.slowest()}; notes: {res.notes()}")
