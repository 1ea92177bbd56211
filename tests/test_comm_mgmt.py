"""Split / Dup / Free on 1..5 ranks over shm (2, 3 and 5 over tcp), with collectives and p2p on the new communicators."""

from __future__ import annotations

import pytest

import harness

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(180)]


@pytest.mark.parametrize(
    "n,transport", [pytest.param(n, t, id=f"n{n}-{t}") for n, t in harness.jobs()]
)
def test_comm_mgmt(n, transport, tmp_path):
    res = harness.run_cases(n, ["comm_mgmt.*"], transport=transport, out_dir=str(tmp_path), job_timeout=140)
    res.assert_ok()
    print(f"{res.label}: {res.proc.wall_s:.1f} s; slowest: {res.slowest()}; notes: {res.notes()}")
