"""Cross-memory copies (process_vm_readv/writev) at every distance between source and destination within a page,
including the short distances that go through a bounce buffer where the CPU copies them slowly, in Python and in the
compiled helper, with the bounce on and off; the timing that decides it; and the arena's agreement on it."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
from harness import run_script

from pycoll import pages
from pycoll.transport import cma

CM = cma.CrossMemory()
pytestmark = pytest.mark.skipif(not CM.loaded, reason=f"no cross-memory attach here: {CM.reason}")

SIZES = [1, 100, 4096, 65536 + 5, 2 * pages.BOUNCE_BYTES + 4099]  # the last crosses the bounce's chunks
DISTANCES = [0, 1, 8, 16, 31, 32, 48, 63, 64, 100, 2048, 4095]


def _pair(n: int, dist: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) views of n bytes whose addresses differ by ``dist`` modulo a page."""
    rng = np.random.default_rng(seed)
    src_buf = rng.integers(0, 256, n + 2 * pages.PAGE, dtype=np.uint8)
    dst_buf = np.zeros(n + 2 * pages.PAGE, np.uint8)
    s = (-src_buf.ctypes.data) % pages.PAGE + 7  # an odd offset in the page, as heap arrays have
    d = (src_buf.ctypes.data + s + dist - dst_buf.ctypes.data) % pages.PAGE
    src, dst = src_buf[s:s + n], dst_buf[d:d + n]
    assert (dst.ctypes.data - src.ctypes.data) % pages.PAGE == dist
    return src, dst


@pytest.fixture(params=["bounce", "direct"])
def short_distance_copies(request, monkeypatch):
    """Each copy test runs with short-distance copies bounced and copied directly (PYCOLL_SHORT_DISTANCE)."""
    monkeypatch.setenv("PYCOLL_SHORT_DISTANCE", request.param)
    return request.param


def test_short_distance_is_the_few_bytes_past_the_source():
    assert [d for d in range(pages.PAGE) if pages.short_distance(1000 + d, 1000)] == list(range(1, pages.SHORT_DISTANCE))
    assert not pages.short_distance(5, 5 + 16)  # the destination before the source
    assert pages.short_distance(pages.PAGE * 7 + 16, 0)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dist", DISTANCES)
def test_python_read_and_write_copy_exactly_the_bytes(n, dist, short_distance_copies):
    src, dst = _pair(n, dist, n + dist)
    guard = dst.base.copy()
    CM.read(os.getpid(), dst, src.ctypes.data)  # this process as the peer: the same system calls
    assert np.array_equal(dst, src)
    lo = dst.ctypes.data - dst.base.ctypes.data
    assert np.array_equal(dst.base[:lo], guard[:lo]) and np.array_equal(dst.base[lo + n:], guard[lo + n:])
    back = np.zeros_like(src)
    # writing: the remote is the destination, so the distance is measured the other way round
    CM.write(os.getpid(), src, back.ctypes.data)
    assert np.array_equal(back, src)


def test_python_write_at_the_short_distance_leaves_the_neighbours(short_distance_copies):
    src, dst = _pair(10_000, 16, 3)
    before = dst.base.copy()
    cm = cma.CrossMemory()
    cm.write(os.getpid(), src, dst.ctypes.data)
    lo = dst.ctypes.data - dst.base.ctypes.data
    assert np.array_equal(dst, src)
    assert np.array_equal(dst.base[:lo], before[:lo]) and np.array_equal(dst.base[lo + 10_000:], before[lo + 10_000:])
    assert cm.bounces == (short_distance_copies == "bounce")
    assert (cm._bounce is not None) == cm.bounces  # the bounce buffer is made only where copies go through it


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("numba")
    from pycoll.transport import atomics

    return atomics


@pytest.mark.parametrize("n", [1, 4096, 65536 + 5, 2 * pages.BOUNCE_BYTES + 4099])
@pytest.mark.parametrize("dist", [0, 1, 16, 31, 63, 64, 2048])
@pytest.mark.parametrize("bounce", [True, False])
def test_compiled_cross_copy_reads_and_writes_at_every_distance(compiled, n, dist, bounce):
    readv, writev = CM.function_address("read"), CM.function_address("write")
    src, dst = _pair(n, dist, 7 * n + dist)
    guard = dst.base.copy()
    assert compiled.cross_copy(readv, os.getpid(), dst.ctypes.data, src.ctypes.data, n, True, bounce)
    assert np.array_equal(dst, src)
    lo = dst.ctypes.data - dst.base.ctypes.data
    assert np.array_equal(dst.base[:lo], guard[:lo]) and np.array_equal(dst.base[lo + n:], guard[lo + n:])
    src2, dst2 = _pair(n, dist, 11 * n + dist)
    assert compiled.cross_copy(writev, os.getpid(), src2.ctypes.data, dst2.ctypes.data, n, False, bounce)
    assert np.array_equal(dst2, src2)


def test_compiled_cross_copy_reports_a_failed_call(compiled):
    readv = CM.function_address("read")
    dst = np.zeros(64, np.uint8)
    unmapped = 8 + (dst.ctypes.data - 8) % pages.PAGE // 2  # the first page is never mapped
    assert not compiled.cross_copy(readv, os.getpid(), dst.ctypes.data, unmapped, 64, True, False)
    short = (dst.ctypes.data - 16) % pages.PAGE  # 16 bytes short of the destination: through the bounce
    assert not compiled.cross_copy(readv, os.getpid(), dst.ctypes.data, short, 64, True, True)


@pytest.mark.parametrize("dist", [0, 16, 2048])
def test_compiled_copy_at_copies_at_every_distance(compiled, dist):
    from numba import njit

    copy = njit(lambda d, s, n: compiled.copy_at(d, s, n))
    src, dst = _pair(70_000, dist, dist)
    copy(dst.ctypes.data, src.ctypes.data, 70_000)
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("dist", [0, 16, 48, 2048])
@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.complex128])
def test_host_copy_at_every_distance(dist, dtype, short_distance_copies):
    from pycoll.memory import HOST

    src_b, dst_b = _pair(96 * 1024, dist, dist)
    src, dst = src_b.view(dtype).reshape(4, -1), dst_b.view(dtype).reshape(4, -1)
    guard = dst_b.base.copy()
    HOST.copy(dst, src)
    assert np.array_equal(dst_b, src_b)
    lo = dst_b.ctypes.data - dst_b.base.ctypes.data
    assert np.array_equal(dst_b.base[:lo], guard[:lo]) and np.array_equal(dst_b.base[lo + dst_b.nbytes:],
                                                                          guard[lo + dst_b.nbytes:])
    strided = np.zeros((4, dst.shape[1] * 2), dtype)[:, ::2]  # not contiguous: copied directly
    HOST.copy(strided, src)
    assert np.array_equal(strided.copy().view(np.uint8), src.view(np.uint8))  # bytes: random floats hold NaNs


def test_host_address_reads_each_arrays_first_byte():
    from pycoll import memory

    assert memory.DATA_FIELD >= 0  # CPython's and NumPy's layouts here: the fast read is on
    base = np.arange(1000, dtype=np.float64)
    import ml_dtypes

    arrays = [base, base[3:17], base[::-3], base.reshape(10, 100).T, base.view(np.uint8)[5:], np.zeros(0),
              np.zeros((), np.int16), np.zeros(7, ml_dtypes.bfloat16), np.ma.masked_array(base[5:9]).data,
              np.matrix(np.ones((2, 2)))[1:]]
    for a in arrays:
        assert memory.host_address(a) == a.__array_interface__["data"][0], a


def _timed_copier(slow_factor: float, log: list):
    """A copy whose time is ``slow_factor`` times longer at the short distance (it busy-waits), recording distances."""
    import time

    def copy(dst: int, src: int, n: int) -> None:
        dist = (dst - src) % pages.PAGE
        log.append(dist)
        end = time.perf_counter() + 20e-6 * (slow_factor if pages.short_distance(dst, src) else 1.0)
        while time.perf_counter() < end:
            pass

    return copy


@pytest.mark.parametrize("factor, slow", [(5.0, True), (1.0, False), (1.2, False)])
def test_the_probe_calls_a_copy_slow_only_where_the_short_distance_costs_several_times(factor, slow):
    log: list = []
    assert pages.slow_at_short_distance(_timed_copier(factor, log), reps=5) is slow
    assert sorted(set(log)) == [16, pages.PAGE // 2] and len(log) == 10


def test_the_setting_overrides_the_probe_and_auto_times_once(monkeypatch):
    from pycoll import memory

    log: list = []
    monkeypatch.setattr(memory, "_bounces", {})
    monkeypatch.setenv("PYCOLL_SHORT_DISTANCE", "direct")
    assert not memory.bounces_short_distance("fake", _timed_copier(5.0, log)) and not log
    monkeypatch.setenv("PYCOLL_SHORT_DISTANCE", "bounce")
    assert memory.bounces_short_distance("fake", _timed_copier(1.0, log)) and not log
    monkeypatch.setenv("PYCOLL_SHORT_DISTANCE", "auto")
    assert memory.bounces_short_distance("fake", _timed_copier(5.0, log)) and log
    timed = len(log)
    assert memory.bounces_short_distance("fake", _timed_copier(1.0, log)) and len(log) == timed  # kept per kind
    monkeypatch.setenv("PYCOLL_SHORT_DISTANCE", "sometimes")
    with pytest.raises(ValueError, match="PYCOLL_SHORT_DISTANCE='sometimes'.*auto, bounce or direct"):
        memory.bounces_short_distance("fake", _timed_copier(1.0, log))


def test_a_refused_kernel_copy_makes_no_bounce_decision(monkeypatch):
    from pycoll import memory

    monkeypatch.setattr(memory, "_bounces", {})
    monkeypatch.delenv("PYCOLL_SHORT_DISTANCE", raising=False)
    cm = cma.CrossMemory()

    def refused(*args):
        raise OSError(1, "process_vm_readv: Operation not permitted")

    monkeypatch.setattr(cm, "_move", refused)
    assert cm.bounces is False
    assert "kernel" not in memory._bounces  # asked again next time, not remembered as measured


def test_freed_memory_is_kept_for_reuse_where_glibc_allocates(monkeypatch):
    """``memory.keep_freed_memory``: set where glibc is the allocator, and not where PYCOLL_KEEP_FREED=0."""
    import ctypes

    from pycoll import memory

    try:
        ctypes.CDLL(None).gnu_get_libc_version
    except AttributeError:
        pytest.skip("not glibc: mallopt's parameters are glibc's")
    assert memory.keep_freed_memory() is True
    monkeypatch.setenv("PYCOLL_KEEP_FREED", "0")
    assert memory.keep_freed_memory() is False


_ATTACH = textwrap.dedent("""
    import json, os, sys
    if os.environ["PYCOLL_RANK"] in sys.argv[2].split(","):
        os.environ["PYCOLL_CMA_DISABLE"] = "1"  # this rank alone cannot copy by cross-memory attach
    import numpy as np
    from pycoll import MPI
    comm = MPI.COMM_WORLD
    n = 300_001
    send = np.arange(n, dtype=np.float64) * (comm.rank + 1)
    recv = np.empty(n)
    comm.Allreduce(send, recv)
    want = np.arange(n, dtype=np.float64) * sum(range(1, comm.size + 1))
    arena = comm._arena.arena
    with open(f"{sys.argv[1]}/rank{comm.rank}.json", "w") as f:
        json.dump({"ok": bool(np.array_equal(recv, want)), "cma": arena.cma_ok, "pids": arena.pids}, f)
""")


@pytest.mark.parametrize("refusing", ["", "0", "2"])
def test_the_arena_turns_cross_memory_attach_off_everywhere_when_one_rank_cannot(tmp_path: Path, refusing: str) -> None:
    """Set-up agrees on cross-memory attach in three messages: rank 0 tries every rank, the others try rank 0. One
    rank that cannot (rank 0 or another) turns it off on all; the forced cma Allreduce then streams, correctly."""
    script = tmp_path / "rank.py"
    script.write_text(_ATTACH)
    proc = run_script(3, script, [str(tmp_path), refusing], env={"PYCOLL_ALGO": "allreduce:cma"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert all(g["ok"] for g in got), got
    assert [g["cma"] for g in got] == [not refusing] * 3, got
    assert all(g["pids"] == got[0]["pids"] and len(set(g["pids"])) == 3 and 0 not in g["pids"] for g in got), got
