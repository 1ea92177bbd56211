"""The compiled point-to-point path (pycoll.p2p_fast) on 2 and 4 ranks of one host: buffer specs resolved once and
followed when the array changes, MPI's matching order against receives it posts, Cancel, Waitall with a failed
receive, a rendezvous acknowledgement behind another frame, Sendrecv by rendezvous, errors, timeouts, a dead peer."""

from __future__ import annotations

import json
import textwrap

import pytest

import harness

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(300)]

COMPILED = {"PYCOLL_ARENA_JIT_LOAD": "now"}

_COMMON = """
import json, os, sys, time
import numpy as np
from pycoll import MPI
from pycoll.errors import InvalidArgumentError, MismatchError, PeerFailureError, TimeoutError
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
out = {"bad": []}
bad = out["bad"]
F = MPI.FLOAT
def done():
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
def pattern(n, salt):
    return ((np.arange(n, dtype=np.int64) * 7 + salt * 13 + n) % 251).astype(np.uint8)
def check(what, got, want):
    if not np.array_equal(got, want):
        bad.append(what)
"""

_TWO = _COMMON + """
peer = 1 - rank
comm.Barrier()

# one array, its spec changing between calls: counts, datatypes, its dtype reassigned, views, fresh arrays
buf = np.arange(64, dtype=np.float32) + 100 * rank
for i, spec in enumerate(["n5", "n3", "n5", "int", "view", "fresh", "bare", "n64"]):
    if rank == 0:
        if spec.startswith("n"):
            comm.Send([buf, int(spec[1:]), F], 1, i)
        elif spec == "int":
            buf.dtype = np.int32
            comm.Send([buf, 7, MPI.INT], 1, i)
            buf.dtype = np.float32
        elif spec == "view":
            comm.Send([buf[10:20], F], 1, i)
        elif spec == "fresh":
            comm.Send([buf.copy(), 9, F], 1, i)
        else:
            comm.Send(buf, 1, i)
    else:
        got = np.full(64, -1, np.float32)
        st = MPI.Status()
        comm.Recv([got, 64, F], 0, i, st)
        want = np.arange(64, dtype=np.float32)
        want = {"n5": want[:5], "n3": want[:3], "int": want[:7], "view": want[10:20], "fresh": want[:9],
                "bare": want, "n64": want}[spec]
        check(f"spec {spec}", got[:want.size].view(np.uint8), want.view(np.uint8))
        check(f"spec {spec} wrote past its message", got[want.size:], np.full(64 - want.size, -1, np.float32))
        if (st.Get_source(), st.Get_tag(), st.Get_count(F)) != (0, i, want.size):
            bad.append(f"spec {spec}: status {(st.Get_source(), st.Get_tag(), st.Get_count(F))}")
comm.Barrier()

# a fresh view or array on every call (a halo's ghost cells): resolved by shape, each at its own address
from pycoll import p2p_fast, p2p_sendrecv, p2p_specs
big = np.zeros(4096, np.float64)
full = []
resolve = p2p_specs.resolve_spec
counting = lambda *a: (full.append(a[1]), resolve(*a))[1]  # noqa: E731 - counts the full parses of a spec
p2p_fast.resolve_spec = p2p_sendrecv.resolve_spec = counting
for i in range(40):
    lo = (i * 37) % 4000
    if rank == 0:
        big[lo:lo + 16] = np.arange(16) + i
        comm.Send([big[lo:lo + 16], 16, MPI.DOUBLE], 1, 60)
        comm.Sendrecv([np.full(3, i, np.int32), MPI.INT], 1, 61, [big[lo:lo + 2], MPI.DOUBLE], 1, 62)
        check(f"fresh view sendrecv {i}", big[lo:lo + 2], np.array([-i, -i - 0.5]))
    else:
        comm.Recv([big[lo + 1:lo + 17], MPI.DOUBLE], 0, 60)
        check(f"fresh view recv {i}", big[lo + 1:lo + 17], np.arange(16) + i)
        got = np.zeros(3, np.int32)
        comm.Sendrecv([np.array([-i, -i - 0.5]), MPI.DOUBLE], 0, 62, [got, 3, MPI.INT], 0, 61)
        check(f"fresh array sendrecv {i}", got, np.full(3, i, np.int32))
p2p_fast.resolve_spec = p2p_sendrecv.resolve_spec = resolve
if len(full) > 8:
    bad.append(f"fresh views were resolved in full: {len(full)} times")
comm.Barrier()

# an Irecv that finds its message next in the ring is done at once: Wait, Get_status and Test report its status
if rank == 0:
    comm.Send([np.arange(5, dtype=np.float32), 5, F], 1, 44)
    comm.Send([np.arange(3, dtype=np.float32), 3, F], 1, 45)
    comm.Barrier()
else:
    comm.Barrier()
    got = np.zeros(8, np.float32)
    r1 = comm.Irecv([got, 8, F], 0, MPI.ANY_TAG)
    st, st2 = MPI.Status(), MPI.Status()
    if not r1.Get_status(st2) or (st2.Get_source(), st2.Get_tag(), st2.Get_count(F)) != (0, 44, 5):
        bad.append(f"Get_status of a taken Irecv {(st2.Get_source(), st2.Get_tag(), st2.Get_count(F))}")
    r1.Wait(st)
    if (st.Get_source(), st.Get_tag(), st.Get_count(F)) != (0, 44, 5):
        bad.append(f"Wait status of a taken Irecv {(st.Get_source(), st.Get_tag(), st.Get_count(F))}")
    r2 = comm.Irecv([got, 8, F], 0, 45)
    st3 = MPI.Status()
    if not r2.Test(st3) or (st3.Get_source(), st3.Get_tag(), st3.Get_count(F)) != (0, 45, 3):
        bad.append(f"Test status of a taken Irecv {(st3.Get_source(), st3.Get_tag(), st3.Get_count(F))}")
comm.Barrier()

# a receive into an array made read-only since its last receive, and a count that is not an int, fail as ever
if rank == 1:
    ro = np.zeros(4, np.float32)
    comm.Send([ro, 4, F], 0, 50)
    comm.Recv([ro, 4, F], 0, 51)
    ro.flags.writeable = False
    try:
        comm.Recv([ro, 4, F], 0, 52)
        bad.append("a receive into a read-only array was taken")
    except InvalidArgumentError:
        pass
    comm.Recv([np.zeros(4, np.float32), 4, F], 0, 52)
    try:
        comm.Send([ro, 4.0, F], 0, 53)
        bad.append("a count of 4.0 was taken")
    except Exception:
        pass
else:
    x = np.zeros(4, np.float32)
    comm.Recv([x, 4, F], 1, 50)
    comm.Send([x, 4, F], 1, 51)
    comm.Send([x, 4, F], 1, 52)
comm.Barrier()

# receives posted before the messages arrive keep their order against a later blocking receive
if rank == 0:
    comm.Barrier()
    comm.Send(pattern(8, 1), 1, 1)
    comm.Send(pattern(8, 2), 1, 2)
    comm.Send(pattern(70000, 3), 1, 3)
else:
    a, b, c = np.zeros(8, np.uint8), np.zeros(8, np.uint8), np.zeros(70000, np.uint8)
    ra = comm.Irecv(a, 0, MPI.ANY_TAG)
    rc = comm.Irecv(c, 0, 3)
    comm.Barrier()
    st = MPI.Status()
    comm.Recv(b, 0, MPI.ANY_TAG, st)  # the second message: the first is the posted receive's
    sa = MPI.Status()
    ra.Wait(sa)
    rc.Wait()
    check("posted first", a, pattern(8, 1))
    check("blocking after posted", b, pattern(8, 2))
    check("rendezvous posted", c, pattern(70000, 3))
    if (sa.Get_tag(), st.Get_tag()) != (1, 2):
        bad.append(f"tags {(sa.Get_tag(), st.Get_tag())}")
comm.Barrier()

# Cancel of a receive posted by the compiled path; then the message goes to the next receive
if rank == 1:
    r = comm.Irecv(np.zeros(8, np.uint8), 0, 7)
    r.Cancel()
    st = MPI.Status()
    r.Wait(st)
    if not st.Is_cancelled():
        bad.append("posted receive not cancelled")
    comm.Barrier()
    got = np.zeros(8, np.uint8)
    comm.Recv(got, 0, 7)
    check("after cancel", got, pattern(8, 7))
else:
    comm.Barrier()
    comm.Send(pattern(8, 7), 1, 7)
comm.Barrier()

# Waitall without statuses over a window with one truncated receive: the error, and the others complete
if rank == 0:
    comm.Barrier()
    MPI.Request.Waitall([comm.Isend(pattern(n, k), 1, 20) for k, n in enumerate([8, 4096, 8, 70000, 8])])
else:
    bufs = [np.zeros(n, np.uint8) for n in (8, 4096, 4, 70000, 8)]  # the third is too short
    reqs = [comm.Irecv(b, 0, 20) for b in bufs]
    comm.Barrier()
    try:
        MPI.Request.Waitall(reqs)
        bad.append("truncation in a window not reported")
    except MismatchError:
        pass
    for k, n in enumerate([8, 4096, 8, 70000, 8]):
        if k != 2:
            check(f"window message {k}", bufs[k], pattern(n, k))
    if any(reqs):
        bad.append("requests not null after a failed Waitall")
comm.Barrier()

# a rendezvous Send whose acknowledgement comes behind another message from the receiver
big = pattern(300000, 4)
if rank == 0:
    comm.Send(big, 1, 30)
    small = np.zeros(8, np.uint8)
    comm.Recv(small, 1, 31)
    check("message ahead of the acknowledgement", small, pattern(8, 5))
else:
    comm.Send(pattern(8, 5), 0, 31)
    got = np.zeros(big.size, np.uint8)
    comm.Recv(got, 0, 30)
    check("rendezvous behind", got, big)
comm.Barrier()

# Sendrecv: both sizes, each side's message eager or by rendezvous, statuses, a pending Isend's acknowledgement
for n_mine, n_theirs in ((8, 8), (70000, 8), (8, 70000), (1 << 20, 1 << 20), (3 << 20, 100)):
    n_send, n_recv = (n_mine, n_theirs) if rank == 0 else (n_theirs, n_mine)
    pending = comm.Isend(pattern(200000, 9 + rank), peer, 40)
    got = np.zeros(n_recv, np.uint8)
    st = MPI.Status()
    comm.Sendrecv(pattern(n_send, rank), peer, 41, got, peer, 41, st)  # the pending message (tag 40) is passed over
    check(f"sendrecv {n_send}/{n_recv}", got, pattern(n_recv, peer))
    if (st.Get_source(), st.Get_tag(), st.Get_count()) != (peer, 41, n_recv):
        bad.append(f"sendrecv {n_send}/{n_recv} status {(st.Get_source(), st.Get_tag(), st.Get_count())}")
    late = np.zeros(200000, np.uint8)
    comm.Recv(late, peer, 40)
    pending.Wait()
    check(f"pending around sendrecv {n_send}", late, pattern(200000, 9 + peer))
out["fast"] = comm._fast.lanes is not None and comm._fast.lanes[comm._world[peer]] != 0
comm.Barrier()
done()
"""

_RING = _COMMON + """
right, left = (rank + 1) % size, (rank - 1) % size
for n in (8, 4096, 65536, 1 << 20, 8, 70000):
    for rep in range(5):
        mine, theirs = pattern(n, rank + rep), np.zeros(n, np.uint8)
        st = MPI.Status()
        comm.Sendrecv([mine, n, MPI.BYTE], right, 3, [theirs, n, MPI.BYTE], left, 3, st)
        check(f"ring {n} #{rep}", theirs, pattern(n, left + rep))
        if (st.Get_source(), st.Get_tag(), st.Get_count()) != (left, 3, n):
            bad.append(f"ring {n} status")
        comm.Sendrecv([mine, n, MPI.BYTE], left, 4, [theirs, n, MPI.BYTE], right, 4)
        check(f"ring back {n} #{rep}", theirs, pattern(n, right + rep))
out["fast"] = comm._fast.lanes is not None
done()
"""

_FAILS = _COMMON + """
case = sys.argv[2]
comm.Barrier()
t0 = time.monotonic()
try:
    if case == "timeout-recv":  # rank 1 waits for a message rank 0 never sends
        if rank == 1:
            comm.Recv(np.zeros(8, np.uint8), 0, 6)
    elif case == "timeout-sendrecv":  # rank 0's Sendrecv by rendezvous: rank 1 never takes part
        if rank == 0:
            comm.Sendrecv(np.ones(1 << 20, np.uint8), 1, 1, np.zeros(8, np.uint8), 1, 1)
    elif case == "dies-sendrecv":  # rank 1 dies with rank 0 in a Sendrecv with it
        if rank == 1:
            time.sleep(0.5)
            os._exit(0)
        comm.Sendrecv(np.ones(1 << 20, np.uint8), 1, 1, np.zeros(1 << 20, np.uint8), 1, 1)
    out["error"] = None
except Exception as exc:
    out["error"] = type(exc).__name__
    out["text"] = str(exc)
out["s"] = time.monotonic() - t0
done()
time.sleep(5.0)  # alive until the other rank's timeout has passed
"""


def _run(tmp_path, program: str, args: list, n: int = 2, env: dict | None = None, timeout: float = 200):
    path = tmp_path / "prog.py"
    path.write_text(textwrap.dedent(program))
    extra = {"PYCOLL_LAUNCH_GRACE": "3", **COMPILED}
    extra.update(env or {})
    cmd = harness.launcher_cmd(n, [harness.PYTHON, str(path), str(tmp_path)] + [str(a) for a in args])
    proc = harness.launch(cmd, harness.rank_env("shm", extra.pop("PYCOLL_TIMEOUT", 60), extra), timeout=timeout)
    outs = {}
    for r in range(n):
        f = tmp_path / f"rank{r}.json"
        if f.exists():
            outs[r] = json.loads(f.read_text())
    return proc, outs


def test_specs_matching_cancel_windows_sendrecv(tmp_path):
    proc, outs = _run(tmp_path, _TWO, [])
    assert set(outs) == {0, 1}, f"ranks did not finish:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for r, o in outs.items():
        assert o["bad"] == [], f"rank {r}: {o['bad']}"
        assert o["fast"], f"rank {r}: the compiled path was not in use"


@pytest.mark.parametrize("n", [3, 4])
def test_sendrecv_ring(n, tmp_path):
    proc, outs = _run(tmp_path, _RING, [], n=n)
    assert set(outs) == set(range(n)), f"ranks did not finish:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for r, o in outs.items():
        assert o["bad"] == [], f"rank {r}: {o['bad']}"
        assert o["fast"], f"rank {r}: the compiled path was not in use"


@pytest.mark.parametrize("case", ["timeout-recv", "timeout-sendrecv", "dies-sendrecv"])
def test_failures(case, tmp_path):
    proc, outs = _run(tmp_path, _FAILS, [case], env={"PYCOLL_TIMEOUT": 2 if case.startswith("timeout") else 60})
    waiter = 1 if case == "timeout-recv" else 0
    assert waiter in outs, f"no result:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    o = outs[waiter]
    if case.startswith("timeout"):
        assert o["error"] == "TimeoutError", o
        assert 1.9 <= o["s"] < 6.0, o
    else:
        assert o["error"] == "PeerFailureError", o
        assert o["s"] < 30, o  # found by liveness checks, not by the timeout
