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
# eager_take: a frame was taken; nothing arrived in the spin; the next frame is not ours; the next frame announces
# a rendezvous of ours (left in the ring: its address is header word 4, its id word 5)
TAKEN, EMPTY, OTHER, ANNOUNCED = 0, 1, 2, 3

_BYTES = types.Array(types.uint8, 1, "C")
_READ_ONLY_BYTES = types.Array(types.uint8, 1, "C", readonly=True)
_WORDS = types.Array(types.uint64, 1, "C")
_I64 = types.int64
_PUT = [types.int64(_BYTES, _WORDS, _WORDS, _I64, payload, _I64, _I64, _I64) for payload in (_BYTES, _READ_ONLY_BYTES)]
_TAKE = [types.UniTuple(types.int64, 4)(_BYTES, _WORDS, _WORDS, _I64, _BYTES, _I64, _I64, _I64, _I64, _I64)]
_PUT_HEADER = [types.int64(_BYTES, _WORDS, _WORDS, _I64, _I64, _I64, _I64, _I64, _I64, _I64)]
_TAKE_HEADER = [types.int64(_BYTES, _WORDS, _WORDS, _I64, _I64, _I64, _I64, _I64, _I64)]


@njit(inline="always", cache=True, nogil=True)
def _write_header(data64, w, ctx, tag, nbytes, meta, count, vhash):
    """The six header words of a frame starting at word ``w``."""
    data64[w] = ctx
    data64[w + 1] = tag
    data64[w + 2] = nbytes
    data64[w + 3] = meta
    data64[w + 4] = count
    data64[w + 5] = vhash


@njit(_PUT, cache=True, nogil=True)
def eager_put(data, data64, words, tail, payload, ctx, tag, meta):
    """Write one frame at the ring's ``tail`` (its payload wrapping round the ring's end if it must) and publish it;
    the new tail, or -1 (nothing written) when the free space is short."""
    cap = data.size
    n = payload.size
    total = HEADER_BYTES + (n + HEADER_BYTES - 1) // HEADER_BYTES * HEADER_BYTES
    pos = tail % cap
    if cap - (tail - types.int64(load_acquire(words, 8))) < total:
        return -1
    _write_header(data64, pos // 8, ctx, tag, n, meta, 0, 0)
    at = (pos + HEADER_BYTES) % cap  # the header never wraps (64-byte frames, capacity a multiple of 64)
    first = min(n, cap - at)  # the payload may: its rest starts the ring again
    if first:
        d = carray(byte_pointer(data, at), first)
        for i in range(first):
            d[i] = payload[i]
    if n > first:
        d = carray(byte_pointer(data, 0), n - first)
        for i in range(n - first):
            d[i] = payload[first + i]
    tail += total
    store_seq_cst(words, 0, tail)
    return tail


@njit(_TAKE, cache=True, nogil=True)
def eager_take(data, data64, words, head, dst, ctx, tag, meta, rts_meta, polls):
    """Wait up to ``polls`` polls for a frame at the ring's ``head``; copy its payload into ``dst`` and consume it
    if it is a plain point-to-point frame (header word 3 ``meta``) of ``ctx`` with ``tag`` (any tag if negative)
    that fits ``dst`` whole. A rendezvous announcement (word 3 ``rts_meta``) that would fit is reported, not taken.
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
    if types.int64(data64[w]) != ctx or (tag >= 0 and got_tag != tag) or n > dst.size:
        return OTHER, 0, 0, head
    if types.int64(data64[w + 3]) == rts_meta:
        return ANNOUNCED, n, got_tag, head
    if tail - head < total or types.int64(data64[w + 3]) != meta or data64[w + 4] != 0 or data64[w + 5] != 0:
        return OTHER, 0, 0, head
    at = (pos + HEADER_BYTES) % cap
    first = min(n, cap - at)
    if first:
        s = carray(byte_pointer(data, at), first)
        for i in range(first):
            dst[i] = s[i]
    if n > first:
        s = carray(byte_pointer(data, 0), n - first)
        for i in range(n - first):
            dst[first + i] = s[i]
    head += total
    store_seq_cst(words, 8, head)
    return TAKEN, n, got_tag, head


@njit(_PUT_HEADER, cache=True, nogil=True)
def put_header(data, data64, words, tail, ctx, tag, nbytes, meta, count, vhash):
    """Write a header-only frame (a rendezvous announcement or acknowledgement: ``count`` and ``vhash`` in words 4
    and 5) at the ring's ``tail`` and publish it; the new tail, or -1 when the ring is full."""
    cap = data.size
    pos = tail % cap
    if cap - (tail - types.int64(load_acquire(words, 8))) < HEADER_BYTES:
        return -1
    _write_header(data64, pos // 8, ctx, tag, nbytes, meta, count, vhash)
    tail += HEADER_BYTES
    store_seq_cst(words, 0, tail)
    return tail


@njit(_TAKE_HEADER, cache=True, nogil=True)
def take_header(data, data64, words, head, ctx, tag, meta, vhash, polls):
    """Wait up to ``polls`` polls for a frame at the ring's ``head`` and consume it if it is exactly the header-only
    frame (ctx, tag, meta, vhash) expected; the new head, or -1 (nothing consumed)."""
    cap = data.size
    while types.int64(load_acquire(words, 0)) == head:
        if polls <= 0:
            return -1
        polls -= 1
        cpu_relax()
    w = (head % cap) // 8
    if (types.int64(data64[w]) != ctx or types.int64(data64[w + 1]) != tag or data64[w + 2] != 0
            or types.int64(data64[w + 3]) != meta or types.int64(data64[w + 5]) != vhash):
        return -1
    head += HEADER_BYTES
    store_seq_cst(words, 8, head)
    return head


_EXCHANGE = [types.UniTuple(types.int64, 5)(_BYTES, _WORDS, _WORDS, _I64, payload, _I64, _I64,
                                           _BYTES, _WORDS, _WORDS, _I64, _BYTES, _I64, _I64, _I64, _I64)
             for payload in (_BYTES, _READ_ONLY_BYTES)]


@njit(_EXCHANGE, cache=True, nogil=True)
def eager_exchange(out, out64, out_words, tail, payload, send_tag, ctx, inp, in64, in_words, head, dst, recv_tag,
                   meta, rts_meta, polls):
    """``eager_put`` then ``eager_take`` in one call (a Sendrecv): (new tail or -1, then ``eager_take``'s four
    results); nothing is taken unless the frame was put."""
    tail = eager_put(out, out64, out_words, tail, payload, ctx, send_tag, meta)
    if tail < 0:
        return tail, EMPTY, 0, 0, head
    status, n, got_tag, head = eager_take(inp, in64, in_words, head, dst, ctx, recv_tag, meta, rts_meta, polls)
    return tail, status, n, got_tag, head
