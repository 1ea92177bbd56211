"""Device (CUDA) buffers: parsing of __cuda_array_interface__ objects, CudaMemory, and collectives on the simulator or a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import harness
from pycoll import arrays, buffers
from pycoll.arrays import DeviceArray
from pycoll.datatypes import BFLOAT16
from pycoll.errors import InvalidArgumentError

SIM_ENV = {"NUMBA_ENABLE_CUDASIM": "1"}


class FakeDevice:
    """An object exporting only __cuda_array_interface__ (no memory behind it: parsing never touches the data)."""

    def __init__(self, shape, dtype="float32", ptr=0x7F0000000000, strides=None, readonly=False, mask=None):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": np.dtype(dtype).str, "data": (ptr, readonly), "strides": strides,
            "version": 3, "mask": mask,
        }


class GradTensor:
    """Like a torch CUDA tensor that requires grad: its interface raises RuntimeError."""

    @property
    def __cuda_array_interface__(self):
        raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad")


class DLPackOnly:
    """A CUDA buffer seen through DLPack only."""

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):  # pragma: no cover - never read
        raise AssertionError("pycoll must not read it")


# --- parsing, in this process (no numba.cuda) --------------------------------------------------------------------


def test_device_array_parsed_without_copy() -> None:
    obj = FakeDevice((2, 3), "float32")
    b = buffers.parse(obj, "recvbuf", "Allreduce", writable=True)
    assert b.memory == "cuda" and isinstance(b.array, DeviceArray)
    assert b.count == 6 and b.dtype == np.float32 and b.nbytes == 24
    assert b.array.owner is obj and b.array.ptr == 0x7F0000000000


def test_device_specs_count_dtype_and_blocks() -> None:
    obj = FakeDevice((10,), "uint16")
    b = buffers.parse([obj, 4, BFLOAT16], "sendbuf", "Allreduce")
    assert b.count == 4 and b.dtype == BFLOAT16 and b.memory == "cuda"
    assert buffers.parse([obj, "f"], "x", "op").count == 5  # reinterpreted as float32
    assert buffers.parse([obj, 2], "recvbuf", "Allgather", blocks=5).count == 10
    v = buffers.parse_vector([obj, [2, 3], [0, 4]], "recvbuf", "Allgatherv", 2, writable=True)
    assert v.memory == "cuda" and isinstance(v.part(1), DeviceArray) and v.part(1).ptr == obj.__cuda_array_interface__["data"][0] + 8
    with pytest.raises(InvalidArgumentError, match="exceeds"):
        buffers.parse([obj, 11], "sendbuf", "Allreduce")
    with pytest.raises(InvalidArgumentError, match="equal blocks"):
        buffers.parse(obj, "recvbuf", "Allgather", blocks=3)
    with pytest.raises(InvalidArgumentError, match="whole number"):
        buffers.parse([FakeDevice((3,), "uint8"), "f"], "x", "op")


def test_device_contiguity() -> None:
    c_order = FakeDevice((3, 4), "float32", strides=(16, 4))
    f_order = FakeDevice((3, 4), "float32", strides=(4, 12))
    single = FakeDevice((1, 4), "float32", strides=(999, 4))  # a length-1 axis may have any stride
    for obj in (c_order, f_order, single):
        assert buffers.parse(obj, "x", "op").memory == "cuda"
    with pytest.raises(InvalidArgumentError, match="non-contiguous CUDA array"):
        buffers.parse(FakeDevice((3, 4), "float32", strides=(32, 4)), "sendbuf", "Allreduce")
    with pytest.raises(InvalidArgumentError, match="non-contiguous CUDA array"):
        buffers.parse(FakeDevice((4,), "float32", strides=(8,)), "sendbuf", "Allreduce")


def test_device_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="read-only"):
        buffers.parse(FakeDevice((4,), readonly=True), "recvbuf", "Allreduce", writable=True)
    assert buffers.parse(FakeDevice((4,), readonly=True), "sendbuf", "Allreduce").memory == "cuda"
    with pytest.raises(InvalidArgumentError, match="masked"):
        buffers.parse(FakeDevice((4,), mask=object()), "sendbuf", "Allreduce")
    with pytest.raises(InvalidArgumentError, match="RuntimeError.*requires grad"):
        buffers.parse(GradTensor(), "sendbuf", "Allreduce")
    with pytest.raises(InvalidArgumentError, match="not supported"):
        buffers.parse(FakeDevice((4,), "U4"), "sendbuf", "Allreduce")
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(InvalidArgumentError, match="DLPack only.*cupy.from_dlpack"):
            buffers.parse(DLPackOnly(), "sendbuf", "Allreduce")


def test_device_slices_and_overlap() -> None:
    d = buffers.parse(FakeDevice((8,), "int32", ptr=4096), "x", "op").array
    assert d[2:5].ptr == 4096 + 8 and d[2:5].size == 3 and d[5:2].size == 0
    assert d.view(np.int16).size == 16
    assert arrays.overlaps(d[:4], d[3:]) and not arrays.overlaps(d[:4], d[4:])
    assert not arrays.overlaps(d, np.zeros(8, np.int32))  # host and device memory never overlap
    assert not arrays.overlaps(d[:0], d)
    iface = d[2:4].__cuda_array_interface__
    assert iface["data"] == (4096 + 8, False) and iface["shape"] == (2,) and iface["typestr"] == "<i4"
    with pytest.raises(ValueError):
        d[::2]


def test_host_buffers_unchanged() -> None:
    b = buffers.parse(np.arange(6, dtype=np.float64).reshape(2, 3), "x", "op")
    assert b.memory == "host" and isinstance(b.array, np.ndarray) and b.count == 6


# --- CudaMemory and the staging, on the simulator (a subprocess: the simulator must be chosen before numba.cuda loads)


MEMORY_SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    import numpy as np
    from numba import cuda
    from pycoll import ops, memory
    from pycoll.algorithms import Call
    from pycoll.cuda.memory import CudaMemory, Staged, wrap
    from pycoll.datatypes import BFLOAT16

    mem = memory.backend("cuda", cuda.stream())
    assert isinstance(mem, CudaMemory) and mem.name == "cuda"
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal(37).astype(np.float32), rng.standard_normal(37).astype(np.float32)
    da, db, out = wrap(cuda.to_device(a)), wrap(cuda.to_device(b)), mem.scratch(37, np.float32)
    mem.reduce(ops.SUM, da, db, out)
    mem.synchronize()
    host = np.empty(37, np.float32)
    mem.to_host(host, out)
    assert np.array_equal(host, a + b), "reduce"
    mem.scale(out, 2)
    mem.to_host(host, out)
    assert np.array_equal(host, (a + b) / np.float32(2)), "scale"
    mem.copy(out, da)
    mem.to_host(host, out)
    assert np.array_equal(host, a), "copy"
    # bfloat16 in its uint16 carrier, told apart by the DeviceArray's dtype
    ab, bb = a.astype(BFLOAT16), b.astype(BFLOAT16)
    xa = wrap(cuda.to_device(ab.view(np.uint16))).view(BFLOAT16)
    xb = wrap(cuda.to_device(bb.view(np.uint16))).view(BFLOAT16)
    mem.reduce(ops.MAX, xa, xb, xa)
    got = np.empty(37, BFLOAT16)
    mem.to_host(got, xa)
    assert np.array_equal(got, np.maximum(ab, bb)), "bfloat16 max"
    mem.release(out)
    again = mem.scratch(5, np.int32)
    assert again.owner is out.owner and again.size == 5, "scratch reuse"
    # staging: an in-place reduce_scatter keeps the send view inside recv; the result lands on the device
    recv = wrap(cuda.to_device(np.arange(6, dtype=np.float32)))
    call = Call("reduce_scatter", np.dtype(np.float32), recv[:6], recv, ops.SUM, counts=[3, 3], in_place=True)
    st = Staged(call, 0, None)
    assert st.call.send.base is not None and np.shares_memory(st.call.send, st.call.recv), "in-place view"
    st.call.recv[:3] = -1
    st.finish()
    assert recv.owner.copy_to_host()[:3].tolist() == [-1, -1, -1], "copied back"
    # a broadcast root copies nothing back
    root = wrap(cuda.to_device(np.ones(4, np.int32)))
    st = Staged(Call("broadcast", np.dtype(np.int32), recv=root, root=1), 1, None)
    assert st.call.recv.tolist() == [1, 1, 1, 1] and not st.copy_back
    st.call.recv[:] = 7
    st.finish()
    assert root.owner.copy_to_host().tolist() == [1, 1, 1, 1], "root untouched"
    print("ok")
    """
)


def test_cuda_memory_on_simulator() -> None:
    env = dict(os.environ, PYTHONPATH=harness.ROOT, **SIM_ENV)
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# --- collectives on 2 and 3 ranks ----------------------------------------------------------------------------------


@pytest.mark.ranks
@pytest.mark.timeout(150)
@pytest.mark.parametrize("n,transport", [(2, "shm"), (3, "shm"), (2, "tcp")])
def test_device_collectives_on_simulator(n: int, transport: str, tmp_path) -> None:
    res = harness.run_cases(n, ["device.*"], transport=transport, out_dir=str(tmp_path), env=SIM_ENV, job_timeout=110)
    res.assert_ok()
    skipped = {r: d.get("skipped") for r, d in res.ranks.items() if d.get("skipped")}
    assert not skipped, skipped  # under the simulator every case runs


def _gpu_missing() -> str | None:
    code = "from numba import cuda; print(cuda.is_available())"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    except subprocess.TimeoutExpired:
        return "probing numba.cuda timed out"
    if out.returncode != 0:
        return f"numba.cuda is not importable: {out.stderr.strip()[-300:]}"
    return None if out.stdout.strip() == "True" else "no CUDA device (numba.cuda.is_available() is False)"


@pytest.mark.gpu
@pytest.mark.ranks
@pytest.mark.timeout(600)
def test_device_collectives_on_gpu(tmp_path) -> None:
    """The same cases on a real device: staging copies on real streams, pinned host memory."""
    why = _gpu_missing()
    if why:
        pytest.skip(why)
    env = {"NUMBA_ENABLE_CUDASIM": "0"}
    res = harness.run_cases(2, ["device.*"], out_dir=str(tmp_path), env=env, job_timeout=500)
    res.assert_ok()
