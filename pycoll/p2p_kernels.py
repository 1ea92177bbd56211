"""Numba kernels of the eager point-to-point path: one small frame written into, or taken out of, a shared-memory
ring in one compiled call. Importing this module needs Numba; it compiles (or loads from Numba's disk cache) its
explicit signatures at import, so a call never compiles and a buffer of another kind is refused (TypeError).

The frames are the engine's (``p2p._HEADER``): six 64-bit header words (ctx, tag, nbytes, meta | root << 32, count,
vhash), the payload from byte 64, zero padding to 64 bytes. The rings are ``transport.shm``'s: the writer's count
in header word 0, the reader's in word 8, each stored with release order after the bytes it covers.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from .transport.atomics import byte_pointer, cpu_relax, load_acquire, store_seq_cst

HEADER_BYTES = 64
# eager_take: a frame was taken; nothing arrived in the spin; the next frame is not ours; the next frame announces
# a rendezvous of ours (left in the ring: its address is header word 4, its id word 5). take_next besides: an
# acknowledgement of one of this rank's rendezvous was consumed; an announced message was pulled and consumed
TAKEN, EMPTY, OTHER, ANNOUNCED, ACKED, PULLED = 0, 1, 2, 3, 4, 5

_BYTES = types.Array(types.uint8, 1, "C")
_READ_ONLY_BYTES = types.Array(types.uint8, 1, "C", readonly=True)
_WORDS = types.Array(types.uint64, 1, "C")
_I64 = types.int64
_PUT = [types.int64(_BYTES, _WORDS, _WORDS, _I64, payload, _I64, _I64, _I64) for payload in (_BYTES, _READ_ONLY_BYTES)]
_TAKE = [types.UniTuple(types.int64, 4)(_BYTES, _WORDS, _WORDS, _I64, _BYTES, _I64, _I64, _I64, _I64, _I64)]
_NEXT = [types.UniTuple(types.int64, 6)(_BYTES, _WORDS, _WORDS, _I64, _BYTES, _I64, _I64, _I64, _I64, _I64,
                                        _BYTES, _WORDS, _WORDS, _I64, _I64, _I64, _I64)]
_PUT_PLAIN = [types.int64(_BYTES, _WORDS, payload, _I64, _I64, _I64) for payload in (_BYTES, _READ_ONLY_BYTES)]
_TAKE_PLAIN = [types.UniTuple(types.int64, 4)(_BYTES, _WORDS, _BYTES, _I64, _I64, _I64, _I64)]
_EXCHANGE_PLAIN = [types.UniTuple(types.int64, 5)(_BYTES, _WORDS, payload, _I64, _I64, _BYTES, _WORDS, _BYTES, _I64, _I64,
                                                   _I64, _I64) for payload in (_BYTES, _READ_ONLY_BYTES)]
_ANNOUNCE = [types.int64(_BYTES, _WORDS, _WORDS, _I64, payload, _I64, _I64, _I64, _I64) for payload in (_BYTES, _READ_ONLY_BYTES)]
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


@intrinsic
def _call6(typingctx, fn, a, b, c, d, e, f):
    """Call the C function at address ``fn`` with six 64-bit integer arguments; its 64-bit result. The address is
    an argument, never a constant, so the compiled code stays cacheable across processes."""

    def codegen(context, builder, sig, args):
        vals = [context.cast(builder, v, t, types.int64) for v, t in zip(args[1:], sig.args[1:])]
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64)] * 6)
        ptr = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.int64), fnty.as_pointer())
        return builder.call(ptr, vals)

    return types.int64(fn, a, b, c, d, e, f), codegen


@njit(inline="always", cache=True, nogil=True)
def _read_remote(readv, pid, dst, addr, n):
    """Copy ``n`` bytes at ``addr`` in process ``pid`` into ``dst`` (``readv``: the address of libc's
    process_vm_readv); False if a call failed (how is for the caller's Python path to find out)."""
    iov = np.empty(4, np.int64)  # the local iovec, then the remote one
    done = 0
    while done < n:
        iov[0] = dst.ctypes.data + done
        iov[2] = addr + done
        iov[1] = iov[3] = n - done
        at = iov.ctypes.data
        got = _call6(readv, pid, at, 1, at + 16, 1, 0)
        if got <= 0:
            return False
        done += got
    return True


@njit(_NEXT, cache=True, nogil=True)
def take_next(inp, in64, in_words, head, dst, ctx, tag, meta, rts_meta, ack_meta, out, out64, out_words, tail, readv,
              pid, polls):
    """One step of a progress loop over the ring from a peer (``inp``, read at ``head``), waiting up to ``polls``
    polls for a frame. An acknowledgement of one of this rank's rendezvous (header word 3 ``ack_meta``, no payload)
    is consumed: ACKED, with its id. Any other frame is handled as ``eager_take`` does for a receive of (``ctx``,
    ``tag``) into ``dst`` (``tag`` < -1: no receive waits, OTHER); an announced message it reports is copied from
    process ``pid`` by ``readv`` (libc's process_vm_readv; 0: not here, ANNOUNCED), its announcement consumed and,
    unless ``tail`` < 0 or the ring to the peer (``out``) is full, acknowledged there: PULLED. Returns (status,
    nbytes, tag, new head, new tail or -1 when the acknowledgement is the caller's to send, id)."""
    cap = inp.size
    polled = polls
    while types.int64(load_acquire(in_words, 0)) == head:
        if polled <= 0:
            return EMPTY, 0, 0, head, tail, 0
        polled -= 1
        cpu_relax()
    w = (head % cap) // 8
    if types.int64(in64[w + 3]) == ack_meta and in64[w + 2] == 0 and types.int64(in64[w]) != -1:
        rid = types.int64(in64[w + 5])
        got_tag = types.int64(in64[w + 1])
        head += HEADER_BYTES
        store_seq_cst(in_words, 8, head)
        return ACKED, 0, got_tag, head, tail, rid
    if tag < -1:
        return OTHER, 0, 0, head, tail, 0
    status, n, got_tag, new_head = eager_take(inp, in64, in_words, head, dst, ctx, tag, meta, rts_meta, 0)
    if status != ANNOUNCED:
        return status, n, got_tag, new_head, tail, 0
    rid = types.int64(in64[w + 5])
    if readv == 0 or not _read_remote(readv, pid, dst, types.int64(in64[w + 4]), n):
        return ANNOUNCED, n, got_tag, head, tail, rid
    head += HEADER_BYTES
    store_seq_cst(in_words, 8, head)
    out_cap = out.size
    if tail < 0 or out_cap - (tail - types.int64(load_acquire(out_words, 8))) < HEADER_BYTES:
        return PULLED, n, got_tag, head, -1, rid
    _write_header(out64, (tail % out_cap) // 8, ctx, got_tag, 0, ack_meta, 0, rid)
    tail += HEADER_BYTES
    store_seq_cst(out_words, 0, tail)
    return PULLED, n, got_tag, head, tail, rid


@njit(_ANNOUNCE, cache=True, nogil=True)
def announce(data, data64, words, tail, payload, ctx, tag, meta, rid):
    """Announce a rendezvous of ``payload`` (its size, and its address in header word 4; ``rid`` in word 5) at the
    ring's ``tail`` and publish it; the new tail, or -1 when the ring is full."""
    cap = data.size
    if cap - (tail - types.int64(load_acquire(words, 8))) < HEADER_BYTES:
        return -1
    _write_header(data64, (tail % cap) // 8, ctx, tag, payload.size, meta, payload.ctypes.data, rid)
    tail += HEADER_BYTES
    store_seq_cst(words, 0, tail)
    return tail


@njit(_PUT_PLAIN, cache=True, nogil=True)
def put_plain(data, words, payload, ctx, tag, meta):
    """``eager_put`` at the ring's own tail (header word 0: only this process writes it), with fewer arguments to
    unpack per call: the new tail, or -1 (nothing written) when the free space is short."""
    return eager_put(data, data.view(np.uint64), words, types.int64(words[0]), payload, ctx, tag, meta)


@njit(_TAKE_PLAIN, cache=True, nogil=True)
def take_plain(data, words, dst, ctx, tag, meta, rts_meta):
    """``eager_take`` without a spin at the ring's own head (header word 8: only this process writes it), with
    fewer arguments to unpack per call."""
    return eager_take(data, data.view(np.uint64), words, types.int64(words[8]), dst, ctx, tag, meta, rts_meta, 0)


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


@njit(_EXCHANGE_PLAIN, cache=True, nogil=True)
def exchange_plain(out, out_words, payload, send_tag, ctx, inp, in_words, dst, recv_tag, meta, rts_meta, polls):
    """``eager_exchange`` at the rings' own tail and head (header words 0 and 8), with fewer arguments to unpack."""
    return eager_exchange(out, out.view(np.uint64), out_words, types.int64(out_words[0]), payload, send_tag, ctx,
                          inp, inp.view(np.uint64), in_words, types.int64(in_words[8]), dst, recv_tag, meta, rts_meta,
                          polls)
