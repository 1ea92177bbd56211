"""The p2p engine in one process, over loopback channels: framing, matching, reduce-on-receive and failures."""

from __future__ import annotations

import numpy as np
import pytest

from pycoll.errors import MismatchError, PeerFailureError, PeerLostError, ProtocolError, TimeoutError
from pycoll.p2p import Engine
from pycoll.p2p_protocol import ANY_SOURCE, ANY_TAG, Owner, Sig
from pycoll.transport.loopback import LoopbackChannel


def owner(op: str = "test", ctx: int = 2) -> Owner:
    return Owner(op, ctx, 0, lambda w: w, [0, 1])


def engine() -> Engine:
    # Rank 0 with a "peer" 1 whose channel loops back: what we send to 1 arrives as if from 1.
    return Engine(0, {1: LoopbackChannel(1)})


@pytest.mark.parametrize("count", [0, 1, 7, 1000, 70_000])
def test_roundtrip_sizes(count: int) -> None:
    eng = engine()
    data = np.arange(count, dtype=np.float64)
    out = np.full(count, -1.0)
    s = eng.isend(1, data, 2, 5, Sig(), owner())
    r = eng.irecv(1, out, 2, 5, None, owner())
    eng.wait_requests([s, r], 5.0, owner())
    assert s.error is None and r.error is None
    np.testing.assert_array_equal(out, data)
    assert r.nbytes == data.nbytes and r.source == 1 and r.recv_tag == 5


def test_unexpected_message_is_buffered_then_matched_by_tag() -> None:
    eng = engine()
    first, second = np.arange(10, dtype=np.int32), np.arange(10, 20, dtype=np.int32)
    eng.isend(1, first, 2, 1, Sig(), owner())
    eng.isend(1, second, 2, 2, Sig(), owner())
    eng.progress()  # both arrive before any receive is posted
    got2, got1 = np.empty(10, np.int32), np.empty(10, np.int32)
    r2 = eng.irecv(1, got2, 2, 2, None, owner())
    r1 = eng.irecv(ANY_SOURCE, got1, 2, ANY_TAG, None, owner())
    eng.wait_requests([r1, r2], 5.0, owner())
    np.testing.assert_array_equal(got2, second)
    np.testing.assert_array_equal(got1, first)


def test_recv_reduce_writes_op_of_local_and_incoming() -> None:
    eng = engine()
    incoming, local = np.arange(50_000, dtype=np.float32), np.full(50_000, 2.0, np.float32)
    out = np.empty_like(local)
    eng.isend(1, incoming, 3, 0, Sig(kind=1), owner(ctx=3))
    r = eng.irecv(1, out, 3, 0, Sig(kind=1), owner(ctx=3), local=local, ufunc=np.add)
    eng.wait_requests([r], 5.0, owner(ctx=3))
    np.testing.assert_array_equal(out, incoming + 2.0)


def test_signature_mismatch_fails_before_writing() -> None:
    eng = engine()
    out = np.zeros(4, np.int64)
    eng.isend(1, np.ones(4, np.int64), 3, 0, Sig(kind=1, count=4), owner("Allreduce #1", 3))
    r = eng.irecv(1, out, 3, 0, Sig(kind=3, count=4), owner("Allgather #1", 3))
    eng.wait_requests([r], 5.0, owner())
    assert isinstance(r.error, MismatchError)
    assert r.error.op == "Allgather #1" and r.error.peers == (1,)
    assert "kind=1" in r.error.cause and "kind=3" in r.error.cause  # both calls are described
    assert (out == 0).all()


def test_truncation_is_an_error() -> None:
    eng = engine()
    eng.isend(1, np.ones(8, np.int32), 2, 0, Sig(), owner())
    r = eng.irecv(1, np.zeros(4, np.int32), 2, 0, None, owner("Recv"))
    eng.wait_requests([r], 5.0, owner())
    assert isinstance(r.error, MismatchError) and "does not fit" in r.error.cause


def test_malformed_header_fails_the_peer_with_protocol_error() -> None:
    eng = engine()
    r = eng.irecv(1, np.zeros(4, np.int32), 2, 0, None, owner("Recv"))
    eng.channels[1].send_some(memoryview(b"\xff" * 64))  # not a pycoll frame
    eng.wait_requests([r], 5.0, owner("Recv"))
    assert isinstance(r.error, PeerFailureError)
    assert "malformed" in r.error.cause and r.error.peers == (1,)
    with pytest.raises(ProtocolError):
        from pycoll.p2p_protocol import Inbound

        st = Inbound()
        st.hdr[:] = b"\0" * 64
        eng._on_header(1, st)  # magic byte missing


def test_wait_times_out_naming_the_silent_peer() -> None:
    eng = engine()
    r = eng.irecv(1, np.zeros(1), 2, 0, None, owner("Recv #1"))
    with pytest.raises(TimeoutError) as info:
        eng.wait_requests([r], 0.2, owner("Recv #1"))
    assert info.value.op == "Recv #1" and info.value.peers == (1,)
    assert "Timed out after 0.2 s" in str(info.value)


def test_tcp_channel_knows_when_bytes_could_die_with_an_exit() -> None:
    """A report pushed into a socket is not safe until the peer acknowledged it: an exit with unread input
    resets the connection and drops it. ``unsafe_to_exit`` must see that, and clear once the peer read it."""
    import socket
    import time

    from pycoll.transport.tcp import TcpChannel

    lsn = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lsn.getsockname())
    b, _ = lsn.accept()
    lsn.close()
    ch = TcpChannel(1, a)
    try:
        assert not ch.unsafe_to_exit()
        blob = memoryview(bytes(8 << 20))
        sent = 0
        while sent < len(blob):  # fill both socket buffers: the peer reads nothing yet
            n = ch.send_some(blob[sent:])
            if n == 0:
                break
            sent += n
        assert sent > 0 and ch.unsafe_to_exit()
        got, deadline = 0, time.monotonic() + 10
        b.settimeout(1.0)
        while got < sent and time.monotonic() < deadline:
            got += len(b.recv(1 << 20))
        assert got == sent
        while ch.unsafe_to_exit() and time.monotonic() < deadline:  # the last ACK is on its way
            time.sleep(0.001)
        assert not ch.unsafe_to_exit()
    finally:
        ch.close()
        b.close()


def test_a_stream_is_never_read_reentrantly_nor_after_its_channel_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Completing a message may run code that reads channels again (a failed cross-memory copy polls for
    reports) or fails the very peer being read: the stream must not be read from inside its own read. A
    failure found inside the read closes the channel once the reader has taken what the stream still holds
    (a peer's report comes before its end), and the stream is not read after that."""
    eng = engine()
    seen: list[int] = []
    complete = eng._on_complete

    def nested(peer: int, st) -> None:
        seen.append(peer)
        assert eng._pull(peer) is False  # the reader higher up owns the stream
        complete(peer, st)
        eng._channel_failed(peer, "failed while its message completed")

    monkeypatch.setattr(eng, "_on_complete", nested)
    for tag in (1, 2):
        eng.isend(1, np.arange(4, dtype=np.int32), 2, tag, Sig(), owner())
    eng.progress()
    assert seen == [1, 1] and 1 in eng.dead_peers()
    eng.isend(1, np.arange(4, dtype=np.int32), 2, 3, Sig(), owner())  # its channel is closed: not sent, not read
    eng.poll_reports()
    assert eng._pull(1) is False and seen == [1, 1]


def test_tcp_messages_and_goodbye_staged_before_the_end_of_the_stream_are_read_first() -> None:
    """A peer that sends its last messages and its goodbye, then exits, may end its stream right behind them:
    one socket read stages them all and the next read sees the end. The staged frames must be read (the
    messages delivered, the goodbye noted) before the end is reported, so the exit counts as a normal one."""
    import socket
    import time

    from pycoll.transport.tcp import TcpChannel

    lsn = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lsn.getsockname())
    b, _ = lsn.accept()
    lsn.close()
    mine = Engine(0, {1: TcpChannel(1, a)})
    theirs = Engine(1, {0: TcpChannel(0, b)})
    try:
        for tag in (1, 2):
            theirs.isend(0, np.arange(4, dtype=np.int32) + tag, 2, tag, Sig(), owner())
        theirs.close()  # goodbye, then the end of the stream
        time.sleep(0.2)  # everything, the end included, has arrived before the first read
        outs = [np.zeros(4, np.int32) for _ in range(2)]
        reqs = [mine.irecv(1, outs[i], 2, i + 1, None, owner("Recv")) for i in range(2)]
        mine.wait_requests(reqs, 5.0, owner())
        assert [r.error for r in reqs] == [None, None]
        np.testing.assert_array_equal(outs[0], np.arange(4) + 1)
        np.testing.assert_array_equal(outs[1], np.arange(4) + 2)
        assert 1 in mine._left  # a normal shutdown, not a failure
        late = mine.irecv(1, np.zeros(1), 2, 3, None, owner("Recv"))
        assert isinstance(late.error, PeerFailureError)  # what still needed it fails
    finally:
        mine.close()


def test_a_frame_cut_short_by_the_end_of_its_stream_fails_the_eager_receive_instead_of_spinning() -> None:
    """A peer killed in the middle of a collective's frame leaves its header and part of the payload staged
    and then the end of its stream: the eager receive must give the call back to the engine (which reports the
    failure), not wait for bytes that cannot come (the socket stays readable at its end, so it never slept)."""
    import socket
    import threading

    from pycoll.p2p_protocol import HEADER_SIZE, frame_head
    from pycoll.transport.tcp import TcpChannel

    a, b = socket.socketpair()
    mine = Engine(0, {1: TcpChannel(1, a)})
    try:
        head = frame_head(2, 7, 4096, Sig())
        b.sendall(head.ljust(HEADER_SIZE, b"\0") + b"\1" * 1000)  # the header and a quarter of the payload
        b.close()
        dst = np.zeros(4096, np.uint8)
        got = []
        reader = threading.Thread(target=lambda: got.append(mine.recv_frame_now(1, head, dst)), daemon=True)
        reader.start()
        reader.join(10.0)
        assert not reader.is_alive(), "the eager receive kept waiting at the end of the stream"
        assert got == [False] and not dst.any()
        req = mine.irecv(1, dst, 2, 7, Sig(), owner("Allreduce"))
        mine.wait_requests([req], 5.0, owner("Allreduce"))
        assert isinstance(req.error, PeerFailureError), req.error  # the engine's path reports the end
    finally:
        mine.close()


def test_a_receive_that_took_a_message_cut_short_before_it_was_posted_fails_when_the_stream_ends() -> None:
    """A peer killed while its large frame streamed in before the receive was posted (an Alltoall's block that
    arrived early) leaves an unexpected message in part. The receive that takes it waits for the rest: the end of
    the stream must fail it, naming the peer (it waited for ever), and no later receive may take the cut message."""
    import socket
    import time

    from pycoll.p2p_protocol import HEADER_SIZE, frame_head
    from pycoll.transport.tcp import TcpChannel

    a, b = socket.socketpair()
    mine = Engine(0, {1: TcpChannel(1, a)})
    try:
        nbytes = 1 << 20  # past the staging area: read into the unexpected message as it comes
        b.sendall(frame_head(2, 7, nbytes, Sig()).ljust(HEADER_SIZE, b"\0") + b"\1" * 100_000)
        deadline = time.monotonic() + 5.0
        while not (mine._unexpected and mine._unexpected[0].got) and time.monotonic() < deadline:
            mine.progress()  # the header and some payload arrive before any receive is posted
        assert mine._unexpected and 0 < mine._unexpected[0].got < nbytes
        dst = np.zeros(nbytes, np.uint8)
        req = mine.irecv(1, dst, 2, 7, Sig(), owner("Alltoall"))
        assert not req.done  # it took the message, and waits for the rest
        b.close()
        mine.wait_requests([req], 5.0, owner("Alltoall"))  # before: TimeoutError (with no timeout, a hang)
        assert isinstance(req.error, PeerFailureError) and "rank 1" in str(req.error), req.error
        assert not mine._unexpected
        again = mine.irecv(1, dst, 2, 7, Sig(), owner("Alltoall"))
        assert again.done and isinstance(again.error, PeerFailureError), again.error
    finally:
        mine.close()


def test_a_reduction_whose_stream_ends_inside_an_element_fails_instead_of_waiting() -> None:
    """Reduce-on-receive takes whole elements only: a stream that ends three bytes into one must fail the
    receive (its peer is gone), not leave the partial element staged while the engine waits for the rest."""
    import socket

    from pycoll.p2p_protocol import HEADER_SIZE, frame_head
    from pycoll.transport.tcp import TcpChannel

    a, b = socket.socketpair()
    mine = Engine(0, {1: TcpChannel(1, a)})
    try:
        b.sendall(frame_head(3, 0, 800, Sig(kind=1)).ljust(HEADER_SIZE, b"\0") + bytes(8 * 10 + 3))
        b.close()
        local, out = np.ones(100), np.full(100, -1.0)
        r = mine.irecv(1, out, 3, 0, Sig(kind=1), owner("Allreduce", 3), local=local, ufunc=np.add)
        mine.wait_requests([r], 5.0, owner("Allreduce", 3))
        assert isinstance(r.error, PeerFailureError), r.error
    finally:
        mine.close()


def test_tcp_peek_reports_the_end_only_once_nothing_is_staged() -> None:
    import socket
    import time

    from pycoll.transport.tcp import TcpChannel

    a, b = socket.socketpair()
    ch = TcpChannel(1, a)
    try:
        b.sendall(b"x" * 100)
        b.close()
        time.sleep(0.05)
        assert len(ch.peek()) == 100
        assert len(ch.peek()) == 100  # the end is behind staged bytes: not reported yet
        ch.consume(60)
        got = memoryview(bytearray(40))
        assert ch.recv_some(got) == 40
        with pytest.raises(PeerFailureError, match="closed its TCP connection"):
            ch.peek()
        with pytest.raises(PeerFailureError):
            ch.recv_some(memoryview(bytearray(8)))
    finally:
        ch.close()


def test_a_closed_shared_memory_channel_is_not_polled_again() -> None:
    """Once the engine closed a failed (or departed) peer's shared-memory channel, its rings are unmapped: the
    fast input test must not touch them (a rank still inside a call crashed with 'released memoryview')."""
    import mmap
    import os

    from pycoll.transport.shm import ShmChannel, _Ring

    class Transport:
        def _channel_closed(self) -> None:
            pass

    cap = 4096
    mem = memoryview(mmap.mmap(-1, 2 * (256 + cap)))
    def rings(out: int, into: int) -> tuple:  # each end maps the two rings itself
        return _Ring(mem, out * (256 + cap), cap), _Ring(mem, into * (256 + cap), cap)

    a = ShmChannel(1, os.getpid(), *rings(0, 1), Transport())  # type: ignore[arg-type]
    b = ShmChannel(0, os.getpid(), *rings(1, 0), Transport())  # type: ignore[arg-type]
    eng = Engine(0, {1: a})
    out = np.zeros(3, np.int64)
    r = eng.irecv(1, out, 2, 1, None, owner("Recv"))
    b.close()  # the peer leaves
    eng._channel_failed(1, "rank 1 closed its shared-memory channel")
    assert not a.has_input()
    for _ in range(3):
        eng.progress()  # no ValueError from the released rings
    assert eng._input_ready() is False
    assert isinstance(r.error, PeerFailureError)


def test_a_lost_connection_after_a_report_of_the_dead_rank_names_the_dead_rank() -> None:
    """A peer that reported a death and then exited closes its stream: an operation that trips over that closed
    stream names the rank that died (the report, with this operation's name), not the messenger."""
    eng = engine()
    owner = Owner("Barrier #15", 8 | 1, 1, lambda w: w, (0, 1, 2), tag=15)
    closed = owner.error(PeerFailureError, "connection to rank 2 failed: [Errno 32] Broken pipe", [2])
    assert eng.witnessed(closed, owner) is closed  # nothing reported: the error stands
    report = PeerLostError("rank 0 failed: rank 2 saw it in Allgather #14 (connection reset)", peers=[0])
    eng.break_ctx(8, report, 14)
    named = eng.witnessed(closed, owner)
    assert isinstance(named, PeerLostError) and list(named.peers) == [0] and named.op == "Barrier #15", named
    # an error that already names the dead rank, or is not a lost connection, is kept
    same = owner.error(PeerFailureError, "connection to rank 0 failed", [0])
    assert eng.witnessed(same, owner) is same
    mismatch = owner.error(MismatchError, "rank 2 called bcast", [2])
    assert eng.witnessed(mismatch, owner) is mismatch


def test_a_messenger_whose_stream_ends_after_its_report_is_not_named_on_another_communicator() -> None:
    """Rank 2 reported (on one communicator) that rank 0 died, then exited: a call on another communicator that
    trips over rank 2's closed stream names rank 0."""
    eng = engine()
    eng._messengers[2] = {0}
    dup = Owner("Allreduce #3", 16 | 1, 1, lambda w: w, (0, 1, 2), tag=3)
    closed = dup.error(PeerFailureError, "connection to rank 2 failed: [Errno 104] Connection reset by peer", [2])
    named = eng.witnessed(closed, dup)
    assert isinstance(named, PeerLostError) and list(named.peers) == [0] and named.op == "Allreduce #3", named
    other = dup.error(PeerFailureError, "connection to rank 1 failed", [1])  # not a messenger: kept
    assert eng.witnessed(other, dup) is other


def test_an_exchange_in_c_hands_a_frame_cut_short_to_the_engine_which_reports_the_end() -> None:
    """A collective's frame whose stream ends inside it, read in part by ``exchange_frames`` in C: the engine takes
    the receive over from where C stopped and fails it with the peer's end, instead of waiting."""
    import socket

    from pycoll.p2p_protocol import HEADER_SIZE, frame_head
    from pycoll.transport import tcp

    if tcp.exchange is None:
        pytest.skip("pycoll/transport/_tcpframe.c was not compiled")
    a, b = socket.socketpair()
    mine = Engine(0, {1: tcp.TcpChannel(1, a)})
    try:
        head = frame_head(3, 5, 4096, Sig())
        b.sendall(head.ljust(HEADER_SIZE, b"\0") + b"\1" * 1000)
        b.close()
        dst = np.zeros(4096, np.uint8)
        [(sent, got)] = mine.exchange_frames([(1, None, dst)], 3, 5, Sig(), owner("Alltoall"))
        assert sent is None and got is not None and got is not True  # moved in part: the engine's request
        assert dst[:1000].all() and not dst[1000:].any() and mine.frames_handed_on == 1
        mine.wait_requests([got], 5.0, owner("Alltoall"))
        assert isinstance(got.error, PeerFailureError), got.error
    finally:
        mine.close()


def test_an_exchange_takes_at_most_its_flows_and_leaves_the_other_peers_untouched(monkeypatch) -> None:
    """More peers than one call into C takes (``EXCHANGE_FLOWS``, here 1): the first peer's frames move whole,
    the second's are left to the caller (None both ways), nothing of its stream read; and C itself refuses more
    flows than it holds, naming the limit."""
    import socket

    from pycoll.p2p_protocol import ALIGN, HEADER_SIZE, frame_head
    from pycoll.transport import tcp

    if tcp.exchange is None:
        pytest.skip("pycoll/transport/_tcpframe.c was not compiled")
    with pytest.raises(ValueError, match=f"at most {tcp.EXCHANGE_FLOWS} flows"):
        tcp.exchange([()] * (tcp.EXCHANGE_FLOWS + 1), 0, 0, 0)
    monkeypatch.setattr(tcp, "EXCHANGE_FLOWS", 1)
    (a1, b1), (a2, b2) = socket.socketpair(), socket.socketpair()
    mine = Engine(0, {1: tcp.TcpChannel(1, a1), 2: tcp.TcpChannel(2, a2)})
    try:
        n = 20_000
        head = frame_head(3, 5, n, Sig())
        frame_in = head.ljust(HEADER_SIZE, b"\0") + bytes(range(200)) * (n // 200) + bytes(-n % ALIGN)
        b1.sendall(frame_in)
        b2.sendall(frame_in)
        outs = [np.full(n, k, np.uint8) for k in (1, 2)]
        intos = [np.zeros(n, np.uint8) for _ in range(2)]
        moved = mine.exchange_frames([(1, outs[0], intos[0]), (2, outs[1], intos[1])], 3, 5, Sig(), owner("Alltoall"))
        assert moved == [(True, True), (None, None)], moved
        assert intos[0].tobytes() == frame_in[HEADER_SIZE : HEADER_SIZE + n] and not intos[1].any()
        b1.settimeout(5.0)
        got = b""
        while len(got) < len(frame_in):
            got += b1.recv(1 << 16)
        assert got == head.ljust(HEADER_SIZE, b"\0") + outs[0].tobytes() + bytes(-n % ALIGN)
        ch2 = mine.channels[2]
        assert ch2._start == ch2._end == 0 and a2.recv(len(frame_in), socket.MSG_PEEK) == frame_in  # all still there
    finally:
        mine.close()
        b1.close()
        b2.close()


def test_a_plans_frame_swapper_tags_each_call_and_leaves_what_it_cannot_take(monkeypatch) -> None:
    """``frame_swapper`` (the two-rank small calls' path, ``pycoll.paired``): headers made once with tag 0 carry
    each call's tag both ways; a frame of another call stays staged; with a receive posted the frame is left to
    the engine; a frame that comes after C's spin and yields is taken by the Python wait with the call's tag."""
    import socket
    import threading

    from pycoll.p2p_protocol import frame_head
    from pycoll.transport import tcp

    if tcp._tcpframe is None:
        pytest.skip("pycoll/transport/_tcpframe.c was not compiled")
    monkeypatch.setenv("PYCOLL_SPIN_US", "0")
    monkeypatch.setenv("PYCOLL_YIELD_US", "0")
    monkeypatch.setenv("PYCOLL_TCP_EAGER_WAIT_MS", "5000")
    a, b = socket.socketpair()
    mine, theirs = Engine(0, {1: tcp.TcpChannel(1, a)}), Engine(1, {0: tcp.TcpChannel(0, b)})
    try:
        head = frame_head(3, 0, 8, Sig(kind=2))
        swap, answer = mine.frame_swapper(1), theirs.frame_swapper(0)
        sent_back = np.array([3.0, 4.0], np.float32)
        assert answer(3, 24, head, sent_back, None, None, 64) == (True, True)
        into = np.zeros(2, np.float32)
        assert swap(3, 24, head, np.array([1.0, 2.0], np.float32), head, into, 64) == (True, True)
        assert into.tolist() == [3.0, 4.0] and mine._seen[1] == (3, 24)
        assert (mine.tcp_eager_sends, mine.tcp_eager_recvs) == (1, 1)
        got = np.zeros(2, np.float32)
        assert answer(3, 0, None, None, head, got, 64) == (True, False)  # tag 24 is next, not 0: left staged
        assert answer(3, 24, None, None, head, got, 64) == (True, True) and got.tolist() == [1.0, 2.0]

        answer(3, 25, head, sent_back, None, None, 64)
        req = mine.irecv(1, np.zeros(64, np.uint8), 9, 9, Sig(), owner())  # a receive that may match first
        assert swap(3, 25, None, None, head, into, 64) == (True, False)
        mine._posted.remove(req)
        assert swap(3, 25, None, None, head, into, 64) == (True, True)

        late = threading.Timer(0.05, answer, (3, 26, head, np.array([5.0, 6.0], np.float32), None, None, 64))
        late.start()
        assert swap(3, 26, None, None, head, into, 64) == (True, True)  # C gave up at once; Python waited
        late.join()
        assert into.tolist() == [5.0, 6.0] and mine._seen[1] == (3, 26)

        # a frame the socket takes in part: its rest queues, with the call's tag in its header
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        big = np.arange(1 << 16, dtype=np.uint8)
        big_head = frame_head(3, 0, big.nbytes, Sig(kind=2))
        assert swap(3, 27, big_head, big, None, None, big.nbytes) == (True, True)
        assert mine._sendq[1] and mine.tcp_eager_queued == 1
        whole = np.zeros(big.nbytes, np.uint8)
        taken = theirs.irecv(0, whole, 3, 27, Sig(kind=2), owner())
        for _ in range(100_000):
            if not mine._sendq[1] and taken.done:
                break
            mine.progress()
            theirs.progress()
        assert taken.done and taken.error is None and (whole == big).all()
    finally:
        mine.close()
        theirs.close()


def test_a_broken_communicators_messages_are_dropped_and_the_others_kept() -> None:
    """Messages that no receive can take any more (their communicator broke from an earlier call, or they are its
    point-to-point messages) leave the buffer, and later ones are read and dropped: while any stayed, every fast path
    left its receives to the engine. Another communicator's messages, and the broken one's from calls before the
    failed one, stay and are received."""
    eng = engine()
    eng.tags_per_call = 4  # collective message tags: call number x 4 + lane
    eng.isend(1, np.arange(3, dtype=np.int32), 3, 4 * 6, Sig(), owner(ctx=3))  # call 6 of the broken communicator
    eng.isend(1, np.arange(3, dtype=np.int32), 3, 4 * 7 + 1, Sig(), owner(ctx=3))  # its call 7
    eng.isend(1, np.arange(3, dtype=np.int32), 2, 9, Sig(), owner(ctx=2))  # its point-to-point
    eng.isend(1, np.arange(4, 7, dtype=np.int32), 5, 4 * 9, Sig(), owner(ctx=5))  # another communicator's
    eng.progress()
    assert len(eng._unexpected) == 4
    eng.break_ctx(2, ProtocolError("broken for the test"), 7)  # from call 7 on
    assert sorted((u.ctx, u.tag) for u in eng._unexpected) == [(3, 24), (5, 36)]
    assert eng.broken_here(3) and eng.broken_here(2) and not eng.broken_here(5)
    eng.isend(1, np.arange(3, dtype=np.int32), 3, 4 * 8, Sig(), owner(ctx=3))  # arrives after the break
    eng.progress()
    assert sorted((u.ctx, u.tag) for u in eng._unexpected) == [(3, 24), (5, 36)]
    got = np.empty(3, np.int32)
    r = eng.irecv(1, got, 5, 4 * 9, None, owner(ctx=5))
    eng.wait_requests([r], 5.0, owner(ctx=5))
    np.testing.assert_array_equal(got, [4, 5, 6])
