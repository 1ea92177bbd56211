"""mpi4py's point-to-point and request API: synchronous sends, probes and matched probes, many-request completion,
cancels, persistent requests, Status and Message semantics, and the errors of bad calls, on 2, 3 and 4 ranks."""

from __future__ import annotations

import json
import pickle
import textwrap

import pytest

import harness

pytestmark = [pytest.mark.timeout(240)]

_PROGRAM = """
import json, os, pickle, sys, time
import numpy as np
from pycoll import MPI
from pycoll.errors import InvalidArgumentError, MismatchError, TimeoutError
from pycoll.p2p_protocol import P2P_CMA_BYTES

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
nxt, prv = (rank + 1) % size, (rank - 1) % size
T = P2P_CMA_BYTES.default  # from here on a rendezvous over shared memory
SIZES = [0, 100, 20 << 10, T + 8]  # one frame, a frame past 16 KiB, a rendezvous (a streamed one over tcp)
bad = []


def check(ok, what):
    if not ok:
        bad.append(what)


def pattern(n, salt):
    return ((np.arange(n, dtype=np.int64) * 7 + salt) % 251).astype(np.uint8)


def same(got, want, what):
    check(got.shape == want.shape and bool(np.array_equal(got, want)), what)


def expect_error(cls, fn, what, op_word, with_rank=True):
    try:
        fn()
    except cls as exc:
        check(exc.op is not None and op_word in exc.op, f"{what}: the error names {exc.op!r}, not {op_word}")
        if with_rank:
            check(exc.rank == rank, f"{what}: the error names rank {exc.rank}")
        return exc
    except Exception as exc:
        bad.append(f"{what}: raised {type(exc).__name__}: {exc}")
    else:
        bad.append(f"{what}: no error")
    return None


def status_of(st):
    return (st.source, st.tag, st.Get_count(MPI.BYTE))


# ---- synchronous sends ------------------------------------------------------------------------
for i, n in enumerate(SIZES):
    data = pattern(n, rank + i)
    req = comm.Issend(data, nxt, 10 + i)
    comm.Barrier()  # every rank's message is out; no receive is posted yet
    check(not req.Test() and not req.Get_status() and bool(req), f"Issend of {n} bytes complete before a receive matched it")
    comm.Barrier()
    got, st = np.zeros(n, np.uint8), MPI.Status()
    comm.Recv(got, prv, 10 + i, st)
    same(got, pattern(n, prv + i), f"Issend {n}: data")
    check(status_of(st) == (prv, 10 + i, n), f"Issend {n}: status {status_of(st)}")
    check(req.Wait() is True and not req and req == MPI.REQUEST_NULL, f"Issend {n}: not null after Wait")
if rank == 0:
    t0 = time.monotonic()
    comm.Ssend(pattern(100, 1), 1, 20)
    waited = time.monotonic() - t0
    check(waited >= 0.25, f"Ssend returned after {waited:.3f} s, before its receive (posted after 0.4 s)")
elif rank == 1:
    time.sleep(0.4)
    got = np.zeros(100, np.uint8)
    comm.Recv(got, 0, 20)
    same(got, pattern(100, 1), "Ssend data")
req = comm.issend({"from": rank, "blob": bytes(T)}, nxt, 21)
check(comm.recv(None, prv, 21) == {"from": prv, "blob": bytes(T)}, "issend object")
check(req.wait() is None and not req, "issend request")
if rank % 2 == 0 and rank + 1 < size:
    comm.ssend(("pair", rank), rank + 1, 22)
elif rank % 2 == 1:
    check(comm.recv(None, rank - 1, 22) == ("pair", rank - 1), "ssend object")
rreq = comm.Irecv(got := np.zeros(64, np.uint8), rank, 23)
comm.Ssend(pattern(64, 9), rank, 23)  # to itself: the receive posted first matches it
rreq.Wait()
same(got, pattern(64, 9), "Ssend to self")
comm.Ssend(None, MPI.PROC_NULL)
comm.Issend([None, 0, MPI.BYTE], MPI.PROC_NULL, 5).Wait()
comm.Barrier()

# ---- probes -------------------------------------------------------------------------------------
st = MPI.Status()
check(not comm.Iprobe() and not comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, st), "Iprobe found a message nobody sent")
check(status_of(st) == (MPI.ANY_SOURCE, MPI.ANY_TAG, 0), "a failed Iprobe touched the status")
comm.Barrier()
for i, n in enumerate(SIZES):
    a, b = pattern(n, 1 + i), pattern(n // 2 + 3, 2 + i)
    sends = [comm.Isend(a, nxt, 31), comm.Isend(b, nxt, 32)]
    comm.Probe(MPI.ANY_SOURCE, MPI.ANY_TAG, st)
    check(status_of(st) == (prv, 31, n), f"Probe(ANY, ANY) {n}: {status_of(st)}")
    check(comm.Probe(prv, 32, st) is True and status_of(st) == (prv, 32, n // 2 + 3), f"Probe(tag 32) {n}: {status_of(st)}")
    check(comm.Iprobe(prv, 31, st) and st.tag == 31, f"Iprobe {n}")
    got_b, got_a = np.zeros(n // 2 + 3, np.uint8), np.zeros(n, np.uint8)
    comm.Recv(got_b, prv, 32)
    comm.Recv(got_a, MPI.ANY_SOURCE, 31)
    same(got_a, a if False else pattern(n, 1 + i), f"probed {n}: first message")
    same(got_b, pattern(n // 2 + 3, 2 + i), f"probed {n}: second message")
    MPI.Request.Waitall(sends)
comm.Barrier()  # no rank's later sends (the fan-in's) may reach a Probe(ANY, ANY) above: MPI orders no two sources
# a probed message is the one the next matching receive takes (the size the probe said)
sends = [comm.Isend(pattern(10, 1), nxt, 33), comm.Isend(pattern(20, 2), nxt, 33)]
comm.Probe(prv, 33, st)
first = np.zeros(st.Get_count(), np.uint8)
comm.Recv(first, prv, 33)
same(first, pattern(10, 1), "the receive after a probe took another message")
second = np.zeros(20, np.uint8)
comm.Recv(second, prv, 33)
MPI.Request.Waitall(sends)
# fan-in: rank 0 probes ANY_SOURCE and sizes each receive by the probe
if rank == 0:
    seen = set()
    for _ in range(size - 1):
        comm.Probe(MPI.ANY_SOURCE, 34, st)
        buf = np.zeros(st.Get_count(MPI.BYTE), np.uint8)
        comm.Recv(buf, st.Get_source(), 34)
        same(buf, pattern(100 + 1000 * st.source, st.source), f"fan-in from {st.source}")
        seen.add(st.source)
    check(seen == set(range(1, size)), f"fan-in sources {seen}")
else:
    comm.Send(pattern(100 + 1000 * rank, rank), 0, 34)
comm.Barrier()

# ---- matched probes -------------------------------------------------------------------------------
for i, n in enumerate(SIZES):
    one, two = pattern(n, 3 + i), pattern(n + 1, 4 + i)
    sends = [comm.Isend(one, nxt, 40), comm.Isend(two, nxt, 40)]
    m = comm.Mprobe(prv, 40, st)
    check(isinstance(m, MPI.Message) and bool(m) and status_of(st) == (prv, 40, n), f"Mprobe {n}: {status_of(st)}")
    got_two = np.zeros(n + 1, np.uint8)
    comm.Recv(got_two, prv, 40)  # must not take the message the probe holds
    same(got_two, pattern(n + 1, 4 + i), f"Mprobe {n}: a later Recv took the matched message")
    got_one = np.zeros(n, np.uint8)
    m.Recv(got_one, st)
    same(got_one, pattern(n, 3 + i), f"Mprobe {n}: Message.Recv data")
    check(status_of(st) == (prv, 40, n) and not m and m == MPI.MESSAGE_NULL, f"Mprobe {n}: after Message.Recv")
    MPI.Request.Waitall(sends)
sreq = comm.isend(("obj", rank), nxt, 41)
m = None
while m is None:
    m = comm.improbe(prv, 41)
check(m.irecv().wait() == ("obj", prv), "improbe + irecv object")
sreq.wait()
sreq = comm.Isend(pattern(300, 7), nxt, 44)
m = MPI.Message.Probe(comm, MPI.ANY_SOURCE, 44)
r = m.Irecv(got := np.zeros(300, np.uint8))
MPI.Request.Waitall([r, sreq])
same(got, pattern(300, 7), "Message.Probe + Irecv")
req = comm.Issend(pattern(50, 5), nxt, 42)  # a matched probe does not complete a synchronous send ...
m = comm.Mprobe(prv, 42)
comm.Barrier()
check(not req.Test(), "Issend complete after a matched probe, before the matched receive")
comm.Barrier()
m.Recv(got := np.zeros(50, np.uint8))  # ... its receive does
req.Wait()
same(got, pattern(50, 5), "Issend through Mprobe")
m = comm.Mprobe(MPI.PROC_NULL, 0, st)
check(m == MPI.MESSAGE_NO_PROC and m is not MPI.MESSAGE_NO_PROC and st.source == MPI.PROC_NULL, "Mprobe(PROC_NULL)")
m.Recv(None)
check(m == MPI.MESSAGE_NULL, "a no-proc Message after its Recv")
expect_error(InvalidArgumentError, lambda: m.Recv(np.zeros(4, np.uint8)), "Recv on MESSAGE_NULL", "Message.Recv", False)
sreq = comm.Isend(pattern(100, 8), nxt, 43)
m = comm.Mprobe(prv, 43)
exc = expect_error(MismatchError, lambda: m.Recv(np.zeros(10, np.uint8)), "truncated matched receive", "Message.Recv")
check(exc is None or ("100 bytes" in exc.cause and exc.peers == (prv,)), f"truncation error: {exc}")
sreq.Wait()
comm.Barrier()

# ---- many requests, cancel, Get_status -----------------------------------------------------------
bufs = [np.zeros(8, np.uint8) for _ in range(4)]
reqs = [comm.Irecv(bufs[k], prv, 50 + k) for k in range(4)]
check(MPI.Request.Testany(reqs) == (MPI.UNDEFINED, False), "Testany with nothing done")
check(MPI.Request.Testsome(reqs) == [] and not MPI.Request.Testall(reqs) and all(reqs), "Testsome/Testall with nothing done")
comm.Barrier()
comm.Send(pattern(8, 52), nxt, 52)
idx = MPI.Request.Waitany(reqs, st)
check(idx == 2 and st.tag == 52 and not reqs[2] and reqs[2] == MPI.REQUEST_NULL, f"Waitany: {idx} {st.tag}")
comm.Barrier()  # the next messages leave after every Waitany returned
comm.Send(pattern(8, 53), nxt, 53)
comm.Send(pattern(8, 50), nxt, 50)
done, statuses = [], []
while len(done) < 2:
    got_idx = MPI.Request.Waitsome(reqs, statuses)
    check(len(statuses) >= len(got_idx), "Waitsome statuses not grown")
    check([s.tag for s in statuses[: len(got_idx)]] == [50 + k for k in got_idx], "Waitsome statuses out of order")
    done += got_idx
check(sorted(done) == [0, 3], f"Waitsome indices {done}")
for k in (0, 2, 3):
    same(bufs[k], pattern(8, 50 + k), f"many receives: tag {50 + k}")
reqs[1].Cancel()
reqs[1].Wait(st)
check(st.Is_cancelled() and st.cancelled, "a cancelled receive's status")
check(MPI.Request.Waitany(reqs) == MPI.UNDEFINED and MPI.Request.Waitsome(reqs) is None, "null requests still active")
check(MPI.Request.Testany(reqs) == (MPI.UNDEFINED, True) and MPI.Request.Testall(reqs), "Testany/Testall on null")
comm.Barrier()  # every receive of tag 51 is cancelled before its message leaves
comm.Send(pattern(8, 51), nxt, 51)
comm.Recv(got := np.zeros(8, np.uint8), prv, 51)
same(got, pattern(8, 51), "the message of a cancelled receive")
check(not bufs[1].any(), "a cancelled receive got data")
rreqs = [comm.irecv(None, prv, 60 + k) for k in range(3)]
comm.Barrier()
for k in (2, 0, 1):
    comm.send(("v", k, rank), nxt, 60 + k)
objs = {}
while True:
    idx, obj = MPI.Request.waitany(rreqs)
    if idx == MPI.UNDEFINED:
        break
    objs[idx] = obj
check(objs == {k: ("v", k, prv) for k in range(3)}, f"waitany objects {objs}")
rreqs = [comm.irecv(None, prv, 64), comm.Irecv(got := np.zeros(4, np.uint8), prv, 65)]
sreqs = [comm.isend([rank] * 3, nxt, 64), comm.Isend(pattern(4, 65), nxt, 65)]
flag, objs = False, None
while not flag:
    flag, objs = MPI.Request.testall(rreqs)
check(objs == [[prv] * 3, None], f"testall objects {objs}")
check(MPI.Request.waitall(sreqs) == [None, None], "waitall of sends")
req = comm.Irecv(got := np.zeros(16, np.uint8), prv, 66)
comm.Send(pattern(16, 66), nxt, 66)
while not req.Get_status(st):
    pass
check(bool(req) and status_of(st) == (prv, 66, 16), "Get_status completed the request")
copy = MPI.Request(req)
check(copy == req and MPI.Request.fromhandle(req.handle) == req and type(copy) is MPI.Request, "request copies")
try:
    pickle.dumps(req)
    bad.append("an active request pickled")
except ValueError:
    pass
sts = []
MPI.Request.Waitall([req, MPI.Request()], sts)
check(len(sts) == 2 and status_of(sts[0]) == (prv, 66, 16) and status_of(sts[1]) == (MPI.ANY_SOURCE, MPI.ANY_TAG, 0),
      "Waitall statuses")
check(req == MPI.REQUEST_NULL, "Waitall left a request active")
comm.Barrier()

# ---- persistent requests, Sendrecv variants --------------------------------------------------------
sbuf, rbuf = np.zeros(16, np.int32), np.zeros(16, np.int32)
sreq, rreq = comm.Send_init(sbuf, nxt, 70), comm.Recv_init(rbuf, prv, 70)
check(isinstance(sreq, MPI.Prequest) and bool(sreq) and sreq.Wait(), "an inactive persistent request")
for it in range(3):
    sbuf[:] = rank * 100 + it  # each Start sends the buffer's contents at that time
    MPI.Prequest.Startall([rreq, sreq])
    seen = set()
    while (i := MPI.Prequest.Waitany([rreq, sreq])) != MPI.UNDEFINED:
        seen.add(i)
    check(seen == {0, 1} and bool(sreq) and rreq != MPI.REQUEST_NULL, f"persistent round {it}: {seen}")
    check(bool((rbuf == prv * 100 + it).all()), f"persistent round {it}: data {rbuf[:2]}")
ssreq = comm.Ssend_init(pattern(32, 71), nxt, 71)
ssreq.Start()
comm.Recv(got := np.zeros(32, np.uint8), prv, 71)
ssreq.Wait()
same(got, pattern(32, 71), "Ssend_init")
for p in (sreq, rreq, ssreq):
    p.Free()
check(sreq == MPI.REQUEST_NULL and not rreq, "freed persistent requests")
expect_error(InvalidArgumentError, sreq.Start, "Start of a freed request", "Prequest.Start", False)
p = comm.Send_init(None, MPI.PROC_NULL)
p.Start()
expect_error(InvalidArgumentError, p.Start, "Start of an active request", "Prequest.Start", False)
p.Wait()
p.Free()
for n in SIZES:
    buf = pattern(n, rank).copy()
    comm.Sendrecv_replace(buf, nxt, 80, prv, 80, st)
    same(buf, pattern(n, prv), f"Sendrecv_replace {n}")
    check(status_of(st) == (prv, 80, n), f"Sendrecv_replace {n}: status")
    buf = pattern(n, rank).copy()
    comm.Isendrecv_replace(buf, nxt, 81, prv, 81).Wait(st)
    same(buf, pattern(n, prv), f"Isendrecv_replace {n}")
    out = np.zeros(n, np.uint8)
    req = comm.Isendrecv(pattern(n, rank), nxt, 82, out, prv, 82)
    req.Wait(st)
    same(out, pattern(n, prv), f"Isendrecv {n}")
    check(status_of(st) == (prv, 82, n) and not req, f"Isendrecv {n}: status")
comm.Barrier()

# ---- bad calls --------------------------------------------------------------------------------------
expect_error(InvalidArgumentError, lambda: comm.Ssend(np.zeros(4), size, 0), "Ssend to rank size", "Ssend")
expect_error(InvalidArgumentError, lambda: comm.Issend(np.zeros(4), 0, -3), "Issend with a negative tag", "Issend")
expect_error(InvalidArgumentError, lambda: comm.Issend(np.zeros(4), 0, 1 << 63), "Issend with a tag past 64 bits", "Issend")
expect_error(InvalidArgumentError, lambda: comm.ssend("x", 1.5), "ssend to a float rank", "ssend")
expect_error(InvalidArgumentError, lambda: comm.Ssend("text", 0), "Ssend of a str", "Ssend")
expect_error(InvalidArgumentError, lambda: comm.Probe(size, 0), "Probe of rank size", "Probe")
expect_error(InvalidArgumentError, lambda: comm.Iprobe(0, "x"), "Iprobe with a str tag", "Iprobe")
expect_error(InvalidArgumentError, lambda: comm.Mprobe(-7), "Mprobe of rank -7", "Mprobe")
expect_error(InvalidArgumentError, lambda: comm.Send_init(np.zeros(4), size + 3), "Send_init to a bad rank", "Send_init")
expect_error(InvalidArgumentError, lambda: comm.Recv_init(b"read-only", 0), "Recv_init into bytes", "Recv_init")
expect_error(InvalidArgumentError, lambda: comm.Isendrecv([None, 3, MPI.BYTE], nxt), "Isendrecv of None with a count", "Isendrecv")
expect_error(InvalidArgumentError, MPI.Request().Cancel, "Cancel of a null request", "Request.Cancel", False)
expect_error(InvalidArgumentError, MPI.Request().Free, "Free of a null request", "Request.Free", False)
# timeouts: a probe nothing answers, a synchronous send nobody receives (each breaks only its own communicator)
dup_a, dup_b = comm.Dup(), comm.Dup()
dup_a.timeout = dup_b.timeout = 1.0
t0 = time.monotonic()
if rank == 0:
    exc = expect_error(TimeoutError, lambda: dup_a.Probe(1, 99), "Probe nobody answers", "Probe")
    check(exc is None or exc.peers == (1,), f"Probe timeout names {exc and exc.peers}")
elif rank == 1:
    exc = expect_error(TimeoutError, lambda: dup_b.Ssend(np.zeros(8, np.uint8), 0, 98), "Ssend nobody receives", "Ssend")
    check(exc is None or exc.peers == (0,), f"Ssend timeout names {exc and exc.peers}")
if rank < 2:
    check(0.9 <= time.monotonic() - t0 < 10, f"timeout after {time.monotonic() - t0:.2f} s")
comm.Barrier()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"bad": bad, "compiled": comm._engine._kernels is not None}, f)
"""


def _run(tmp_path, n: int, transport: str, env: dict):
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(_PROGRAM))
    cmd = harness.launcher_cmd(n, [harness.PYTHON, str(prog), str(tmp_path)], timeout=150)
    proc = harness.launch(cmd, harness.rank_env(transport, 30, {"PYCOLL_LAUNCH_GRACE": "3", **env}), timeout=180)
    outs = {}
    for r in range(n):
        f = tmp_path / f"rank{r}.json"
        if f.exists():
            outs[r] = json.loads(f.read_text())
    return proc, outs


@pytest.mark.ranks
@pytest.mark.parametrize(
    "n,transport,compiled",
    [(2, "shm", False), (3, "shm", False), (4, "shm", False), (3, "tcp", False), (2, "shm", True)],
    ids=["n2-shm", "n3-shm", "n4-shm", "n3-tcp", "n2-shm-compiled"],
)
def test_p2p_api(n, transport, compiled, tmp_path):
    # compiled: the kernels load with the communicator, so eager receives (that a matched probe must not fool) run them
    env = {"PYCOLL_ARENA_JIT_LOAD": "now" if compiled else "background"}
    proc, outs = _run(tmp_path, n, transport, env)
    assert set(outs) == set(range(n)), f"ranks did not finish:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for r, out in sorted(outs.items()):
        assert out["bad"] == [], f"rank {r}: {out['bad']}"
        if compiled:
            assert out["compiled"], f"rank {r} ran without the compiled eager kernels"


# ---- objects alone (no ranks) ---------------------------------------------------------------------------
def test_status_fields_setters_copy_pickle():
    from pycoll import MPI

    st = MPI.Status()
    assert (st.source, st.tag, st.error, st.count, st.cancelled) == (MPI.ANY_SOURCE, MPI.ANY_TAG, MPI.SUCCESS, 0, False)
    st.Set_source(3)
    st.Set_tag(7)
    st.Set_error(MPI.ERR_ARG)
    st.Set_elements(MPI.INT32_T, 5)
    assert (st.Get_source(), st.Get_tag(), st.Get_error()) == (3, 7, MPI.ERR_ARG)
    assert (st.Get_count(MPI.INT32_T), st.Get_elements(MPI.INT32_T), st.Get_count(MPI.BYTE), st.count) == (5, 5, 20, 20)
    assert st.Get_count(MPI.DOUBLE) == MPI.UNDEFINED  # 20 bytes are not whole doubles
    assert not st.Is_cancelled()
    st.Set_cancelled(True)
    copy = MPI.Status(st)
    assert (copy.source, copy.tag, copy.error, copy.count, copy.Is_cancelled()) == (3, 7, MPI.ERR_ARG, 20, True)
    copy.count = 2
    assert copy.Get_count() == 2 and st.count == 20
    back = pickle.loads(pickle.dumps(st))
    assert (back.source, back.tag, back.error, back.count, back.cancelled) == (3, 7, MPI.ERR_ARG, 20, True)
    mem = st.tomemory()
    words = list(mem)
    mem[words.index(3)] = 11
    assert st.source == 11
    for wrong in (123, "abc", object()):
        with pytest.raises(TypeError):
            MPI.Status(wrong)


def test_null_requests_and_messages():
    from pycoll import MPI

    null = MPI.Request()
    assert not null and null == MPI.REQUEST_NULL and null.handle == 0
    assert null.Wait() is True and null.wait() is None and null.Test() is True and null.test() == (True, None)
    st = MPI.Status()
    st.source = 5
    assert null.Get_status(st) and (st.source, st.tag) == (MPI.ANY_SOURCE, MPI.ANY_TAG)
    reqs = [MPI.Request() for _ in range(3)]
    assert MPI.Request.Waitany(reqs) == MPI.UNDEFINED and MPI.Request.Testany(reqs) == (MPI.UNDEFINED, True)
    assert MPI.Request.Waitsome(reqs) is None and MPI.Request.Testsome(reqs) is None
    statuses: list = []
    assert MPI.Request.Waitall(reqs, statuses) is True and len(statuses) == 3
    assert MPI.Request.testall(reqs) == (True, [None, None, None])
    assert pickle.loads(pickle.dumps(MPI.REQUEST_NULL)) is MPI.REQUEST_NULL
    with pytest.raises(TypeError):
        MPI.Prequest(MPI.Request.completed())  # an active request that is not persistent
    assert MPI.MESSAGE_NULL != MPI.MESSAGE_NO_PROC and not MPI.MESSAGE_NULL and MPI.MESSAGE_NO_PROC
    assert MPI.Message() == MPI.MESSAGE_NULL and MPI.Message(MPI.MESSAGE_NO_PROC) == MPI.MESSAGE_NO_PROC
    for constant in (MPI.MESSAGE_NULL, MPI.MESSAGE_NO_PROC):
        assert pickle.loads(pickle.dumps(constant)) is constant
        copy = pickle.loads(pickle.dumps(MPI.Message(constant)))
        assert copy == constant and copy is not constant
    noproc = MPI.Message(MPI.MESSAGE_NO_PROC)
    req = noproc.Irecv(None)
    assert noproc == MPI.MESSAGE_NULL and req and req.Wait(st) and not req and st.source == MPI.PROC_NULL
    MPI.MESSAGE_NO_PROC.Recv(None)
    assert MPI.MESSAGE_NO_PROC  # the constant itself stays


def test_generalized_request():
    from pycoll import MPI

    calls = []
    greq = MPI.Grequest.Start(lambda st: st.Set_tag(9), lambda: calls.append("free"), lambda done: calls.append(done))
    assert not greq.Test()
    greq.Cancel()
    greq.complete("result")
    st = MPI.Status()
    assert greq.test(st) == (True, "result") and st.tag == 9 and not greq
    assert calls == [False, "free"]
    with pytest.raises(TypeError):
        MPI.Prequest(MPI.Grequest.Start())


def test_alloc_mem_and_buffered_mode_names():
    from pycoll import MPI

    mem = MPI.Alloc_mem(64)
    assert len(mem) == 64 and mem.nbytes == 64 and mem.address != 0 and not mem.readonly
    mem[3] = 7
    MPI.Attach_buffer(mem)
    assert MPI.Detach_buffer() is mem
    MPI.Free_mem(mem)
    assert len(mem) == 0
    with pytest.raises(MPI.Exception):
        MPI.Alloc_mem(-1)
    with pytest.raises(MPI.Exception):
        MPI.Free_mem(bytearray(4))
    assert MPI.pickle.loads(MPI.pickle.dumps({"a": 1})) == {"a": 1}
