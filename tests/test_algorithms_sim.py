"""Every registered algorithm, run by the in-process schedule checker on 1..8 ranks, against NumPy references."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from pycoll import ops
from pycoll.algorithms import ALGORITHMS, Call, Layout
from pycoll.algorithms.base import offsets
from pycoll.algorithms.simulate import ScheduleError, run_schedules

RANKS = range(1, 9)
DTYPES = [np.float32, np.float64, np.int32, np.int8, np.uint64]
REDUCE_OPS = [ops.SUM, ops.PROD, ops.MIN, ops.MAX, ops.AVG, ops.BAND, ops.BOR, ops.BXOR]
COUNTS = [0, 1, 7, 100]
# A 64-byte chunk splits only the largest count into several chunks; the others are one chunk at either size.
COUNT_CHUNKS = [(c, 1 << 20) for c in COUNTS] + [(COUNTS[-1], 64)]


def _data(rng: np.random.Generator, n: int, dtype, rank: int, op=ops.SUM) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return rng.uniform(0.5, 1.5, n).astype(dt)  # products of 8 stay finite; sums compare with tolerance
    hi = 3 if op is ops.PROD else 50
    return rng.integers(0, hi, n).astype(dt)


def _reference(op, arrays: list[np.ndarray]) -> np.ndarray:
    acc = arrays[0].copy()
    for a in arrays[1:]:
        op.ufunc(acc, a, out=acc)
    if op.averages:
        acc = acc / acc.dtype.type(len(arrays))
    return acc


def _close(got: np.ndarray, want: np.ndarray, label: str) -> None:
    if got.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=label)
    else:
        np.testing.assert_array_equal(got, want, err_msg=label)


def _ops_for(dtype) -> list:
    return [op for op in REDUCE_OPS if op.check(np.dtype(dtype)) is None]


def _layouts(p: int) -> list[Layout]:
    """A flat layout and, where it makes sense, 2 hosts (in blocks and round robin) and 3 (uneven for odd p)."""
    out = [Layout.flat(p)]
    if p >= 4:
        out.append(Layout(tuple(r * 2 // p for r in range(p))))
        out.append(Layout(tuple(r % 2 for r in range(p))))
    if p >= 5:
        out.append(Layout(tuple(min(r // 2, 2) for r in range(p))))
    return out


ARENA = ("oneshot", "staged", "cma", "slots")  # single-host arena algorithms: they refuse one rank
DEVICE = ("ipc_oneshot", "ipc_twoshot")  # device buffers only: they refuse these host calls (tests/test_cuda_ipc.py)
# non-commutative ops and reproducible calls only: they refuse these calls (tests/test_ops_datatypes.py and
# test_reproducible_algorithms_give_the_left_fold_bit_for_bit run them)
ORDERED = ("ordered", "owner")


def _algos(coll: str) -> list[str]:
    return list(ALGORITHMS[coll])


def _accepts(coll: str, name: str, call: Call, lay: Layout) -> bool:
    return ALGORITHMS[coll][name].refusal(call, lay) is None


# ---- allreduce ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", _algos("allreduce"))
@pytest.mark.parametrize("p", RANKS)
def test_allreduce(name: str, p: int) -> None:
    rng = np.random.default_rng(p)
    ran = 0
    for lay, dtype, (count, chunk), in_place in itertools.product(_layouts(p), DTYPES, COUNT_CHUNKS, (False, True)):
        for op in _ops_for(dtype):
            inputs = [_data(rng, count, dtype, r, op) for r in range(p)]
            sends = [a.copy() for a in inputs]
            recvs = [s if in_place else np.full(count, 77, dtype) for s in sends]
            calls = [Call("allreduce", np.dtype(dtype), sends[r], recvs[r], op, in_place=in_place) for r in range(p)]
            if not _accepts("allreduce", name, calls[0], lay):
                continue
            run_schedules(ALGORITHMS["allreduce"][name], calls, lay, chunk_bytes=chunk)
            want = _reference(op, inputs)
            for r in range(p):
                _close(recvs[r], want, f"{name} p={p} {lay} {np.dtype(dtype)} {op.name} n={count} rank {r}")
                if not in_place:
                    np.testing.assert_array_equal(sends[r], inputs[r])  # the input is left alone
            ran += 1
    if (name == "hierarchical" and p < 4) or (name in ARENA and p == 1) or name in DEVICE or name in ORDERED:
        assert ran == 0
    else:
        assert ran > 0


@pytest.mark.parametrize("p", (4, 5, 6, 8))
def test_hierarchical_allreduce_in_pipelined_segments(p: int, monkeypatch) -> None:
    """A large hierarchical allreduce runs as segments whose steps inside the hosts overlap the transfers between
    them; segments of 64 bytes here, so these counts run as 1 to 8 of them, on even and uneven hosts."""
    from pycoll.algorithms import hierarchical

    monkeypatch.setenv("PYCOLL_HIER_SEGMENT", "64")
    rng = np.random.default_rng(40 + p)
    ran = 0
    cases = itertools.product(_layouts(p)[1:], (np.float32, np.int32), (0, 7, 33, 1001), (False, True))
    for lay, dtype, count, in_place in cases:
        for op in (ops.SUM, ops.MAX, ops.AVG) if np.dtype(dtype).kind == "f" else (ops.SUM, ops.BXOR):
            inputs = [_data(rng, count, dtype, r, op) for r in range(p)]
            sends = [a.copy() for a in inputs]
            recvs = [s if in_place else np.full(count, 77, dtype) for s in sends]
            calls = [Call("allreduce", np.dtype(dtype), sends[r], recvs[r], op, in_place=in_place) for r in range(p)]
            if not _accepts("allreduce", "hierarchical", calls[0], lay):
                continue
            run_schedules(ALGORITHMS["allreduce"]["hierarchical"], calls, lay, chunk_bytes=48)
            want = _reference(op, inputs)
            for r in range(p):
                _close(recvs[r], want, f"p={p} {lay} {np.dtype(dtype)} {op.name} n={count} rank {r}")
            ran += 1
    assert ran > 0
    assert hierarchical._segments(1001 * 4) == 8 and hierarchical._segments(100) == 1


@pytest.mark.parametrize("p", (4, 6, 8))
def test_hierarchical_reduce_scatter_in_pipelined_segments(p: int, monkeypatch) -> None:
    """The hierarchical reduce-scatter in segments of 64 bytes (1 to 8 of them), even and uneven blocks."""
    monkeypatch.setenv("PYCOLL_HIER_SEGMENT", "64")
    rng = np.random.default_rng(60 + p)
    ran = 0
    for lay, each, vector, op in itertools.product(_layouts(p)[1:], (0, 3, 40, 300), (False, True),
                                                   (ops.SUM, ops.MAX, ops.AVG)):
        counts = [each + (r % 3 if vector else 0) for r in range(p)]
        inputs = [_data(rng, sum(counts), np.float32, r, op) for r in range(p)]
        recvs = [np.full(counts[r] + 2, 77, np.float32) for r in range(p)]
        calls = [Call("reduce_scatter", np.dtype(np.float32), inputs[r].copy(), recvs[r], op, counts=counts)
                 for r in range(p)]
        if not _accepts("reduce_scatter", "hierarchical", calls[0], lay):
            continue
        run_schedules(ALGORITHMS["reduce_scatter"]["hierarchical"], calls, lay, chunk_bytes=48)
        want, d = _reference(op, inputs), offsets(counts)
        for r in range(p):
            _close(recvs[r][: counts[r]], want[d[r] : d[r] + counts[r]], f"p={p} {lay} {op.name} rank {r}")
            np.testing.assert_array_equal(recvs[r][counts[r] :], 77)
        ran += 1
    assert ran > 0


# ---- reduce-scatter -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", _algos("reduce_scatter"))
@pytest.mark.parametrize("p", RANKS)
def test_reduce_scatter(name: str, p: int) -> None:
    rng = np.random.default_rng(100 + p)
    ran = 0
    each_chunks = ((0, 1 << 20), (1, 1 << 20), (5, 1 << 20), (5, 64))  # blocks of 5: several 64-byte chunks
    for lay, dtype, (each, chunk), in_place in itertools.product(_layouts(p), DTYPES[:3], each_chunks, (False, True)):
        for op in _ops_for(dtype):
            for vector in (False, True):
                counts = [each + (r % 3 if vector else 0) for r in range(p)]
                total = sum(counts)
                inputs = [_data(rng, total, dtype, r, op) for r in range(p)]
                sends = [a.copy() for a in inputs]
                recvs = [s if in_place else np.full(counts[r] + 2, 77, dtype) for r, s in enumerate(sends)]
                calls = [Call("reduce_scatter", np.dtype(dtype), sends[r] if not in_place else recvs[r][:total], recvs[r], op,
                              counts=counts, in_place=in_place) for r in range(p)]
                if not _accepts("reduce_scatter", name, calls[0], lay):
                    continue
                run_schedules(ALGORITHMS["reduce_scatter"][name], calls, lay, chunk_bytes=chunk)
                want = _reference(op, inputs)
                d = offsets(counts)
                for r in range(p):
                    _close(recvs[r][: counts[r]], want[d[r] : d[r] + counts[r]], f"{name} p={p} rank {r} {op.name}")
                    if not in_place:
                        np.testing.assert_array_equal(recvs[r][counts[r] :], 77)  # nothing written past the block
                ran += 1
    assert ran > 0 or (name == "hierarchical" and (p < 4 or p % 2)) or (name in ARENA and p == 1) or name in ORDERED


@pytest.mark.parametrize("p", (2, 3, 5))
def test_reduce_scatter_staged_in_many_rounds(p: int, monkeypatch) -> None:
    """A 4 KiB stage splits uneven blocks over many rounds; in place, results overwrite input not yet staged."""
    monkeypatch.setenv("PYCOLL_ARENA_STAGE", "4K")
    rng = np.random.default_rng(7 + p)
    for in_place, dtype in itertools.product((False, True), (np.float64, np.int32)):
        counts = [900 + 333 * (r % 3) for r in range(p)]  # 1 to 7 rounds' worth per block
        total = sum(counts)
        inputs = [_data(rng, total, dtype, r) for r in range(p)]
        sends = [a.copy() for a in inputs]
        recvs = [s if in_place else np.full(counts[r], 77, dtype) for r, s in enumerate(sends)]
        calls = [Call("reduce_scatter", np.dtype(dtype), sends[r], recvs[r], ops.SUM, counts=counts, in_place=in_place)
                 for r in range(p)]
        run_schedules(ALGORITHMS["reduce_scatter"]["staged"], calls)
        want, d = _reference(ops.SUM, inputs), offsets(counts)
        for r in range(p):
            _close(recvs[r][: counts[r]], want[d[r] : d[r] + counts[r]], f"staged p={p} rank {r} in_place={in_place}")
            if not in_place:
                np.testing.assert_array_equal(sends[r], inputs[r])


# ---- allgather ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", _algos("allgather"))
@pytest.mark.parametrize("p", RANKS)
def test_allgather(name: str, p: int) -> None:
    rng = np.random.default_rng(200 + p)
    ran = 0
    for lay, dtype, (each, chunk), in_place, gaps in itertools.product(
        _layouts(p), DTYPES, ((0, 1 << 20), (1, 1 << 20), (9, 1 << 20), (9, 64)), (False, True), (False, True)
    ):
        counts = [each + (r % 2 if gaps else 0) for r in range(p)]
        displs = [d + (2 * i if gaps else 0) for i, d in enumerate(offsets(counts))]  # holes between blocks
        size = (displs[-1] + counts[-1] + 2) if p else 0
        blocks = [_data(rng, counts[r], dtype, r) for r in range(p)]
        recvs = [np.full(size, 77, dtype) for _ in range(p)]
        sends = []
        for r in range(p):
            if in_place:
                recvs[r][displs[r] : displs[r] + counts[r]] = blocks[r]
                sends.append(None)
            else:
                sends.append(blocks[r].copy())
        calls = [Call("allgather", np.dtype(dtype), sends[r], recvs[r], counts=counts, displs=displs, in_place=in_place)
                 for r in range(p)]
        if not _accepts("allgather", name, calls[0], lay):
            continue
        run_schedules(ALGORITHMS["allgather"][name], calls, lay, chunk_bytes=chunk)
        want = np.full(size, 77, dtype)
        for r in range(p):
            want[displs[r] : displs[r] + counts[r]] = blocks[r]
        for r in range(p):
            np.testing.assert_array_equal(recvs[r], want, err_msg=f"{name} p={p} rank {r}")
        ran += 1
    assert ran > 0 or (name == "hierarchical" and (p < 4 or p % 2)) or (name in ARENA and p == 1)


# ---- broadcast and reduce -------------------------------------------------------------------------


@pytest.mark.parametrize("name", _algos("broadcast"))
@pytest.mark.parametrize("p", RANKS)
def test_broadcast(name: str, p: int) -> None:
    rng = np.random.default_rng(300 + p)
    for root, dtype, (count, chunk) in itertools.product(range(p), DTYPES, COUNT_CHUNKS):
        data = _data(rng, count, dtype, root)
        bufs = [data.copy() if r == root else np.full(count, 77, dtype) for r in range(p)]
        calls = [Call("broadcast", np.dtype(dtype), recv=bufs[r], root=root) for r in range(p)]
        run_schedules(ALGORITHMS["broadcast"][name], calls, chunk_bytes=chunk)
        for r in range(p):
            np.testing.assert_array_equal(bufs[r], data, err_msg=f"{name} p={p} root {root} rank {r}")


@pytest.mark.parametrize("name", _algos("reduce"))
@pytest.mark.parametrize("p", RANKS)
def test_reduce(name: str, p: int) -> None:
    rng = np.random.default_rng(400 + p)
    for root, dtype, (count, chunk), in_place in itertools.product(range(p), DTYPES[:3], COUNT_CHUNKS, (False, True)):
        for op in _ops_for(dtype):
            inputs = [_data(rng, count, dtype, r, op) for r in range(p)]
            sends = [a.copy() for a in inputs]
            root_recv = sends[root] if in_place else np.full(count, 77, dtype)
            calls = [Call("reduce", np.dtype(dtype), sends[r], root_recv if r == root else None, op, root=root,
                          in_place=in_place and r == root) for r in range(p)]
            run_schedules(ALGORITHMS["reduce"][name], calls, chunk_bytes=chunk)
            _close(root_recv, _reference(op, inputs), f"{name} p={p} root {root} {op.name}")
            for r in range(p):
                if r != root:
                    np.testing.assert_array_equal(sends[r], inputs[r])


# ---- reproducible mode ---------------------------------------------------------------------------------


def _left_fold(op, arrays: list[np.ndarray]) -> np.ndarray:
    out = functools.reduce(op.ufunc, arrays)
    return np.asarray(np.divide(out, out.dtype.type(len(arrays))) if op.averages else out, arrays[0].dtype)


@pytest.mark.parametrize("coll", ["allreduce", "reduce", "reduce_scatter"])
@pytest.mark.parametrize("p", RANKS)
def test_reproducible_algorithms_give_the_left_fold_bit_for_bit(coll: str, p: int) -> None:
    """Every algorithm that claims the rank-order left fold gives NumPy's bits on every layout and chunk size, with
    signed zeros for MIN and MAX; every other one declines the call."""
    rng = np.random.default_rng(900 + p)
    ran = 0
    for lay, dtype, (count, chunk), in_place in itertools.product(_layouts(p), (np.float32, np.float16), COUNT_CHUNKS,
                                                                  (False, True)):
        for op in (ops.SUM, ops.PROD, ops.MIN, ops.MAX, ops.AVG):
            total = count * p if coll == "reduce_scatter" else count
            inputs = [rng.standard_normal(total).astype(dtype) for _ in range(p)]
            for r, x in enumerate(inputs):
                x[::3] = -0.0 if r % 2 else 0.0
            want = _left_fold(op, inputs)
            for name, algo in ALGORITHMS[coll].items():
                sends = [a.copy() for a in inputs]
                root = p - 1
                if coll == "allreduce":
                    recvs = [s if in_place else np.full(count, 77, dtype) for s in sends]
                    calls = [Call(coll, np.dtype(dtype), sends[r], recvs[r], op, in_place=in_place, reproducible=True)
                             for r in range(p)]
                    outs, expect = list(range(p)), [want] * p
                elif coll == "reduce":
                    recvs = [sends[r] if in_place and r == root else (np.full(count, 77, dtype) if r == root else None)
                             for r in range(p)]
                    calls = [Call(coll, np.dtype(dtype), sends[r], recvs[r], op, root=root,
                                  in_place=in_place and r == root, reproducible=True) for r in range(p)]
                    outs, expect = [root], {root: want}
                else:
                    recvs = [s if in_place else np.full(count, 77, dtype) for s in sends]
                    calls = [Call(coll, np.dtype(dtype), sends[r], recvs[r], op, counts=[count] * p,
                                  in_place=in_place, reproducible=True) for r in range(p)]
                    outs, expect = list(range(p)), [want[r * count:(r + 1) * count] for r in range(p)]
                reason = algo.refusal(calls[0], lay)
                if not algo.reproducible:
                    assert reason and "left fold" in reason, f"{coll}:{name} accepts a reproducible call"
                if reason is not None:
                    continue
                run_schedules(algo, calls, lay, chunk_bytes=chunk)
                for r in outs:
                    got = recvs[r][:count] if coll == "reduce_scatter" else recvs[r]
                    assert got.tobytes() == np.asarray(expect[r]).tobytes(), (
                        f"{coll}:{name} p={p} {lay} {np.dtype(dtype)} {op.name} n={count} in_place={in_place} rank {r}")
                ran += 1
    assert ran > 0


# ---- the checker itself catches broken schedules ----------------------------------------------------


def _call(p: int, n: int = 8) -> list[Call]:
    return [Call("allreduce", np.dtype(np.float32), np.ones(n, np.float32), np.zeros(n, np.float32), ops.SUM) for _ in range(p)]


def test_checker_finds_a_send_without_receive() -> None:
    def extra_send(st, call):
        yield (st.send((st.rank + 1) % st.size, call.send),)

    with pytest.raises(ScheduleError, match="never received|wait forever"):
        run_schedules(extra_send, _call(3))


def test_checker_finds_a_receive_without_send() -> None:
    def lonely(st, call):
        if st.rank == 0:
            yield (st.recv(1, call.recv),)

    with pytest.raises(ScheduleError, match="deadlock.*never sends"):
        run_schedules(lonely, _call(2))


def test_checker_finds_size_mismatch() -> None:
    def short(st, call):
        if st.rank == 0:
            yield (st.send(1, call.send[:3]),)
        else:
            yield (st.recv(0, call.recv),)

    with pytest.raises(ScheduleError, match="sends 12 bytes to rank 1, which receives 32"):
        run_schedules(short, _call(2))


def test_checker_finds_a_cycle_of_waits() -> None:
    def both_wait_first(st, call):
        peer = 1 - st.rank
        yield (st.recv(peer, call.recv),)  # each waits before it sends
        yield (st.send(peer, call.send),)

    with pytest.raises(ScheduleError, match="deadlock: ranks \\[0, 1\\]"):
        run_schedules(both_wait_first, _call(2))


def test_checker_finds_sends_left_over() -> None:
    def fire_and_forget(st, call):
        if st.rank == 0:
            st.send(1, call.send)  # never waited for, never received
        yield ()

    with pytest.raises(ScheduleError, match="rank 0 -> rank 1: 1 send"):
        run_schedules(fire_and_forget, _call(2))


def test_checker_counts_traffic_of_ring() -> None:
    p, n = 4, 1024
    net = run_schedules(ALGORITHMS["allreduce"]["ring"], _call(p, n), chunk_bytes=1 << 20)
    assert net.bytes == 2 * (p - 1) * n * 4  # each rank sends 2(p-1)/p of the vector
    assert net.messages == 2 * (p - 1) * p
