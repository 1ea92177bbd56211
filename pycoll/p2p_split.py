"""A rendezvous whose copy the sender shares: it writes chunks of its message from the back, by process_vm_writev,
while the receiver reads them from the front, each chunk claimed with one compare-and-swap in the slot of the split
table (``transport.shm``) that the rendezvous' id names. A sender that never helps costs the receiver nothing; the
receiver returns only once every chunk the sender claimed is written. Importing this module needs Numba."""

from __future__ import annotations

from numba import njit, types

from .p2p_addresses import acquire, cas, peer_alive, publish, pull, put_word, relax, word
from .p2p_lane import (L_BOUNCE, L_IN_HDR, L_OUT_HDR, L_PID, L_WRITEV, S_BYTES, S_CLAIMS, S_DST, S_FAILED, S_PUSHED,
                       S_STATE, SPLIT_ACTIVE, SPLIT_CHUNK, SPLIT_FREE, SPLIT_MIN_BYTES, SPLIT_OFFERED, SPLIT_PREPARING,
                       SPLIT_SLOT_BYTES, SPLIT_SLOTS, SPLIT_TABLE)
from .transport.atomics import cpu_relax, cross_copy

_LOW = 0xFFFFFFFF


@njit(inline="always", cache=True, nogil=True)
def split_slot(hdr, rid):
    """The split-table slot of rendezvous ``rid`` in the ring whose header is at ``hdr``."""
    return hdr + SPLIT_TABLE + (rid % SPLIT_SLOTS) * SPLIT_SLOT_BYTES


@njit(inline="always", cache=True, nogil=True)
def offer_split(d, rid, n):
    """Before announcing rendezvous ``rid`` of ``n`` bytes on lane ``d``: offer the receiver the sender's help, in
    the slot the id names unless a transfer holds it (a slot still offered to an older id is taken over)."""
    if n < SPLIT_MIN_BYTES or word(d + 8 * L_WRITEV) == 0:
        return
    s = split_slot(word(d + 8 * L_OUT_HDR), rid)
    old = acquire(s + S_STATE)
    if old & 3 == SPLIT_ACTIVE or not cas(s + S_STATE, old, rid * 4 + SPLIT_PREPARING):
        return
    put_word(s + S_BYTES, n)
    put_word(s + S_CLAIMS, 0)
    put_word(s + S_PUSHED, 0)
    put_word(s + S_FAILED, 0)
    publish(s + S_STATE, rid * 4 + SPLIT_OFFERED)


@njit(inline="always", cache=True, nogil=True)
def pull_split(d, dst, addr, n, rid):
    """``pull`` of rendezvous ``rid``, sharing the chunks with the sender where it offered to help: this rank
    reads chunks from the front while the sender writes them from the back, and returns only once every chunk the
    sender claimed is written (no write lands after the receive completes). False if a read failed, or the sender
    died holding a claim."""
    s = split_slot(word(d + 8 * L_IN_HDR), rid)
    if acquire(s + S_STATE) != rid * 4 + SPLIT_OFFERED or word(s + S_BYTES) != n:
        return pull(d, dst, addr, n)
    put_word(s + S_DST, dst)
    if not cas(s + S_STATE, rid * 4 + SPLIT_OFFERED, rid * 4 + SPLIT_ACTIVE):
        return pull(d, dst, addr, n)
    chunks = (n + SPLIT_CHUNK - 1) // SPLIT_CHUNK
    ok = True
    while True:
        c = acquire(s + S_CLAIMS)
        front = c & _LOW
        back = c >> 32
        if front + back >= chunks:
            break
        if not ok:  # the rest is this rank's: the sender claims no more
            if cas(s + S_CLAIMS, c, (chunks - back) | (back << 32)):
                break
            continue
        if not cas(s + S_CLAIMS, c, c + 1):
            continue
        at = front * SPLIT_CHUNK
        ok = pull(d, dst + at, addr + at, min(SPLIT_CHUNK, n - at))
    back = acquire(s + S_CLAIMS) >> 32
    spins = 0
    while acquire(s + S_PUSHED) < back:
        spins += 1
        if spins & 0xFFF == 0:
            if not peer_alive(d):
                ok = False
                break
            relax(d)
        else:
            cpu_relax()
    if ok and back > 0 and acquire(s + S_FAILED) != 0:  # a write of the sender's failed: read its chunks here
        at = (chunks - back) * SPLIT_CHUNK
        ok = pull(d, dst + at, addr + at, n - at)
    publish(s + S_STATE, rid * 4 + SPLIT_FREE)
    return ok


@njit(inline="always", cache=True, nogil=True)
def help_split_inline(d, rid, src, n):
    """While rendezvous ``rid`` of ``n`` bytes at ``src`` waits for its acknowledgement: write the chunks the
    receiver has not claimed yet, from the back, into its buffer. The chunks written."""
    fn = word(d + 8 * L_WRITEV)
    if fn == 0 or n < SPLIT_MIN_BYTES:
        return 0
    s = split_slot(word(d + 8 * L_OUT_HDR), rid)
    if acquire(s + S_STATE) != rid * 4 + SPLIT_ACTIVE:
        return 0
    dst = word(s + S_DST)
    chunks = (n + SPLIT_CHUNK - 1) // SPLIT_CHUNK
    pid = word(d + 8 * L_PID)
    bounce = word(d + 8 * L_BOUNCE) != 0
    written = 0
    while True:
        c = acquire(s + S_CLAIMS)
        if (c & _LOW) + (c >> 32) >= chunks:
            break
        if not cas(s + S_CLAIMS, c, c + (1 << 32)):
            continue
        at = (chunks - 1 - (c >> 32)) * SPLIT_CHUNK
        if not cross_copy(fn, pid, src + at, dst + at, min(SPLIT_CHUNK, n - at), False, bounce):
            publish(s + S_FAILED, 1)  # before the count: the receiver reads it once the count is complete
            publish(s + S_PUSHED, word(s + S_PUSHED) + 1)
            break
        publish(s + S_PUSHED, word(s + S_PUSHED) + 1)
        written += 1
    return written


@njit(types.int64(types.int64, types.int64, types.int64, types.int64), cache=True, nogil=True)
def help_split(d, rid, src, n):
    """``help_split_inline`` for the engine's wait: the chunks of rendezvous ``rid`` this rank wrote into its
    receiver's buffer."""
    return help_split_inline(d, rid, src, n)
