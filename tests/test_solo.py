"""A one-rank communicator's collectives: each call shape's later calls run as one local copy (``pycoll.solo``),
checked against NumPy with fresh arrays, buffer specs, in place, every op and several dtypes and counts."""

from __future__ import annotations

import numpy as np
import pytest

from pycoll import MPI, solo
from pycoll.errors import InvalidArgumentError

DTYPES = [(np.float32, MPI.FLOAT), (np.float64, MPI.DOUBLE), (np.int32, MPI.INT), (np.int8, MPI.SIGNED_CHAR),
          (np.complex128, MPI.C_DOUBLE_COMPLEX)]
COUNTS = [0, 1, 7, 1025, 3000]  # 3000 doubles pass 4 KiB: the host copy's other branch


def _data(dtype, n, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(-50, 50, n * 2).astype(np.float64)
    return (x[:n] + 1j * x[n:]).astype(dtype) if np.dtype(dtype).kind == "c" else x[:n].astype(dtype)


def _calls(comm, t, send, recv):
    """(name, run, expected recv) for every collective whose recv is a copy of send on one rank."""
    real = send.dtype.kind != "c"
    MAX, PROD, MIN = (MPI.MAX, MPI.PROD, MPI.MIN) if real else (MPI.SUM, MPI.PROD, MPI.SUM)  # noqa: N806
    return [
        ("Allreduce", lambda: comm.Allreduce([send, t], [recv, t], op=MPI.SUM), send),
        ("Reduce", lambda: comm.Reduce([send, t], [recv, t], op=MAX, root=0), send),
        ("Scan", lambda: comm.Scan([send, t], [recv, t], op=PROD), send),
        ("Reduce_scatter_block", lambda: comm.Reduce_scatter_block([send, t], [recv, t], op=MIN), send),
        ("Reduce_scatter", lambda: comm.Reduce_scatter([send, t], [recv, t], [send.size], op=MPI.SUM), send),
        ("Gather", lambda: comm.Gather([send, send.size, t], [recv, recv.size, t], root=0), send),
        ("Scatter", lambda: comm.Scatter([send, t], [recv, t], root=0), send),
        ("Allgather", lambda: comm.Allgather([send, t], [recv, t]), send),
        ("Alltoall", lambda: comm.Alltoall([send, t], [recv, t]), send),
    ]


@pytest.mark.parametrize("dtype, t", DTYPES)
@pytest.mark.parametrize("n", COUNTS)
def test_every_collective_alone_matches_numpy_with_fresh_arrays(dtype, t, n):
    comm = MPI.COMM_SELF
    for call in range(4):  # the first call is scheduled, the later ones take the solo path
        send, recv = _data(dtype, n, call), np.full(n, 99, dtype)
        for name, run, _want in _calls(comm, t, send, recv):
            recv[:] = 99
            run()
            assert np.array_equal(recv, send), (name, call)
            assert np.array_equal(send, _data(dtype, n, call)), name  # the input is left as it was


def test_the_later_calls_take_the_solo_path():
    comm = MPI.COMM_SELF.Dup()
    try:
        send, recv = np.arange(5.0), np.zeros(5)
        comm.Allreduce(send, recv)
        plans = [p for (label, _k), p in comm._x.plans.items() if label == "Allreduce"]
        assert len(plans) == 1 and plans[0].fast and plans[0].fast.__qualname__.startswith(solo.fast_path.__name__)
        seq = comm._seq
        for k in range(3):
            s2, r2 = np.arange(5.0) * k, np.zeros(5)
            comm.Allreduce(s2, r2)
            assert np.array_equal(r2, s2)
        assert comm._seq == seq + 3  # every call is numbered, as on the schedule
    finally:
        comm.Free()


@pytest.mark.parametrize("n", [0, 6, 2000])
def test_in_place_barrier_bcast_and_exscan_move_nothing(n):
    comm = MPI.COMM_SELF
    for call in range(3):
        buf = np.arange(n, dtype=np.float64) + call
        want = buf.copy()
        comm.Allreduce(MPI.IN_PLACE, [buf, MPI.DOUBLE], op=MPI.SUM)
        comm.Reduce(MPI.IN_PLACE, buf, op=MPI.SUM, root=0)
        comm.Scan(MPI.IN_PLACE, buf, op=MPI.SUM)
        comm.Allgather(MPI.IN_PLACE, buf)
        comm.Gather(MPI.IN_PLACE, buf, root=0)
        comm.Scatter(buf, MPI.IN_PLACE, root=0)
        comm.Bcast(buf, root=0)
        comm.Barrier()
        assert np.array_equal(buf, want)
        out = np.full(n, 7.0)
        comm.Exscan(buf, out, op=MPI.SUM)  # rank 0's result is undefined: left as it was
        assert np.array_equal(out, np.full(n, 7.0))


def test_avg_alone_is_the_input():
    comm = MPI.COMM_SELF
    for call in range(3):
        x, out = np.arange(9.0) + call, np.zeros(9)
        comm.Allreduce(x, out, op=MPI.AVG)
        assert np.array_equal(out, x)


def test_overlapping_buffers_still_meet_the_checks():
    comm = MPI.COMM_SELF
    buf = np.arange(10.0)
    comm.Allreduce(buf[:5], buf[5:])  # distinct halves: allowed, and the plan made
    assert np.array_equal(buf[5:], buf[:5])
    with pytest.raises(InvalidArgumentError, match="Allreduce.*overlap"):
        comm.Allreduce(buf[:5], buf[2:7])


def test_a_freed_communicator_refuses_on_the_solo_path():
    comm = MPI.COMM_SELF.Dup()
    a, b = np.ones(3), np.zeros(3)
    comm.Allreduce(a, b)
    comm.Allreduce(a, b)
    comm.Free()
    with pytest.raises(InvalidArgumentError, match="freed"):
        comm.Allreduce(a, b)


def test_a_count_short_of_the_arrays_moves_that_many_elements():
    comm = MPI.COMM_SELF
    for call in range(3):
        send, recv = np.arange(8, dtype=np.int32) + call, np.full(8, -1, np.int32)
        comm.Allgather([send, 3, MPI.INT], [recv, 3, MPI.INT])
        assert recv.tolist() == [call, call + 1, call + 2] + [-1] * 5


@pytest.mark.parametrize("n", [0, 5, 3000])
def test_sendrecv_with_itself_delivers_in_order(n):
    comm = MPI.COMM_SELF
    st = MPI.Status()
    for call in range(3):  # fresh arrays and buffer specs each call
        send, recv = np.arange(n, dtype=np.float64) + call, np.full(n + 2, -1.0)
        comm.Sendrecv([send, MPI.DOUBLE], 0, 7, [recv, n + 2, MPI.DOUBLE], 0, MPI.ANY_TAG, st)
        assert np.array_equal(recv[:n], send) and np.all(recv[n:] == -1)
        assert (st.Get_source(), st.Get_tag(), st.Get_count(MPI.DOUBLE)) == (0, 7, n)
    # an earlier message to itself is received first, as MPI's order has it
    first = np.full(n, 5.0)
    req = comm.Isend(first, 0, 3)
    out = np.zeros(n)
    comm.Sendrecv(np.full(n, 9.0), 0, 3, out, 0, 3)
    assert np.all(out == 5.0)
    req.Wait()
    comm.Recv(out, 0, 3)
    assert np.all(out == 9.0)


def test_sendrecv_with_itself_names_a_message_too_long():
    from pycoll.errors import MismatchError

    with pytest.raises(MismatchError, match="Sendrecv.*64 bytes.*48-byte"):
        MPI.COMM_SELF.Sendrecv(np.arange(8.0), 0, 1, np.zeros(6), 0, 1)
    MPI.COMM_SELF.Sendrecv(np.arange(2.0), 0, 1, np.zeros(6), 0, 1)  # the communicator goes on


def test_nonblocking_forms_alone_complete_with_the_same_status_as_scheduled():
    comm = MPI.COMM_SELF
    statuses = []
    for call in range(4):  # the first call of the shape is scheduled; the later ones complete at once
        x = np.arange(6.0) + call
        outs = [np.zeros(6) for _ in range(4)]
        reqs = [comm.Iallreduce(x, outs[0], op=MPI.SUM), comm.Igather([x, MPI.DOUBLE], [outs[1], MPI.DOUBLE], root=0),
                comm.Iscan(x, outs[2], op=MPI.SUM), comm.Ialltoall(x, outs[3]), comm.Ibarrier(),
                comm.Ibcast(x, root=0)]
        st = MPI.Status()
        reqs[0].Wait(st)
        statuses.append((st.Get_source(), st.Get_tag(), st.Get_error()))
        MPI.Request.Waitall(reqs[1:])
        assert all(np.array_equal(o, x) for o in outs), call
    assert len(set(statuses)) == 1, statuses
