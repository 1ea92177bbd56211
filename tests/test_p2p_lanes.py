"""The address-based point-to-point kernels in one process: two lanes facing each other over private rings (frames,
wrap-around, full rings, tags, truncation, rendezvous pulls from this process, acknowledgements, Sendrecv's
exchanges), and the buffer-spec cache of the compiled path."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

k = pytest.importorskip("pycoll.p2p_kernels")

from pycoll import p2p_lane as lane  # noqa: E402
from pycoll.p2p_protocol import ACK_META, P2P_META, RTS_META  # noqa: E402

CAP = 4096
HEADER_WORDS = (lane.SPLIT_TABLE + lane.SPLIT_SLOTS * lane.SPLIT_SLOT_BYTES) // 8  # as transport.shm's rings
CTX = 2
TAKEN, EMPTY, OTHER, ANNOUNCED, ACKED, PULLED = lane.TAKEN, lane.EMPTY, lane.OTHER, lane.ANNOUNCED, lane.ACKED, lane.PULLED


def _readv() -> int:
    try:
        return int(ctypes.cast(ctypes.CDLL(None).process_vm_readv, ctypes.c_void_p).value or 0)
    except (OSError, AttributeError):
        return 0


class Pair:
    """Rank a and rank b of one process: ring ab (a writes, b reads) and ring ba, and each side's lane words."""

    def __init__(self, cap: int = CAP, readv: bool = True) -> None:
        self.rings = {name: (np.zeros(cap, np.uint8), np.zeros(HEADER_WORDS, np.int64)) for name in ("ab", "ba")}
        self.a = self._lane("ab", "ba", readv)
        self.b = self._lane("ba", "ab", readv)

    def _lane(self, out: str, inp: str, readv: bool) -> np.ndarray:
        w = np.zeros(lane.LANE_WORDS, np.int64)
        (od, oh), (idata, ih) = self.rings[out], self.rings[inp]
        w[: lane.L_BELL + 1] = [od.ctypes.data, od.size, oh.ctypes.data, idata.ctypes.data, idata.size, ih.ctypes.data, 0]
        w[lane.L_PID] = os.getpid()
        w[lane.L_READV] = _readv() if readv else 0
        w[lane.L_META], w[lane.L_RTS], w[lane.L_ACK], w[lane.L_YIELD] = P2P_META, RTS_META, ACK_META, -1
        return w

    @staticmethod
    def addr(w: np.ndarray) -> int:
        return w.ctypes.data

    def tail(self, ring: str) -> int:
        return int(self.rings[ring][1][0])

    def head(self, ring: str) -> int:
        return int(self.rings[ring][1][8])


def data(n: int, salt: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 7 + salt) % 251).astype(np.uint8)


def test_put_take_every_size_and_wrap_round():
    p = Pair()
    a, b = p.addr(p.a), p.addr(p.b)
    for i, n in enumerate([0, 1, 8, 63, 64, 65, 1000, 1500, 7, 2000, 100] * 3):  # the ring wraps several times
        src, dst = data(n, i), np.full(n + 8, 255, np.uint8)
        assert k.put(a, src.ctypes.data, n, CTX, i) == 1
        assert k.take(b, dst.ctypes.data, dst.size, CTX, i, 0, 1) == TAKEN
        assert (dst[:n] == src).all() and (dst[n:] == 255).all()
        assert (p.b[lane.L_GOT_TAG], p.b[lane.L_GOT_BYTES]) == (i, n)
    assert p.head("ab") == p.tail("ab")


def test_full_ring_refuses_whole_frames():
    p = Pair()
    a, b = p.addr(p.a), p.addr(p.b)
    src = data(960, 1)
    sent = 0
    while k.put(a, src.ctypes.data, src.size, CTX, sent) == 1:
        sent += 1
    assert sent == CAP // 1024 and p.tail("ab") == CAP  # 960 bytes and a 64-byte header per frame
    dst = np.zeros(960, np.uint8)
    assert k.take(b, dst.ctypes.data, dst.size, CTX, 0, 0, 1) == TAKEN
    assert k.put(a, src.ctypes.data, src.size, CTX, sent) == 1  # room again, the frame wraps round
    for tag in range(1, sent + 1):
        dst[:] = 0
        assert k.take(b, dst.ctypes.data, dst.size, CTX, tag, 0, 1) == TAKEN and (dst == src).all()


def test_take_leaves_what_is_not_its_own():
    p = Pair()
    a, b = p.addr(p.a), p.addr(p.b)
    dst = np.zeros(16, np.uint8)
    assert k.take(b, dst.ctypes.data, 16, CTX, 5, 100, 1) == EMPTY  # nothing came in the spin
    src = data(16, 3)
    k.put(a, src.ctypes.data, 16, CTX, 5)
    head = p.head("ab")
    assert k.take(b, dst.ctypes.data, 16, CTX, 6, 0, 1) == OTHER  # another tag
    assert k.take(b, dst.ctypes.data, 16, CTX + 2, 5, 0, 1) == OTHER  # another communicator
    assert k.take(b, dst.ctypes.data, 8, CTX, 5, 0, 1) == OTHER  # too long: the engine reports the truncation
    assert p.head("ab") == head and (dst == 0).all()
    assert k.take(b, dst.ctypes.data, 16, CTX, -1, 0, 1) == TAKEN and (dst == src).all()  # ANY_TAG
    assert p.b[lane.L_GOT_TAG] == 5


def test_rendezvous_pull_ack_and_await():
    if not _readv():
        pytest.skip("no process_vm_readv in libc")
    p = Pair()
    a, b = p.addr(p.a), p.addr(p.b)
    big = data(100_000, 9)
    assert k.announce_at(a, big.ctypes.data, big.size, CTX, 4, 77) == 1
    assert k.await_ack(a, CTX, 4, 77, 10, big.ctypes.data, big.size) == 0  # not pulled yet
    got = np.zeros(big.size, np.uint8)
    status = k.take(b, got.ctypes.data, 10, CTX, 4, 0, 1)  # too small: left for the engine's truncation report
    assert status == OTHER
    status = k.take(b, got.ctypes.data, got.size, CTX, 4, 0, 1)
    if status == ANNOUNCED:
        pytest.skip("process_vm_readv refused here (ptrace rules)")
    assert status == PULLED and (got == big).all()
    assert (p.b[lane.L_GOT_RID], p.b[lane.L_GOT_BYTES]) == (77, big.size)
    assert k.await_ack(a, CTX, 4, 76, 0, big.ctypes.data, big.size) == 0  # another id's acknowledgement is not consumed
    assert k.await_ack(a, CTX, 4, 77, 0, big.ctypes.data, big.size) == 1
    assert p.head("ba") == p.tail("ba")


def test_pull_without_acknowledgement_and_failed_pull():
    if not _readv():
        pytest.skip("no process_vm_readv in libc")
    p = Pair()
    a, b = p.addr(p.a), p.addr(p.b)
    big = data(70_000, 2)
    got = np.zeros(big.size, np.uint8)
    k.announce_at(a, big.ctypes.data, big.size, CTX, 1, 5)
    status = k.take(b, got.ctypes.data, got.size, CTX, 1, 0, 0)  # frames queued ahead on the way back
    if status == ANNOUNCED:
        pytest.skip("process_vm_readv refused here (ptrace rules)")
    assert status == lane.PULLED_ACK_DUE and (got == big).all() and p.tail("ba") == 0
    # without cross-memory attach the announcement stays for the engine's path
    q = Pair(readv=False)
    k.announce_at(q.addr(q.a), big.ctypes.data, big.size, CTX, 1, 6)
    assert k.take(q.addr(q.b), got.ctypes.data, got.size, CTX, 1, 0, 1) == ANNOUNCED
    assert q.head("ab") == 0 and (q.b[lane.L_GOT_RID], q.b[lane.L_GOT_ADDR]) == (6, big.ctypes.data)


def test_acknowledgement_ahead_of_a_message():
    if not _readv():
        pytest.skip("no process_vm_readv in libc")
    p = Pair()
    a, b = p.addr(p.a), p.addr(p.b)
    big, got = data(80_000, 1), np.zeros(80_000, np.uint8)
    k.announce_at(a, big.ctypes.data, big.size, CTX, 3, 11)
    if k.take(b, got.ctypes.data, got.size, CTX, 3, 0, 1) != PULLED:
        pytest.skip("process_vm_readv refused here (ptrace rules)")
    small, dst = data(8, 4), np.zeros(8, np.uint8)
    k.put(b, small.ctypes.data, 8, CTX, 3)  # b answers behind its acknowledgement
    assert k.take(a, dst.ctypes.data, 8, CTX, 3, 0, 1) == ACKED and p.a[lane.L_GOT_RID] == 11
    assert k.take(a, dst.ctypes.data, 8, CTX, 3, 0, 1) == TAKEN and (dst == small).all()


def test_exchange_eager_both_ways():
    p = Pair()
    a, b = p.addr(p.a), p.addr(p.b)
    sa, sb = data(300, 1), data(300, 2)
    ra, rb = np.zeros(300, np.uint8), np.zeros(300, np.uint8)
    assert k.exchange(a, a, sa.ctypes.data, 300, 7, ra.ctypes.data, 300, 7, CTX, 0, 1) == EMPTY  # b has not sent
    assert k.exchange(b, b, sb.ctypes.data, 300, 7, rb.ctypes.data, 300, 7, CTX, 0, 1) == TAKEN
    assert k.take(a, ra.ctypes.data, 300, CTX, 7, 0, 1) == TAKEN
    assert (ra == sb).all() and (rb == sa).all()
    q = Pair(cap=1024)
    fill = data(900, 0)
    k.put(q.addr(q.a), fill.ctypes.data, 900, CTX, 1)
    assert k.exchange(q.addr(q.a), q.addr(q.a), sa.ctypes.data, 300, 7, ra.ctypes.data, 300, 7, CTX, 0, 1) == lane.NOT_SENT


@pytest.mark.parametrize("other_size", [8, 90_000])
def test_exchange_rendezvous(other_size):
    if not _readv():
        pytest.skip("no process_vm_readv in libc")
    p = Pair(cap=1 << 16)
    a, b = p.addr(p.a), p.addr(p.b)
    sa, sb = data(100_000, 1), data(other_size, 2)
    ra, rb = np.zeros(other_size, np.uint8), np.zeros(100_000, np.uint8)
    state = k.exchange_rdv(a, a, sa.ctypes.data, sa.size, 1, ra.ctypes.data, ra.size, 1, CTX, 40, 0, 1, 0)
    assert state == lane.ANNOUNCED_OWN  # announced; nothing from b yet
    if other_size > 64:  # b's send by rendezvous too: it pulls a's message and acknowledges it in the same call
        state_b = k.exchange_rdv(b, b, sb.ctypes.data, sb.size, 1, rb.ctypes.data, rb.size, 1, CTX, 50, 0, 1, 0)
        if not state_b & lane.RECEIVED:
            pytest.skip("process_vm_readv refused here (ptrace rules)")
        assert state_b == lane.ANNOUNCED_OWN | lane.RECEIVED | lane.PULLED_IN
    else:  # b's eager send, then its receive pulls a's message
        assert k.put(b, sb.ctypes.data, sb.size, CTX, 1) == 1
        if k.take(b, rb.ctypes.data, rb.size, CTX, 1, 0, 1) != PULLED:
            pytest.skip("process_vm_readv refused here (ptrace rules)")
    state = k.exchange_rdv(a, a, sa.ctypes.data, sa.size, 1, ra.ctypes.data, ra.size, 1, CTX, 40, 0, 1, state)
    assert state & (lane.SENT | lane.RECEIVED) == lane.SENT | lane.RECEIVED
    assert (rb == sa).all() and (ra == sb).all()
    if other_size > 64:  # b's own send: a acknowledged it
        assert k.await_ack(b, CTX, 1, 50, 0, sb.ctypes.data, sb.size) == 1


def test_exchange_rendezvous_reports_another_acknowledgement():
    if not _readv():
        pytest.skip("no process_vm_readv in libc")
    p = Pair(cap=1 << 16)
    a, b = p.addr(p.a), p.addr(p.b)
    earlier, got = data(70_000, 5), np.zeros(70_000, np.uint8)
    k.announce_at(a, earlier.ctypes.data, earlier.size, CTX, 9, 1)  # an Isend of a, not yet acknowledged
    if k.take(b, got.ctypes.data, got.size, CTX, 9, 0, 1) != PULLED:
        pytest.skip("process_vm_readv refused here (ptrace rules)")
    sa, ra = data(70_000, 6), np.zeros(8, np.uint8)
    state = k.exchange_rdv(a, a, sa.ctypes.data, sa.size, 2, ra.ctypes.data, 8, 2, CTX, 2, 0, 1, 0)
    assert state == lane.ANNOUNCED_OWN | lane.ACKED_OTHER and p.a[lane.L_GOT_RID] == 1


def test_spec_cache_follows_the_array():
    from pycoll import MPI, p2p_specs

    class Comm:  # the parse the cache falls back to
        calls = 0

        def _p2p_buf(self, buf, opname, writable):
            Comm.calls += 1
            from pycoll import flat_bytes

            return flat_bytes.parse_bytes(buf, "buf", opname, writable)

    comm = Comm()
    a = np.arange(8, dtype=np.float32)
    e = p2p_specs.resolve_spec(comm, [a, 4, MPI.FLOAT], "Send", False)
    assert e[6] == 16 and e[5] == a.ctypes.data and Comm.calls == 1
    assert p2p_specs.cached_spec([a, 4, MPI.FLOAT], False) is e
    assert p2p_specs.cached_spec([a, 5, MPI.FLOAT], False) is None  # another count
    assert p2p_specs.cached_spec([a, 4.0, MPI.FLOAT], False) is None  # not an int: the full parse rejects it
    assert p2p_specs.cached_spec([a, 4, MPI.INT], False) is None  # another datatype
    a.flags.writeable = False
    assert p2p_specs.cached_spec([a, 4, MPI.FLOAT], False) is e
    assert p2p_specs.cached_spec([a, 4, MPI.FLOAT], True) is None  # a receive into it now goes through the full parse
    a.flags.writeable = True
    a.dtype = np.int32  # the same memory seen as another type
    assert p2p_specs.cached_spec([a, 4, MPI.FLOAT], False) is None
    a.dtype = np.float32
    b = a[2:6]  # a view: its own entry, its own address
    e2 = p2p_specs.resolve_spec(comm, [b, MPI.FLOAT], "Send", False)
    assert e2[5] == a.ctypes.data + 8 and e2[6] == 16
    every_other = MPI.FLOAT.Create_vector(4, 1, 2).Commit()
    c = np.arange(16, dtype=np.float32)
    e3 = p2p_specs.resolve_spec(comm, [c, 1, every_other], "Send", False)  # a packed copy: used once, never cached
    assert p2p_specs.cached_spec([c, 1, every_other], False) is None and e3[0] is None
    assert (e3[4].view(np.float32) == c[0:8:2]).all()


def test_acknowledgements_only_take():
    # what the engine's drain runs while only its rendezvous sends wait: an acknowledgement is taken, a message
    # (even an empty one on any communicator) is left
    p = Pair()
    a, b = p.addr(p.a), p.addr(p.b)
    k.put(a, 0, 0, 0, 0)
    assert k.take(b, 0, -1, 0, -1, 0, 0) == OTHER and p.head("ab") == 0
    q = Pair()
    if not _readv():
        pytest.skip("no process_vm_readv in libc")
    big, got = data(70_000, 3), np.zeros(70_000, np.uint8)
    k.announce_at(q.addr(q.a), big.ctypes.data, big.size, CTX, 1, 21)
    if k.take(q.addr(q.b), got.ctypes.data, got.size, CTX, 1, 0, 1) != PULLED:
        pytest.skip("process_vm_readv refused here (ptrace rules)")
    assert k.take(q.addr(q.a), 0, -1, 0, -1, 0, 0) == ACKED and q.a[lane.L_GOT_RID] == 21
