"""The executor's plan cache: call shapes as keys, and flat views found again in later calls' buffers."""

from __future__ import annotations

import numpy as np
import pytest

from pycoll import MPI
from pycoll.algorithms import Call
from pycoll.buffers import IN_PLACE
from pycoll.plans import _compiled_shape_key, Rebind, shape_key_python

_COMPILED = _compiled_shape_key()
# both forms of the key: the C one (pycoll/_callkey.c) where the install compiled it, and the Python one
KEY_FORMS = [pytest.param(shape_key_python, id="python"), pytest.param(
    _COMPILED, id="compiled",
    marks=pytest.mark.skipif(_COMPILED is None, reason="pycoll._callkey was not compiled at install (no C compiler)"))]


@pytest.mark.parametrize("shape_key", KEY_FORMS)
def test_shape_key_ignores_addresses_and_sees_everything_else(shape_key) -> None:
    a, b = np.zeros(8, np.float32), np.ones(8, np.float32)
    assert shape_key(([a, MPI.FLOAT], 0)) == shape_key(([b, MPI.FLOAT], 0))  # a fresh array: the same shape
    assert shape_key((a,)) != shape_key((np.zeros(9, np.float32),))
    assert shape_key((a,)) != shape_key((np.zeros(8, np.float64),))
    assert shape_key((a,)) != shape_key((np.zeros((2, 4), np.float32),))
    assert shape_key((a,)) != shape_key((np.zeros(16, np.float32)[::2],))  # strides
    ro = np.zeros(8, np.float32)
    ro.flags.writeable = False
    assert shape_key((a,)) != shape_key((ro,))  # a read-only buffer must meet the checks again
    assert shape_key(([a, 4, MPI.FLOAT],)) != shape_key(([a, 8, MPI.FLOAT],))
    assert shape_key((IN_PLACE, a, MPI.SUM)) != shape_key((IN_PLACE, a, MPI.MAX))
    assert shape_key((a, 0)) != shape_key((a, 1))  # the root
    assert shape_key((a, np.int64(1))) == shape_key((a, 1))
    assert shape_key((a, True)) != shape_key((a, 1)) and shape_key((a, 1.0)) != shape_key((a, 1))  # invalid roots
    assert shape_key((a, False)) != shape_key((a, 0)) and shape_key((a, None)) != shape_key((a, 0))
    assert shape_key(([a, True, MPI.FLOAT],)) != shape_key(([a, 1, MPI.FLOAT],))


@pytest.mark.parametrize("shape_key", KEY_FORMS)
@pytest.mark.parametrize("buf", [bytearray(8), memoryview(bytearray(8)), object(), [bytearray(8), MPI.BYTE]])
def test_shape_key_declines_buffers_it_cannot_describe(shape_key, buf) -> None:
    assert shape_key((buf, 0)) is None


class _List(list):
    pass


def _argument_lists() -> list[tuple]:
    a = np.arange(12, dtype=np.float32)
    ro = a.copy()
    ro.flags.writeable = False
    F, B = MPI.FLOAT, MPI.BYTE
    return [
        (), ([a, 12, F], [a.copy(), 12, F], 0, False), ([a, F], [ro, F], 3, True), (IN_PLACE, a, MPI.SUM),
        (IN_PLACE, [a, F], MPI.MAX), ([a[::2], 6, F], None), ([a.reshape(3, 4), B], "x"), ((a, 12, F), (a, F)),
        ([a, [1, 2, 3], [0, 1, 3], F], 1), ([a, ([4, 8], [0, 4]), F],), ([a, 12, B, 0],), ([a],), ([a, np.int64(3), F],),
        ([a, 3.0, F],), ([a, True, F],), ([a, F, 12],), (np.float32(1.5), 2.5, np.int32(7)), (a, np.int64(1)),
        (np.zeros((), np.int8),), (np.zeros((2, 0, 3)),), (a.reshape(3, 4).T,), (_List([a, 12, F]),), (F,), (MPI.SUM,),
        ([IN_PLACE, a],), ([[a, F]],), ([memoryview(a), F],), (b"bytes",), ({1: 2},), ([{1: 2}],),
        # vector specs, built in C where every item is an array, Datatype, int, IN_PLACE or such a list
        ([a, [6, 6], [0, 6], F], [a, [6, 6], (0, 6), F]), ([a, [np.int64(6), 6], [0, 6], F],), ([a, [True, 6], F],),
        ([a, [[1, [2, [3]]]], F],), ([a, [6, 6], [0, 6], F, [ro, F]],), ([a, [], [], F],),
    ]


@pytest.mark.skipif(_COMPILED is None, reason="pycoll._callkey was not compiled at install (no C compiler)")
def test_the_compiled_key_is_the_python_key() -> None:
    """Every kind of argument list gives the same key (or the same None) in C and in Python."""
    import sys

    lists = _argument_lists()
    for args in lists:
        assert _COMPILED(args) == shape_key_python(args), args
    # nothing leaks or is freed early: references to the objects a key holds are back where they were
    F, dtype = MPI.FLOAT, np.dtype(np.float32)
    before = sys.getrefcount(F), sys.getrefcount(dtype), sys.getrefcount(list)
    for _ in range(1000):
        for args in lists:
            _COMPILED(args)
    assert (sys.getrefcount(F), sys.getrefcount(dtype), sys.getrefcount(list)) == before
    with pytest.raises(TypeError):
        _COMPILED([1, 2])  # not a tuple


@pytest.mark.skipif(_COMPILED is None, reason="pycoll._callkey was not compiled at install (no C compiler)")
def test_the_compiled_buffer_address_is_the_python_one() -> None:
    """The inline runners' addresses in C (``_callkey.buffer_address``) agree with ``cma_program.address``."""
    from pycoll.algorithms import cma_program
    from pycoll.p2p_specs import call_key_module

    buffer_address = call_key_module().buffer_address
    a = np.arange(12, dtype=np.float32)
    ro = a[3:9]
    ro.flags.writeable = False
    for arr in (a, a[5:], a[::1], ro, np.zeros(0), np.zeros((0, 3)), np.zeros(1, np.float16), None):
        assert buffer_address(arr) == cma_program.address(arr), arr
    assert buffer_address(a[5:]) == buffer_address(a) + 20 and buffer_address(np.zeros(0)) == 0
    with pytest.raises(TypeError, match="NumPy array"):
        buffer_address(b"bytes")


def test_rebind_finds_views_in_new_buffers() -> None:
    big = np.arange(12, dtype=np.float32).reshape(3, 4)
    args = ([big, 6, MPI.FLOAT],)
    view = big.reshape(-1)[2:8]
    rb = Rebind.find(view, args)
    assert rb and (rb.start, rb.stop) == (2, 8)
    other = np.arange(100, 112, dtype=np.float32).reshape(3, 4)
    got = rb.view(([other, 6, MPI.FLOAT],))
    assert np.array_equal(got, other.reshape(-1)[2:8]) and np.shares_memory(got, other)
    # a reinterpreting spec: bytes of a float64 buffer
    f = np.zeros(4, np.float64)
    rb = Rebind.find(f.view(np.uint8)[8:24], ([f, 16, MPI.BYTE],))
    g = np.arange(4, dtype=np.float64)
    assert np.array_equal(rb.view(([g, 16, MPI.BYTE],)), g.view(np.uint8)[8:24])
    # not a view of an argument (a copy): no plan
    assert Rebind.find(big.reshape(-1).copy(), args) is False
    assert Rebind.find(None, args) is None


def test_plan_rejects_overlapping_views_after_a_hit() -> None:
    from pycoll.plans import Plan
    from pycoll.p2p_protocol import Sig

    a, b = np.zeros(8, np.float32), np.zeros(8, np.float32)
    call = Call("allreduce", np.dtype(np.float32), a, b, MPI.SUM)
    plan = Plan("Allreduce", call, Sig(), Rebind.find(a, (a, b)), Rebind.find(b, (a, b)))
    c = np.zeros(12, np.float32)
    assert plan.views((c[:8], c[4:])) is None  # the same shape, but the buffers now overlap: the checks must run
    d = np.zeros(8, np.float32)
    assert plan.views((d, d)) is None  # one array passed twice (it owns its memory, and still overlaps itself)
    send, recv = plan.views((c[:8], np.zeros(8, np.float32)))
    assert np.shares_memory(send, c) and recv.size == 8


def test_point_to_point_specs_on_fresh_views_resolve_without_the_cache() -> None:
    from pycoll import flat_bytes
    from pycoll.errors import InvalidArgumentError

    u = np.arange(40, dtype=np.float64)
    for spec, want in [
        ([u[8:16], 8, MPI.DOUBLE], u[8:16]),  # a halo's slice, new every call
        ([u[8:16], 3, MPI.DOUBLE], u[8:11]),
        ([u[8:16], 0, MPI.DOUBLE], u[8:8]),
        ([u[8:16], MPI.DOUBLE], u[8:16]),
        ([u.reshape(5, 8)[1:3], 10, MPI.DOUBLE], u[8:18]),
        ([u[8:16], 16, MPI.BYTE], u[8:10]),  # another datatype than the dtype: the full parse, same answer
    ]:
        got = flat_bytes.parse_bytes(spec, "buf", "Send")
        assert got.dtype == np.uint8 and got.tobytes() == want.tobytes() and (not want.size or np.shares_memory(got, u))
    with pytest.raises(InvalidArgumentError, match="exceeds"):
        flat_bytes.parse_bytes([u[8:16], 9, MPI.DOUBLE], "buf", "Send")
    with pytest.raises(InvalidArgumentError, match="negative"):
        flat_bytes.parse_bytes([u[8:16], -1, MPI.DOUBLE], "buf", "Send")
    strided = u[::2]
    assert flat_bytes.contiguous_bytes(strided, 4, MPI.DOUBLE, False) is None  # left to the full parse
    ro = u[8:16].copy()
    ro.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="read-only"):
        flat_bytes.parse_bytes([ro, 8, MPI.DOUBLE], "buf", "Recv", writable=True)


def test_sleeping_waits_drop_yields_and_retries_inside_only() -> None:
    from types import SimpleNamespace

    from pycoll.executor import Executor

    x = SimpleNamespace(gate=SimpleNamespace(yields=200), retry_s=1e-3)
    with Executor.sleeping_waits(x):  # type: ignore[arg-type]
        assert (x.gate.yields, x.retry_s) == (0, 0.0)
    assert (x.gate.yields, x.retry_s) == (200, 1e-3)
    with pytest.raises(RuntimeError), Executor.sleeping_waits(x):  # type: ignore[arg-type]
        raise RuntimeError("a failed call")
    assert (x.gate.yields, x.retry_s) == (200, 1e-3)


@pytest.mark.parametrize("shares_cores", [False, True])
@pytest.mark.parametrize("leader_in", [False, True])
@pytest.mark.parametrize("root", [0, 1, 2])
def test_a_composed_reduces_other_rank_hands_its_core_over_once_posted(monkeypatch, shares_cores, leader_in, root) -> None:
    """A host's other rank (parent rank 1 here) posts its vector to its leader; where the host's ranks share cores and
    the leader has entered the call (it waits for that post) it then yields, unless it is the root, which waits for
    the result anyway."""
    from types import SimpleNamespace

    from pycoll import composed, ops

    seen: list = []
    monkeypatch.setattr(composed.os, "sched_yield", lambda: seen.append("yield"))
    opno = 7
    arena = SimpleNamespace(ops=opno, has_posted=lambda rank, op: (seen.append(("asked", rank, op)), leader_in)[1])
    host_comm = SimpleNamespace(Reduce=lambda send, recv, op, root: seen.append(("reduce", recv, root)),
                                Recv=lambda buf, source, tag: seen.append(("recv", source)),
                                _arena=SimpleNamespace(arena=arena))
    hc = object.__new__(composed.HostComposition)
    hc.host_comm, hc.comm, hc.shares_cores = host_comm, SimpleNamespace(_rank=1), shares_cores
    hc._scratch_buf = np.zeros(0, np.uint8)  # the root's result lands in the composition's kept scratch first
    a = np.ones(2, np.float32)
    hc._member_reduce(a, a.copy(), ops.SUM, root)
    if root == 1:
        assert seen == [("reduce", None, 0), ("recv", 0)]
    elif not shares_cores:
        assert seen == [("reduce", None, 0)]
    else:
        assert seen == [("reduce", None, 0), ("asked", 0, opno)] + (["yield"] if leader_in else [])
    host_comm._arena = None  # a host communicator without an arena: nothing to ask
    seen.clear()
    hc._member_reduce(a, a.copy(), ops.SUM, 0)
    assert seen == [("reduce", None, 0)]


@pytest.mark.parametrize("leader", [False, True])
@pytest.mark.parametrize("nbytes", [64 << 10, 1 << 20, 8 << 20, 16 << 20])
def test_a_composed_calls_other_ranks_wait_asleep_through_a_long_leaders_step(leader, nbytes) -> None:
    """They sleep where the leaders' step brings their host at least SLEEP_FROM_BYTES (8 MiB); the leader never does."""
    from types import SimpleNamespace

    from pycoll.composed import SLEEP_FROM_BYTES, HostComposition
    from pycoll.executor import Executor

    seen = []
    x = SimpleNamespace(gate=SimpleNamespace(yields=200), retry_s=1e-3)
    x.sleeping_waits = lambda: Executor.sleeping_waits(x)  # type: ignore[arg-type]
    host_comm = SimpleNamespace(_x=x, Bcast=lambda buf, root: seen.append((x.gate.yields, x.retry_s)))
    hc = object.__new__(HostComposition)
    hc.leader, hc.host_comm = leader, host_comm
    buf = np.zeros(nbytes // 4, np.float32)
    hc._host_bcast(buf, 0, buf.nbytes)
    asleep = not leader and nbytes >= SLEEP_FROM_BYTES
    assert seen == [(0, 0.0) if asleep else (200, 1e-3)]
    assert (x.gate.yields, x.retry_s) == (200, 1e-3)
