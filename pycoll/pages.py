"""Where a copy between two addresses is slow: the page, and the short distance within it that memcpy crosses slowly.

The kernel and glibc copy with `rep movsb`, which on some CPUs runs several times slower when the destination lies
1-31 bytes past the source modulo a page (AMD EPYC here: 1 MiB in 0.7 ms against 0.13 ms). Two arrays allocated one
after the other on the heap sit 16 bytes apart modulo a page, in every rank alike, so a program's send and receive
buffers often meet at that distance. Such copies go through a bounce buffer half a page from both ends: host copies
(``pycoll.memory``), cross-memory attach (``transport.cma``) and the compiled kernels (``transport.atomics``).
"""

from __future__ import annotations

PAGE = 4096
SHORT_DISTANCE = 64
BOUNCE_BYTES = 1 << 20  # the bounce's size: one system call costs about 9 µs, so it moves at least this much


def short_distance(dst: int, src: int) -> bool:
    """Whether a copy from address ``src`` to ``dst`` meets the slow distance (then it is bounced)."""
    return 0 < (dst - src) % PAGE < SHORT_DISTANCE
