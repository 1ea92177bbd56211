"""Bus-bandwidth factors, size/count rounding and bandwidth math, as nccl-tests' PERFORMANCE.md defines them."""

from __future__ import annotations

import statistics
from typing import Sequence

# Collectives whose size is the big buffer, split into one block per rank.
SPLIT = frozenset({"allgather", "reduce_scatter", "alltoall"})
REDUCING = frozenset({"allreduce", "reduce_scatter", "reduce"})
ROOTED = frozenset({"broadcast", "reduce"})


def bus_factor(collective: str, nranks: int) -> float:
    """busbw = algbw * factor."""
    n = nranks
    if collective == "allreduce":
        return 2.0 * (n - 1) / n
    if collective in SPLIT:
        return (n - 1) / n
    if collective in ROOTED:
        return 1.0
    raise ValueError(f"unknown collective {collective!r}")


def round_size(collective: str, size: int, itemsize: int, nranks: int) -> tuple[int, int]:
    """(bytes, count) actually moved for a requested size, rounded down as nccl-tests does.

    count is the per-call count: all elements for allreduce/broadcast/reduce, the per-rank block for
    allgather/reduce_scatter/alltoall (whose bytes are then count * itemsize * nranks)."""
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
