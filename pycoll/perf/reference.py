"""What `pycoll perf` checks each timed call against: every rank's inputs, the output NumPy says each collective
must give, and the count of wrong elements (checked in chunks, so a large output is never held twice)."""

from __future__ import annotations

from typing import Any, Iterable, Optional

import numpy as np

from pycoll.perf import metrics

P2P_SLOT_BYTES = 64 << 20  # p2p_bw: distinct receive slots up to this many bytes, then slots are reused


def window_slots(count: int, itemsize: int) -> int:
    """Receive slots of p2p_bw: one per message of the window while they fit in P2P_SLOT_BYTES (then reused)."""
    return max(1, min(metrics.P2P_WINDOW, P2P_SLOT_BYTES // max(1, count * itemsize)))


def np_dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def inputs(rank: int, length: int, op: str, dtype: Any = np.float64) -> np.ndarray:
    """Small integers (1..3, or 1..2 for prod) so every dtype and every sum is exact: element i is
    (i + rank) % m + 1, tiled from one period so that no temporary is larger than the result."""
    mod = 2 if op == "prod" else 3
    period = ((np.arange(mod) + rank) % mod + 1).astype(dtype)
    return np.resize(period, length)


_COMBINE = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def _reduce(arrays: Iterable[np.ndarray], op: str) -> np.ndarray:
    """The elementwise reduction of ``arrays`` in float64, one input in memory at a time."""
    acc, n = None, 0
    for a in arrays:
        acc = a.astype(np.float64) if acc is None else _COMBINE[op](acc, a, out=acc)
        n += 1
    assert acc is not None
    return acc / n if op == "avg" else acc


CHECK_CHUNK = 1 << 22  # output elements checked at a time: the reference never holds a whole large output


def participates(coll: str, rank: int, root: int) -> bool:
    """Whether this rank has an output to check."""
    if coll in ("reduce", "gather"):
        return rank == root
    if coll == "pingpong":
        return rank in (0, 1)
    if coll == "p2p_bw":
        return rank == 1
    return coll != "barrier"


def output_length(coll: str, n: int, count: int, dtype: str = "float32") -> int:
    if coll in ("allgather", "alltoall", "gather"):
        return n * count
    if coll == "p2p_bw":
        return window_slots(count, np_dtype(dtype).itemsize) * count
    return count


def expected(coll: str, rank: int, n: int, count: int, op: str, root: int, dtype: str, lo: int = 0,
             hi: Optional[int] = None) -> Optional[np.ndarray]:
    """NumPy reference of elements lo:hi of this rank's output, in float64 rounded through the dtype.

    Input element i of rank r is (i + r) % m + 1 (see ``inputs``), so any slice is computed without the rest."""
    if not participates(coll, rank, root):
        return None
    mod = 2 if op == "prod" else 3
    i = np.arange(lo, output_length(coll, n, count, dtype) if hi is None else hi, dtype=np.int64)
    value = lambda r, idx: ((idx + r) % mod + 1).astype(np.float64)  # noqa: E731 - rank r's input at idx
    if coll in ("allreduce", "reduce"):
        ref = _reduce((value(r, i) for r in range(n)), op)
    elif coll == "broadcast":
        ref = value(root, i)
    elif coll in ("allgather", "gather"):  # block b is rank b's input
        ref = value(i // count, i % count)
    elif coll == "scatter":  # block `rank` of the root's input
        ref = value(root, rank * count + i)
    elif coll == "sendrecv":  # from the left neighbour
        ref = value((rank - 1) % n, i)
    elif coll == "scan":  # inclusive prefix over ranks 0..rank
        ref = _reduce((value(r, i) for r in range(rank + 1)), op)
    elif coll == "pingpong":  # rank 0's message, echoed back to it by rank 1
        ref = value(0, i)
    elif coll == "p2p_bw":  # every slot holds rank 0's message
        ref = value(0, i % count)
    elif coll == "reduce_scatter":
        ref = _reduce((value(r, rank * count + i) for r in range(n)), op)
    elif coll == "alltoall":  # block b is block `rank` of rank b's input
        ref = value(i // count, rank * count + i % count)
    else:
        raise ValueError(coll)
    return ref.astype(np_dtype(dtype)).astype(np.float64)


def check_result(got: Optional[np.ndarray], coll: str, rank: int, n: int, count: int, op: str, root: int,
                 dtype: str) -> int:
    """Wrong elements of this rank's output, compared CHECK_CHUNK elements at a time."""
    if not participates(coll, rank, root):
        return 0
    total = output_length(coll, n, count, dtype)
    if got is None or got.size != total:
        return total
    flat = got.reshape(-1)
    return sum(count_wrong(flat[lo:lo + CHECK_CHUNK].astype(np.float64),
                           expected(coll, rank, n, count, op, root, dtype, lo, min(lo + CHECK_CHUNK, total)), dtype, op)
               for lo in range(0, total, CHECK_CHUNK))


def count_wrong(got: Optional[np.ndarray], ref: Optional[np.ndarray], dtype: str, op: str) -> int:
    if ref is None:
        return 0
    if got is None or got.shape != ref.shape:
        return int(ref.size)
    if np.issubdtype(np_dtype(dtype), np.integer):
        tol = 1.0 if op == "avg" else 0.0  # integer averages may round either way
        return int(np.count_nonzero(np.abs(got - ref) > tol))
    rtol = 1e-2 if dtype in ("float16", "bfloat16") else 1e-5
    return int(np.count_nonzero(~np.isclose(got, ref, rtol=rtol, atol=0.0)))
