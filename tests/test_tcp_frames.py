"""The C frame swap between hosts (pycoll/transport/_tcpframe.c) on a socket pair: the frame it sends byte for byte,
a frame taken whole however it arrives, the frames it must leave to the engine, and the Python path it stands for."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from pycoll.p2p_protocol import ALIGN, HEADER, HEADER_SIZE, P2P_META
from pycoll.transport import tcp

pytestmark = pytest.mark.skipif(tcp._tcpframe is None, reason="pycoll/transport/_tcpframe.c was not compiled")


def _frame(ctx: int, tag: int, payload: bytes, meta: int = P2P_META, root: int = 0, count: int = 0) -> bytes:
    pad = -len(payload) % ALIGN
    return HEADER.pack(ctx, tag, len(payload), meta, root, count, 0).ljust(HEADER_SIZE, b"\0") + payload + bytes(pad)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    ch = tcp.TcpChannel(1, a)  # the side under test; b plays the peer
    b.setblocking(True)
    yield ch, b
    ch.close()
    b.close()


def test_the_frame_sent_is_header_padding_payload_padding(pair) -> None:
    ch, peer = pair
    head = HEADER.pack(7, 3, 5, P2P_META, 0, 0, 0)
    sent, status = ch.swap_frame(head, np.frombuffer(b"hello", np.uint8), None, None, 0)
    assert (sent, status) == (HEADER_SIZE + ALIGN, tcp._tcpframe.NOTHING_ASKED)
    assert peer.recv(4096) == _frame(7, 3, b"hello")


@pytest.mark.parametrize("nbytes", [0, 1, 64, 1000, 5000])
def test_a_frame_is_taken_whole_however_its_bytes_arrive(pair, nbytes: int) -> None:
    ch, peer = pair
    payload = bytes(range(256)) * (nbytes // 256 + 1)
    payload = payload[:nbytes]
    whole = _frame(9, 4, payload)
    into = np.zeros(nbytes, np.uint8)
    head = HEADER.pack(9, 4, nbytes, P2P_META, 0, 0, 0)
    peer.sendall(whole[:HEADER_SIZE // 2])  # half a header: nothing can be decided yet
    sent, status = ch.swap_frame(None, None, head, into, 20_000)
    assert (sent, status) == (-1, ch.NOT_YET)
    assert not into.any() or nbytes == 0
    peer.sendall(whole[HEADER_SIZE // 2 : len(whole) - 1])  # all but its last byte
    assert ch.swap_frame(None, None, head, into, 0)[1] == ch.NOT_YET
    peer.sendall(whole[-1:] + _frame(9, 5, b"next"))  # its end, and the next frame behind it
    assert ch.swap_frame(None, None, head, into, 10**9)[1] == ch.TAKEN
    assert into.tobytes() == payload
    # the next frame stays staged for the next receive (by context and tag, as a point-to-point one)
    box = np.zeros(16, np.uint8)
    assert ch.take_message(9, -1, True, P2P_META, box, 0) == (ch.TAKEN, 4, 5)
    assert box[:4].tobytes() == b"next" and ch._start == ch._end == 0


def test_a_frame_that_comes_while_the_swap_yields_the_core_is_taken(pair) -> None:
    """Past its spin, the swap polls the socket between sched_yields for up to ``yield_ns``, in C: a frame that
    comes meanwhile is taken there, and the frame sent went out whole first."""
    ch, peer = pair
    head = HEADER.pack(9, 4, 3, P2P_META, 0, 0, 0)
    into = np.zeros(3, np.uint8)
    assert ch.swap_frame(None, None, head, into, 0)[1] == ch.NOT_YET  # no spin, no yields: not in yet
    late = threading.Timer(0.05, peer.sendall, (_frame(9, 4, b"abc"),))
    late.start()
    sent, status = ch.swap_frame(head, np.frombuffer(b"xyz", np.uint8), head, into, 0, 60 * 10**9)
    late.join()
    assert (sent, status) == (HEADER_SIZE + ALIGN, ch.TAKEN) and into.tobytes() == b"abc"
    assert peer.recv(4096) == _frame(9, 4, b"xyz")


def test_a_swap_whose_frame_left_in_part_does_not_yield_for_the_answer(pair) -> None:
    """Where the socket took only part of the outgoing frame, the swap gives up the wait after its spin (the
    engine must send the rest before the peer can answer), however long ``yield_ns`` is."""
    ch, peer = pair
    ch.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    out = np.ones(4 << 20, np.uint8)  # more than the socket pair holds while the peer reads nothing
    head_out = HEADER.pack(9, 4, out.nbytes, P2P_META, 0, 0, 0)
    head_in = HEADER.pack(9, 4, 3, P2P_META, 0, 0, 0)
    got: list = []
    swap = threading.Thread(target=lambda: got.append(
        ch.swap_frame(head_out, out, head_in, np.zeros(3, np.uint8), 0, 60 * 10**9)))
    swap.start()
    swap.join(20)
    assert not swap.is_alive(), "the swap waited through its yields with its own frame half sent"
    sent, status = got[0]
    assert 0 <= sent < HEADER_SIZE + out.nbytes and status == ch.NOT_YET


def test_frames_that_are_not_this_calls_are_left_where_they_are(pair) -> None:
    ch, peer = pair
    box = np.zeros(64, np.uint8)
    peer.sendall(_frame(9, 4, b"abc"))
    expected = HEADER.pack(9, 5, 3, P2P_META, 0, 0, 0)  # another tag
    assert ch.swap_frame(None, None, expected, np.zeros(3, np.uint8), 0)[1] == ch.OTHER
    for ctx, tag, any_tag, meta, room in [(8, 4, False, P2P_META, 64), (9, 5, False, P2P_META, 64),
                                          (9, 4, False, P2P_META + 1, 64), (9, 4, False, P2P_META, 2)]:
        assert ch.take_message(ctx, tag, any_tag, meta, box[:room], 0)[0] == ch.OTHER
    assert ch._end - ch._start == HEADER_SIZE + ALIGN  # nothing consumed
    peer.sendall(_frame(9, 4, b"", root=1))
    assert ch.take_message(9, 4, False, P2P_META, box, 0) == (ch.TAKEN, 3, 4)
    assert ch.take_message(9, 4, False, P2P_META, box, 0)[0] == ch.OTHER  # a root: not a plain message


def test_a_stream_that_ends_inside_a_frame_is_reported_not_waited_on(pair) -> None:
    ch, peer = pair
    peer.sendall(_frame(1, 1, b"x" * 100)[:80])
    peer.close()
    t0 = time.monotonic()
    status, _, _ = ch.take_message(1, 1, False, P2P_META, np.zeros(100, np.uint8), 2 * 10**9)
    assert status not in (ch.TAKEN, ch.NOT_YET, ch.OTHER)
    assert time.monotonic() - t0 < 1.0


def test_the_spin_is_bounded(pair) -> None:
    ch, _ = pair
    t0 = time.monotonic()
    assert ch.take_message(1, 1, False, P2P_META, np.zeros(8, np.uint8), 30_000_000)[0] == ch.NOT_YET
    assert 0.03 <= time.monotonic() - t0 < 1.0


def test_a_frame_behind_the_staging_areas_end_is_compacted_to_fit(pair) -> None:
    ch, peer = pair
    room = ch.staging_bytes - HEADER_SIZE - ALIGN  # the largest payload staged whole
    big = bytes([7]) * room
    into = np.zeros(room, np.uint8)
    for k in range(3):  # small frames first leave the big one starting part way into the area
        peer.sendall(_frame(2, k, b"s") + _frame(2, 100 + k, b"s") + _frame(2, 200 + k, big)[:1000])
        for tag in (k, 100 + k):
            assert ch.take_message(2, tag, False, P2P_META, np.zeros(1, np.uint8), 0)[0] == ch.TAKEN
        assert ch._start > 0 and ch._start + HEADER_SIZE + room > ch.staging_bytes
        sender = threading.Thread(target=peer.sendall, args=(_frame(2, 200 + k, big)[1000:],))
        sender.start()
        deadline = time.monotonic() + 10
        while (got := ch.take_message(2, 200 + k, False, P2P_META, into, 10**7))[0] == ch.NOT_YET:
            assert time.monotonic() < deadline
        sender.join()
        assert got == (ch.TAKEN, room, 200 + k) and into.tobytes() == big
