"""Point-to-point: tags, ANY_SOURCE/ANY_TAG with Status, self-send, ordering, large bidirectional messages, objects."""

from __future__ import annotations

import time

import numpy as np

from . import case, reduce_ref, sentinel


@case
def case_ring_send_recv(ctx):
    """Each rank Sends to the right and Recvs from the left (even ranks send first; no reliance on buffering)."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    if n < 2:
        ctx.skip("needs 2 ranks")
    right, left = (r + 1) % n, (r - 1) % n
    for dt in (np.float64, np.int8, np.complex64):
        for count in (0, 1, 1000):
            out = ctx.data(dt, count, r)
            inbuf = sentinel(dt, count)
            if r % 2 == 0:
                comm.Send(out, dest=right, tag=3)
                comm.Recv(inbuf, source=left, tag=3)
            else:
                comm.Recv(inbuf, source=left, tag=3)
                comm.Send(out, dest=right, tag=3)
            ctx.check(f"ring Send/Recv dtype={np.dtype(dt).name} count={count}", inbuf, ctx.data(dt, count, left))
            if count == 0:
                st = MPI.Status()
                if r % 2 == 0:
                    comm.Send(out, dest=right, tag=30)
                    comm.Recv(inbuf, source=left, tag=30, status=st)
                else:
                    comm.Recv(inbuf, source=left, tag=30, status=st)
                    comm.Send(out, dest=right, tag=30)
                ctx.check_equal("empty message: status count", st.Get_count(MPI.BYTE), 0)
                ctx.check_equal("empty message: status (source, tag)", (st.Get_source(), st.Get_tag()), (left, 30))
            ctx.check("Send sendbuf unchanged", out, ctx.data(dt, count, r))


@case
def case_tags_out_of_order(ctx):
    """Messages with different tags can be received in a different order than sent."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    if n < 2:
        ctx.skip("needs 2 ranks")
    if r == 0:
        a = np.arange(10, dtype=np.int32)
        b = np.arange(10, 30, dtype=np.int32)
        c = np.arange(30, 35, dtype=np.int32)
        reqs = [comm.Isend(a, dest=1, tag=5), comm.Isend(b, dest=1, tag=7), comm.Isend(c, dest=1, tag=9)]
        MPI.Request.Waitall(reqs)
    elif r == 1:
        b = np.zeros(20, np.int32)
        comm.Recv(b, source=0, tag=7)
        a = np.zeros(10, np.int32)
        comm.Recv(a, source=0, tag=5)
        c = np.zeros(5, np.int32)
        st = MPI.Status()
        comm.Recv(c, source=0, tag=MPI.ANY_TAG, status=st)
        ctx.check("tag 7 first", b, np.arange(10, 30, dtype=np.int32))
        ctx.check("tag 5 second", a, np.arange(10, dtype=np.int32))
        ctx.check("ANY_TAG last", c, np.arange(30, 35, dtype=np.int32))
        ctx.check_equal("ANY_TAG status tag", st.Get_tag(), 9)
        ctx.check_equal("ANY_TAG status source", st.Get_source(), 0)
    comm.Barrier()


@case
def case_any_source_status(ctx):
    """Rank 0 receives one message from every other rank with ANY_SOURCE/ANY_TAG; Status says who and how much."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    if n < 2:
        ctx.skip("needs 2 ranks")
    if r == 0:
        seen = {}
        for _ in range(n - 1):
            buf = sentinel(np.float64, 64)
            st = MPI.Status()
            comm.Recv(buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st)
            src, tag = st.Get_source(), st.Get_tag()
            cnt = st.Get_count(MPI.DOUBLE)
            ctx.check_equal(f"status tag of message from {src}", tag, 100 + src)
            ctx.check_equal(f"Get_count(DOUBLE) from {src}", cnt, 3 * src)
            ctx.check_equal(f"Get_count() (bytes) from {src}", st.Get_count(), 3 * src * 8)
            ctx.check(f"payload from {src}", buf[:cnt], np.full(cnt, src, np.float64))
            ctx.check(f"tail beyond count from {src}", buf[cnt:], sentinel(np.float64, 64 - cnt))
            seen[src] = seen.get(src, 0) + 1
        ctx.check_equal("each source seen once", seen, {q: 1 for q in range(1, n)})
    else:
        comm.Send(np.full(3 * r, r, np.float64), dest=0, tag=100 + r)
    comm.Barrier()
    # specific source, ANY_TAG
    if r == n - 1:
        comm.Send(np.array([1, 2, 3], np.int16), dest=0, tag=42)
    elif r == 0:
        st = MPI.Status()
        buf = np.zeros(3, np.int16)
        comm.Recv(buf, source=n - 1, tag=MPI.ANY_TAG, status=st)
        ctx.check_equal("specific source ANY_TAG: tag", st.Get_tag(), 42)
        ctx.check_equal("specific source ANY_TAG: source", st.Get_source(), n - 1)
        ctx.check("specific source ANY_TAG: data", buf, np.array([1, 2, 3], np.int16))
    comm.Barrier()


@case
def case_self_send(ctx):
    """A rank sends to itself (Isend + Recv, Irecv + Send, Sendrecv)."""
    comm = ctx.comm
    r = ctx.rank
    for count in (0, 5, 300000):
        out = ctx.data(np.float32, count, r)
        inbuf = sentinel(np.float32, count)
        req = comm.Isend(out, dest=r, tag=11)
        comm.Recv(inbuf, source=r, tag=11)
        req.Wait()
        ctx.check(f"self Isend/Recv count={count}", inbuf, out)
        inbuf = sentinel(np.float32, count)
        req = comm.Irecv(inbuf, source=r, tag=12)
        comm.Send(out, dest=r, tag=12)
        req.Wait()
        ctx.check(f"self Irecv/Send count={count}", inbuf, out)
    if hasattr(comm, "Sendrecv"):
        out = ctx.data(np.int64, 50, r)
        inbuf = np.zeros(50, np.int64)
        comm.Sendrecv(out, dest=r, sendtag=1, recvbuf=inbuf, source=r, recvtag=1)
        ctx.check("self Sendrecv", inbuf, out)
    else:
        ctx.note("Sendrecv not available")
    obj_req = None
    if hasattr(comm, "isend"):
        obj_req = comm.isend({"self": r}, dest=r, tag=13)
        ctx.check_equal("self isend/recv object", comm.recv(source=r, tag=13), {"self": r})
        obj_req.wait()


@case
def case_non_overtaking(ctx):
    """Messages between one pair with one tag arrive in the order sent."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    if n < 2:
        ctx.skip("needs 2 ranks")
    k = 20
    if r == 1:
        reqs = [comm.Isend(np.full(4 + j, j, np.int32), dest=0, tag=8) for j in range(k)]
        MPI.Request.Waitall(reqs)
    elif r == 0:
        for j in range(k):
            buf = np.zeros(4 + j, np.int32)
            comm.Recv(buf, source=1, tag=8)
            ctx.check(f"message {j} in order", buf, np.full(4 + j, j, np.int32))
    comm.Barrier()


@case
def case_large_bidirectional(ctx):
    """8 MB messages both ways at once between every pair of neighbours, without deadlock."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    if n < 2:
        ctx.skip("needs 2 ranks")
    count = 1 << 20  # float64 -> 8 MB
    right, left = (r + 1) % n, (r - 1) % n
    # (a) Irecv posted, then blocking Send, then Wait
    out = ctx.data(np.float64, count, r, "a")
    inbuf = np.zeros(count, np.float64)
    req = comm.Irecv(inbuf, source=left, tag=21)
    comm.Send(out, dest=right, tag=21)
    req.Wait()
    ctx.check("Irecv+Send ring 8 MB", inbuf, ctx.data(np.float64, count, left, "a"))
    # (b) Isend both ways, then blocking Recv
    out = ctx.data(np.float64, count, r, "b")
    inbuf = np.zeros(count, np.float64)
    req = comm.Isend(out, dest=left, tag=22)
    comm.Recv(inbuf, source=right, tag=22)
    req.Wait()
    ctx.check("Isend+Recv reverse ring 8 MB", inbuf, ctx.data(np.float64, count, right, "b"))
    # (c) pairs exchange with all four requests at once
    partner = r ^ 1
    if partner < n:
        out = ctx.data(np.uint8, 3 * count + 1, r, "c")
        inbuf = np.zeros(3 * count + 1, np.uint8)
        reqs = [comm.Irecv(inbuf, source=partner, tag=23), comm.Isend(out, dest=partner, tag=23)]
        MPI.Request.Waitall(reqs)
        ctx.check("pairwise Isend/Irecv 3 MB", inbuf, ctx.data(np.uint8, 3 * count + 1, partner, "c"))
    # (d) Sendrecv, when present
    if hasattr(comm, "Sendrecv"):
        out = ctx.data(np.int32, count, r, "d")
        inbuf = np.zeros(count, np.int32)
        comm.Sendrecv(out, dest=right, sendtag=24, recvbuf=inbuf, source=left, recvtag=24)
        ctx.check("Sendrecv ring 4 MB", inbuf, ctx.data(np.int32, count, left, "d"))


def _partner_across(ctx) -> int:
    """This rank's partner in the other half of the ranks (on another host where hosts hold blocks of ranks); an odd
    count pairs neighbours and the last rank skips."""
    n, r = ctx.size, ctx.rank
    partner = (r + n // 2) % n if n % 2 == 0 else r ^ 1
    if partner >= n:
        ctx.skip("no partner")
    return partner


@case
def case_exchange_posted_first(ctx):
    """Irecv posted before the partner's message is sent (the partner comes late), then Isend and a wait, as halo
    exchanges write it: Waitall, Wait with a status, ANY_TAG, a buffer longer than the message, and a message of
    another tag ahead of the awaited one. Records the engine's posted receives whose wait took their message in C."""
    comm, MPI = ctx.comm, ctx.MPI
    r, partner = ctx.rank, _partner_across(ctx)
    engine = getattr(comm, "_engine", None)
    before = engine.posted_socket_takes if engine is not None else None
    for count in (1, 1000, 16000):
        for late in (min(r, partner), max(r, partner)):
            out = ctx.data(np.float64, count, r, "x", late)
            inbuf = sentinel(np.float64, count + 3)
            req = comm.Irecv(inbuf, partner, 60)
            if r == late:
                time.sleep(0.005)
            MPI.Request.Waitall([req, comm.Isend(out, partner, 60)])
            ctx.check(f"Irecv/Isend/Waitall count={count}, rank {late} late", inbuf[:count],
                      ctx.data(np.float64, count, partner, "x", late))
            ctx.check(f"Irecv/Isend/Waitall count={count}: the rest untouched", inbuf[count:],
                      sentinel(np.float64, count + 3)[count:])
    st = MPI.Status()
    inbuf = sentinel(np.int32, 500)
    req = comm.Irecv(inbuf, partner, MPI.ANY_TAG)
    if r > partner:
        time.sleep(0.005)
    sreq = comm.Isend(ctx.data(np.int32, 400, r, "status"), partner, 61 + (r > partner))
    req.Wait(st)
    sreq.Wait()
    ctx.check("Irecv ANY_TAG, Wait(status)", inbuf[:400], ctx.data(np.int32, 400, partner, "status"))
    ctx.check_equal("Irecv ANY_TAG, Wait(status): status",
                    (st.Get_source(), st.Get_tag(), st.Get_count(MPI.INT)), (partner, 61 + (partner > r), 400))
    # the partner's message of tag 63 comes first; this rank waits for tag 64 before it receives tag 63
    first, second = sentinel(np.int16, 99), sentinel(np.int16, 99)
    req = comm.Irecv(second, partner, 64)
    a = comm.Isend(ctx.data(np.int16, 99, r, "63"), partner, 63)
    b = comm.Isend(ctx.data(np.int16, 99, r, "64"), partner, 64)
    req.Wait()
    comm.Recv(first, partner, 63)
    MPI.Request.Waitall([a, b])
    ctx.check("the awaited message behind another tag's", second, ctx.data(np.int16, 99, partner, "64"))
    ctx.check("the other tag's message, received after", first, ctx.data(np.int16, 99, partner, "63"))
    if before is not None:
        ctx.record("posted socket takes", engine.posted_socket_takes - before)


@case
def case_sendrecv_ring_late_peer(ctx):
    """Sendrecv round a ring (send right, receive left: on hosts of several ranks one partner shares the host and the
    other does not) while one rank comes late, so the others wait for its message: values, and the status of each
    receive (named tag, ANY_TAG), for eager sizes."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    if n < 2:
        ctx.skip("needs 2 ranks")
    right, left = (r + 1) % n, (r - 1) % n
    for count in (1, 1000, 30000):
        for late in range(n):
            tag = 50 + late
            if r == late:
                time.sleep(0.02)
            out = ctx.data(np.int32, count, r, "ring", late)
            inbuf = sentinel(np.int32, count)
            st = MPI.Status()
            recvtag = tag if late % 2 == 0 else MPI.ANY_TAG
            comm.Sendrecv([out, MPI.INT], right, tag, [inbuf, MPI.INT], left, recvtag, st)
            ctx.check(f"ring Sendrecv count={count}, rank {late} late", inbuf, ctx.data(np.int32, count, left, "ring", late))
            ctx.check_equal(f"ring Sendrecv count={count}, rank {late} late: status",
                            (st.Get_source(), st.Get_tag(), st.Get_count(MPI.INT)), (left, tag, count))


@case
def case_sendrecv_large_one_peer(ctx):
    """Sendrecv of messages past the eager size with one partner (dest == source, one tag), as a halo exchange makes
    them, and the cases a one-call exchange must hand to the engine: a shorter message than the buffer, a message of
    another tag ahead in the stream, a partner that answers with Recv then Send, and Sendrecv_replace. Records the
    engine's frames exchanged and handed on, where it has them."""
    comm, MPI = ctx.comm, ctx.MPI
    r, partner = ctx.rank, _partner_across(ctx)
    engine = getattr(comm, "_engine", None)
    before = (engine.frames_exchanged, engine.frames_handed_on) if engine is not None else None
    count = (1 << 18) + 3  # int32: 1 MiB and 12 bytes
    for round_ in range(3):
        out = ctx.data(np.int32, count, r, "even", round_)
        inbuf = sentinel(np.int32, count)
        st = MPI.Status()
        comm.Sendrecv([out, MPI.INT], partner, 40, [inbuf, MPI.INT], partner, 40, st)
        ctx.check(f"Sendrecv 1 MiB, round {round_}", inbuf, ctx.data(np.int32, count, partner, "even", round_))
        ctx.check_equal("Sendrecv 1 MiB: status", (st.Get_source(), st.Get_tag(), st.Get_count(MPI.INT)),
                        (partner, 40, count))
    # the partner's message shorter than the buffer: the buffer's tail is left as it was
    short = count - 1000 if r > partner else count
    out = ctx.data(np.int32, short, r, "short")
    inbuf = sentinel(np.int32, count)
    st = MPI.Status()
    comm.Sendrecv(out, partner, 41, inbuf, partner, 41, st)
    theirs = count - 1000 if partner > r else count
    ctx.check("Sendrecv, a shorter message", inbuf[:theirs], ctx.data(np.int32, theirs, partner, "short"))
    ctx.check("Sendrecv, a shorter message: the rest untouched", inbuf[theirs:], sentinel(np.int32, count)[theirs:])
    ctx.check_equal("Sendrecv, a shorter message: status count", st.Get_count(MPI.INT), theirs)
    # a message of another tag ahead of the exchanged one: it waits for its own Recv
    ahead = ctx.data(np.float64, 1 << 16, r, "ahead")
    req = comm.Isend(ahead, partner, 42)
    out = ctx.data(np.int32, count, r, "after")
    inbuf = sentinel(np.int32, count)
    comm.Sendrecv(out, partner, 43, inbuf, partner, 43)
    ctx.check("Sendrecv behind a message of another tag", inbuf, ctx.data(np.int32, count, partner, "after"))
    got = np.zeros(1 << 16, np.float64)
    comm.Recv(got, partner, 42)
    req.Wait()
    ctx.check("the message of another tag, received after", got, ctx.data(np.float64, 1 << 16, partner, "ahead"))
    # the partner answers with Recv then Send (4 MiB: past the sockets' buffers)
    big = 1 << 20
    out = ctx.data(np.float32, big, r, "one-sided")
    inbuf = sentinel(np.float32, big)
    if r < partner:
        comm.Sendrecv(out, partner, 44, inbuf, partner, 44)
    else:
        comm.Recv(inbuf, partner, 44)
        comm.Send(out, partner, 44)
    ctx.check("Sendrecv against Recv then Send, 4 MiB", inbuf, ctx.data(np.float32, big, partner, "one-sided"))
    buf = ctx.data(np.float64, 1 << 17, r, "replace")
    comm.Sendrecv_replace(buf, partner, 45, partner, 45)
    ctx.check("Sendrecv_replace 1 MiB", buf, ctx.data(np.float64, 1 << 17, partner, "replace"))
    if before is not None:
        ctx.record("frames exchanged", engine.frames_exchanged - before[0])
        ctx.record("frames handed on", engine.frames_handed_on - before[1])


@case
def case_irecv_test_poll(ctx):
    """Irecv completed by polling Test(); Status of a wildcard Wait."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    if n < 2:
        ctx.skip("needs 2 ranks")
    if r == 0:
        buf = np.zeros(1000, np.int64)
        req = comm.Irecv(buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
        comm.Barrier()  # the sender sends only after this
        deadline = time.monotonic() + 60
        st0 = MPI.Status()
        while not req.Test(st0):  # the call that returns True fills the status
            if time.monotonic() > deadline:
                ctx.fail("Irecv Test", "never completed")
                break
            time.sleep(0.0005)
        ctx.check_equal("Irecv (polled) status (source, tag, count)", (st0.Get_source(), st0.Get_tag(), st0.Get_count(MPI.INT64_T)), (n - 1, 76, 1000))
        ctx.check("Irecv (polled)", buf, np.arange(1000, dtype=np.int64))
        st = MPI.Status()
        req2 = comm.Irecv(buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
        req2.Wait(st)
        ctx.check_equal("Wait(status) source", st.Get_source(), n - 1)
        ctx.check_equal("Wait(status) tag", st.Get_tag(), 77)
        ctx.check_equal("Wait(status) count", st.Get_count(MPI.INT64_T), 10)
    else:
        comm.Barrier()
        if r == n - 1:
            comm.Send(np.arange(1000, dtype=np.int64), dest=0, tag=76)
            comm.Send(np.arange(10, dtype=np.int64), dest=0, tag=77)
    # no rank may start the next case (and send to rank 0) while rank 0 has a wildcard receive posted
    comm.Barrier()


@case
def case_objects(ctx):
    """send/recv of Python objects with tags and wildcards."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    if n < 2:
        ctx.skip("needs 2 ranks")
    if r != 0:
        comm.send({"from": r, "data": list(range(r))}, dest=0, tag=r)
    else:
        got = {}
        for _ in range(n - 1):
            st = MPI.Status()
            obj = comm.recv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st)
            got[obj["from"]] = obj
            ctx.check_equal("recv status source", st.Get_source(), obj["from"])
            ctx.check_equal("recv status tag", st.Get_tag(), obj["from"])
        ctx.check_equal("recv objects", got, {q: {"from": q, "data": list(range(q))} for q in range(1, n)})
    comm.Barrier()
    if r == 0:
        comm.send("second", dest=n - 1, tag=5)
        comm.send("first", dest=n - 1, tag=4)
    elif r == n - 1:
        ctx.check_equal("recv by tag 4", comm.recv(source=0, tag=4), "first")
        ctx.check_equal("recv by tag 5", comm.recv(source=0, tag=5), "second")
    comm.Barrier()


@case
def case_p2p_with_collectives(ctx):
    """Outstanding Irecv/Isend across collectives: the two kinds of traffic do not mix."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    inbuf = np.zeros(100, np.float64)
    rreq = comm.Irecv(inbuf, source=left, tag=0)
    out = np.full(100, r, np.float64)
    sreq = comm.Isend(out, dest=right, tag=0)
    a = np.full(100, r + 1, np.float64)
    b = np.zeros(100, np.float64)
    comm.Allreduce(a, b, op=MPI.SUM)
    comm.Barrier()
    MPI.Request.Waitall([rreq, sreq])
    ctx.check("Allreduce with p2p outstanding", b, np.full(100, n * (n + 1) / 2))
    ctx.check("Irecv across collectives", inbuf, np.full(100, left, np.float64))
    # the other way round: a nonblocking collective outstanding across blocking p2p
    big = ctx.data(np.float32, 200000, r)
    big_out = np.zeros(200000, np.float32)
    creq = comm.Iallreduce(big, big_out, op=MPI.SUM)
    got = np.zeros(1000, np.int32)
    if n > 1:
        if r % 2 == 0:
            comm.Send(np.full(1000, r, np.int32), dest=right, tag=0)
            comm.Recv(got, source=left, tag=0)
        else:
            comm.Recv(got, source=left, tag=0)
            comm.Send(np.full(1000, r, np.int32), dest=right, tag=0)
        ctx.check("p2p while Iallreduce outstanding", got, np.full(1000, left, np.int32))
    creq.Wait()
    ctx.check("Iallreduce across p2p", big_out, reduce_ref("SUM", [ctx.data(np.float32, 200000, q) for q in range(n)], np.float32))


@case
def case_split_every_call(ctx):
    """Messages past the rendezvous size whose copy the sender may share (pycoll's split table): Isend windows,
    blocking Send and Recv, Sendrecv and Irecv posted first, sizes off the chunk grid, each checked whole."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    if n < 2:
        ctx.skip("needs 2 ranks")
    partner = r ^ 1
    if partner >= n:
        return
    for rounds, count in ((3, (1 << 20) + 3), (2, (4 << 20) + 129), (2, 300_001)):
        for i in range(rounds):
            # a window of Isends one way, then blocking Send/Recv the other way
            window = [ctx.data(np.uint8, count, r, "w", i, j) for j in range(4)]
            got = [np.zeros(count, np.uint8) for _ in range(4)]
            if r < partner:
                MPI.Request.Waitall([comm.Isend([w, count, MPI.BYTE], partner, 40 + j) for j, w in enumerate(window)])
                back = np.zeros(count, np.uint8)
                comm.Recv([back, count, MPI.BYTE], partner, 45)
                ctx.check(f"blocking Recv {count} B", back, ctx.data(np.uint8, count, partner, "s", i))
            else:
                MPI.Request.Waitall([comm.Irecv([g, count, MPI.BYTE], partner, 40 + j) for j, g in enumerate(got)])
                for j, g in enumerate(got):
                    ctx.check(f"Isend window {count} B #{j}", g, ctx.data(np.uint8, count, partner, "w", i, j))
                comm.Send([ctx.data(np.uint8, count, r, "s", i), count, MPI.BYTE], partner, 45)
            out, inbuf = ctx.data(np.uint8, count, r, "x", i), np.zeros(count, np.uint8)
            comm.Sendrecv([out, count, MPI.BYTE], partner, 46, [inbuf, count, MPI.BYTE], partner, 46)
            ctx.check(f"Sendrecv {count} B", inbuf, ctx.data(np.uint8, count, partner, "x", i))
    engine = getattr(comm, "_engine", None)
    if engine is not None and hasattr(engine, "split_chunks"):
        ctx.record("split_chunks", int(engine.split_chunks))
