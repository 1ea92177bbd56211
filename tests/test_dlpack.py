"""CPU DLPack buffers: pycoll borrows the producer's capsule (never renames it), so producers whose capsule owns the tensor work."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import harness
from dlpack_producer import DELETER_CALLS, LEGACY_NAME, Exporter
from pycoll import buffers
from pycoll.errors import InvalidArgumentError


def test_repeated_use_of_a_capsule_owning_producer_does_not_crash():
    """The crash of mpi4py's dlpack test arrays: with numpy.from_dlpack the first view's death calls a deleter in
    released memory (SIGSEGV). Run in a child process, so that a crash fails this test instead of pytest."""
    script = textwrap.dedent("""
        import gc
        import numpy as np
        from dlpack_producer import DELETER_CALLS, Exporter
        from pycoll import MPI, buffers

        for versioned in (False, True):
            src = Exporter(np.arange(6, dtype=np.float64), versioned=versioned)
            dst = Exporter(np.zeros(6), versioned=versioned)
            for i in range(3):
                view = buffers.parse(src, "sendbuf", "Test").array
                assert view.tolist() == list(range(6)), view
                del view
                gc.collect()
                MPI.COMM_WORLD.Allreduce(src, dst, op=MPI.SUM)
                assert dst.array.tolist() == list(range(6)), dst.array
                dst.array[:] = 0
            gc.collect()
            exported = src.exported + dst.exported
            assert [DELETER_CALLS[a] for a in exported] == [1] * len(exported), dict(DELETER_CALLS)
        print("ok")
    """)
    env = harness.rank_env("shm", comm_timeout=30)
    for var in ("PYCOLL_RANK", "PYCOLL_SIZE", "PYCOLL_STORE_ADDR", "RANK", "WORLD_SIZE"):
        env.pop(var, None)  # a singleton, whatever launched pytest
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit {proc.returncode} (negative: killed by that signal)\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


@pytest.mark.parametrize("versioned", [False, True])
def test_deleter_runs_once_after_the_last_view(versioned):
    exporter = Exporter(np.arange(4, dtype=np.int32), versioned=versioned)
    view = buffers.parse(exporter, "recvbuf", "Test", writable=True).array
    (address,) = exporter.exported
    gc.collect()
    assert DELETER_CALLS[address] == 0, "the tensor was deleted while pycoll still looks at its memory"
    view[1] = 42
    assert exporter.array[1] == 42, "the view is a copy, not the exported memory"
    del view
    gc.collect()
    assert DELETER_CALLS[address] == 1


def test_asks_for_dlpack_1_without_copy_then_falls_back():
    modern = Exporter(np.zeros(3), versioned=True)
    buffers.parse(modern, "buf", "Test")
    assert modern.calls == [{"max_version": (1, 0), "copy": False, "stream": None}]
    legacy = Exporter(np.zeros(3))  # raises TypeError for the keywords, as DLPack 0.x producers do
    buffers.parse(legacy, "buf", "Test")
    assert legacy.calls == [{"stream": None}]


def test_read_only_flag_is_kept():
    exporter = Exporter(np.arange(3.0), versioned=True, readonly=True)
    view = buffers.parse(exporter, "sendbuf", "Test").array
    assert not view.flags.writeable
    with pytest.raises(InvalidArgumentError, match=r"\[Recv.*recvbuf is read-only"):
        buffers.parse(exporter, "recvbuf", "Recv", writable=True)


def test_strided_export_is_refused():
    exporter = Exporter(np.zeros((4, 4)), strides=(8, 2))
    with pytest.raises(InvalidArgumentError, match=r"\[Send.*non-contiguous DLPack"):
        buffers.parse(exporter, "buf", "Send")


def test_dtypes_and_shapes_map_to_numpy():
    for dtype in (np.int8, np.uint16, np.float32, np.float64, np.complex128, np.bool_):
        arr = np.ones((2, 3), dtype=dtype)
        view = buffers.parse(Exporter(arr), "buf", "Test").array
        assert view.dtype == dtype and view.shape == (6,)
    empty = buffers.parse(Exporter(np.zeros(0, np.float32)), "buf", "Test").array
    assert empty.dtype == np.float32 and empty.size == 0


def test_capsule_is_not_consumed():
    exporter = Exporter(np.zeros(2))
    capsules = []
    original = exporter.__dlpack__

    def keep(*args, **kwargs):
        capsules.append(original(*args, **kwargs))
        return capsules[-1]

    exporter.__dlpack__ = keep
    view = buffers.parse(exporter, "buf", "Test").array
    assert f'"{LEGACY_NAME.decode()}"' in repr(capsules[0])  # not renamed "used_dltensor"
    del view
