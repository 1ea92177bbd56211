"""The pipelined staged allreduce, reduce-scatter, allgather, reduce and (ex)scan, stepped rank by rank on one real arena
in this process.

Each rank runs the compiled chunk loop or its NumPy twin (mixed ranks speak the same protocol); a rank that
must wait hands back, as in a job, and the driver steps the next. Results are checked bit for bit against
chained NumPy ufuncs in the documented order (own block first, then the peers in rank order).
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from pycoll import ops
from pycoll.algorithms import arena_jit, staged
from pycoll.algorithms.base import Call, even_counts, offsets
from pycoll.algorithms.arena_meeting import close_rounds
from pycoll.transport.arena import HostArena

KERNELS = arena_jit.unavailable() is None
WHO = ["python"] + (["kernel", "mixed"] if KERNELS else [])
DTYPES = [np.float32, np.float64, np.int32, np.uint8, np.complex64, np.bool_, np.float16]


def _arenas(tmp_path, p: int, stage: int) -> list[HostArena]:
    path = str(tmp_path / f"arena-{p}-{stage}")
    first = HostArena(path, 0, p, 4096, create=True, stage_bytes=stage)
    return [first] + [HostArena(path, r, p, 4096, create=False, stage_bytes=stage) for r in range(1, p)]


def _drive(arenas: list[HostArena], calls: list[Call], who: str) -> list[staged.Pipe]:
    """Step every rank's pipe in turn until all are done (failing on a stall), then close the rounds."""
    p = len(arenas)
    pipes = [staged.Pipe(a, c, r) for r, (a, c) in enumerate(zip(arenas, calls))]
    for r, pipe in enumerate(pipes):
        if who == "python" or (who == "mixed" and r % 2):
            pipe.kernel = False
        pipe.polls = 20  # hand back quickly: the driver is the scheduler
    views = [pipe.views(c) for pipe, c in zip(pipes, calls)]
    base = arenas[0].rounds
    assert all(a.rounds == base for a in arenas)
    at = [0] * p
    for _ in range(100_000):
        if all(j >= pipe.nchunks for j, pipe in zip(at, pipes)):
            break
        for r in range(p):
            at[r], _ = pipes[r].run(arenas[r], *views[r], base, at[r])
    else:
        pytest.fail(f"the pipe stalled at chunks {at} of {[pipe.nchunks for pipe in pipes]}")
    for a, pipe in zip(arenas, pipes):
        close_rounds(a, base + pipe.nchunks)
    return pipes


def _inputs(rng, dt, p: int, n: int) -> list[np.ndarray]:
    dt = np.dtype(dt)
    if dt.kind == "b":
        return [rng.integers(0, 2, n).astype(dt) for _ in range(p)]
    if dt.kind in "iu":
        return [rng.integers(0, 100, n).astype(dt) for _ in range(p)]
    vals = [rng.standard_normal(n) * 4 for _ in range(p)]
    if dt.kind == "c":
        vals = [v + 1j * rng.standard_normal(n) for v in vals]
    out = [v.astype(dt) for v in vals]
    if dt.kind == "f" and n > 3:
        out[0][1], out[-1][2] = np.nan, np.inf
    return out


def _reduced(op: ops.Op, rows: list[np.ndarray]) -> np.ndarray:
    """A block's result: the left fold in rank order, a new array each step, as ``functools.reduce`` gives it (the
    pipe folds each block in rank order, the owner's own input at its place)."""
    with np.errstate(all="ignore"):
        acc = rows[0].copy()
        for row in rows[1:]:
            acc = op.ufunc(acc, row).astype(rows[0].dtype, copy=False)  # LAND, LOR, LXOR give bools
        if op.averages and acc.size:
            acc = np.divide(acc, acc.dtype.type(len(rows)))
    return acc


def _ops_for(dt) -> list[ops.Op]:
    return [o for o in (ops.SUM, ops.PROD, ops.MAX, ops.MIN, ops.BXOR, ops.LOR, ops.AVG) if o.check(np.dtype(dt)) is None]


@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("p", [2, 3, 5])
def test_allreduce_pipe(tmp_path, p: int, who: str) -> None:
    """Every block's owner reduces; every rank ends with every block, the same bits; in and out of place."""
    arenas = _arenas(tmp_path, p, 4096)  # small stage: many chunks, the ring wraps
    rng = np.random.default_rng(p)
    tried = 0
    for dt, n, in_place in itertools.product(DTYPES, (0, 1, 7, 1000), (False, True)):
        for op in _ops_for(dt):
            rows = _inputs(rng, dt, p, n)
            sends = [r.copy() for r in rows]
            recvs = sends if in_place else [np.full(n, 3, dt) for _ in range(p)]
            calls = [Call("allreduce", np.dtype(dt), sends[r], recvs[r], op, in_place=in_place) for r in range(p)]
            _drive(arenas, calls, who)
            d, counts = offsets(even_counts(n, p)), even_counts(n, p)
            want = np.concatenate([_reduced(op, [row[d[q] : d[q] + counts[q]] for row in rows]) for q in range(p)]) if n else rows[0]
            for r in range(p):
                assert recvs[r].tobytes() == recvs[0].tobytes()  # every rank holds the same bits
                if np.dtype(dt).kind == "c" and op is ops.PROD:  # NumPy's vector loops may fuse, by slice length
                    np.testing.assert_allclose(recvs[r], want, rtol=1e-5)
                else:
                    assert recvs[r].tobytes() == want.tobytes(), f"{op.name} {np.dtype(dt)} n={n} rank {r} in_place={in_place}"
                if not in_place:
                    assert np.array_equal(sends[r], rows[r], equal_nan=sends[r].dtype.kind in "fc")
            tried += 1
    assert tried > 50


@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("p", [2, 3, 5])
def test_reduce_scatter_pipe(tmp_path, p: int, who: str) -> None:
    """Uneven and empty blocks; in place the result overwrites the input's head without corrupting later chunks."""
    arenas = _arenas(tmp_path, p, 4096)
    rng = np.random.default_rng(10 + p)
    for dt, each, in_place, op in itertools.product((np.float64, np.int32, np.float16), (0, 5, 700), (False, True), (ops.SUM, ops.MAX)):
        counts = [each + 333 * (r % 3) for r in range(p)]
        total = sum(counts)
        rows = _inputs(rng, dt, p, total)
        sends = [r.copy() for r in rows]
        recvs = sends if in_place else [np.full(counts[r] + 2, 7, dt) for r in range(p)]
        calls = [Call("reduce_scatter", np.dtype(dt), sends[r] if not in_place else recvs[r][:total], recvs[r], op,
                      counts=counts, in_place=in_place) for r in range(p)]
        _drive(arenas, calls, who)
        d = offsets(counts)
        for r in range(p):
            want = _reduced(op, [row[d[r] : d[r] + counts[r]] for row in rows])
            assert recvs[r][: counts[r]].tobytes() == want.tobytes(), f"{op.name} {np.dtype(dt)} counts={counts} rank {r}"
            if not in_place:
                assert (recvs[r][counts[r] :] == 7).all()  # nothing written past the block
                assert np.array_equal(sends[r], rows[r], equal_nan=True)


@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("p", [2, 3, 5])
def test_allgather_pipe(tmp_path, p: int, who: str) -> None:
    """Blocks of any dtype as bytes, with holes between them (Allgatherv displacements), in and out of place."""
    arenas = _arenas(tmp_path, p, 4096)
    rng = np.random.default_rng(20 + p)
    for dt, each, in_place in itertools.product((np.float32, np.complex128, np.int8), (0, 3, 900), (False, True)):
        counts = [each + 101 * (r % 2) for r in range(p)]
        displs = [d + 3 * i for i, d in enumerate(offsets(counts))]
        size = displs[-1] + counts[-1] + 2
        blocks = [_inputs(rng, dt, 1, counts[r])[0] for r in range(p)]
        recvs = [np.zeros(size, dt) for _ in range(p)]
        sends = []
        for r in range(p):
            if in_place:
                recvs[r][displs[r] : displs[r] + counts[r]] = blocks[r]
            sends.append(None if in_place else blocks[r].copy())
        calls = [Call("allgather", np.dtype(dt), sends[r], recvs[r], counts=counts, displs=displs, in_place=in_place) for r in range(p)]
        _drive(arenas, calls, who)
        for r in range(p):
            for q in range(p):
                got = recvs[r][displs[q] : displs[q] + counts[q]]
                assert got.tobytes() == blocks[q].tobytes(), f"{np.dtype(dt)} rank {r} block {q} in_place={in_place}"
            holes = np.ones(size, bool)
            for q in range(p):
                holes[displs[q] : displs[q] + counts[q]] = False
            assert not recvs[r][holes].any()  # nothing written between or after the blocks


@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("p", [2, 3, 5])
def test_reduce_pipe(tmp_path, p: int, who: str) -> None:
    """The root ends with every block reduced by its owner, as the allreduce's; the others' buffers stay as they were
    (they reduce into their stage); the root in the middle and at either end, in and out of place."""
    arenas = _arenas(tmp_path, p, 4096)
    rng = np.random.default_rng(30 + p)
    tried = 0
    for dt, n, in_place, root in itertools.product(DTYPES, (0, 1, 7, 1000), (False, True), sorted({0, p // 2, p - 1})):
        for op in _ops_for(dt):
            rows = _inputs(rng, dt, p, n)
            sends = [r.copy() for r in rows]
            recv = sends[root] if in_place else np.full(n, 3, dt)
            calls = [Call("reduce", np.dtype(dt), sends[r], recv if r == root else None, op, root=root,
                          in_place=in_place and r == root) for r in range(p)]
            _drive(arenas, calls, who)
            d, counts = offsets(even_counts(n, p)), even_counts(n, p)
            want = np.concatenate([_reduced(op, [row[d[q] : d[q] + counts[q]] for row in rows]) for q in range(p)]) if n else rows[0]
            if np.dtype(dt).kind == "c" and op is ops.PROD:
                np.testing.assert_allclose(recv, want, rtol=1e-5)
            else:
                assert recv.tobytes() == want.tobytes(), f"{op.name} {np.dtype(dt)} n={n} root {root} in_place={in_place}"
            for r in range(p):
                if r != root or not in_place:
                    assert np.array_equal(sends[r], rows[r], equal_nan=sends[r].dtype.kind in "fc")
            tried += 1
    assert tried > 50


@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("p", [2, 3, 5])
@pytest.mark.parametrize("coll", ["scan", "exscan"])
def test_scan_pipe(tmp_path, p: int, who: str, coll: str) -> None:
    """Rank r ends with the left fold of ranks 0..r's inputs (Exscan: 0..r-1; rank 0 untouched), bit for bit, in and
    out of place; the inputs stay as they were."""
    arenas = _arenas(tmp_path, p, 4096)
    rng = np.random.default_rng(40 + p)
    tried = 0
    for dt, n, in_place in itertools.product(DTYPES, (0, 1, 7, 1000), (False, True)):
        for op in _ops_for(dt):
            rows = _inputs(rng, dt, p, n)
            sends = [r.copy() for r in rows]
            recvs = sends if in_place else [np.full(n, 3, dt) for _ in range(p)]
            calls = [Call(coll, np.dtype(dt), sends[r], recvs[r], op, in_place=in_place) for r in range(p)]
            _drive(arenas, calls, who)
            for r in range(p):
                k = r + 1 if coll == "scan" else r
                if k == 0:
                    want = rows[r] if in_place else np.full(n, 3, dt)
                else:
                    with np.errstate(all="ignore"):
                        want = functools.reduce(lambda a, b: op.ufunc(a, b), rows[:k]).astype(dt, copy=True)
                        if op.averages and n:
                            want = np.divide(want, want.dtype.type(k)).astype(dt)
                if np.dtype(dt).kind == "c" and op is ops.PROD:
                    np.testing.assert_allclose(recvs[r], want, rtol=1e-5)
                else:
                    assert recvs[r].tobytes() == want.tobytes(), f"{coll} {op.name} {np.dtype(dt)} n={n} rank {r} in_place={in_place}"
                if not in_place:
                    assert np.array_equal(sends[r], rows[r], equal_nan=sends[r].dtype.kind in "fc")
            tried += 1
    assert tried > 50


@pytest.mark.skipif(not KERNELS, reason=f"compiled arena path unavailable: {arena_jit.unavailable()}")
def test_kernel_hands_back_and_resumes(tmp_path) -> None:
    """A rank whose peer has not staged stops in the right phase with its own part staged, then resumes there."""
    arenas = _arenas(tmp_path, 2, 4096)
    n = 5000
    rows = [np.arange(n, dtype=np.float64) * (r + 1) for r in range(2)]
    recvs = [np.zeros(n) for _ in range(2)]
    calls = [Call("allreduce", np.dtype(np.float64), rows[r], recvs[r], ops.SUM) for r in range(2)]
    pipes = [staged.Pipe(a, c, r) for r, (a, c) in enumerate(zip(arenas, calls))]
    for pipe in pipes:
        pipe.polls = 20
    j, phase = pipes[0].run(arenas[0], *pipes[0].views(calls[0]), 0, 0)
    assert (j, phase) == (0, 1)  # staged chunk 0, waits for rank 1's stage
    j1, phase1 = pipes[1].run(arenas[1], *pipes[1].views(calls[1]), 0, 0)
    assert (j1, phase1) == (0, 2)  # staged and reduced chunk 0, waits for rank 0's result
    j, phase = pipes[0].run(arenas[0], *pipes[0].views(calls[0]), 0, j)
    assert j == 1 and phase == 1  # finished chunk 0 and staged chunk 1
    half = pipes[0].c
    assert np.array_equal(recvs[0][:half], rows[0][:half] + rows[1][:half])
