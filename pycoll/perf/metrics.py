"""Bus-bandwidth factors, size/count rounding and bandwidth math, as nccl-tests' PERFORMANCE.md defines them."""

from __future__ import annotations

import statistics
from typing import Sequence

# Collectives whose size is the big buffer, split into one block per rank.
SPLIT = frozenset({"allgather", "reduce_scatter", "alltoall", "gather", "scatter"})
REDUCING = frozenset({"allreduce", "reduce_scatter", "reduce", "scan"})
ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})
SIZELESS = frozenset({"barrier"})  # one point, time only
P2P = frozenset({"pingpong", "p2p_bw"})  # ranks 0 and 1 only, timed on rank 0
NO_INPLACE = frozenset({"sendrecv"}) | SIZELESS | P2P  # measured once, reported as out-of-place
FACTOR_ONE = frozenset({"broadcast", "reduce", "sendrecv", "scan"}) | P2P
P2P_WINDOW = 64  # messages in flight per p2p_bw iteration (osu_bw's window)


def bus_factor(collective: str, nranks: int) -> float:
    """busbw = algbw * factor (0 for the size-less barrier)."""
    n = nranks
    if collective == "allreduce":
        return 2.0 * (n - 1) / n
    if collective in SPLIT:
        return (n - 1) / n
    if collective in FACTOR_ONE:
        return 1.0
    if collective in SIZELESS:
        return 0.0
    raise ValueError(f"unknown collective {collective!r}")


def calls_per_iteration(collective: str) -> int:
    """What one timed iteration is divided by: a ping-pong is two one-way trips, a p2p_bw window P2P_WINDOW messages."""
    return {"pingpong": 2, "p2p_bw": P2P_WINDOW}.get(collective, 1)


def round_size(collective: str, size: int, itemsize: int, nranks: int) -> tuple[int, int]:
    """(bytes, count) actually moved for a requested size, rounded down as nccl-tests does.

    count is the per-call count: all elements for allreduce/broadcast/reduce, the per-rank block for
    allgather/reduce_scatter/alltoall/gather/scatter (whose bytes are then count * itemsize * nranks).
    The barrier moves nothing: (0, 0)."""
    if collective in SIZELESS:
        return 0, 0
    elements = size // itemsize
    if collective in SPLIT:
        count = elements // nranks
        return count * itemsize * nranks, count
    return elements * itemsize, elements


def algbw(nbytes: int, time_us: float) -> float:
    """GB/s (1e9 bytes per second) of size / time."""
    return nbytes / (time_us * 1e3) if time_us > 0 else 0.0


def busbw(collective: str, nranks: int, nbytes: int, time_us: float) -> float:
    return algbw(nbytes, time_us) * bus_factor(collective, nranks)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def slowest_rank_time(per_rank: Sequence[Sequence[float]]) -> float:
    """Time of one size: per iteration the max over ranks, then the median over iterations."""
    per_iter = [max(times) for times in zip(*per_rank)]
    return median(per_iter)
