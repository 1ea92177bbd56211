"""Where a copy between two addresses is slow: the page, and the short distance within it that memcpy crosses slowly.

The kernel and glibc copy with `rep movsb`, which on some CPUs runs several times slower when the destination lies
1-31 bytes past the source modulo a page (AMD EPYC here: 1 MiB in 0.7 ms against 0.13 ms). Two arrays allocated one
after the other on the heap sit 16 bytes apart modulo a page, in every rank alike, so a program's send and receive
buffers often meet at that distance. On such CPUs these copies go through a bounce buffer half a page from both
ends: host copies (``pycoll.memory``), cross-memory attach (``transport.cma``) and the compiled kernels
(``transport.atomics``). Elsewhere (Intel Xeon here: 1.2x, no more than any other misalignment within a cache line)
the bounce's second copy costs more than it saves, so each copier times itself once (``slow_at_short_distance``).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

PAGE = 4096
SHORT_DISTANCE = 64
BOUNCE_BYTES = 1 << 20  # the bounce's size: one system call costs about 9 µs, so it moves at least this much


def short_distance(dst: int, src: int) -> bool:
    """Whether a copy from address ``src`` to ``dst`` meets the slow distance (bounced where the copier is slow
    there: ``slow_at_short_distance``)."""
    return 0 < (dst - src) % PAGE < SHORT_DISTANCE


PROBE_BYTES = 256 << 10
SLOW_RATIO = 2.0  # slow: at least this many times the time of the same copy half a page apart


def slow_at_short_distance(copy: Callable[[int, int, int], object], reps: int = 7) -> bool:
    """Whether ``copy(dst, src, nbytes)`` (addresses in this process) runs at least ``SLOW_RATIO`` times slower when
    the destination lies 16 bytes past the source modulo a page than half a page past it: the fastest of ``reps``
    timings of each, alternating, of ``PROBE_BYTES`` (about 0.4-0.8 ms in all here)."""
    buf = np.ones(2 * PROBE_BYTES + 3 * PAGE, np.uint8)
    src = buf.ctypes.data + (-buf.ctypes.data) % PAGE
    dst = src + PROBE_BYTES + PAGE
    best = {16: float("inf"), PAGE // 2: float("inf")}
    for _ in range(reps):
        for dist in best:
            t0 = time.perf_counter()
            copy(dst + dist, src, PROBE_BYTES)
            best[dist] = min(best[dist], time.perf_counter() - t0)
    return best[16] >= SLOW_RATIO * best[PAGE // 2]
