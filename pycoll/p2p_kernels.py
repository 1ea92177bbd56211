"""Numba kernels of the eager point-to-point path: one small frame written into, or taken out of, a shared-memory
ring in one compiled call. Importing this module needs Numba; it compiles (or loads from Numba's disk cache) its
explicit signatures at import, so a call never compiles and a buffer of another kind is refused (TypeError).

The frames are the engine's (``p2p_protocol.HEADER``): six 64-bit header words (ctx, tag, nbytes, meta | root << 32, count,
vhash), the payload from byte 64, zero padding to 64 bytes. The rings are ``transport.shm``'s: the writer's count
in header word 0, the reader's in word 8, each stored with release order after the bytes it covers.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, types

from .p2p_addresses import HEAD_AT, TAIL_AT, acquire, publish, put_word, relax, wake, word
from .p2p_lane import (ACK_DUE, ACKED, ACKED_OTHER, ANNOUNCED, ANNOUNCED_OWN, EMPTY, HEADER_BYTES, L_ACK, L_GOT_ADDR,
                       L_GOT_BYTES, L_GOT_RID, L_GOT_TAG, L_IN, L_IN_CAP, L_IN_HDR, L_META, L_OUT, L_OUT_CAP,
                       L_OUT_HDR, L_RTS, NOT_SENT, OTHER, PULLED, PULLED_ACK_DUE, PULLED_IN, RECEIVED, SENT, TAKEN)
from .p2p_split import help_split, help_split_inline, offer_split, pull_split  # noqa: F401  (help_split: exported)
from .transport.atomics import byte_pointer, copy_at, cpu_relax, cross_copy, load_acquire, store_seq_cst


_BYTES = types.Array(types.uint8, 1, "C")
_READ_ONLY_BYTES = types.Array(types.uint8, 1, "C", readonly=True)
_WORDS = types.Array(types.uint64, 1, "C")
_I64 = types.int64
_PUT = [types.int64(_BYTES, _WORDS, _WORDS, _I64, payload, _I64, _I64, _I64) for payload in (_BYTES, _READ_ONLY_BYTES)]
_TAKE = [types.UniTuple(types.int64, 4)(_BYTES, _WORDS, _WORDS, _I64, _BYTES, _I64, _I64, _I64, _I64, _I64)]
_NEXT = [types.UniTuple(types.int64, 6)(_BYTES, _WORDS, _WORDS, _I64, _BYTES, _I64, _I64, _I64, _I64, _I64,
                                        _BYTES, _WORDS, _WORDS, _I64, _I64, types.boolean, _I64, _I64)]
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


@njit(inline="always", cache=True, nogil=True)
def _read_remote(readv, bounce, pid, dst, addr, n):
    """Copy ``n`` bytes at ``addr`` in process ``pid`` into ``dst`` (``readv``: the address of libc's
    process_vm_readv; ``bounce``: ``cross_copy``'s); False if a call failed (how is for the caller's Python path to
    find out)."""
    return cross_copy(readv, pid, dst.ctypes.data, addr, n, True, bounce)


@njit(_NEXT, cache=True, nogil=True)
def take_next(inp, in64, in_words, head, dst, ctx, tag, meta, rts_meta, ack_meta, out, out64, out_words, tail, readv,
              bounce, pid, polls):
    """One step of a progress loop over the ring from a peer (``inp``, read at ``head``), waiting up to ``polls``
    polls for a frame. An acknowledgement of one of this rank's rendezvous (header word 3 ``ack_meta``, no payload)
    is consumed: ACKED, with its id. Any other frame is handled as ``eager_take`` does for a receive of (``ctx``,
    ``tag``) into ``dst`` (``tag`` < -1: no receive waits, OTHER); an announced message it reports is copied from
    process ``pid`` by ``readv`` (libc's process_vm_readv; 0: not here, ANNOUNCED; ``bounce``: ``cross_copy``'s),
    its announcement consumed and,
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
    if readv == 0 or not _read_remote(readv, bounce, pid, dst, types.int64(in64[w + 4]), n):
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


# ---- the per-call fast path: every argument a 64-bit integer (the cheapest to pass), memory named by address -----
#
# A lane is one peer's pair of rings, described by int64 words at address ``d`` (``Engine._lane_words`` fills them).
# Results besides the status go back in the lane's output words.
@njit(inline="always", cache=True, nogil=True)
def _header_out(d, ctx, tag, n, meta, count, vhash, payload):
    """Write a frame header (its size word ``n``) at the outbound ring's tail if the frame, with ``payload`` bytes
    after the header, fits; the tail it was written at, or -1."""
    cap = word(d + 8 * L_OUT_CAP)
    hdr = word(d + 8 * L_OUT_HDR)
    tail = word(hdr + TAIL_AT)  # only this process writes it
    total = HEADER_BYTES + (payload + HEADER_BYTES - 1) // HEADER_BYTES * HEADER_BYTES
    if cap - (tail - acquire(hdr + HEAD_AT)) < total:
        return -1
    at = word(d + 8 * L_OUT) + tail % cap
    put_word(at, ctx)
    put_word(at + 8, tag)
    put_word(at + 16, n)
    put_word(at + 24, meta)
    put_word(at + 32, count)
    put_word(at + 40, vhash)
    return tail


@njit(inline="always", cache=True, nogil=True)
def _publish_out(d, tail, n):
    """Publish the frame of ``n`` payload bytes written at ``tail`` and wake the peer if it sleeps."""
    total = HEADER_BYTES + (n + HEADER_BYTES - 1) // HEADER_BYTES * HEADER_BYTES
    publish(word(d + 8 * L_OUT_HDR) + TAIL_AT, tail + total)
    wake(d)


@njit(inline="always", cache=True, nogil=True)
def _frame_out(d, src, n, ctx, tag, meta):
    """A plain frame of ``n`` bytes at address ``src`` into the outbound ring, published; False if it does not fit."""
    tail = _header_out(d, ctx, tag, n, meta, 0, 0, n)
    if tail < 0:
        return False
    cap = word(d + 8 * L_OUT_CAP)
    base = word(d + 8 * L_OUT)
    at = (tail + HEADER_BYTES) % cap  # the header never wraps (64-byte frames, capacity a multiple of 64)
    first = min(n, cap - at)  # the payload may: its rest starts the ring again
    if first > 0:
        copy_at(base + at, src, first)
    if n > first:
        copy_at(base, src + first, n - first)
    _publish_out(d, tail, n)
    return True


@njit(inline="always", cache=True, nogil=True)
def _consume_in(d, head):
    """Hand the inbound ring's bytes up to ``head`` back to the writer (waking it if it sleeps)."""
    publish(word(d + 8 * L_IN_HDR) + HEAD_AT, head)
    wake(d)


@njit(inline="always", cache=True, nogil=True)
def _take_step(d, dst, cap_bytes, ctx, tag, can_ack):
    """One look at the frame at the inbound ring's head, for a receive of (``ctx``, ``tag``; -1 any tag) into
    ``cap_bytes`` bytes at address ``dst``: EMPTY (nothing there), OTHER (not this receive's: left), ACKED (an
    acknowledgement of this rank's rendezvous, consumed; its id in L_GOT_RID), TAKEN (a plain message copied and
    consumed), PULLED (an announced one copied from the sender, consumed and acknowledged unless ``can_ack`` is 0 or
    the ring back is full: PULLED_ACK_DUE), ANNOUNCED (the pull failed: left). The message's tag and size go to
    L_GOT_TAG and L_GOT_BYTES, a rendezvous id to L_GOT_RID."""
    hdr = word(d + 8 * L_IN_HDR)
    head = word(hdr + HEAD_AT)  # only this process writes it
    tail = acquire(hdr + TAIL_AT)
    if tail == head:
        return EMPTY
    icap = word(d + 8 * L_IN_CAP)
    at = word(d + 8 * L_IN) + head % icap
    f_ctx = word(at)
    f_tag = word(at + 8)
    n = word(at + 16)
    meta = word(at + 24)
    if meta == word(d + 8 * L_ACK) and n == 0 and f_ctx != -1:
        put_word(d + 8 * L_GOT_RID, word(at + 40))
        put_word(d + 8 * L_GOT_TAG, f_tag)
        _consume_in(d, head + HEADER_BYTES)
        return ACKED
    if f_ctx != ctx or (tag >= 0 and f_tag != tag) or n > cap_bytes:
        return OTHER
    put_word(d + 8 * L_GOT_TAG, f_tag)
    put_word(d + 8 * L_GOT_BYTES, n)
    if meta == word(d + 8 * L_RTS):
        rid = word(at + 40)
        put_word(d + 8 * L_GOT_RID, rid)
        put_word(d + 8 * L_GOT_ADDR, word(at + 32))
        if not pull_split(d, dst, word(at + 32), n, rid):
            return ANNOUNCED
        _consume_in(d, head + HEADER_BYTES)
        if can_ack == 0:
            return PULLED_ACK_DUE
        out = _header_out(d, ctx, f_tag, 0, word(d + 8 * L_ACK), 0, rid, 0)
        if out < 0:
            return PULLED_ACK_DUE
        _publish_out(d, out, 0)
        return PULLED
    total = HEADER_BYTES + (n + HEADER_BYTES - 1) // HEADER_BYTES * HEADER_BYTES
    if meta != word(d + 8 * L_META) or word(at + 32) != 0 or word(at + 40) != 0 or tail - head < total:
        return OTHER
    base = word(d + 8 * L_IN)
    pos = (head + HEADER_BYTES) % icap
    first = min(n, icap - pos)
    if first > 0:
        copy_at(dst, base + pos, first)
    if n > first:
        copy_at(dst + first, base, n - first)
    _consume_in(d, head + total)
    return TAKEN


@njit(types.int64(types.int64, types.int64, types.int64, types.int64, types.int64), cache=True, nogil=True)
def put(d, src, n, ctx, tag):
    """Send a plain message of ``n`` bytes at address ``src`` on lane ``d``: 1 once published, 0 (nothing written)
    when the ring lacks room."""
    return 1 if _frame_out(d, src, n, ctx, tag, word(d + 8 * L_META)) else 0


@njit(types.int64(types.int64, types.int64, types.int64, types.int64, types.int64, types.int64, types.int64),
      cache=True, nogil=True)
def take(d, dst, cap_bytes, ctx, tag, polls, can_ack):
    """A receive on lane ``d`` (see ``_take_step``), waiting up to ``polls`` polls for a frame; its status."""
    hdr = word(d + 8 * L_IN_HDR)
    head = word(hdr + HEAD_AT)
    while acquire(hdr + TAIL_AT) == head:
        if polls <= 0:
            return EMPTY
        polls -= 1
        relax(d)
    return _take_step(d, dst, cap_bytes, ctx, tag, can_ack)


@njit(types.int64(types.int64, types.int64, types.int64, types.int64, types.int64, types.int64), cache=True,
      nogil=True)
def announce_at(d, src, n, ctx, tag, rid):
    """Announce rendezvous ``rid`` of ``n`` bytes at address ``src`` on lane ``d``: 1 once published, 0 if full."""
    tail = _header_out(d, ctx, tag, n, word(d + 8 * L_RTS), src, rid, 0)
    if tail < 0:
        return 0
    offer_split(d, rid, n)
    _publish_out(d, tail, 0)
    return 1


@njit(inline="always", cache=True, nogil=True)
def _ack_step(d, ctx, tag, rid):
    """Consume the acknowledgement of rendezvous ``rid`` if it is the inbound ring's next frame: 1 if it was."""
    hdr = word(d + 8 * L_IN_HDR)
    head = word(hdr + HEAD_AT)
    if acquire(hdr + TAIL_AT) == head:
        return 0
    at = word(d + 8 * L_IN) + head % word(d + 8 * L_IN_CAP)
    if (word(at) != ctx or word(at + 8) != tag or word(at + 16) != 0 or word(at + 24) != word(d + 8 * L_ACK)
            or word(at + 40) != rid):
        return 0
    _consume_in(d, head + HEADER_BYTES)
    return 1


@njit(types.int64(types.int64, types.int64, types.int64, types.int64, types.int64, types.int64, types.int64),
      cache=True, nogil=True)
def await_ack(d, ctx, tag, rid, polls, src, n):
    """Wait up to ``polls`` polls for the acknowledgement of rendezvous ``rid`` (``n`` bytes at ``src``) as lane
    ``d``'s next frame and consume it: 1, or 0 (another frame is next, or none came). Meanwhile, write the chunks
    the receiver leaves (``p2p_split.help_split_inline``)."""
    hdr = word(d + 8 * L_IN_HDR)
    head = word(hdr + HEAD_AT)
    while acquire(hdr + TAIL_AT) == head:
        if polls <= 0:
            return 0
        polls -= 1
        if help_split_inline(d, rid, src, n) == 0:
            relax(d)
    return _ack_step(d, ctx, tag, rid)


@njit(types.int64(types.int64, types.int64, types.int64, types.int64, types.int64, types.int64, types.int64,
                  types.int64, types.int64, types.int64, types.int64), cache=True, nogil=True)
def exchange(dd, ds, src, n, stag, dst, cap_bytes, rtag, ctx, polls, can_ack):
    """A Sendrecv of eager size: ``put`` on lane ``dd``, then ``take`` on lane ``ds``; NOT_SENT (nothing done) if
    the message did not fit, else the take's status."""
    if not _frame_out(dd, src, n, ctx, stag, word(dd + 8 * L_META)):
        return NOT_SENT
    return take(ds, dst, cap_bytes, ctx, rtag, polls, can_ack)


@njit(types.int64(types.int64, types.int64, types.int64, types.int64, types.int64, types.int64, types.int64,
                  types.int64, types.int64, types.int64, types.int64, types.int64, types.int64), cache=True, nogil=True)
def exchange_rdv(dd, ds, src, n, stag, dst, cap_bytes, rtag, ctx, rid, polls, can_ack, state):
    """A Sendrecv whose send goes by rendezvous: announce ``rid`` on lane ``dd`` (unless ``state`` says it was),
    then, as frames come, take the receive from lane ``ds`` (pulled if announced, acknowledged at once) and the
    acknowledgement of ``rid`` from ``dd``, waiting up to ``polls`` idle polls in all. Returns ``state`` with bits
    added: ANNOUNCED_OWN (without it nothing was done), SENT, RECEIVED (PULLED_IN: from the sender's memory),
    ACK_DUE (the receive's acknowledgement is the caller's to send; its id in ``ds``'s L_GOT_RID), ACKED_OTHER (an
    acknowledgement of another rendezvous was consumed: the caller completes it). Stops at a frame it cannot
    place, leaving it for the engine."""
    state &= ANNOUNCED_OWN | SENT | RECEIVED | PULLED_IN
    if state & ANNOUNCED_OWN == 0:
        tail = _header_out(dd, ctx, stag, n, word(dd + 8 * L_RTS), src, rid, 0)
        if tail < 0:
            return 0
        # no split offered: this rank is busy pulling its own receive, and both ranks claiming chunks of both
        # messages took longer than each pulling its message whole (1 MiB: 143 against 122 us, medians of 6 jobs)
        _publish_out(dd, tail, 0)
        state = np.int64(ANNOUNCED_OWN)  # typed as the argument (the AOT compiler does not unify a literal)
    while True:
        moved = False
        if state & SENT == 0 and _ack_step(dd, ctx, stag, rid) == 1:
            state |= SENT
            moved = True
        if state & RECEIVED == 0:
            status = _take_step(ds, dst, cap_bytes, ctx, rtag, can_ack)
            if status == TAKEN:
                state |= RECEIVED
                moved = True
            elif status == PULLED:
                state |= RECEIVED | PULLED_IN
                moved = True
            elif status == PULLED_ACK_DUE:
                return state | RECEIVED | PULLED_IN | ACK_DUE
            elif status == ACKED:
                return state | ACKED_OTHER
            elif status != EMPTY:
                return state
        if state & (SENT | RECEIVED) == SENT | RECEIVED:
            return state
        if not moved:
            if polls <= 0:
                return state
            polls -= 1
            relax(ds)
