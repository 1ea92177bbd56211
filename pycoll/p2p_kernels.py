"""Numba kernels of the eager point-to-point path: one small frame written into, or taken out of, a shared-memory
ring in one compiled call. Importing this module needs Numba; it compiles (or loads from Numba's disk cache) its
explicit signatures at import, so a call never compiles and a buffer of another kind is refused (TypeError).

The frames are the engine's (``p2p._HEADER``): six 64-bit header words (ctx, tag, nbytes, meta | root << 32, count,
vhash), the payload from byte 64, zero padding to 64 bytes. The rings are ``transport.shm``'s: the writer's count
in header word 0, the reader's in word 8, each stored with release order after the bytes it covers.
"""

from __future__ import annotations

from numba import carray, njit, types

from .transport.atomics import byte_pointer, cpu_relax, load_acquire, store_seq_cst

HEADER_BYTES = 64
TAKEN, EMPTY, OTHER = 0, 1, 2  # eager_take: a frame was taken; nothing arrived in the spin; the next frame is not ours

_BYTES = types.Array(types.uint8, 1, "C")
_READ_ONLY_BYTES = types.Array(types.uint8, 1, "C", readonly=True)
_WORDS = types.Array(types.uint64, 1, "C")
_I64 = types.int64
_PUT = [types.int64(_BYTES, _WORDS, _WORDS, _I64, payload, _I64, _I64, _I64) for payload in (_BYTES, _READ_ONLY_BYTES)]
_TAKE = [types.UniTuple(types.int64, 4)(_BYTES, _WORDS, _WORDS, _I64, _BYTES, _I64, _I64, _I64, _I64)]


@njit(_PUT, cache=True, nogil=True)
def eager_put(data, data64, words, tail, payload, ctx, tag, meta):
    """Write one frame at the ring's ``tail`` and publish it; the new tail, or -1 (nothing written) when it does not
    fit contiguously in the free space."""
    cap = data.size
    n = payload.size
    total = HEADER_BYTES + (n + HEADER_BYTES - 1) // HEADER_BYTES * HEADER_BYTES
    pos = tail % cap
    if pos + total > cap or cap - (tail - types.int64(load_acquire(words, 8))) < total:
        return -1
    w = pos // 8
    data64[w] = ctx
    data64[w + 1] = tag
    data64[w + 2] = n
    data64[w + 3] = meta
    data64[w + 4] = 0
    data64[w + 5] = 0
    if n:
        d = carray(byte_pointer(data, pos + HEADER_BYTES), n)
        for i in range(n):
            d[i] = payload[i]
    tail += total
    store_seq_cst(words, 0, tail)
    return tail


@njit(_TAKE, cache=True, nogil=True)
def eager_take(data, data64, words, head, dst, ctx, tag, meta, polls):
    """Wait up to ``polls`` polls for a frame at the ring's ``head``; copy its payload into ``dst`` and consume it
    if it is a plain point-to-point frame of ``ctx`` with ``tag`` (any tag if negative) that fits ``dst`` whole.
    Returns (status, nbytes, tag, new head); only TAKEN consumed anything."""
    cap = data.size
    tail = types.int64(load_acquire(words, 0))
    while tail == head:
        if polls <= 0:
            return EMPTY, 0, 0, head
        polls -= 1
        cpu_relax()
        tail = types.int64(load_acquire(words, 0))
    pos = head % cap
    w = pos // 8
    n = types.int64(data64[w + 2])
    got_tag = types.int64(data64[w + 1])
    total = HEADER_BYTES + (n + HEADER_BYTES - 1) // HEADER_BYTES * HEADER_BYTES
    if (tail - head < total or pos + total > cap or types.int64(data64[w]) != ctx or (tag >= 0 and got_tag != tag)
            or types.int64(data64[w + 3]) != meta or data64[w + 4] != 0 or data64[w + 5] != 0 or n > dst.size):
        return OTHER, 0, 0, head
    if n:
        s = carray(byte_pointer(data, pos + HEADER_BYTES), n)
        for i in range(n):
            dst[i] = s[i]
    head += total
    store_seq_cst(words, 8, head)
    return TAKEN, n, got_tag, head


_EXCHANGE = [types.UniTuple(types.int64, 5)(_BYTES, _WORDS, _WORDS, _I64, payload, _I64, _I64,
                                           _BYTES, _WORDS, _WORDS, _I64, _BYTES, _I64, _I64, _I64)
             for payload in (_BYTES, _READ_ONLY_BYTES)]


@njit(_EXCHANGE, cache=True, nogil=True)
def eager_exchange(out, out64, out_words, tail, payload, send_tag, ctx, inp, in64, in_words, head, dst, recv_tag,
                   meta, polls):
    """``eager_put`` then ``eager_take`` in one call (a Sendrecv): (new tail or -1, then ``eager_take``'s four
    results); nothing is taken unless the frame was put."""
    tail = eager_put(out, out64, out_words, tail, payload, ctx, send_tag, meta)
    if tail < 0:
        return tail, EMPTY, 0, 0, head
    status, n, got_tag, head = eager_take(inp, in64, in_words, head, dst, ctx, recv_tag, meta, polls)
    return tail, status, n, got_tag, head
