"""Reduction ops (MAXLOC/MINLOC, REPLACE, NO_OP, OP_NULL, Op.Create) and datatypes (pairs, derived types) in one
process: mpi4py's semantics, buffer specs, Reduce_local, and the selection and schedules non-commutative ops get."""

from __future__ import annotations

import array
import functools
import pickle

import numpy as np
import pytest

from pycoll import buffers, datatypes, flat_bytes, MPI
from pycoll.algorithms import ALGORITHMS, Call, Layout, arena_jit, select
from pycoll.algorithms.base import offsets
from pycoll.algorithms.simulate import run_schedules
from pycoll.errors import InvalidArgumentError

PAIR_SHAPES = {  # name: (size, extent, true extent, MPI name), as MPICH reports them on x86-64
    "FLOAT_INT": (8, 8, 8, "MPI_FLOAT_INT"),
    "DOUBLE_INT": (12, 16, 12, "MPI_DOUBLE_INT"),
    "LONG_INT": (12, 16, 12, "MPI_LONG_INT"),
    "INT_INT": (8, 8, 8, "MPI_2INT"),
    "SHORT_INT": (6, 8, 8, "MPI_SHORT_INT"),
    "LONG_DOUBLE_INT": (20, 32, 20, "MPI_LONG_DOUBLE_INT"),
}


def _pairs(name: str, values, index) -> np.ndarray:
    dt = getattr(MPI, name).layout.base
    out = np.zeros(len(values), dt)
    out["f0"], out["f1"] = values, index
    return out


# ---- datatypes --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PAIR_SHAPES))
def test_pair_datatypes_have_the_c_layout(name: str) -> None:
    size, extent, true_extent, mpi_name = PAIR_SHAPES[name]
    t = getattr(MPI, name)
    assert (t.size, t.extent, t.lb, t.ub, t.true_lb, t.true_extent) == (size, extent, 0, extent, 0, true_extent)
    assert t.Get_extent() == (0, extent) and t.Get_true_extent() == (0, true_extent) and t.Get_size() == size
    assert t.Get_name() == mpi_name and t.is_named and t.is_predefined
    assert t.layout.base.names == ("f0", "f1") and t.layout.base.itemsize == extent
    assert MPI.TWOINT is MPI.INT_INT
    assert MPI.Datatype.Get_value_index(MPI.DOUBLE, MPI.INT) is MPI.DOUBLE_INT
    assert MPI.Datatype.Get_value_index(MPI.DOUBLE, MPI.FLOAT) == MPI.DATATYPE_NULL


def test_datatype_handles_compare_and_pickle_as_mpi4py() -> None:
    copy = MPI.Datatype(MPI.DOUBLE)
    assert copy == MPI.DOUBLE and MPI.DOUBLE == copy and copy is not MPI.DOUBLE and not copy != MPI.DOUBLE
    assert hash(copy) == hash(MPI.DOUBLE) and copy != MPI.FLOAT
    null = MPI.Datatype()
    assert null == MPI.DATATYPE_NULL and null is not MPI.DATATYPE_NULL and not null
    assert MPI.DATATYPE_NULL.Get_name() == "MPI_DATATYPE_NULL"
    with pytest.raises(TypeError):
        MPI.Datatype((1, 2, 3))
    assert pickle.loads(pickle.dumps(MPI.DOUBLE_INT)) is MPI.DOUBLE_INT
    back = pickle.loads(pickle.dumps(copy))
    assert back == MPI.DOUBLE and back is not MPI.DOUBLE
    vec = MPI.FLOAT.Create_vector(3, 2, 4)
    again = pickle.loads(pickle.dumps(vec))
    assert again.decode() == (MPI.FLOAT, "VECTOR", {"count": 3, "blocklength": 2, "stride": 4})
    assert (again.size, again.extent) == (vec.size, vec.extent)
    with pytest.raises(InvalidArgumentError, match="predefined"):
        MPI.DOUBLE.Free()
    vec.Free()
    assert not vec
    with pytest.raises(InvalidArgumentError, match="freed"):
        vec.Get_size()


def test_derived_datatype_bounds_follow_mpi() -> None:
    d = MPI.DOUBLE
    con = d.Create_contiguous(3)
    assert (con.size, con.lb, con.extent, con.combiner) == (24, 0, 24, MPI.COMBINER_CONTIGUOUS)
    assert con.Get_envelope() == (1, 0, 0, 1, MPI.COMBINER_CONTIGUOUS) and con.Get_contents() == ([3], [], [], [d])
    vec = d.Create_vector(3, 2, 4)  # blocks at 0, 4, 8 doubles
    assert (vec.size, vec.extent, vec.true_extent) == (48, 80, 80)
    hvec = d.Create_hvector(2, 1, 20)  # unaligned byte stride
    assert (hvec.size, hvec.extent) == (16, 28)
    ib = MPI.INT.Create_indexed_block(2, [5, 0])  # typemap order, not memory order
    assert (ib.size, ib.lb, ib.extent) == (16, 0, 28) and ib.layout.starts.tolist() == [20, 0]
    idx = MPI.INT.Create_indexed([1, 2], [3, 0])
    assert (idx.size, idx.extent) == (12, 16)
    sub = d.Create_subarray([4, 5], [2, 3], [1, 1])
    assert (sub.size, sub.lb, sub.extent, sub.true_lb, sub.true_extent) == (48, 0, 160, 48, 64)
    subf = d.Create_subarray([4, 5], [2, 3], [1, 1], order=MPI.ORDER_FORTRAN)
    assert subf.layout.starts.tolist() == [40, 72, 104]
    res = d.Create_resized(-8, 32)
    assert (res.lb, res.extent, res.ub, res.true_lb, res.true_extent) == (-8, 32, 24, 0, 8)
    assert d.Dup() != d.Dup()  # each Dup is a type of its own
    assert d.Dup().decode()[1] == "DUP" and d.Create_contiguous(0).size == 0
    huge = MPI.BYTE.Create_contiguous(2**31 - 1)  # one run, no per-element table
    assert huge.size == 2**31 - 1 and huge.layout.starts.size == 1
    with pytest.raises(InvalidArgumentError, match="non-negative"):
        d.Create_vector(-1, 1, 1)


def _spec(buf, count, t):
    return [buf, count, t]


def test_derived_specs_are_views_where_contiguous_else_packed_and_written_back() -> None:
    buf = np.arange(12.0)
    b = buffers.parse(_spec(buf, 2, MPI.DOUBLE.Create_contiguous(3)), "recvbuf", "Test", writable=True)
    assert b.packed is None and np.shares_memory(b.array, buf) and b.array.tolist() == list(range(6))
    vec = MPI.DOUBLE.Create_vector(3, 1, 2)  # 0, 2, 4; the next element starts at 5
    b = buffers.parse(_spec(buf, 2, vec), "recvbuf", "Test", writable=True)
    assert b.packed is not None and b.array.tolist() == [0, 2, 4, 5, 7, 9] and b.elements == 3 and b.datatype is vec
    b.array[:] = -1
    b.finish()
    assert buf.tolist() == [-1, 1, -1, 3, -1, -1, 6, -1, 8, -1, 10, 11]
    # an irregular type (a gather of bytes), in typemap order
    ib = MPI.INT.Create_indexed_block(1, [3, 0, 2])
    ints = np.arange(8, dtype=np.int32)
    b = buffers.parse(_spec(ints, 2, ib), "sendbuf", "Test")
    assert b.array.tolist() == [3, 0, 2, 7, 4, 6] and b.packed.access.index is not None
    # unaligned byte strides and a negative stride go through strided views
    hv = MPI.INT16_T.Create_hvector(3, 1, 3)
    raw = np.arange(12, dtype=np.uint8)
    b = buffers.parse(_spec(raw, 1, hv), "sendbuf", "Test")
    assert b.array.view(np.uint8).tolist() == [0, 1, 3, 4, 6, 7] and b.packed.access.shape == (3, 1)
    back = buffers.parse(_spec(ints, 1, MPI.INT.Create_indexed_block(1, [2, 1, 0])), "sendbuf", "Test")
    assert back.array.tolist() == [2, 1, 0] and back.packed.access.strides == (-4, 4)
    with pytest.raises(InvalidArgumentError, match="do not fit"):
        buffers.parse(_spec(raw[:6], 1, hv), "sendbuf", "Test")
    with pytest.raises(InvalidArgumentError, match="do not fit"):  # before the buffer's first byte
        buffers.parse(_spec(raw, 1, MPI.INT.Create_indexed_block(1, [-1])), "sendbuf", "Test")
    # count inferred from the extent; a remainder is refused as mpi4py does
    assert buffers.parse([buf[:10], vec], "sendbuf", "Test").count == 6
    with pytest.raises(InvalidArgumentError, match="whole number"):
        buffers.parse([buf[:7], vec], "sendbuf", "Test")
    with pytest.raises(InvalidArgumentError, match="read-only"):
        ro = buf.copy()
        ro.flags.writeable = False
        buffers.parse(_spec(ro, 1, vec), "recvbuf", "Test", writable=True)
    # vector specs: counts and displacements in datatype elements, flattened
    v = buffers.parse_vector([buf, [1, 1], [0, 2], MPI.DOUBLE.Create_contiguous(2)], "recvbuf", "Test", 2)
    assert (v.counts, v.displs) == ([2, 2], [0, 4]) and np.shares_memory(v.array, buf)
    v = buffers.parse_vector([np.arange(12.0), [1, 1], [1, 0], vec], "sendbuf", "Test", 2)
    assert (v.counts, v.displs, v.array.tolist()) == ([3, 3], [0, 3], [5, 7, 9, 0, 2, 4])


def test_records_by_name_are_not_datatypes_but_their_mpi_datatypes_are() -> None:
    arr = np.zeros(4, np.dtype("f4,i4"))
    with pytest.raises(InvalidArgumentError, match="record"):
        buffers.parse([arr, "f4,i4"], "sendbuf", "Test")
    with pytest.raises(InvalidArgumentError, match="not supported"):
        buffers.parse([np.zeros(8, np.uint8), "V3"], "sendbuf", "Test")
    if datatypes.BFLOAT16 is not None:  # a void-kind dtype that is an element type
        assert buffers.parse([np.zeros(4, np.uint16), datatypes.BFLOAT16], "sendbuf", "Test").count == 4
    b = buffers.parse([arr, MPI.FLOAT_INT], "sendbuf", "Test")
    assert b.dtype == MPI.FLOAT_INT.layout.base and b.count == 4 and b.datatype is MPI.FLOAT_INT
    assert buffers.parse(_pairs("DOUBLE_INT", [1.0], [2]), "sendbuf", "Test").dtype == MPI.DOUBLE_INT.layout.base


def test_point_to_point_refuses_receiving_into_a_packed_derived_type() -> None:
    vec = MPI.DOUBLE.Create_vector(2, 1, 2)
    assert flat_bytes.parse_bytes([np.arange(4.0), 1, vec], "buf", "Send").view(np.float64).tolist() == [0.0, 2.0]
    with pytest.raises(InvalidArgumentError, match="contiguous run"):
        flat_bytes.parse_bytes([np.arange(4.0), 1, vec], "buf", "Recv", writable=True)


def test_get_address() -> None:
    a = np.zeros(10)
    assert MPI.Get_address(a[3:]) - MPI.Get_address(a) == 24
    assert MPI.Aint_diff(MPI.Aint_add(100, 8), 100) == 8


# ---- ops --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PAIR_SHAPES))
def test_maxloc_minloc_match_numpy_and_break_ties_by_lowest_index(name: str) -> None:
    rng = np.random.default_rng(5)
    n = 500
    a = _pairs(name, rng.integers(-2, 3, n), rng.integers(0, 50, n))
    b = _pairs(name, rng.integers(-2, 3, n), rng.integers(0, 50, n))
    for op, better in ((MPI.MAXLOC, np.greater), (MPI.MINLOC, np.less)):
        take_b = better(b["f0"], a["f0"]) | ((b["f0"] == a["f0"]) & (b["f1"] < a["f1"]))
        first, second = a.copy(), b.copy()
        results = [op.ufunc(a, b),  # a new array
                   op.ufunc(first, b, out=first),  # written over the first operand
                   op.ufunc(a, second, out=second)]  # over the second
        for got in results:
            assert np.array_equal(got["f0"], np.where(take_b, b["f0"], a["f0"]))
            assert np.array_equal(got["f1"], np.where(take_b, b["f1"], a["f1"]))
        assert op.check(a.dtype) is None and op.commutative and not op.kernel
        assert op.check(np.dtype(np.float64)) is not None
        assert not arena_jit.covers(op, a.dtype)


def test_op_api_as_mpi4py() -> None:
    assert MPI.Op() == MPI.OP_NULL and not MPI.Op() and MPI.Op() is not MPI.OP_NULL
    with pytest.raises(TypeError):
        MPI.OP_NULL()
    with pytest.raises(TypeError):
        MPI.OP_NULL(None)
    with pytest.raises(ValueError):
        MPI.OP_NULL(None, None)
    assert (MPI.MIN(2, 3), MPI.MAX(2, 3), MPI.SUM(2, 3), MPI.PROD(2, 3)) == (2, 3, 5, 6)
    assert (MPI.REPLACE(2, 3), MPI.NO_OP(2, 3), MPI.LXOR(True, True), MPI.BXOR(6, 3)) == (3, 2, False, 5)
    x, i, y, j = [1], [2], [2], [1]
    res = MPI.MINLOC([x, i], [y, j])
    assert res[0] is x and res[1] is i
    assert MPI.MAXLOC((1, 1), (1, 0)) == (1, 0) and MPI.MINLOC((1, 0), (1, 1)) == (1, 0)
    for op in (MPI.SUM, MPI.MAXLOC, MPI.MINLOC, MPI.OP_NULL, MPI.NO_OP):
        assert pickle.loads(pickle.dumps(op)) is op
        again = pickle.loads(pickle.dumps(MPI.Op(op)))
        assert again == op and again is not op
    assert all(op.Is_commutative() and op.is_predefined for op in (MPI.SUM, MPI.MAXLOC, MPI.LXOR))
    assert not MPI.REPLACE.Is_commutative() and not MPI.NO_OP.is_commutative
    with pytest.raises(InvalidArgumentError):
        MPI.SUM.Free()
    for op in (MPI.REPLACE, MPI.NO_OP, MPI.OP_NULL):
        assert op.check(np.dtype(np.float64)) is not None
    assert MPI.Op.fromint(MPI.SUM.toint()) == MPI.SUM


def _mysum(a, b, dt):  # mpi4py's test_op.py user function: typed through array.array on buffers
    if dt is None:
        for k in range(len(a)):
            b[k] = a[k] + b[k]
        return b
    assert dt == MPI.INT
    b[:] = array.array("i", [p + q for p, q in zip(array.array("i", bytes(a)), array.array("i", bytes(b)))])


def test_user_ops_create_call_free_and_pickle() -> None:
    op = MPI.Op.Create(_mysum, commute=False)
    try:
        assert not op.is_predefined and not op.Is_commutative() and op
        a, b = [1, 2], [10, 20]
        assert op(a, b) is b and b == [11, 22]
        assert MPI.Op(op)([1], [2]) == [3] and MPI.Op(op) == op
        clone = pickle.loads(pickle.dumps(op))
        assert clone != op and clone([2], [3]) == [5] and not clone.Is_commutative()
        clone.Free()
        borrowed = MPI.Op.fromint(op.toint())
        assert borrowed == op
        with pytest.raises(ValueError):
            borrowed.__reduce__()
        # on buffers: inoutvec = invec op inoutvec, with the call's datatype
        x, y = np.arange(5, dtype=np.int32), np.full(5, 7, np.int32)
        op.Reduce_local([x, MPI.INT], [y, MPI.INT])
        assert y.tolist() == [7, 8, 9, 10, 11]
    finally:
        op.Free()
    assert not op and op.is_predefined  # a freed op is null
    with pytest.raises(ValueError):
        op(1, 2)


def test_at_most_32_user_ops_live_at_once_as_in_mpi4py() -> None:
    ops = [MPI.Op.Create(_mysum) for _ in range(32)]
    with pytest.raises(RuntimeError):
        MPI.Op.Create(_mysum)
    for op in ops:
        op.Free()
    ops = [MPI.Op.Create(_mysum) for _ in range(32)]  # freed slots are free again
    del ops  # garbage-collected ops give theirs back too
    MPI.Op.Create(_mysum).Free()


def test_reduce_local_every_op_and_its_errors() -> None:
    for op, dt in ((MPI.SUM, np.float32), (MPI.PROD, np.int64), (MPI.MAX, np.int16), (MPI.MIN, np.float64),
                   (MPI.BXOR, np.uint8)):
        a, b = np.arange(1, 6).astype(dt), np.arange(5).astype(dt)
        want = op.ufunc(a, b)
        op.Reduce_local(a, b)
        assert np.array_equal(b, want)
    a, b = _pairs("SHORT_INT", [3, 1], [0, 0]), _pairs("SHORT_INT", [3, 2], [1, 1])
    MPI.MAXLOC.Reduce_local([a, MPI.SHORT_INT], [b, MPI.SHORT_INT])
    assert b["f0"].tolist() == [3, 2] and b["f1"].tolist() == [0, 1]
    with pytest.raises(ValueError, match="elements"):  # mpi4py: ValueError for mismatched counts and types
        MPI.SUM.Reduce_local([np.zeros(3), 2, MPI.DOUBLE], [np.zeros(3), 3, MPI.DOUBLE])
    with pytest.raises(ValueError, match="INT32_T"):
        MPI.SUM.Reduce_local([np.zeros(3, np.int32), 1, MPI.INT], [np.zeros(3, np.int16), 1, MPI.SHORT])
    for op in (MPI.REPLACE, MPI.NO_OP, MPI.OP_NULL, MPI.AVG):
        with pytest.raises(InvalidArgumentError):
            op.Reduce_local(np.ones(2), np.ones(2))
    vec = MPI.DOUBLE.Create_vector(2, 1, 2)  # a derived type: packed, reduced, written back
    inout = np.arange(4.0)
    MPI.SUM.Reduce_local([np.full(4, 10.0), 1, vec], [inout, 1, vec])
    assert inout.tolist() == [10, 1, 12, 3]


def test_user_function_buffers_are_assignable_bytes() -> None:
    def fn(invec, inoutvec, dt):
        assert isinstance(inoutvec, np.ndarray) and inoutvec.dtype == np.uint8 and len(inoutvec) == 12
        inoutvec[:] = array.array("i", [7, 8, 9])

    op = MPI.Op.Create(fn, commute=True)
    try:
        y = np.zeros(3, np.int32)
        op.Reduce_local(np.zeros(3, np.int32), y)
        assert y.tolist() == [7, 8, 9]
        a = np.arange(3, dtype=np.int32)
        assert op.ufunc(a, a.copy(), out=a) is a and a.tolist() == [7, 8, 9]  # out over the first operand
    finally:
        op.Free()


# ---- selection and schedules for non-commutative ops ------------------------------------------------------------

def _affine(invec, inoutvec, dt):
    a = np.frombuffer(invec, np.float64).reshape(-1, 2)
    b = np.frombuffer(inoutvec, np.float64).reshape(-1, 2)
    b[:, 1] = a[:, 1] * b[:, 0] + b[:, 1]
    b[:, 0] = a[:, 0] * b[:, 0]


def _affine_ref(xs):
    def fold(a, b):
        return np.stack([a[:, 0] * b[:, 0], a[:, 1] * b[:, 0] + b[:, 1]], axis=1)
    return functools.reduce(fold, [x.reshape(-1, 2) for x in xs])


LAYOUTS = [Layout.flat(4), Layout((0, 0, 1, 1)), Layout((0, 1, 2)), Layout.flat(1)]


def test_selection_gives_non_commutative_ops_ordered_algorithms_only(monkeypatch: pytest.MonkeyPatch) -> None:
    op = MPI.Op.Create(_affine, commute=False)
    comm_op = MPI.Op.Create(_affine, commute=True)
    try:
        for lay in LAYOUTS:
            for n in (16, 1 << 12, 1 << 20):
                x = np.zeros(n, np.float64)
                pairs = x.view(MPI.DOUBLE_INT.layout.base)
                for coll in ("allreduce", "reduce", "reduce_scatter", "scan", "exscan"):
                    counts = [n // lay.size] * lay.size
                    algo = select(Call(coll, x.dtype, x, x, op, counts=counts), lay)
                    assert algo.ordered, (coll, algo.name, lay, n)
                    other = select(Call(coll, x.dtype, x, x, comm_op, counts=counts), lay)
                    assert other.memory == "host" and other.name != "ordered", (coll, other.name)
                    maxloc = Call(coll, pairs.dtype, pairs, pairs, MPI.MAXLOC, counts=[n // 2 // lay.size] * lay.size)
                    assert select(maxloc, lay).name != "ordered"
        monkeypatch.setenv("PYCOLL_ALGO", "allreduce:ring,reduce:tree")
        x = np.zeros(64)
        assert select(Call("allreduce", x.dtype, x, x.copy(), op), Layout.flat(4)).ordered
        assert select(Call("reduce", x.dtype, x, x.copy(), op), Layout.flat(4)).ordered
        assert select(Call("allreduce", x.dtype, x, x.copy(), comm_op), Layout.flat(4)).name == "ring"
        monkeypatch.setenv("PYCOLL_ALGO", "allreduce:ordered")
        assert select(Call("allreduce", x.dtype, x, x.copy(), MPI.SUM), Layout.flat(4)).name != "ordered"
        assert not arena_jit.covers(comm_op, x.dtype) and arena_jit.covers(MPI.SUM, x.dtype)
    finally:
        op.Free()
        comm_op.Free()


ORDERED_ALGOS = [(coll, name) for coll in ("allreduce", "reduce", "reduce_scatter", "scan", "exscan")
                 for name, algo in ALGORITHMS[coll].items() if algo.ordered]


@pytest.mark.parametrize("coll,name", ORDERED_ALGOS)
def test_ordered_algorithms_keep_rank_order(coll: str, name: str) -> None:
    """Every algorithm registered ordered gives MPI's rank-order result of a non-commutative op, on 1..6 ranks,
    in tiny chunks, in place and out of place, every root."""
    op = MPI.Op.Create(_affine, commute=False)
    algo = ALGORITHMS[coll][name]
    rng = np.random.default_rng(11)
    try:
        for p in range(1, 7):
            lay = Layout.flat(p)
            for n in (0, 1, 5, 37):
                xs = [np.stack([rng.choice([-1.0, 1.0, 2.0], n), rng.integers(-3, 4, n)], axis=1).reshape(-1)
                      for _ in range(p)]
                unit = np.dtype((np.void, 16))  # one map = two doubles, never cut apart
                for in_place in (False, True):
                    for root in (range(p) if coll == "reduce" else (0,)):
                        counts = [n // p + (q < n % p) for q in range(p)]
                        sends = [x.copy() for x in xs]
                        recvs = [s if in_place else np.full(2 * n, 77.0) for s in sends]
                        calls = []
                        for r in range(p):
                            recv = recvs[r] if coll != "reduce" or r == root else None
                            calls.append(Call(coll, unit, sends[r].view(unit), None if recv is None else recv.view(unit),
                                              op.bind(None, np.dtype(np.float64), 2)[0], root=root, counts=counts,
                                              in_place=in_place and (coll != "reduce" or r == root)))
                        if algo.refusal(calls[0], lay) is not None:
                            continue
                        run_schedules(algo, calls, lay, chunk_bytes=64)
                        for r in range(p):
                            k = {"scan": r + 1, "exscan": r}.get(coll, p)
                            if not k or (coll == "reduce" and r != root) or not n:
                                continue
                            want = _affine_ref(xs[:k]).reshape(-1)
                            got = recvs[r]
                            if coll == "reduce_scatter":
                                d = offsets(counts)[r]
                                want, got = want[2 * d:2 * (d + counts[r])], got[: 2 * counts[r]]
                            np.testing.assert_array_equal(got, want, err_msg=f"{coll}:{name} p={p} n={n} r={r} root={root}")
    finally:
        op.Free()


def test_vector_spec_two_tuple_is_count_and_displacement():
    """mpi4py reads ``[buf, (a, b), TYPE]`` and ``[buf, (a, b)]`` as (counts, displs): with integers, count ``a``
    for every rank and a displacement stride ``b``, even where the ranks number two (issue 24)."""
    buf = np.arange(8.0)
    for spec in ([buf, (2, 4), MPI.DOUBLE], [buf, (2, 4)]):
        v = buffers.parse_vector(spec, "recvbuf", "Test", 2)
        assert (v.counts, v.displs) == ([2, 2], [0, 4])
    v = buffers.parse_vector([buf, ([1, 3], [4, 0])], "recvbuf", "Test", 2)
    assert (v.counts, v.displs) == ([1, 3], [4, 0])
    v = buffers.parse_vector([buf, [3, 5]], "recvbuf", "Test", 2)  # a list is counts
    assert (v.counts, v.displs) == ([3, 5], [0, 3])


def test_error_classes_are_mpich_values():
    from pycoll.errors import InvalidRootError, PycollError

    assert (MPI.ERR_ROOT, MPI.ERR_ARG, MPI.ERR_OTHER, MPI.ERR_TRUNCATE, MPI.ERR_LASTCODE) == (7, 12, 15, 14, 0x3FFFFFFF)
    assert InvalidRootError("x").Get_error_class() == MPI.ERR_ROOT
    assert InvalidArgumentError("x").Get_error_class() == MPI.ERR_ARG
    assert PycollError("x").Get_error_class() == MPI.ERR_OTHER
    with pytest.raises(MPI.Exception) as exc:
        MPI.COMM_SELF.Bcast(np.zeros(1), root=1)
    assert exc.value.Get_error_class() == MPI.ERR_ROOT


def test_create_struct_bounds_sizes_and_contents() -> None:
    from pycoll.errors import NotProvidedError

    d = MPI.DOUBLE
    t = MPI.Datatype.Create_struct([2, 1, 3], [40, 0, 8], [d, d, d.Create_contiguous(1)])
    # blocks at bytes 40..56, 0..8 and 8..32: data 6 doubles, bounds 0..56
    assert (t.size, t.lb, t.extent, t.true_lb, t.true_extent) == (48, 0, 56, 0, 56)
    assert t.combiner == MPI.COMBINER_STRUCT and t.Get_envelope()[:4] == (4, 3, 0, 3)
    ints, addrs, _, types = t.Get_contents()
    assert ints == [3, 2, 1, 3] and addrs == [40, 0, 8] and len(types) == 3
    again = pickle.loads(pickle.dumps(t))
    assert (again.size, again.lb, again.extent) == (48, 0, 56)
    # MPI pads a struct of named types to their alignment (bytes: none; a double at 4: none needed)
    pad = MPI.Datatype.Create_struct([1, 1], [0, 9], [MPI.BYTE, MPI.BYTE])
    assert (pad.size, pad.extent) == (2, 10)
    odd = MPI.Datatype.Create_struct([1], [4], [d])
    assert (odd.lb, odd.extent, odd.true_lb) == (4, 8, 4)
    # the typemap's order: the [2, 1, 3] struct above packs bytes 40.., 0.., 8.. in that order
    out = np.zeros(6)
    MPI.COMM_SELF.Alltoallw([np.arange(7.0), [1], [0], [t]], [out, [6], [0], [MPI.DOUBLE]])
    assert out.tolist() == [5.0, 6.0, 0.0, 1.0, 2.0, 3.0]
    with pytest.raises(NotProvidedError):
        MPI.Datatype.Create_struct([1, 1], [0, 8], [d, MPI.INT])
    with pytest.raises(InvalidArgumentError):
        MPI.Datatype.Create_struct([1, 1], [0], [d, d])
    with pytest.raises(InvalidArgumentError):
        MPI.Datatype.Create_struct([-1], [0], [d])


def test_bottom_specs_read_and_write_absolute_addresses() -> None:
    assert MPI.Get_address(MPI.BOTTOM) == 0 and MPI.BOTTOM is not MPI.IN_PLACE
    send = np.arange(6.0)
    recv = np.full(8, -1.0)
    sa, ra = MPI.Get_address(send), MPI.Get_address(recv)
    # send send[5], send[0], send[1:5] (typemap order); receive into recv[6:8], recv[0], recv[2:5]
    st = MPI.Datatype.Create_struct([1, 1, 4], [sa + 40, sa, sa + 8], [MPI.DOUBLE] * 3).Commit()
    rt = MPI.Datatype.Create_struct([2, 1, 3], [ra + 48, ra, ra + 16], [MPI.DOUBLE] * 3).Commit()
    MPI.COMM_SELF.Alltoallw([MPI.BOTTOM, [1], [0], [st]], [MPI.BOTTOM, ([1], [0]), [rt]])
    assert recv.tolist() == [1.0, -1.0, 2.0, 3.0, 4.0, -1.0, 5.0, 0.0]
    # a byte displacement is added to the addresses; an address that is not one is refused
    recv[:] = 0
    one = MPI.Datatype.Create_struct([1], [ra], [MPI.DOUBLE]).Commit()
    MPI.COMM_SELF.Alltoallw([send, [1], [16], [MPI.DOUBLE]], [MPI.BOTTOM, [1], [8], [one]])
    assert recv.tolist() == [0.0, 2.0] + [0.0] * 6
    with pytest.raises(InvalidArgumentError):
        MPI.COMM_SELF.Alltoallw([send, [1], [0], [MPI.DOUBLE]], [MPI.BOTTOM, [1], [0], [MPI.DOUBLE]])
