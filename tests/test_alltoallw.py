"""Alltoallw and Ialltoallw on 1 to 4 ranks (tests/cases/alltoallw.py), checked against NumPy references."""

from __future__ import annotations

import pytest

import harness

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_alltoallw(n, tmp_path):
    res = harness.run_cases(n, ["alltoallw.*"], out_dir=str(tmp_path), job_timeout=110)
    res.assert_ok()
