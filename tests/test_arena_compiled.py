"""The compiled arena path (Numba kernels for small Allreduce and Barrier): bit-exact against NumPy, and in real jobs."""

from __future__ import annotations

import numpy as np
import pytest

import harness
from pycoll import ops
from pycoll.algorithms import arena_jit
from pycoll.transport import arena as A

K = arena_jit.kernels() if arena_jit.unavailable() is None else None
need_numba = pytest.mark.skipif(K is None, reason=f"compiled arena path unavailable: {arena_jit.unavailable()}")

DTYPES = sorted(arena_jit.DTYPES, key=str)
SIG = np.array([0x10203, 5, 7, 11, 11], np.uint64)  # word 4: word 3 unfolded (unused: seq -1)


def _valid(op: ops.Op, dt: np.dtype) -> bool:
    return op.check(dt) is None and arena_jit.covers(op, dt)


class FakeArena:
    """The words of a ``ranks``-rank arena in private memory, with every peer but ``me`` already posted."""

    def __init__(self, ranks: int, me: int = 0, opno: int = 1, sig: np.ndarray = SIG, posted: int | None = None) -> None:
        self.words = np.zeros(A.HostArena.ctrl(ranks) + 8, np.uint64)
        self.bases = np.array([A.HostArena.ctrl(r) + 16 + 24 * (opno % A.DEPTH) for r in range(ranks)], np.int64)
        self.me = me
        for r in range(ranks if posted is None else posted):
            if r != me:
                self.words[self.bases[r] : self.bases[r] + 4] = sig[:4]
                self.words[self.bases[r] + A.POST] = opno

    def done(self, r: int) -> int:
        return int(self.words[A.HostArena.ctrl(r) + A.DONE])


def _inputs(dt: np.dtype, ranks: int, count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dt.kind == "b":
        return rng.integers(0, 2, (ranks, count)).astype(dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, (ranks, count), dtype=dt, endpoint=True)  # wraps under SUM and PROD
    vals = rng.standard_normal((ranks, count)) * 3
    if dt.kind == "c":
        vals = vals + 1j * rng.standard_normal((ranks, count))
    out = vals.astype(dt)
    if dt.kind == "f" and count > 3:
        out[0, 1], out[-1, 2], out[:, 3] = np.nan, np.inf, -0.5  # NaN and inf follow NumPy's rules
    return out


def _numpy_reference(op: ops.Op, rows: np.ndarray) -> np.ndarray:
    """What the Python path computes: chained ufunc calls in rank order, then the AVG division."""
    out = np.empty_like(rows[0])
    op.ufunc(rows[0], rows[1], out=out)
    for q in range(2, len(rows)):
        op.ufunc(out, rows[q], out=out)
    if op.averages:
        np.divide(out, out.dtype.type(len(rows)), out=out)
    return out


@need_numba
@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_allreduce_kernel_is_bit_exact(dt: np.dtype) -> None:
    tried = 0
    for ranks in (2, 3, 5):
        for count in (0, 1, 7, 1000):
            for op in ops.OPS.values():
                if not _valid(op, dt):
                    continue
                me = ranks - 1
                rows = _inputs(dt, ranks, count, seed=ranks * 1000 + count + op.code)
                fake = FakeArena(ranks, me)
                slots = np.zeros((ranks, A.DEPTH, count), dt)  # call 1: slot 1
                for r in range(ranks):
                    if r != me:
                        slots[r, 1] = rows[r]
                send, recv = rows[me].copy(), np.zeros(count, dt)
                with np.errstate(all="ignore"):
                    status = K.allreduce(fake.words, slots, send, recv, me, fake.bases, SIG, 1, op.code, 1000, -1, 0, 0)
                    expect = _numpy_reference(op, rows)
                assert status & 3 == arena_jit.DONE, (ranks, count, op)
                assert recv.tobytes() == expect.tobytes(), f"{op.name} {dt} ranks={ranks} count={count}"
                assert np.array_equal(slots[me, 1], rows[me]) and np.array_equal(send, rows[me])  # posted, input kept
                assert fake.done(me) == 1 and int(fake.words[fake.bases[me] + A.POST]) == 1
                assert np.array_equal(fake.words[fake.bases[me] : fake.bases[me] + 4], SIG[:4])
                tried += 1
    assert tried >= 12


@need_numba
def test_allreduce_kernel_in_place() -> None:
    fake = FakeArena(3, me=1)
    slots = np.zeros((3, A.DEPTH, 4), np.float64)
    slots[0, 1], slots[2, 1] = [1, 2, 3, 4], [10, 20, 30, 40]
    buf = np.array([100, 200, 300, 400], np.float64)
    assert K.allreduce(fake.words, slots, buf, buf, 1, fake.bases, SIG, 1, ops.SUM.code, 1000, -1, 0, 0) & 3 == arena_jit.DONE
    assert buf.tolist() == [111, 222, 333, 444]


@need_numba
def test_kernel_waits_and_refuses_without_finishing() -> None:
    # a peer that has not posted: posted here, not done, result untouched
    fake = FakeArena(3, me=0, posted=2)
    slots, recv = np.zeros((3, A.DEPTH, 2), np.int32), np.full(2, -1, np.int32)
    status = K.allreduce(fake.words, slots, np.ones(2, np.int32), recv, 0, fake.bases, SIG, 1, ops.SUM.code, 50, -1, 0, 0)
    assert status & 3 == arena_jit.WAITING and fake.done(0) == 0 and recv.tolist() == [-1, -1]
    assert int(fake.words[fake.bases[0] + A.POST]) == 1  # the Python schedule picks up from here
    # a peer that posted another call: MISMATCH, nothing reduced
    other = SIG.copy()
    other[2] = 8
    fake = FakeArena(2, me=0, sig=other)
    status = K.allreduce(fake.words, slots[:2], np.ones(2, np.int32), recv, 0, fake.bases, SIG, 1, ops.SUM.code, 50, -1, 0, 0)
    assert status & 3 == arena_jit.MISMATCH and fake.done(0) == 0 and recv.tolist() == [-1, -1]
    assert K.barrier(fake.words, 0, fake.bases, SIG, 1, 50, -1, 0, 0) & 3 == arena_jit.MISMATCH


@need_numba
def test_barrier_kernel_and_doorbell() -> None:
    fake = FakeArena(4, me=2)
    bell = A.BELL_BYTE // 8
    before = int(fake.words[bell])
    assert K.barrier(fake.words, 2, fake.bases, SIG, 1, 50, -1, 0, 0) == arena_jit.DONE  # nobody asleep: no wake asked
    assert fake.done(2) == 1 and int(fake.words[bell]) == before  # nor the doorbell's shared word written
    fake = FakeArena(4, me=2)
    fake.words[A.HostArena.ctrl(3) + A.SLEEPING] = 1
    assert K.barrier(fake.words, 2, fake.bases, SIG, 1, 50, -1, 0, 0) == arena_jit.DONE | arena_jit.WAKE
    assert int(fake.words[bell]) == before + 2  # a sleeper: rung after posting and after finishing
    fake = FakeArena(4, me=2)
    fake.words[A.RING_ALWAYS] = 1  # ranks outnumber cores: every post rings
    assert K.barrier(fake.words, 2, fake.bases, SIG, 1, 50, -1, 0, 0) == arena_jit.DONE
    assert int(fake.words[bell]) == before + 2


@need_numba
def test_has_posted_reads_a_peers_post_for_that_call_only(tmp_path) -> None:
    """Rank 1 sees rank 0 as entered call 5 once rank 0 posted it, not for call 1 (same ring line, DEPTH earlier) or 6."""
    path = str(tmp_path / "posts")
    arenas = [A.HostArena(path, 0, 2, 4096, create=True), A.HostArena(path, 1, 2, 4096, create=False)]
    try:
        assert not arenas[1].has_posted(0, 5)
        arenas[0].post(1, (1, 0, 2, 3))
        assert arenas[1].has_posted(0, 1) and not arenas[1].has_posted(0, 1 + A.DEPTH)
        arenas[0].post(5, (1, 0, 2, 3))
        assert arenas[1].has_posted(0, 5) and not arenas[1].has_posted(0, 6) and not arenas[1].has_posted(1, 5)
    finally:
        for a in reversed(arenas):
            a.close()


def test_a_sleeping_rank_is_woken_by_a_peers_post(tmp_path) -> None:
    """The doorbell's word is bumped only for a sleeper: rank 1 raises its flag (with a barrier) and sleeps until
    rank 0 posted its Barrier; rank 0's kernel sees the flag, rings and asks for the wake, which ends the sleep long
    before its timeout (a missed wake would sleep it out). The flag is down again afterwards."""
    import threading
    import time

    path = str(tmp_path / "bell")
    arenas = [A.HostArena(path, 0, 2, 4096, create=True), A.HostArena(path, 1, 2, 4096, create=False)]
    try:
        bases = arena_jit.line_bases(arenas[0], 1)
        posted = lambda: int(arenas[1].u64[bases[0] + A.POST]) == 1  # noqa: E731
        slept = []

        def sleeper() -> None:
            t0 = time.monotonic()
            arenas[1].bell.sleep(20.0, posted)
            slept.append(time.monotonic() - t0)

        th = threading.Thread(target=sleeper, daemon=True)
        th.start()
        flag = A.HostArena.ctrl(1) + A.SLEEPING
        for _ in range(2000):
            if arenas[0].u64[flag]:
                break
            time.sleep(0.005)
        assert arenas[0].u64[flag] == 1, "the sleeper never raised its flag"
        status = K.barrier(arenas[0].u64, 0, bases, SIG, 1, 50, -1, 0, 0)
        assert status & arena_jit.WAKE
        arenas[0].bell.wake()
        th.join(15.0)
        assert not th.is_alive() and slept[0] < 15.0 and arenas[0].u64[flag] == 0
    finally:
        for a in reversed(arenas):
            a.close()


@need_numba
@pytest.mark.parametrize("ranks", [2, 3])
def test_broadcast_kernel_root_and_reader(ranks: int) -> None:
    """The inline Bcast kernel: meeting, every chunk through the ring, rounds closed, call done."""
    chunk, nslots, base, n = 64, 4, 10, 1000  # 16 chunks through a 4-slot ring
    data = (np.arange(n) % 251).astype(np.uint8)
    # the root, with every reader already past all chunks (the ring never blocks it)
    fake = FakeArena(ranks, me=0)
    for r in range(1, ranks):
        fake.words[A.HostArena.ctrl(r) + A.CONSUMED] = base + 16
    stage = np.zeros(chunk * nslots, np.uint8)
    status, j, met = K.broadcast(fake.words, stage, data.copy(), 0, fake.bases, SIG, 1, 0, base, chunk, nslots, 1000)
    assert (status & 3, j, met) == (arena_jit.DONE, 16, True)
    mine = A.HostArena.ctrl(0)
    assert [int(fake.words[mine + w]) for w in (A.STAGED, A.REDUCED, A.CONSUMED)] == [base + 16] * 3
    assert fake.done(0) == 1
    last = (base + 15) % nslots  # the ring holds the last chunk in its slot
    assert np.array_equal(stage[last * chunk : last * chunk + n - 15 * chunk], data[15 * chunk :])
    # a reader whose root staged only chunk 0: it copies that, then hands back at chunk 1
    fake = FakeArena(ranks, me=ranks - 1)
    fake.words[A.HostArena.ctrl(0) + A.STAGED] = base + 1
    stage = np.zeros(chunk * nslots, np.uint8)
    stage[(base % nslots) * chunk : (base % nslots + 1) * chunk] = data[:chunk]
    out = np.zeros(n, np.uint8)
    status, j, met = K.broadcast(fake.words, stage, out, ranks - 1, fake.bases, SIG, 1, 0, base, chunk, nslots, 50)
    assert (status & 3, j, met) == (arena_jit.WAITING, 1, True) and fake.done(ranks - 1) == 0
    assert np.array_equal(out[:chunk], data[:chunk]) and not out[chunk:].any()
    assert int(fake.words[A.HostArena.ctrl(ranks - 1) + A.CONSUMED]) == base + 1


@pytest.mark.ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3])
def test_compiled_path_in_jobs(n: int, tmp_path) -> None:
    """Repeated calls, the kernels loaded with each communicator (PYCOLL_ARENA_JIT_LOAD=now, so what runs compiled
    does not depend on the background load's timing): Allreduce with all ranks compiled and
    mixed with Python, a mismatch, Bcast through the inline staged path, and the pipelined staged allreduce,
    reduce-scatter and allgather, inline."""
    env = {"PYCOLL_ARENA_JIT_LOAD": "now", "PYCOLL_ALGO": "allreduce:oneshot,broadcast:staged",
           "PYCOLL_ARENA_STAGE": "64K", "PYCOLL_ARENA_PIPE_CHUNK": "4K"}  # Bcast: many chunks, a wrapping ring
    res = harness.run_cases(n, ["repeated.*"], transport="shm", out_dir=str(tmp_path), job_timeout=240, env=env)
    res.assert_ok()
    if K is not None:
        assert res.records("repeated.allreduce_repeated", "compiled_same") == dict.fromkeys(range(n), True)
        mixed = res.records("repeated.allreduce_repeated", "compiled_mixed")
        assert mixed == {r: r != 0 for r in range(n)}
        assert res.records("repeated.allreduce_repeated_mismatch", "compiled") == dict.fromkeys(range(n), True)
        assert res.records("repeated.bcast_repeated", "compiled") == dict.fromkeys(range(n), True)
        inline = res.records("repeated.bcast_repeated", "inline")
        assert len(inline) == n, inline
        if n == 2:  # one rank per core: some calls finish inside the kernel (on 3 ranks, timing decides)
            assert sum(inline.values()) > 0, inline
        assert res.records("repeated.staged_repeated", "compiled") == dict.fromkeys(range(n), True)
        inline = res.records("repeated.staged_repeated", "inline")
        if n == 2:
            assert sum(inline.values()) > 0, inline


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_first_call_of_a_communicator_opens_the_kernels(tmp_path) -> None:
    """Without PYCOLL_ARENA_JIT_LOAD=now: the ahead-of-time kernels are open after one call (the second would
    otherwise stall loading them, 10-30 ms at 4 ranks on 2 cores)."""
    from pycoll import native

    res = harness.run_cases(3, ["repeated.first_call_opens_kernels"], transport="shm", out_dir=str(tmp_path),
                            job_timeout=90)
    res.assert_ok()
    if native.load_together(arena_jit.ARENA_FAMILIES) is None:
        pytest.skip(f"no ahead-of-time kernels here: {native.why('arena+staged')}")
    for name in ("allreduce", "bcast"):
        assert res.records("repeated.first_call_opens_kernels", f"open_{name}") == dict.fromkeys(range(3), True)


# ---- cross-memory attach programs (direct_cma), every rank of one arena stepped in this process ----------------------

def _cma_calls(coll: str, p: int, count: int, in_place: bool, rng) -> tuple[list, list]:
    """(each rank's Call, each rank's expected result) for a cma collective of ``count`` float32 per block."""
    from pycoll.algorithms.base import Call

    f = np.dtype(np.float32)
    counts, displs = [count] * p, [q * count for q in range(p)]
    data = [rng.standard_normal(p * count).astype(f) for _ in range(p)]
    calls, want = [], []
    root = p - 1
    for r in range(p):
        if coll == "broadcast":
            buf = data[root][:count].copy() if r == root else np.zeros(count, f)
            calls.append(Call(coll, f, None, buf, root=root))
            want.append(data[root][:count])
        elif coll == "gather":
            recv = None
            if r == root:
                recv = np.zeros(p * count, f)
                if in_place:
                    recv[r * count:(r + 1) * count] = data[r][:count]
            send = recv[r * count:(r + 1) * count] if in_place and r == root else data[r][:count].copy()
            calls.append(Call(coll, f, send, recv, root=root, counts=counts, displs=displs, in_place=in_place and r == root))
            want.append(np.concatenate([d[:count] for d in data]) if r == root else None)
        elif coll == "scatter":
            send = data[root].copy() if r == root else None
            recv = send[r * count:(r + 1) * count] if in_place and r == root else np.zeros(count, f)
            calls.append(Call(coll, f, send, recv, root=root, counts=counts, displs=displs, in_place=in_place and r == root))
            want.append(data[root][r * count:(r + 1) * count])
        elif coll == "allgather":
            recv = np.zeros(p * count, f)
            if in_place:
                recv[r * count:(r + 1) * count] = data[r][:count]
            send = recv[r * count:(r + 1) * count] if in_place else data[r][:count].copy()
            calls.append(Call(coll, f, send, recv, counts=counts, displs=displs, in_place=in_place))
            want.append(np.concatenate([d[:count] for d in data]))
        else:  # alltoall: block q of rank r's send goes to rank q
            recv = data[r].copy() if in_place else np.zeros(p * count, f)
            send = recv if in_place else data[r].copy()
            calls.append(Call(coll, f, send, recv, counts=counts, displs=displs, send_counts=counts, send_displs=displs,
                              in_place=in_place))
            want.append(np.concatenate([data[q][r * count:(r + 1) * count] for q in range(p)]))
    return calls, want


@need_numba
@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("coll,vector", [("broadcast", False), ("gather", False), ("scatter", False),
                                         ("allgather", False), ("alltoall", False),
                                         ("gather", True), ("scatter", True), ("alltoall", True)])
def test_cma_programs(tmp_path, coll: str, vector: bool, p: int) -> None:
    """Each rank's ``cma_program.Program`` run by the compiled kernel (ranks stepped in turn; process_vm_readv on this
    process), or by the Python path for odd ranks: every block lands, blocks from 256 KiB split with the root, in and
    out of place. A rank the peers keep waiting returns WAITING or LEFT and is called again. ``vector``: the calls as
    v-forms, whose blocks go through the tables (from the senders' 4 KiB slots below a slot's share, else by
    cross-memory attach: read from the sender, or a Gatherv sender writing where the root's table says)."""
    import os

    from pycoll.algorithms import cma_program, direct_cma
    from pycoll.memory import backend
    from pycoll.transport.cma import CrossMemory

    cma = CrossMemory()
    if cma.probe(os.getpid(), np.zeros(1).ctypes.data, b"\0" * 8) is not None:
        pytest.skip("cross-memory attach is unavailable here")
    rng = np.random.default_rng(p)
    path = str(tmp_path / f"cma-{coll}-{p}")
    arenas = [A.HostArena(path, 0, p, 4096, create=True)] + [A.HostArena(path, r, p, 4096, create=False) for r in range(1, p)]
    pids = [os.getpid()] * p
    for a in arenas:
        a.pids = pids
    readv, writev = cma.function_address("read"), cma.function_address("write")
    moves, host = direct_cma.MOVES[coll], backend("host")
    for opno, (count, in_place) in enumerate([(c, ip) for c in (0, 5, 100_000) for ip in ((False, True) if coll != "broadcast" else (False,))], 1):
        calls, want = _cma_calls(coll, p, count, in_place, rng)
        for c in calls:
            c.vector = vector
        sub = cma_program.table_block_bytes(arenas[0].slot_bytes, p)
        progs = [moves.program(r, p, c, sub) for r, c in enumerate(calls)]
        assert all((prog.table is not None) == vector for prog in progs)
        # short-distance copies bounced in every other call
        packed = [prog.packed(r, 20, readv, writev, opno % 2 == 0, pids, arenas[r]) for r, prog in enumerate(progs)]
        bufs = [moves.buffers(c, host) for c in calls]
        words = (0x1234, 0, count, 99)  # the Python path posts the vhash word folded with the call number, as the kernel's
        sig = arena_jit.sig_array(words)  # the kernel folds the call number in
        bases = arena_jit.line_bases(arenas[0], opno)
        state = [None] * p
        for a in arenas:
            a.seq = opno
        for _ in range(10_000):
            for r in range(p):
                if state[r] == "done":
                    continue
                a, prog, (s, rv, _) = arenas[r], progs[r], bufs[r]
                if r % 2 and state[r] is None:  # the Python path: post, then copy once all posted
                    cma_program.post(a, opno, prog, words, s, rv)
                    state[r] = "posted"
                if r % 2:
                    if state[r] == "posted" and not a.waiting_for("post", opno, range(p)):
                        cma_program.copy(a, opno, prog, s, rv)
                        a.set_done(opno)
                        cma_program.local(prog, s, rv)
                        state[r] = "copied"
                    if state[r] == "copied" and not a.waiting_for("done", opno, prog.waits.tolist()):
                        state[r] = "done"
                    continue
                if state[r] == "left":
                    if not a.waiting_for("done", opno, prog.waits.tolist()):
                        state[r] = "done"
                    continue
                status = K.cma_moves(a.u64, bases, sig, packed[r], opno, opno, s, rv, False)
                assert status & 3 != arena_jit.MISMATCH and not status & arena_jit.FAILED, status
                if status & 3 == arena_jit.DONE:
                    state[r] = "done"
                elif status & 3 == arena_jit.LEFT:
                    state[r] = "left"
            if all(x == "done" for x in state):
                break
        else:
            pytest.fail(f"{coll} stalled: {state}")
        for r in range(p):
            got = calls[r].recv
            if want[r] is not None:
                assert np.array_equal(got, want[r]), f"{coll} p={p} count={count} in_place={in_place} rank {r}"
    for a in arenas:
        a.close()


@need_numba
@pytest.mark.parametrize("coll,ranks,me", [("reduce_scatter", 2, 0), ("reduce_scatter", 3, 1), ("reduce_scatter", 3, 2),
                                           ("reduce", 3, 1)])
def test_slots_kernel_leaves_the_range_no_peer_reads_out_of_its_slot(tmp_path, coll: str, ranks: int, me: int) -> None:
    """A Reduce_scatter's own block and a Reduce root's vector are read by no peer: the compiled rank copies the rest
    of its vector into its slot (the own range keeps what was there), folds its own row from its send buffer, and
    meets peers that posted through the Python path. The Python twin of the fold (a call that left the kernel for
    the schedule) reads that row from the send buffer too. In place the output may overlap the row: all is copied."""
    from pycoll.algorithms import slots
    from pycoll.algorithms.base import Call, offsets
    from pycoll.p2p_protocol import Sig

    dt, counts = np.dtype(np.int64), [5, 3, 4][:ranks]
    n = sum(counts) if coll == "reduce_scatter" else 7
    rows = np.random.default_rng(ranks + me).integers(-1000, 1000, (ranks, n)).astype(dt)

    def call_of(r: int, in_place: bool = False) -> Call:
        if coll == "reduce_scatter":
            return Call(coll, dt, send=rows[r].copy(), recv=np.full(counts[r], -7, dt), op=ops.SUM, counts=counts,
                        in_place=in_place)
        return Call(coll, dt, send=rows[r].copy(), recv=np.full(n, -7, dt) if r == me else None, op=ops.SUM, root=me,
                    in_place=in_place)

    assert not slots.Program(call_of(me, in_place=True), ranks, me).own
    path = str(tmp_path / "slots")
    arenas = [A.HostArena(path, 0, ranks, 4096, create=True)]
    arenas += [A.HostArena(path, r, ranks, 4096, create=False) for r in range(1, ranks)]
    try:
        sig, opno = Sig(kind=5, dtype=3, op=1, count=n), 1
        words = arena_jit.sig_words(sig)
        for r in range(ranks):
            arenas[r].seq = 1
            if r != me:  # a peer on the Python path
                call = call_of(r)
                prog = slots.Program(call, ranks, r)
                slots._pack_py(arenas[r], opno, call, prog)
                arenas[r].post(opno, words, nbytes=prog.nbytes)
        mine, call = arenas[me], call_of(me)
        prep = slots.Prepared(mine, call, sig, me, K)
        assert prep.prog.own and prep.ok
        lo, count = (offsets(counts)[me], counts[me]) if coll == "reduce_scatter" else (0, n)
        slot = mine.slot(me, opno)[: n * dt.itemsize].view(dt)
        slot[:] = -99
        gate = arena_jit.Gate(0.01)
        status = slots.run_kernel(K, prep, mine, opno, call.send, call.recv, gate)
        assert status & 3 == arena_jit.DONE
        expected = rows.sum(axis=0)[lo:lo + count]
        assert call.recv.tolist() == expected.tolist()
        kept = np.ones(n, bool)
        kept[lo:lo + count] = False
        assert (slot[~kept] == -99).all() and slot[kept].tolist() == rows[me][kept].tolist()
        call.recv[:] = -7
        slots._unpack_py(None, mine, opno, call, prep.prog)
        assert call.recv.tolist() == expected.tolist()
    finally:
        for a in reversed(arenas):
            a.close()


@pytest.mark.parametrize("coll", ["broadcast", "reduce", "allgather", "alltoall"])
def test_a_new_shapes_slots_program_shares_the_arenas_tables_and_matches_one_made_from_scratch(tmp_path, coll) -> None:
    """A new call shape's plan takes the post-line bases and slot views the arena keeps (made once per parity and
    dtype), and its other parity's program is the first one's copy with that parity's bases: the same words as a
    program built from scratch for each parity."""
    import dataclasses

    from pycoll.algorithms import slots
    from pycoll.algorithms.base import Call, offsets
    from pycoll.p2p_protocol import Sig

    ranks, me, dt = 3, 1, np.dtype(np.float32)
    path = str(tmp_path / "tables")
    arenas = [A.HostArena(path, 0, ranks, 4096, create=True)]
    arenas += [A.HostArena(path, r, ranks, 4096, create=False) for r in range(1, ranks)]
    try:
        mine = arenas[me]
        for n in (1, 5, 12):
            counts = [n] * ranks
            kw: dict = {"counts": counts, "displs": offsets(counts)} if coll in ("allgather", "alltoall") else {}
            if coll == "alltoall":
                kw.update(send_counts=counts, send_displs=offsets(counts))
            total = n * ranks if coll in ("allgather", "alltoall") else n
            call = Call(coll, dt, send=np.ones(n if coll != "alltoall" else total, dt), recv=np.empty(total, dt),
                        op=ops.SUM if coll == "reduce" else None, root=0, **kw)
            sig = Sig(kind=5, dtype=3, op=1, count=n, vhash=0xF00D + n)
            prep = slots.Prepared(mine, call, sig, me, None)
            words, code = arena_jit.sig_words(sig), call.op.code if call.op is not None else 0
            for k in range(A.DEPTH):
                bases = np.array([mine.line(r, k) for r in range(ranks)], np.int64)
                assert np.array_equal(arena_jit.line_bases(mine, k), bases)
                assert arena_jit.line_bases(mine, k) is arena_jit.line_bases(mine, k + A.DEPTH)  # kept, per parity
                fresh = slots._meta(slots.Program(call, ranks, me), me, ranks, bases, code, words)
                assert prep.metas[k].dtype == np.int64 and np.array_equal(prep.metas[k], fresh), (n, k)
            assert prep.metas[0] is not prep.metas[1]  # each parity's words are its own (the spin is set in each)
            assert prep.slots is arena_jit.slot_array(mine, prep.slots.dtype)
            template = call.without_buffers()
            assert template == dataclasses.replace(call, send=None, recv=None) and call.send is not None
    finally:
        for a in reversed(arenas):
            a.close()
