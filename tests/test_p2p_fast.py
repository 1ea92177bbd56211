"""Point-to-point on 2 ranks, every size class around the rendezvous threshold, over shm (with and without CMA) and tcp."""

from __future__ import annotations

import json
import textwrap

import pytest

import harness
from pycoll.p2p_protocol import P2P_CMA_BYTES, SENDRECV_CMA_BYTES

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(240)]

THRESHOLD = P2P_CMA_BYTES.default  # from here on a rendezvous
SENDRECV_THRESHOLD = SENDRECV_CMA_BYTES.default  # a compiled Sendrecv's, where each rank has a core

_COMMON = """
import json, os, sys, time
import numpy as np
from pycoll import MPI
from pycoll.errors import PeerFailureError, TimeoutError
comm = MPI.COMM_WORLD
rank, peer = comm.Get_rank(), 1 - comm.Get_rank()
out = {}
def done():
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
"""

_MAIN = _COMMON + """
T = int(sys.argv[2])
sizes = [0, 8, 4096, T - 8, T, T + 8, 4 << 20]
bad = []
def check(what, got, want):
    if not np.array_equal(got, want):
        bad.append(what)
def pattern(n, salt):
    return ((np.arange(n, dtype=np.int64) * 7 + salt) % 251).astype(np.uint8)
# every size, three spellings of the buffer, and fresh arrays
for i, n in enumerate(sizes):
    data = pattern(n, i)
    f32 = pattern(n - n % 4, i).view(np.float32)
    for form in ("bare", "bytes", "float", "fresh"):
        tag = 10 * i + len(form)
        if rank == 0:
            if form == "bare":
                comm.Send(data, 1, tag)
            elif form == "bytes":
                buf = np.zeros(n + 16, np.uint8); buf[:n] = data
                comm.Send([buf, n, MPI.BYTE], 1, tag)
            elif form == "float":
                comm.Send([f32, MPI.FLOAT], 1, tag)
            else:
                comm.Send(data.copy(), 1, tag)
        else:
            st = MPI.Status()
            if form == "float":
                got = np.full(f32.size + 3, -1, np.float32)
                comm.Recv([got, MPI.FLOAT], 0, tag, st)
                check(f"{form} {n}", got[: f32.size].view(np.uint8), f32.view(np.uint8))
                check(f"{form} {n} tail", got[f32.size:], np.full(3, -1, np.float32))
                want = (f32.size * 4, 0, tag)
            else:
                got = np.zeros(n + 5, np.uint8) if form != "fresh" else np.empty(n, np.uint8)
                comm.Recv([got, n, MPI.BYTE] if form == "bytes" else got, 0, tag, st)
                check(f"{form} {n}", got[:n], data)
                want = (n, 0, tag)
            if (st.Get_count(MPI.BYTE), st.Get_source(), st.Get_tag()) != want:
                bad.append(f"status {form} {n}: {(st.Get_count(MPI.BYTE), st.Get_source(), st.Get_tag())} != {want}")
    # the send buffer is untouched by the transfer
    if rank == 0:
        check(f"sendbuf intact {n}", data, pattern(n, i))
comm.Barrier()
# ANY_SOURCE / ANY_TAG on rendezvous-sized messages, and unexpected ones (out of order tags)
big, small = pattern(T + 8, 1), pattern(100, 2)
if rank == 0:
    reqs = [comm.Isend(big, 1, 501), comm.Isend(small, 1, 502), comm.Isend(pattern(4 << 20, 3), 1, 503)]
    MPI.Request.Waitall(reqs)
    comm.Send(pattern(T, 4), 1, 504)
else:
    time.sleep(0.3)  # all three arrive before any receive is posted
    a, b, c = np.zeros(4 << 20, np.uint8), np.zeros(100, np.uint8), np.zeros(T + 8, np.uint8)
    st = MPI.Status()
    comm.Recv(a, 0, 503, st); check("unexpected 503", a, pattern(4 << 20, 3))
    comm.Recv(b, 0, 502); check("unexpected 502", b, small)
    comm.Recv(c, MPI.ANY_SOURCE, MPI.ANY_TAG, st); check("unexpected any", c, big)
    if (st.Get_source(), st.Get_tag(), st.Get_count()) != (0, 501, T + 8):
        bad.append(f"any status {(st.Get_source(), st.Get_tag(), st.Get_count())}")
    d = np.zeros(T, np.uint8)
    comm.Recv(d, MPI.ANY_SOURCE, MPI.ANY_TAG, st); check("posted any", d, pattern(T, 4))
# a message larger than the receive buffer fails the receive, not the sender
if rank == 0:
    comm.Send(pattern(T * 2, 5), 1, 505)
else:
    try:
        comm.Recv(np.zeros(T, np.uint8), 0, 505)
        bad.append("truncation not reported")
    except Exception as exc:
        out["truncation"] = type(exc).__name__
comm.Barrier()
# windows of Isends with Waitall, both directions at once
for n in (8, T + 8, 1 << 20):
    srcs = [pattern(n, k) for k in range(64)]
    dsts = [np.zeros(n, np.uint8) for _ in range(64)]
    reqs = [comm.Irecv(dsts[k], peer, 600 + k) for k in range(64)] + [comm.Isend(srcs[k], peer, 600 + k) for k in range(64)]
    MPI.Request.Waitall(reqs)
    for k in range(64):
        check(f"window {n} #{k}", dsts[k], srcs[k])
# Sendrecv (a halo exchange), about its own rendezvous threshold S too
S = int(sys.argv[3])
pulls_before = comm._engine.rdv_pulls
for n in (S - 8, S, S + 8):
    mine, theirs = pattern(n, rank + 5), np.zeros(n, np.uint8)
    comm.Sendrecv([mine, n, MPI.BYTE], peer, 8, [theirs, n, MPI.BYTE], peer, 8)
    check(f"sendrecv about S {n}", theirs, pattern(n, peer + 5))
out["sendrecv_pulls"] = comm._engine.rdv_pulls - pulls_before
# a Sendrecv met by a plain Irecv and Send on the other rank
if rank == 0:
    theirs = np.zeros(S + 8, np.uint8)
    comm.Sendrecv(pattern(S + 8, 21), 1, 9, theirs, 1, 9)
    check("sendrecv against irecv+send", theirs, pattern(S + 8, 22))
else:
    theirs = np.zeros(S + 8, np.uint8)
    req = comm.Irecv(theirs, 0, 9)
    comm.Send(pattern(S + 8, 22), 0, 9)
    req.Wait()
    check("irecv+send against sendrecv", theirs, pattern(S + 8, 21))
for n in (8, 4096, T + 8, 4 << 20):
    mine, theirs = pattern(n, rank), np.zeros(n, np.uint8)
    st = MPI.Status()
    comm.Sendrecv([mine, n, MPI.BYTE], peer, 7, [theirs, n, MPI.BYTE], peer, 7, st)
    check(f"sendrecv {n}", theirs, pattern(n, peer))
    if (st.Get_source(), st.Get_tag(), st.Get_count()) != (peer, 7, n):
        bad.append(f"sendrecv status {n}")
# objects, and PROC_NULL
obj = {"r": rank, "blob": bytes(T * 2)}
got = comm.sendrecv(obj, peer, 3, source=peer, recvtag=3)
if got != {"r": peer, "blob": bytes(T * 2)}:
    bad.append("sendrecv object")
comm.Send(np.zeros(T * 2, np.uint8), MPI.PROC_NULL, 1)
st = MPI.Status()
comm.Recv(np.zeros(4, np.uint8), MPI.PROC_NULL, 1, st)
if st.Get_source() != MPI.PROC_NULL:
    bad.append("PROC_NULL status")
comm.Barrier()
out["bad"] = bad
out["rendezvous"] = comm._engine.rdv_pulls
out["compiled"] = comm._engine._kernels is not None
out["eager_pulls"] = comm._engine.rdv_eager_pulls
done()
"""

_DIES = _COMMON + """
who = sys.argv[2]  # "receiver": rank 1 dies with a rendezvous pending; "sender": rank 0 does
n = 4 << 20
data = np.full(n, 7, np.uint8)
comm.Barrier()
if who == "receiver":
    if rank == 1:
        time.sleep(0.5)  # the announcement has arrived; nobody will pull it
        os._exit(0)
    t0 = time.monotonic()
    try:
        comm.Send(data, 1, 5)
        out["error"] = None
    except PeerFailureError as exc:
        out["error"] = type(exc).__name__
        out["text"] = str(exc)
    out["s"] = time.monotonic() - t0
    out["intact"] = bool((data == 7).all())
else:
    if rank == 0:
        comm.Isend(data, 1, 5)
        time.sleep(0.3)
        os._exit(0)
    time.sleep(1.0)
    got = np.zeros(n, np.uint8)
    t0 = time.monotonic()
    try:
        comm.Recv(got, 0, 5)
        out["error"] = None
    except PeerFailureError as exc:
        out["error"] = type(exc).__name__
        out["text"] = str(exc)
    out["s"] = time.monotonic() - t0
done()
"""

_TIMEOUT = _COMMON + """
n = int(sys.argv[2])
data = np.ones(n, np.uint8)
comm.Barrier()
t0 = time.monotonic()
try:
    if rank == 0:
        comm.Send(data, 1, 5)  # rank 1 never receives (a rendezvous waits for its ack)
    else:
        comm.Recv(np.zeros(8, np.uint8), 0, 6)  # rank 0 never sends tag 6
    out["error"] = None
except Exception as exc:
    out["error"] = type(exc).__name__
    out["text"] = str(exc)
out["s"] = time.monotonic() - t0
done()
time.sleep(4.0)  # still alive when the other rank's timeout ends
"""


_BUFFERED = _COMMON + """
from pycoll.errors import MismatchError
from pycoll import p2p_fast, p2p_specs
bad = []
def pattern(n, salt):
    return ((np.arange(n, dtype=np.int64) * 7 + salt) % 251).astype(np.uint8)
sizes = {1: 8, 2: 4096, 3: 100, 4: 16, 5: 64, 6: 40}
if rank == 0:
    for tag, n in sizes.items():
        comm.Send([pattern(n, tag), n, MPI.BYTE], 1, tag)
    comm.Send([pattern(8, 7), 8, MPI.BYTE], 1, 7)
    reply = np.zeros(24, np.uint8)
    st = MPI.Status()
    comm.Recv([reply, 24, MPI.BYTE], 1, 8, st)
    if not np.array_equal(reply, pattern(24, 8)) or st.Get_count(MPI.BYTE) != 24:
        bad.append("Sendrecv's send")
else:
    engine = comm._engine
    t0 = time.monotonic()
    mine = lambda: [u for u in engine._unexpected if u.ctx == comm._ctx]  # not rank 0's frames of the last Barrier
    while len(mine()) < 7 and time.monotonic() - t0 < 30:
        engine.progress()  # the messages come while this rank is busy elsewhere: the engine buffers them
    out["buffered"] = len(mine())
    taken = []
    real = p2p_fast.FastP2P._take_unexpected
    def spy(self, peer, e, tag):
        got = real(self, peer, e, tag)
        taken.append(got is not None)
        return got
    p2p_fast.FastP2P._take_unexpected = spy
    st = MPI.Status()
    got3 = np.zeros(100, np.uint8)
    comm.Recv([got3, 100, MPI.BYTE], 0, 3, st)  # by tag, past two earlier messages
    if not np.array_equal(got3, pattern(100, 3)) or (st.source, st.tag, st.Get_count(MPI.BYTE)) != (0, 3, 100):
        bad.append("Recv tag 3")
    big = np.zeros(8192, np.uint8)
    r1 = comm.Irecv([big, MPI.BYTE], 0, MPI.ANY_TAG)  # the earliest left: tag 1, 8 bytes into a larger buffer
    st = MPI.Status()
    r1.Wait(st)
    if not np.array_equal(big[:8], pattern(8, 1)) or big[8:].any() or (st.tag, st.Get_count(MPI.BYTE)) != (1, 8):
        bad.append(f"Irecv any tag {st.tag} {st.Get_count(MPI.BYTE)}")
    views = np.zeros(4096 + 16, np.uint8)
    rs = [comm.Irecv([views[:4096], 4096, MPI.BYTE], 0, 2), comm.Irecv([views[4096:], 16, MPI.BYTE], 0, 4)]
    MPI.Request.Waitall(rs)
    if not (np.array_equal(views[:4096], pattern(4096, 2)) and np.array_equal(views[4096:], pattern(16, 4))):
        bad.append("views")
    small = np.full(8, 9, np.uint8)
    try:
        comm.Recv([small, 8, MPI.BYTE], 0, 5)  # 64 bytes into 8: the engine's path raises, the buffer kept
        bad.append("no truncation error")
    except MismatchError as exc:
        out["truncation"] = str(exc)
    if not (small == 9).all():
        bad.append("truncated receive wrote its buffer")
    rest = np.zeros(48, np.uint8)
    st = MPI.Status()
    comm.Sendrecv([pattern(24, 8), 24, MPI.BYTE], 0, 8, [rest, 48, MPI.BYTE], 0, 6, st)  # the receive from the buffer
    if not np.array_equal(rest[:40], pattern(40, 6)) or (st.source, st.tag, st.Get_count(MPI.BYTE)) != (0, 6, 40):
        bad.append("Sendrecv tag 6")
    comm.Recv([rest, 8, MPI.BYTE], 0, 7)
    if not np.array_equal(rest[:8], pattern(8, 7)):
        bad.append("last")
    out["taken_here"] = sum(taken)
    out["left"] = len(mine())
out["bad"] = bad
comm.Barrier()
done()
"""


def _run(tmp_path, program: str, args: list, transport: str = "shm", env: dict | None = None, timeout: float = 150):
    path = tmp_path / "prog.py"
    path.write_text(textwrap.dedent(program))
    extra = {"PYCOLL_LAUNCH_GRACE": "3"}
    extra.update(env or {})
    cmd = harness.launcher_cmd(2, [harness.PYTHON, str(path), str(tmp_path)] + [str(a) for a in args])
    proc = harness.launch(cmd, harness.rank_env(transport, extra.pop("PYCOLL_TIMEOUT", 60), extra), timeout=timeout)
    outs = {}
    for r in (0, 1):
        f = tmp_path / f"rank{r}.json"
        if f.exists():
            outs[r] = json.loads(f.read_text())
    return proc, outs


def _cma_works() -> bool:
    """Whether this host lets sibling processes read each other (Yama ptrace scope 0)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f.read().strip() == "0"
    except OSError:
        return True


@pytest.mark.parametrize("transport,cma,compiled", [("shm", "1", False), ("shm", "1", True), ("shm", "0", False), ("tcp", "1", False)])
def test_sizes_specs_wildcards_windows(transport, cma, compiled, tmp_path):
    # compiled: the kernels load with the communicator, so eager sends and receives run them from the first call
    env = {"PYCOLL_P2P_CMA": cma, "PYCOLL_ARENA_JIT_LOAD": "now" if compiled else "background"}
    proc, outs = _run(tmp_path, _MAIN, [THRESHOLD, SENDRECV_THRESHOLD], transport, env)
    assert set(outs) == {0, 1}, f"ranks did not finish:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for r, o in outs.items():
        assert o["bad"] == [], f"rank {r}: {o['bad']}"
        if compiled:
            assert o["compiled"], f"rank {r} ran point-to-point without the compiled eager kernels"
    if compiled and _cma_works():
        assert outs[1]["eager_pulls"] > 0, "no rendezvous went through the compiled eager receive"
        # each rank pulls its peer's Sendrecv message from S on (the compiled Sendrecv's own threshold)
        assert all(o["sendrecv_pulls"] >= 2 for o in outs.values()), {r: o["sendrecv_pulls"] for r, o in outs.items()}
    assert outs[1]["truncation"] == "MismatchError"
    pulls = outs[0]["rendezvous"] + outs[1]["rendezvous"]
    if transport == "shm" and cma == "1" and _cma_works():
        assert pulls > 0, "no message went by cross-memory attach"
    else:
        assert pulls == 0, f"{pulls} messages went by cross-memory attach with it off or across TCP"


@pytest.mark.parametrize("who", ["receiver", "sender"])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_peer_dies_mid_rendezvous(who, transport, tmp_path):
    proc, outs = _run(tmp_path, _DIES, [who], transport, {"PYCOLL_TIMEOUT": 60})
    survivor = 0 if who == "receiver" else 1
    assert survivor in outs, f"no result:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    o = outs[survivor]
    if transport == "shm" and _cma_works():
        assert o["error"] == "PeerFailureError", o  # a rendezvous: nobody pulled, or nothing left to pull
    else:  # streamed: the socket may have taken the whole message before the peer died
        assert o["error"] in ("PeerFailureError", None), o
    assert o["s"] < 30, o  # found by liveness checks, not by the 60 s timeout
    if who == "receiver":
        assert o["intact"]


@pytest.mark.parametrize("n", [8, 4 << 20])
def test_timeouts_are_honoured(n, tmp_path):
    proc, outs = _run(tmp_path, _TIMEOUT, [n], "shm", {"PYCOLL_TIMEOUT": 2})
    assert set(outs) == {0, 1}, f"ranks did not finish:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    if n < THRESHOLD:  # rank 0's small send is buffered and completes at once
        assert outs[0]["error"] is None and outs[0]["s"] < 1.0, outs[0]
        waiting = [1]
    else:
        waiting = [0, 1]
    timed = [r for r in waiting if outs[r]["error"] == "TimeoutError"]
    assert timed, outs  # at least one rank timed out on its own; the other may have heard of it first
    for r in timed:
        assert 1.9 <= outs[r]["s"] < 6.0, outs[r]
    for r in waiting:
        assert outs[r]["error"] is not None and outs[r]["s"] < 6.0, outs[r]


@pytest.mark.parametrize("form", ["c", "python"])
def test_views_and_fresh_arrays_are_found_by_shape_and_never_held(form: str) -> None:
    import numpy as np

    from pycoll import MPI, p2p_specs

    if form == "c" and p2p_specs.cached_spec is p2p_specs.cached_spec_python:
        pytest.skip("pycoll/_callkey.c was not compiled at install (no C compiler)")
    cached_spec = p2p_specs.cached_spec if form == "c" else p2p_specs.cached_spec_python

    class _Parse:  # the communicator's full parse, for specs over a whole C-ordered array
        def _p2p_buf(self, buf, opname, writable):
            return buf[0].reshape(-1).view(np.uint8)

    base = np.arange(64, dtype=np.float32)
    first = base[0:8]
    held = p2p_specs.resolve_spec(_Parse(), [first, MPI.FLOAT], "Irecv", True)  # its shape is known from now on
    assert cached_spec([first, MPI.FLOAT], True) is held  # the resolved spec itself, by the array's identity
    before = len(p2p_specs._SPECS)
    for lo in (8, 16, 40):  # a window's receive slots, or a halo's fresh views: each its own address
        slot = base[lo:lo + 8]
        found = cached_spec([slot, MPI.FLOAT], True)
        assert found is not None and found[5] == slot.__array_interface__["data"][0] and found[6] == 32
        assert found[0] is slot and found[4] is None  # no flat bytes made until asked for
        assert (p2p_specs.flat_bytes_of(found) == slot.view(np.uint8)).all() and p2p_specs.flat_bytes_of(found).base is not None
    for _ in range(3):  # a new array per call: found by its shape, its address its own, and never held
        again = np.zeros(8, np.float32)
        got = cached_spec([again, MPI.FLOAT], True)
        assert got is not None and got[5] == again.__array_interface__["data"][0]
        del again, got
    assert len(p2p_specs._SPECS) == before  # nothing found by shape is kept alive
    fresh = np.zeros(8, np.float32)
    assert cached_spec([fresh, 4, MPI.FLOAT], True) is None  # another count: a new shape, fully checked
    assert cached_spec([fresh, MPI.INT], True) is None  # another datatype
    assert cached_spec([fresh.astype(np.float64), MPI.FLOAT], True) is None  # another dtype
    assert cached_spec((fresh, MPI.FLOAT), True) is None  # a tuple spec is keyed apart from a list
    assert cached_spec([fresh, 8.0, MPI.FLOAT], True) is None  # not an int count: the full parse rejects it
    assert cached_spec([fresh, [], MPI.FLOAT], True) is None
    assert cached_spec([fresh, 8, []], True) is None  # an unhashable datatype argument: the full parse names it
    assert cached_spec([fresh, 1, 2, 3], True) is None and cached_spec(fresh.tolist(), True) is None
    ro = np.zeros(8, np.float32)
    ro.flags.writeable = False
    assert cached_spec([ro, MPI.FLOAT], True) is None  # a receive into read-only memory: the full parse says no
    first.flags.writeable = False
    assert cached_spec([first, MPI.FLOAT], True) is None  # nor through the identity cache
    first.flags.writeable = True
    assert cached_spec([base[0:16:2], MPI.FLOAT], True) is None  # strided: never by shape
    c_form, py_form = p2p_specs.cached_spec, p2p_specs.cached_spec_python  # both forms give the same entries
    for spec in ([base[24:32], MPI.FLOAT], [first, MPI.FLOAT], [fresh, 4, MPI.FLOAT], [base[0:16:2], MPI.FLOAT]):
        assert c_form(spec, True) == py_form(spec, True) or c_form(spec, True) is py_form(spec, True)


_TCP_EAGER = _COMMON + """
from pycoll.runtime import current
engine = comm._engine
M, COUNT = 60000, 300  # 18 MB of eager frames: more than the socket buffers hold while the receiver sleeps
def pattern(n, salt):
    return ((np.arange(n, dtype=np.int64) * 13 + salt) % 251).astype(np.uint8)
bad = []
comm.Barrier()
if rank == 0:
    for i in range(COUNT):  # Send returns at once: what the socket does not take queues, copied
        comm.Send([pattern(M, i), M, MPI.BYTE], 1, 7)
    comm.Send(np.array([3.5], np.float64), 1, 9)  # then a tag the receiver asks for first
    comm.Send(np.array([2.5], np.float64), 1, 8)
    for i in range(200):  # ping-pong: each message straight from the socket
        comm.Send([np.full(2, i, np.float32), MPI.FLOAT], 1, 1)
        got = np.zeros(2, np.float32)
        comm.Recv([got, MPI.FLOAT], 1, 2)
        if not (got == i + 1).all():
            bad.append(f"pong {i}")
else:
    time.sleep(0.5)
    for i in range(COUNT):
        got = np.empty(M, np.uint8)
        st = MPI.Status()
        comm.Recv([got, MPI.BYTE], 0, 7, st)
        if not np.array_equal(got, pattern(M, i)) or st.Get_count(MPI.BYTE) != M:
            bad.append(f"message {i}")
    nine, eight = np.zeros(1), np.zeros(1)
    comm.Recv(nine, 0, 9)  # not the next frame: it goes through the engine, which buffers tag 8
    comm.Recv(eight, 0, 8)
    if (nine[0], eight[0]) != (3.5, 2.5):
        bad.append(f"out of order: {nine[0]}, {eight[0]}")
    for i in range(200):
        got = np.zeros(2, np.float32)
        comm.Recv([got, MPI.FLOAT], 0, 1)
        comm.Send([got + 1, MPI.FLOAT], 0, 2)
out.update(bad=bad, sends=engine.tcp_eager_sends, recvs=engine.tcp_eager_recvs, queued=engine.tcp_eager_queued,
           transports=sorted(set(current().transport_of.values())))
done()
"""


@pytest.mark.parametrize("eager", ["1", "0"])
def test_messages_between_hosts_go_straight_through_the_socket(eager, tmp_path):
    """Over tcp, a small message leaves in one send and is taken straight from the socket; a full socket queues
    the rest in order, and a receive that is not for the next frame goes through the engine. PYCOLL_TCP_EAGER=0
    turns the path off with the same results."""
    proc, outs = _run(tmp_path, _TCP_EAGER, [], "tcp", {"PYCOLL_TCP_EAGER": eager})
    assert set(outs) == {0, 1}, f"ranks did not finish:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for r, o in outs.items():
        assert o["bad"] == [] and o["transports"] == ["self", "tcp"], o
    if eager == "1":
        assert outs[0]["sends"] >= 400 and outs[1]["sends"] >= 200, outs  # behind a queued rest: the engine
        assert outs[0]["queued"] > 0, outs  # the socket filled while rank 1 slept
        assert outs[1]["recvs"] >= 400 and outs[0]["recvs"] >= 150, outs
    else:
        assert all(o["sends"] == 0 and o["recvs"] == 0 for o in outs.values()), outs


def test_buffered_messages_are_taken_in_matching_order(tmp_path):
    """Messages that came while the receiver was busy elsewhere (the engine buffered them): receives by tag, by
    ANY_TAG, into views and a Sendrecv's take them through the compiled path, in MPI's matching order, with their
    statuses; one too large for its buffer still raises on the engine's path and leaves the buffer alone."""
    proc, outs = _run(tmp_path, _BUFFERED, [], "shm", {"PYCOLL_ARENA_JIT_LOAD": "now"})
    assert set(outs) == {0, 1}, f"ranks did not finish:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    o = outs[1]
    assert o["bad"] == [] and outs[0]["bad"] == [], o
    assert o["buffered"] == 7 and o["left"] == 0, o
    assert o["taken_here"] >= 6, o  # every receive but the truncated one, the Sendrecv's too
    assert "64 bytes" in o["truncation"] and "8-byte" in o["truncation"], o["truncation"]


_LATE_PEER = _COMMON + """
# CLOCK_MONOTONIC is one clock for every process on the host: rank 0 notes when each call began, when its
# compiled wait last looked and when it handed over; rank 1 when each of its frames had surely been written
clock = time.monotonic
posts, began, looked, written, starts, cpu = [], [0.0], [0.0], [], [], []
from pycoll import p2p_fast
wait = p2p_fast.FastP2P._linger
def timed(*a):
    got = wait(*a)
    looked[0] = clock()
    return got
p2p_fast.FastP2P._linger = timed
irecv = comm._irecv_array
def counted(*a, **k):  # the engine's receive: what a compiled call hands over when it stops waiting
    posts.append([len(written), began[0], clock(), max(looked[0], began[0])])
    return irecv(*a, **k)
comm._irecv_array = counted
bad = []
halo = np.zeros(64)
for step in range(60):
    if rank == 1:  # the late rank: 300 us of work before each exchange
        until = time.perf_counter() + 300e-6
        while time.perf_counter() < until:
            pass
    send = np.full(8, 100 * rank + step, np.float64)
    began[0] = clock()
    starts.append(began[0])
    on_core = time.thread_time()
    comm.Sendrecv([send, 8, MPI.DOUBLE], peer, 3, [halo[8:16], 8, MPI.DOUBLE], peer, 3)
    written.append(clock())
    cpu.append(time.thread_time() - on_core)
    if not (halo[8:16] == 100 * peer + step).all():
        bad.append(f"sendrecv {step}")
    if rank == 0:
        got = np.zeros(2)
        began[0] = clock()
        starts.append(began[0])
        on_core = time.thread_time()
        comm.Recv([got, MPI.DOUBLE], 1, 4)
        written.append(clock())
        cpu.append(time.thread_time() - on_core)
        if not (got == step).all():
            bad.append(f"recv {step}")
    else:
        starts.append(clock())
        comm.Send(np.full(2, step, np.float64), 0, 4)
        written.append(clock())
        cpu.append(0.0)
out["bad"], out["posts"], out["written"], out["starts"], out["cpu"] = bad, posts, written, starts, cpu
out["compiled"] = comm._engine._kernels is not None
comm.Barrier()
done()
"""


@pytest.mark.parametrize("spin_us", ["2000", "20"])
def test_a_late_peer_is_awaited_in_the_compiled_call(spin_us, tmp_path):
    """Where each rank has a core, a compiled Sendrecv or Recv whose peer comes 300 µs late keeps polling its ring
    between yields (PYCOLL_P2P_SPIN_US) rather than posting an engine receive; with a span shorter than the delay
    it hands over, and the data is right either way.

    How often the peer is late by more than the span depends on the host's load (a rank that loses its core for
    2 ms is that late), so the test judges each hand-over by the clock the ranks share: it must come a whole span
    after its call began, and the wait must not have given up after the peer's frame had surely been written (its
    call returned over 1 ms earlier: the wait takes from the ring after every yield, so it would have found it)."""
    env = {"PYCOLL_ARENA_JIT_LOAD": "now", "PYCOLL_P2P_SPIN_US": spin_us}
    proc, outs = _run(tmp_path, _LATE_PEER, [], "shm", env)
    assert set(outs) == {0, 1}, f"ranks did not finish:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert outs[0]["bad"] == [] and outs[1]["bad"] == [], outs
    assert outs[0]["compiled"], outs
    import os
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: the ranks share it, so the compiled wait yields instead of spinning")
    posts, written = outs[0]["posts"], outs[1]["written"]
    span = float(spin_us) * 1e-6
    early = [(call, round((at - began) * 1e6)) for call, began, at, looked in posts if at - began < span]
    needless = [(call, round((looked - written[call]) * 1e6)) for call, began, at, looked in posts
                if looked - written[call] > 1e-3]
    assert early == [], f"handed over before the {spin_us} µs span (call, µs waited): {early}"
    assert needless == [], f"handed over though the peer's frame was there (call, µs since written): {needless}"
    if spin_us == "20":
        # the calls whose peer began over two spans after this rank, while this rank kept its core for two spans: a
        # wait that keeps its core hands them over. The scheduler may put both ranks on one core, where the peer's
        # 300 µs of work run while this rank waits off it (and finds the frame there when it runs again)
        mine, theirs, cpu = outs[0]["starts"], outs[1]["starts"], outs[0]["cpu"]
        late = [c for c in range(min(len(mine), len(theirs))) if theirs[c] - mine[c] > 2 * span and cpu[c] > 2 * span]
        if len(late) < 10:
            pytest.skip(f"only {len(late)} calls waited on their core past the span: the ranks shared a core")
        assert len(posts) >= len(late) // 2, (posts, late)  # about 60 Sendrecvs and Recvs wait past a 20 µs span
