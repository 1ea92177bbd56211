"""The C frame swap between hosts (pycoll/transport/_tcpframe.c) on a socket pair: the frame it sends byte for byte,
a frame taken whole however it arrives, the frames it must leave to the engine, and the Python path it stands for;
and an exchange's shared-memory flows, on rings laid out in this process's memory."""

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


def test_a_tag_given_to_the_swap_goes_into_both_headers(pair) -> None:
    """A plan's headers are made once with tag 0; each call's tag replaces that field, in the frame sent and in the
    frame expected; the arrays may be of any dtype, taken as their bytes."""
    ch, peer = pair
    template = HEADER.pack(9, 0, 8, P2P_META, 0, 0, 0)
    out, into = np.array([1.5, -2.0], np.float32), np.zeros(2, np.float32)
    peer.sendall(_frame(9, 40, np.array([7.0, 8.0], np.float32).tobytes()))  # the call tagged 40, not 41
    assert ch.swap_frame(None, None, template, into, 0, 0, 41)[1] == ch.OTHER and not into.any()
    sent, status = ch.swap_frame(template, out, template, into, 0, 0, 40)
    assert (sent, status) == (HEADER_SIZE + ALIGN, ch.TAKEN) and into.tolist() == [7.0, 8.0]
    assert peer.recv(4096) == _frame(9, 40, out.tobytes())
    assert template == HEADER.pack(9, 0, 8, P2P_META, 0, 0, 0)  # the caller's header is left as it was
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ch.swap_frame(template[:12], out, None, None, 0, 0, 40)
    with pytest.raises(TypeError, match="9 to 11 arguments"):
        tcp._tcpframe.swap(ch._fd, ch._stage, 0, 0, None, None, None, None)


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


def _exchange(moves, spin_ns=0, yield_ns=0, wait_ns=0, slice_bytes=0):
    """``tcp.exchange`` over (channel, head_out, out, head_in, into), the channels' staging bounds settled after."""
    states = tcp.exchange([ch.flow(ho, o, hi, i) for ch, ho, o, hi, i in moves], spin_ns, yield_ns, wait_ns,
                          slice_bytes)
    for (ch, *_), (_, _, _, start, end, _) in zip(moves, states):
        ch.settle(start, end)
    return [state[:3] for state in states]


@pytest.mark.parametrize("slice_bytes", [0, 1000, 61440])
def test_an_exchange_moves_every_peers_frames_at_once_straight_into_place(slice_bytes: int) -> None:
    """Three sockets: each one's outgoing frame leaves whole (the peer reads it byte for byte), in writes of at most
    ``slice_bytes`` where given, and each incoming frame, sent in pieces by a thread while the exchange waits, lands
    in its buffer, padding consumed, the frame behind it left staged."""
    pairs = [socket.socketpair() for _ in range(3)]
    chans = [tcp.TcpChannel(i, a) for i, (a, _) in enumerate(pairs)]
    sizes = [0, 17_001, 300_000]
    outs = [np.arange(n, dtype=np.uint8) * 3 for n in sizes]
    frames_in = [_frame(5, 2, bytes(np.arange(n, dtype=np.uint8) * 7 + 1)) for n in sizes]
    intos = [np.zeros(n, np.uint8) for n in sizes]
    got_out: list = [b""] * 3

    def peer(i: int) -> None:
        b = pairs[i][1]
        b.setblocking(True)
        whole = frames_in[i] + _frame(5, 3, b"behind")
        for k in range(0, len(whole), 40_000):
            b.sendall(whole[k : k + 40_000])
            time.sleep(0.002)
        want = HEADER_SIZE + len(outs[i]) + (-len(outs[i]) % ALIGN)
        while len(got_out[i]) < want:
            got_out[i] += b.recv(1 << 20)

    threads = [threading.Thread(target=peer, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    heads = [HEADER.pack(5, 2, n, P2P_META, 0, 0, 0) for n in sizes]
    states = _exchange([(chans[i], heads[i], outs[i], heads[i], intos[i]) for i in range(3)], wait_ns=10**9,
                       slice_bytes=slice_bytes)
    for t in threads:
        t.join()
    for i, n in enumerate(sizes):
        total = HEADER_SIZE + n + (-n % ALIGN)
        assert states[i] == (total, total, tcp._tcpframe.TAKEN)
        assert intos[i].tobytes() == bytes(np.arange(n, dtype=np.uint8) * 7 + 1)
        assert got_out[i] == _frame(5, 2, outs[i].tobytes())
        box = np.zeros(16, np.uint8)
        assert chans[i].take_message(5, 3, False, P2P_META, box, 10**8) == (tcp._tcpframe.TAKEN, 6, 3)
    for ch, (_, b) in zip(chans, pairs):
        ch.close()
        b.close()


@pytest.mark.parametrize("slice_bytes", [1, 40, 100, 4096])
def test_an_exchanges_writes_each_carry_at_most_the_slice(slice_bytes: int) -> None:
    """Over a packet socket (each sendmsg arrives as one record), a frame whose header, payload and padding the
    slices cut anywhere: every write but the last carries exactly ``slice_bytes``, and the records make the frame."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ch = tcp.TcpChannel(1, a)
    out = (np.arange(5003) % 253).astype(np.uint8)
    head = HEADER.pack(5, 2, out.nbytes, P2P_META, 0, 0, 0)
    frame = _frame(5, 2, out.tobytes())
    records: list = []
    reader = threading.Thread(target=lambda: records.extend(iter(lambda: b.recv(1 << 16), b"")))
    reader.start()
    assert _exchange([(ch, head, out, None, None)], wait_ns=10**9, slice_bytes=slice_bytes) == \
        [(len(frame), 0, tcp._tcpframe.NOTHING_ASKED)]
    ch.close()
    reader.join(10)
    b.close()
    assert b"".join(records) == frame
    assert all(len(r) == slice_bytes for r in records[:-1]) and 0 < len(records[-1]) <= slice_bytes
    assert len(records) == -(-len(frame) // slice_bytes)


def test_an_exchange_leaves_another_frame_the_end_of_a_stream_and_a_late_peer_to_the_engine(pair) -> None:
    """A socket whose next frame is another one (OTHER), whose stream ended (ENDED) or whose frame is not in when
    the waits run out (NOT_YET): nothing of the frame is consumed, and the frame behind stays staged whole."""
    ch, peer = pair
    head = HEADER.pack(5, 2, 8, P2P_META, 0, 0, 0)
    into = np.zeros(8, np.uint8)
    assert _exchange([(ch, None, None, head, into)]) == [(-1, 0, tcp._tcpframe.NOT_YET)]
    other = _frame(5, 9, b"12345678")
    peer.sendall(other)
    assert _exchange([(ch, None, None, head, into)], wait_ns=10**8) == [(-1, 0, tcp._tcpframe.OTHER)]
    assert ch.peek().tobytes() == other and not into.any()
    a, b = socket.socketpair()
    ended = tcp.TcpChannel(2, a)
    b.close()
    assert _exchange([(ended, None, None, head, into)], wait_ns=10**8) == [(-1, 0, tcp._tcpframe.ENDED)]
    ended.close()


def test_an_exchange_that_runs_out_of_waiting_reports_the_bytes_moved_of_each_frame(pair) -> None:
    """The socket takes only part of a large frame and only part of the incoming one is in: the exchange returns
    after its waits with both counts, exact: the peer holds that prefix of the frame sent, and the payload read so
    far is in place (the engine finishes both from there: ``Engine.exchange_frames``)."""
    ch, peer = pair
    ch.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
    n = 3 << 20
    out = (np.arange(n) % 251).astype(np.uint8)
    payload_in = bytes((np.arange(n) % 241).astype(np.uint8))
    peer.sendall(_frame(5, 2, payload_in)[: HEADER_SIZE + 1000])
    head = HEADER.pack(5, 2, n, P2P_META, 0, 0, 0)
    into = np.zeros(n, np.uint8)
    t0 = time.monotonic()
    sent, got, status = _exchange([(ch, head, out, head, into)], wait_ns=20 * 10**6)[0]
    assert time.monotonic() - t0 >= 0.02  # it waited its 20 ms since the last byte moved, in poll
    assert 0 < sent < HEADER_SIZE + n and got == HEADER_SIZE + 1000 and status == tcp._tcpframe.NOT_YET
    assert into[:1000].tobytes() == payload_in[:1000] and not into[1000:].any()
    peer.setblocking(False)
    seen = bytearray()
    while True:
        try:
            chunk = peer.recv(1 << 20)
        except BlockingIOError:
            break
        seen.extend(chunk)
    assert bytes(seen) == _frame(5, 2, out.tobytes())[:sent]


def test_a_closed_channel_sends_nothing_to_a_socket_that_took_its_number(pair) -> None:
    """The swap and an exchange ask the socket for its descriptor on every call: once the channel is closed, a new
    socket may get the same number, and a late call fails with EBADF instead of writing into it."""
    import errno

    ch, _ = pair
    old = ch.sock.fileno()
    ch.close()
    a, b = socket.socketpair()
    try:
        head = HEADER.pack(9, 4, 3, P2P_META, 0, 0, 0)
        sent, _ = ch.swap_frame(head, np.frombuffer(b"xyz", np.uint8), None, None, 0)
        assert sent == -1 - errno.EBADF, (sent, old, a.fileno(), b.fileno())
        assert ch.flow(head, None, None, None)[0] == -1
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(64)  # nothing arrived on the sockets made after the close
        a.setblocking(False)
        with pytest.raises(BlockingIOError):
            a.recv(64)
    finally:
        a.close()
        b.close()


class _Rings:
    """A shared-memory flow's two rings and the peer's doorbell in this process's memory, laid out as
    ``ShmChannel.lane_addresses`` gives them (a header's byte 0: the writer's count, byte 64: the reader's); the
    test plays the peer by hand."""

    def __init__(self, cap: int, start: int = 0) -> None:
        self.cap = cap
        self.out, self.inn = np.zeros(cap, np.uint8), np.zeros(cap, np.uint8)
        self.out_hdr, self.in_hdr = np.zeros(16, np.int64), np.zeros(16, np.int64)
        self.out_hdr[[0, 8]] = start  # both rings begin at ``start`` bytes into their streams
        self.in_hdr[[0, 8]] = start
        self.bell = np.zeros(2, np.int64)  # the flag word, then the futex word

    def flow(self, head_out, out, head_in, into) -> tuple:
        lane = (self.out.ctypes.data, self.cap, self.out_hdr.ctypes.data, self.inn.ctypes.data, self.cap,
                self.in_hdr.ctypes.data, self.bell.ctypes.data)
        return (-1, lane, 0, 0, head_out, out, head_in, into)

    def settle(self, start: int, end: int) -> None:
        pass

    def publish(self, data: bytes) -> None:
        """The peer writes ``data`` into our inbound ring at its tail and publishes it."""
        tail = int(self.in_hdr[0])
        for k, byte_at in enumerate(range(tail, tail + len(data))):
            self.inn[byte_at % self.cap] = data[k]
        self.in_hdr[0] = tail + len(data)

    def written(self) -> bytes:
        """What we published into the peer's ring past its reader's count (the peer has not read it)."""
        head, tail = int(self.out_hdr[8]), int(self.out_hdr[0])
        return bytes(self.out[[i % self.cap for i in range(head, tail)]])


def test_an_exchange_moves_a_rings_frames_beside_a_sockets_wrapping_at_the_rings_end(pair) -> None:
    """A ring flow (a peer on this host) beside a socket's: the outgoing frame is written into the peer's ring from
    its tail, wrapping at the ring's end, and published; the incoming one, published by a thread in pieces while the
    exchange yields, lands in place with its padding consumed and the frame behind it left in the ring; the peer's
    doorbell is rung where it sleeps."""
    ch, peer = pair
    rings = _Rings(4096, start=3 * 4096 - 128)  # 128 bytes before the end: both frames wrap
    rings.bell[0] = 1  # the peer sleeps on its doorbell
    out = (np.arange(1001) % 251).astype(np.uint8)
    payload_in = bytes((np.arange(1500) % 239).astype(np.uint8))
    head_out = HEADER.pack(5, 2, out.nbytes, P2P_META, 0, 0, 0)
    head_in = HEADER.pack(5, 2, len(payload_in), P2P_META, 0, 0, 0)
    into = np.zeros(len(payload_in), np.uint8)
    incoming = _frame(5, 2, payload_in) + _frame(5, 3, b"behind")

    def publish_in_pieces() -> None:
        for k in range(0, len(incoming), 500):
            rings.publish(incoming[k : k + 500])
            time.sleep(0.002)

    thread = threading.Thread(target=publish_in_pieces)
    thread.start()
    peer.sendall(_frame(5, 2, b"sock"))
    sock_into = np.zeros(4, np.uint8)
    states = _exchange([(ch, None, None, HEADER.pack(5, 2, 4, P2P_META, 0, 0, 0), sock_into),
                        (rings, head_out, out, head_in, into)], yield_ns=10**9)
    thread.join()
    total_out, total_in = HEADER_SIZE + 1024, HEADER_SIZE + 1536
    assert states == [(-1, HEADER_SIZE + 64, tcp._tcpframe.TAKEN), (total_out, total_in, tcp._tcpframe.TAKEN)]
    assert sock_into.tobytes() == b"sock"
    assert rings.written() == _frame(5, 2, out.tobytes())
    assert into.tobytes() == payload_in
    assert int(rings.in_hdr[8]) == 3 * 4096 - 128 + total_in  # consumed up to the frame behind
    assert int(rings.in_hdr[0]) - int(rings.in_hdr[8]) == len(_frame(5, 3, b"behind"))
    assert rings.bell[1] & 0xFFFFFFFF > 0  # the futex word was bumped for the sleeping peer


def test_a_ring_without_room_or_with_another_frame_next_is_left_to_the_engine_exactly() -> None:
    """A ring with room for part of the outgoing frame: the exchange writes that part, and returns after its spin and
    yields with the count exact (the engine writes the rest); a ring whose next frame is another call's: OTHER,
    nothing of it consumed; no frame in at all: NOT_YET once the yields run out, without sleeping in the kernel."""
    rings = _Rings(4096)
    rings.out_hdr[0] = 4096 - 1024  # the peer has not read 3 KiB of earlier frames: 1 KiB of room
    out = np.full(3000, 9, np.uint8)
    head = HEADER.pack(5, 2, out.nbytes, P2P_META, 0, 0, 0)
    rings.publish(_frame(5, 7, b"another call"))
    into = np.zeros(8, np.uint8)
    t0 = time.monotonic()
    states = _exchange([(rings, head, out, HEADER.pack(5, 2, 8, P2P_META, 0, 0, 0), into)], yield_ns=2 * 10**7,
                       wait_ns=10**9)
    assert time.monotonic() - t0 < 0.5  # a ring has nothing to sleep on: the wait is the engine's
    assert states == [(1024, 0, tcp._tcpframe.OTHER)]
    assert int(rings.out_hdr[0]) == 4096 and bytes(rings.out[3072:]) == _frame(5, 2, out.tobytes())[:1024]
    assert int(rings.in_hdr[8]) == 0 and not into.any()
    empty = _Rings(4096)
    assert _exchange([(empty, None, None, HEADER.pack(5, 2, 8, P2P_META, 0, 0, 0), into)], yield_ns=10**6,
                     wait_ns=10**9) == [(-1, 0, tcp._tcpframe.NOT_YET)]


def _part(ch, head_out: bytes, out_at: tuple, head_in: bytes, in_at: tuple) -> tuple:
    return ch.block_part() + (head_out, *out_at, head_in, *in_at)


def test_a_plans_blocks_move_in_one_call_with_its_tag_and_the_staging_bounds_written_back() -> None:
    """``exchange_blocks``: two sockets' and a ring's blocks of one send and one receive buffer, the headers made with
    tag 0 and the call's tag put into them: every peer gets its block's frame under that tag, every incoming block
    lands at its place, the rest of the receive buffer untouched, and the frame behind one socket's stays staged
    (the channel's bounds written back), so the engine takes it next. None: every frame moved whole."""
    pairs = [socket.socketpair() for _ in range(2)]
    chans = [tcp.TcpChannel(i, a) for i, (a, _) in enumerate(pairs)]
    rings = _Rings(1 << 16)
    rings.block_part = lambda: (None, -1, rings.flow(None, None, None, None)[1])
    send = np.arange(4 * 5000, dtype=np.float32)
    recv = np.full(4 * 5000, -1, np.float32)
    block = 5000 * 4  # bytes
    peers_payload = [bytes((np.arange(5000, dtype=np.float32) + 1000 * (k + 1)).data) for k in range(3)]
    got_out: list = [b""] * 2
    rings.publish(_frame(5, 77, peers_payload[2]))

    def peer(i: int) -> None:
        b = pairs[i][1]
        b.setblocking(True)
        whole = _frame(5, 77, peers_payload[i]) + (_frame(5, 78, b"behind") if i == 1 else b"")
        for k in range(0, len(whole), 7000):
            b.sendall(whole[k : k + 7000])
            time.sleep(0.001)
        while len(got_out[i]) < HEADER_SIZE + block:
            got_out[i] += b.recv(1 << 20)

    threads = [threading.Thread(target=peer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    head = HEADER.pack(5, 0, block, P2P_META, 0, 0, 0)  # tag 0: the call's goes in
    parts = (_part(chans[0], head, (block, 2 * block), head, (block, 2 * block)),
             _part(chans[1], head, (2 * block, 3 * block), head, (2 * block, 3 * block)),
             _part(rings, head, (3 * block, 4 * block), head, (3 * block, 4 * block)))
    assert tcp.exchange_blocks(parts, send, recv, 77, 0, 0, 10**9, 61440) is None
    for t in threads:
        t.join()
    for i in range(2):
        assert got_out[i] == _frame(5, 77, send.tobytes()[(i + 1) * block : (i + 2) * block])
    assert rings.written() == _frame(5, 77, send.tobytes()[3 * block :])
    assert recv.tobytes()[block:] == b"".join(peers_payload) and (recv[:5000] == -1).all()
    box = np.zeros(16, np.uint8)
    assert chans[1].take_message(5, 78, False, P2P_META, box, 10**8) == (tcp._tcpframe.TAKEN, 6, 78)
    for ch, (_, b) in zip(chans, pairs):
        ch.close()
        b.close()


def test_a_plans_exchange_reports_each_flow_where_one_is_left_to_the_engine(pair) -> None:
    """A socket whose next frame is another call's (OTHER) beside a ring whose frame comes whole: the states of
    both, the other call's frame left staged and nothing of it consumed."""
    ch, peer = pair
    rings = _Rings(1 << 14)
    rings.block_part = lambda: (None, -1, rings.flow(None, None, None, None)[1])
    send, recv = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    other = _frame(5, 9, b"12345678")
    peer.sendall(other)
    rings.publish(_frame(5, 3, bytes(range(100, 132))))
    head = HEADER.pack(5, 0, 32, P2P_META, 0, 0, 0)
    states = tcp.exchange_blocks((_part(ch, head, (0, 32), head, (0, 32)), _part(rings, head, (32, 64), head, (32, 64))),
                                 send, recv, 3, 0, 0, 10**8, 0)
    total = HEADER_SIZE + 64
    assert [s[:3] for s in states] == [(total, 0, tcp._tcpframe.OTHER), (total, total, tcp._tcpframe.TAKEN)]
    assert ch.peek().tobytes() == other and not recv[:32].any() and recv[32:].tobytes() == bytes(range(100, 132))


def test_a_plans_exchange_refuses_blocks_outside_its_buffers_before_moving_anything(pair) -> None:
    """A block past the end of the send or receive buffer, a read-only receive buffer or a malformed part: an error
    naming it, and not a byte sent."""
    ch, peer = pair
    send, recv = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    head = HEADER.pack(5, 0, 32, P2P_META, 0, 0, 0)
    with pytest.raises(ValueError, match="outside its buffer"):
        tcp.exchange_blocks((_part(ch, head, (48, 80), head, (0, 32)),), send, recv, 1, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="outside its buffer"):
        tcp.exchange_blocks((_part(ch, head, (0, 32), head, (40, 72)),), send, recv, 1, 0, 0, 0, 0)
    readonly = np.zeros(64, np.uint8)
    readonly.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        tcp.exchange_blocks((_part(ch, head, (0, 32), head, (0, 32)),), send, readonly, 1, 0, 0, 0, 0)
    with pytest.raises(TypeError, match="each part is"):
        tcp.exchange_blocks((ch.block_part(),), send, recv, 1, 0, 0, 0, 0)
    peer.setblocking(False)
    with pytest.raises(BlockingIOError):
        peer.recv(1)


def test_a_plans_exchange_makes_its_local_copy_whole_while_and_whatever_the_frames_do(pair) -> None:
    """``exchange_blocks``'s copy (an own block into its result): made in pieces while the socket waits for a peer
    that answers late, and whole when the call returns, also where the frame in never came (the flow's state
    reported for the engine) or where the peer's frame came at once."""
    ch, peer = pair
    send, recv = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    head = HEADER.pack(5, 0, 32, P2P_META, 0, 0, 0)
    source = np.random.default_rng(3).integers(0, 255, (3 << 16) + 5, dtype=np.uint8)  # several pieces and a tail
    for answer in ("late", "never", "at once"):
        target = np.zeros_like(source)
        if answer == "at once":
            peer.sendall(_frame(5, 7, bytes(range(32))))
        late = threading.Timer(0.02, lambda: peer.sendall(_frame(5, 7, bytes(range(32))))) if answer == "late" else None
        if late is not None:
            late.start()
        states = tcp.exchange_blocks((_part(ch, head, (0, 32), head, (0, 32)),), send, recv, 7, 0, 0,
                                     10**9 if answer != "never" else 10**7, 0, source, target)
        if late is not None:
            late.join()
        assert np.array_equal(target, source), answer
        taken = peer.recv(1 << 16)
        assert taken == _frame(5, 7, send[:32].tobytes()), answer
        if answer == "never":
            assert states is not None and states[0][2] == tcp._tcpframe.NOT_YET
        else:
            assert states is None and recv[:32].tobytes() == bytes(range(32)), answer
        recv[:] = 0


def test_a_plans_exchange_refuses_a_local_copy_of_two_lengths_before_moving_anything(pair) -> None:
    ch, peer = pair
    send, recv = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    head = HEADER.pack(5, 0, 32, P2P_META, 0, 0, 0)
    target = np.zeros(9, np.uint8)
    with pytest.raises(ValueError, match="differ in length"):
        tcp.exchange_blocks((_part(ch, head, (0, 32), head, (0, 32)),), send, recv, 1, 0, 0, 0, 0,
                            np.ones(10, np.uint8), target)
    assert not target.any()
    peer.setblocking(False)
    with pytest.raises(BlockingIOError):
        peer.recv(1)
