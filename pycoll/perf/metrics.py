"""Bus-bandwidth factors, size/count rounding and bandwidth math, as nccl-tests' PERFORMANCE.md defines them."""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

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


def min_link_bytes(collective: str, nbytes: int, per_host: Sequence[int], root_host: int = 0,
                   p2p_hosts: tuple[int, int] = (0, 0)) -> Optional[float]:
    """The fewest bytes that must cross between hosts in one call (every host's links together), for ranks placed
    ``per_host[h]`` on host h, the root on host ``root_host`` and ranks 0 and 1 on ``p2p_hosts``; None where no
    bound is kept (barrier, scan, sendrecv).

    Allreduce: each host sends 2 n (H-1)/H at least (reduce-scatter then allgather across hosts); broadcast,
    reduce, allgather and reduce_scatter: n (H-1) (each block from or to a host crosses once per other host);
    alltoall, gather and scatter: the blocks whose two ranks sit on different hosts; point-to-point: n when
    ranks 0 and 1 sit on different hosts (per message)."""
    hosts = sum(1 for k in per_host if k)
    total = sum(per_host)
    if collective == "allreduce":
        return 2.0 * nbytes * (hosts - 1)
    if collective in ("broadcast", "reduce", "allgather", "reduce_scatter"):
        return float(nbytes * (hosts - 1))
    if collective == "alltoall":  # nbytes: what one rank sends, a block to every rank
        return nbytes / total * sum(k * (total - k) for k in per_host)
    if collective in ("gather", "scatter"):  # nbytes: the root's whole buffer
        return nbytes * (total - per_host[root_host]) / total
    if collective in P2P:
        return float(nbytes) if p2p_hosts[0] != p2p_hosts[1] else 0.0
    return None
