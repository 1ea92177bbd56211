"""Scan and Exscan: every algorithm in process on 1..8 ranks, then the rank-side cases on 1..5 ranks over shm and tcp."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import harness
from pycoll import ops
from pycoll.algorithms import ALGORITHMS, Call, Layout, cost, select
from pycoll.algorithms.simulate import run_schedules

PAIRS = [("SUM", np.float32), ("PROD", np.complex128), ("AVG", np.float64), ("MAX", np.float64), ("BXOR", np.int64)]


def _inputs(op, dt, p, n, rng):
    if op == "BXOR":
        return [rng.integers(-(2**62), 2**62, n) for _ in range(p)]
    xs = [rng.standard_normal(n) + (1j * rng.standard_normal(n) if dt == np.complex128 else 0) for _ in range(p)]
    return [x.astype(dt) for x in xs]


@pytest.mark.parametrize("coll", ["scan", "exscan"])
@pytest.mark.parametrize("name", ["linear", "doubling"])
def test_schedules_give_left_fold_bits(coll: str, name: str) -> None:
    """In process, 1..8 ranks, tiny chunks: recvbuf holds functools.reduce(ufunc, x_0..x_k) bit for bit."""
    rng = np.random.default_rng(7)
    algo = ALGORITHMS[coll][name]
    for p in range(1, 9):
        for n in (0, 1, 7, 300):
            for opname, dt in PAIRS:
                op = ops.OPS[opname]
                for in_place in (False, True):
                    xs = _inputs(opname, dt, p, n, rng)
                    recvs = [x.copy() if in_place else np.full(n, 5, dt) for x in xs]
                    calls = [Call(coll, np.dtype(dt), recvs[r] if in_place else xs[r].copy(), recvs[r], op,
                                  in_place=in_place) for r in range(p)]
                    run_schedules(algo, calls, chunk_bytes=64, arena=False)
                    for r in range(p):
                        k = r + 1 if coll == "scan" else r
                        if k == 0:  # Exscan at rank 0: untouched
                            want = xs[r] if in_place else np.full(n, 5, dt)
                        else:
                            want = functools.reduce(op.ufunc, xs[:k])
                            if op.averages:
                                want = np.divide(want, np.dtype(dt).type(k))
                        assert np.array_equal(recvs[r], want), (coll, name, p, n, opname, in_place, r)


def test_cost_prefers_doubling_small_and_chain_large() -> None:
    model = cost.current()
    for lay in (Layout.flat(8), Layout((0, 0, 0, 0, 1, 1, 1, 1))):
        for coll in ("scan", "exscan"):
            algos = ALGORITHMS[coll]
            doubling, linear = algos["doubling"], algos["linear"]
            assert doubling.predict(model, 8, lay) < linear.predict(model, 8, lay)
            assert linear.predict(model, 16 << 20, lay) < doubling.predict(model, 16 << 20, lay)
            if lay.hosts > 1:  # the one-host arena algorithms decline: the choice is between these two
                small = Call(coll, np.dtype(np.float32), np.zeros(2, np.float32), np.zeros(2, np.float32), ops.SUM)
                large = Call(coll, np.dtype(np.float32), np.zeros(1 << 22, np.float32), np.zeros(1 << 22, np.float32),
                             ops.SUM)
                assert select(small, lay).name == "doubling"
                assert select(large, lay).name == "linear"
            big = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), (256 << 20,), (0,))  # 256 MiB, no memory
            huge = Call(coll, np.dtype(np.uint8), big, big, ops.SUM)  # 8 ranks: 2 GiB held by the last one
            assert "MiB" in (doubling.refusal(huge, lay) or "")
            assert linear.refusal(huge, lay) is None


@pytest.mark.ranks
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_scan_cases(n: int, transport: str, tmp_path) -> None:
    res = harness.run_cases(n, ["scan.*"], transport=transport, out_dir=str(tmp_path), job_timeout=80)
    res.assert_ok()
    print(f"{res.label}: {res.proc.wall_s:.1f} s; slowest: {res.slowest()}")
