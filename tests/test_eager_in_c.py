"""The eager send and receive in C (``pycoll/_callkey.c``: ``eager_send``, ``eager_take``, ``eager_take_object``) in
one process, over two lanes facing each other: frames the Numba kernels read and write alike, wrap-round, full rings, what a receive must
leave in the ring, every state of the engine that sends a call down the Python path, the engine's lock, the
doorbell."""

from __future__ import annotations

import threading
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest

from pycoll import p2p_lane as lane
from pycoll import p2p_specs
from pycoll.p2p_fast import _not_in_c, eager_calls, eager_gate
from pycoll.p2p_protocol import ACK_META, RTS_META, Inbound

_callkey = p2p_specs.call_key_module()
if _callkey is None or not hasattr(_callkey, "eager_take"):
    pytest.skip("pycoll/_callkey.c was not compiled at install (no C compiler)", allow_module_level=True)
k = pytest.importorskip("pycoll.p2p_kernels")

from test_p2p_lanes import CAP, CTX, Pair, data  # noqa: E402  (the rings and lanes of the Numba kernels' tests)

from pycoll import MPI  # noqa: E402
from pycoll.p2p_addresses import HEAD_AT, TAIL_AT  # noqa: E402


class _Parse:  # the communicator's full parse, for specs over a whole C-ordered array
    def _p2p_buf(self, buf, opname, writable):
        return buf[0].reshape(-1).view(np.uint8)


def spec(arr: np.ndarray, writable: bool) -> list:
    """``[arr, MPI.BYTE]``, resolved once so that the C calls find it."""
    buf = [arr, MPI.BYTE]
    p2p_specs.resolve_spec(_Parse(), buf, "Irecv" if writable else "Isend", writable)
    return buf


class Side:
    """One rank of a Pair as a communicator's eager calls see it: comm rank ``me`` of 2, its lane to the other."""

    def __init__(self, pair: Pair, me: int, eager_max: int = 2048) -> None:
        words = pair.a if me == 0 else pair.b
        other = 1 - me
        lane_of = [0, 0]
        lane_of[other] = words.ctypes.data
        self.engine = SimpleNamespace(
            lane_of=lane_of, _sendq={0: deque(), 1: deque()}, broken_ctxs={}, _posted=[], _unexpected=[],
            _schedules=[], _abort_requests=deque(), _inbound={0: Inbound(), 1: Inbound()}, lock=threading.RLock())
        self.comm = SimpleNamespace(_freed=False, _aborted=None)
        fast = SimpleNamespace(engine=self.engine, comm=self.comm, world=[0, 1], ctx=CTX, eager_max=eager_max)
        self.gate = eager_gate(fast)
        self.send_now, self.take_now, self.take_object_now = eager_calls(fast)
        self.lane = words


def test_the_layout_and_gate_are_the_ones_python_describes():
    got = _callkey.eager_layout()
    for name in ("L_OUT", "L_OUT_CAP", "L_OUT_HDR", "L_IN", "L_IN_CAP", "L_IN_HDR", "L_BELL", "L_SYSCALL", "L_FUTEX",
                 "L_META", "HEADER_BYTES"):
        assert got[name] == getattr(lane, name), name
    assert (got["TAIL_AT"], got["HEAD_AT"]) == (TAIL_AT, HEAD_AT)
    assert got["G_ITEMS"] == len(Side(Pair(), 0).gate)
    with pytest.raises(TypeError, match="eager_gate"):
        _callkey.eager_take((1, 2), [np.zeros(1, np.uint8), MPI.BYTE], 0, 0)


@pytest.mark.parametrize("writer,reader", [("c", "numba"), ("numba", "c"), ("c", "c")])
def test_frames_cross_between_c_and_numba_at_every_size_and_wrap_round(writer, reader):
    p = Pair()
    a, b = Side(p, 0), Side(p, 1)
    # the ring wraps several times (an empty message is not cached as a spec: it always takes the Python path)
    for i, n in enumerate([1, 8, 63, 64, 65, 1000, 1500, 7, 2000, 100] * 3):
        src, dst = data(n, i), np.full(n + 8, 255, np.uint8)
        if writer == "c":
            assert a.send_now(spec(src, False), 1, i) is True
        else:
            assert k.put(p.addr(p.a), src.ctypes.data, n, CTX, i) == 1
        if reader == "c":
            assert b.take_now(spec(dst, True), 0, i) == (i, n)
        else:
            assert k.take(p.addr(p.b), dst.ctypes.data, dst.size, CTX, i, 0, 1) == lane.TAKEN
            assert (p.b[lane.L_GOT_TAG], p.b[lane.L_GOT_BYTES]) == (i, n)
        assert (dst[:n] == src).all() and (dst[n:] == 255).all()
    assert p.head("ab") == p.tail("ab")


def test_a_full_ring_or_a_rendezvous_size_is_the_python_paths():
    p = Pair()
    a, b = Side(p, 0, eager_max=960), Side(p, 1)
    src = data(960, 1)
    sent = 0
    while a.send_now(spec(src, False), 1, sent):
        sent += 1
    assert sent == CAP // 1024 and p.tail("ab") == CAP  # 960 bytes and a 64-byte header per frame
    assert a.send_now(spec(data(961, 2), False), 1, 0) is False  # over the eager limit: a rendezvous
    dst = np.zeros(960, np.uint8)
    assert b.take_now(spec(dst, True), 0, 0) == (0, 960)
    assert a.send_now(spec(src, False), 1, sent) is True  # room again: the frame wraps round
    for tag in range(1, sent + 1):
        dst[:] = 0
        assert b.take_now(spec(dst, True), 0, tag) == (tag, 960) and (dst == src).all()
    assert b.take_now(spec(dst, True), 0, -1) is None  # nothing left


def test_a_receive_leaves_every_frame_that_is_not_its_own():
    p = Pair()
    a, b = Side(p, 0), Side(p, 1)
    src, dst = data(16, 3), np.zeros(16, np.uint8)
    assert b.take_now(spec(dst, True), 0, 5) is None  # nothing there yet
    assert a.send_now(spec(src, False), 1, 5)
    head = p.head("ab")
    assert b.take_now(spec(dst, True), 0, 6) is None  # another tag
    assert b.take_now(spec(dst[:8], True), 0, 5) is None  # too long: the engine reports the truncation
    other_ctx = Side(p, 1)
    other_ctx.gate = (*other_ctx.gate[:7], CTX + 2, *other_ctx.gate[8:])
    assert _callkey.eager_take(other_ctx.gate, spec(dst, True), 0, 5) is None  # another communicator
    assert p.head("ab") == head and (dst == 0).all()
    assert b.take_now(spec(dst, True), 0, -1) == (5, 16) and (dst == src).all()  # ANY_TAG
    # an acknowledgement and a rendezvous announcement are the Numba kernels' to handle
    assert k.put_header(p.rings["ab"][0], p.rings["ab"][0].view(np.uint64), p.rings["ab"][1].view(np.uint64),
                        p.tail("ab"), CTX, 5, 0, ACK_META, 0, 9) >= 0
    assert b.take_now(spec(dst, True), 0, 5) is None and p.head("ab") != p.tail("ab")
    assert k.take(p.addr(p.b), dst.ctypes.data, 16, CTX, 5, 0, 1) == lane.ACKED
    assert k.announce_at(p.addr(p.a), src.ctypes.data, 16, CTX, 5, 7) == 1
    assert p.rings["ab"][0].view(np.int64)[(p.head("ab") % CAP) // 8 + 3] == RTS_META
    assert b.take_now(spec(dst, True), 0, 5) is None and p.head("ab") != p.tail("ab")


def _engine_states():
    """(what, how to set it on a Side): each state that sends a receive down the Python path."""
    return [
        ("a receive posted first", lambda s: s.engine._posted.append(object())),
        ("a message buffered", lambda s: s.engine._unexpected.append(object())),
        ("a schedule running", lambda s: s.engine._schedules.append(object())),
        ("an abort asked for", lambda s: s.engine._abort_requests.append(object())),
        ("a stream part read", lambda s: setattr(s.engine._inbound[0], "have", 3)),
        ("a stream's message part in", lambda s: setattr(s.engine._inbound[0], "target", object())),
        ("the communicator freed", lambda s: setattr(s.comm, "_freed", True)),
        ("the communicator aborted", lambda s: setattr(s.comm, "_aborted", RuntimeError("x"))),
        ("the communicator broken", lambda s: s.engine.broken_ctxs.update({CTX & ~1: None})),
        ("the peer's lane dropped", lambda s: s.engine.lane_of.__setitem__(0, 0)),
        ("the kernels not in yet", lambda s: setattr(s.engine, "lane_of", None)),
    ]


@pytest.mark.parametrize("what,state", _engine_states(), ids=[w for w, _ in _engine_states()])
def test_a_receive_goes_the_python_way_while_the_engine_has_anything_that_could_come_first(what, state):
    p = Pair()
    a, b = Side(p, 0), Side(p, 1)
    src, dst = data(8, 1), np.zeros(8, np.uint8)
    assert a.send_now(spec(src, False), 1, 2)
    state(b)
    assert b.take_now(spec(dst, True), 0, 2) is None and (dst == 0).all()
    assert p.head("ab") == 0


@pytest.mark.parametrize("what,state", [
    ("a frame queued ahead", lambda s: s.engine._sendq[1].append(object())),
    ("the communicator freed", lambda s: setattr(s.comm, "_freed", True)),
    ("the communicator aborted", lambda s: setattr(s.comm, "_aborted", RuntimeError("x"))),
    ("the communicator broken", lambda s: s.engine.broken_ctxs.update({CTX & ~1: None})),
    ("the peer's lane dropped", lambda s: s.engine.lane_of.__setitem__(1, 0)),
])
def test_a_send_goes_the_python_way_while_the_engine_must_see_it(what, state):
    p = Pair()
    a = Side(p, 0)
    state(a)
    assert a.send_now(spec(data(8, 1), False), 1, 2) is False and p.tail("ab") == 0


def test_another_communicators_failure_leaves_the_eager_path_to_this_one():
    """A failure breaks the communicator it happened on (the engine keys it by its even context); the eager calls of
    another communicator on the same engine go on in C."""
    p = Pair()
    a, b = Side(p, 0), Side(p, 1)
    for side in (a, b):
        side.engine.broken_ctxs.update({(CTX & ~1) + 2: None})
    src, dst = data(8, 3), np.zeros(8, np.uint8)
    assert a.send_now(spec(src, False), 1, 4)
    assert b.take_now(spec(dst, True), 0, 4) and (dst == src).all()


def test_arguments_the_python_path_must_check_or_reject_never_move_a_byte():
    p = Pair()
    a, b = Side(p, 0), Side(p, 1)
    src, dst = data(8, 1), np.zeros(8, np.uint8)
    for dest, tag in [(2, 0), (-1, 0), (MPI.PROC_NULL, 0), (True, 0), (1, -1), (1, True), (1, 1 << 70), (1, 2.0)]:
        assert a.send_now(spec(src, False), dest, tag) is False
    assert a.send_now([np.zeros(5, np.int16), MPI.BYTE], 1, 0) is False  # a spec never resolved
    assert a.send_now(src[::2], 1, 0) is False and a.send_now("bytes", 1, 0) is False
    assert p.tail("ab") == 0
    assert a.send_now(spec(src, False), 1, 4)
    ro = np.zeros(8, np.uint8)
    ro.flags.writeable = False
    for source, tag, buf in [(1, 4, spec(dst, True)), (MPI.ANY_SOURCE, 4, spec(dst, True)), (0, -2, spec(dst, True)),
                             (0, 4, [ro, MPI.BYTE]), (0, 4, [np.zeros(8, np.int16), MPI.BYTE])]:
        assert b.take_now(buf, source, tag) is None
    assert p.head("ab") == 0 and (dst == 0).all()


def test_the_lock_is_asked_for_where_another_thread_could_be_inside_a_wait():
    p = Pair()
    a, b = Side(p, 0), Side(p, 1)
    src, dst = data(8, 1), np.zeros(8, np.uint8)
    assert a.send_now(spec(src, False), 1, 2)
    holding, done = threading.Event(), threading.Event()

    def waiter():  # another thread inside the engine's wait
        with b.engine.lock:
            holding.set()
            done.wait(30)

    t = threading.Thread(target=waiter)
    t.start()
    try:
        assert holding.wait(30)
        assert b.take_now(spec(dst, True), 0, 2) is None and p.head("ab") == 0
    finally:
        done.set()
        t.join(30)
    other = threading.Thread(target=done.wait, args=(30,))  # a second thread, the lock free: taken under it
    done.clear()
    other.start()
    try:
        assert b.take_now(spec(dst, True), 0, 2) == (2, 8) and (dst == src).all()
        assert b.engine.lock.acquire(blocking=False)  # and released
        b.engine.lock.release()
    finally:
        done.set()
        other.join(30)


def test_a_sleeping_peer_is_woken_by_a_send_and_by_a_take():
    from pycoll.transport.futex import _SYS_FUTEX

    p = Pair()
    a, b = Side(p, 0), Side(p, 1)
    bell = np.zeros(2, np.int64)  # the flag word, then the 32-bit futex word
    for side in (a, b):
        side.lane[lane.L_BELL] = bell.ctypes.data
        side.lane[lane.L_FUTEX] = _SYS_FUTEX or 0
        side.lane[lane.L_SYSCALL] = 0  # no system call: the futex word's count shows the wake
    src, dst = data(8, 1), np.zeros(8, np.uint8)
    assert a.send_now(spec(src, False), 1, 1) and bell[1] == 0  # nobody sleeps: the bell stays quiet
    bell[0] = 1
    assert a.send_now(spec(src, False), 1, 2) and bell[1] == 1
    assert b.take_now(spec(dst, True), 0, 1) == (1, 8) and bell[1] == 2


def test_without_the_c_module_every_call_takes_the_python_path(monkeypatch):
    monkeypatch.setenv("PYCOLL_CALL_KEY", "python")
    fast = SimpleNamespace(engine=None, comm=None, world=[0, 1], ctx=CTX, eager_max=0)
    assert eager_calls(fast) == (_not_in_c, _not_in_c, _not_in_c)
    assert not _not_in_c([np.zeros(1), MPI.BYTE], 0, 0)


@pytest.mark.parametrize("writer", ["c", "numba"])
def test_an_object_receive_takes_a_message_of_any_length_into_new_bytes(writer):
    p = Pair()
    a, b = Side(p, 0), Side(p, 1)
    assert b.take_object_now(0, 3, 0) is False  # nothing there yet, every other condition holds
    assert b.take_object_now(0, 3, 200) is False  # nor after a spin of 200 polls
    for i, n in enumerate([0, 1, 47, 64, 65, 1500, 2000] * 3):  # wraps round the ring
        src = data(n, i).tobytes()
        if writer == "c":
            assert a.send_now(src, 1, i) is True  # a bytes object is sent as it is (a pickle)
        else:
            assert k.put(p.addr(p.a), np.frombuffer(src, np.uint8).ctypes.data if n else 0, n, CTX, i) == 1
        got = b.take_object_now(0, i if i % 2 else -1, 0)
        assert got == (i, n, src) and type(got[2]) is bytes
    assert a.send_now(spec(data(8, 1), False), 1, 9)
    assert b.take_object_now(0, 8, 0) is None and p.head("ab") != p.tail("ab")  # another tag: not False, not taken
    b.engine._posted.append(object())
    assert b.take_object_now(0, 9, 0) is None  # a receive posted first matches first
    b.engine._posted.clear()
    assert b.take_object_now(0, 9, 0) == (9, 8, data(8, 1).tobytes())
    assert a.send_now(b"x" * 2049, 1, 1) is False  # past the eager limit: the Python path's rendezvous
    for args in [(0, True, 0), (0, 1, -1), (2, 1, 0), (0, 1, 1.0)]:
        assert not b.take_object_now(*args)
    with pytest.raises(TypeError, match="eager_gate"):
        _callkey.eager_take_object(b.gate, 0, 1)
