"""The CUDA memory backend (device kernels on DeviceArrays) and the staging of device collectives through host memory."""

# Transports move host bytes. A collective on device buffers therefore runs as:
#   1. on the user's stream (or after a device-wide sync when none is given): copy the device input to pinned host
#      memory, then wait for that stream, so that the copy follows whatever was queued on it before the call;
#   2. the host algorithm on those host buffers, as for NumPy arrays;
#   3. copy the result back to the device on the same stream and wait for it (the call returns with the result in place).
# A later cuda_ipc / zero-copy path replaces steps 1 and 3 for peers on one node: kernels read the peers' device
# memory (or registered buffers) directly and reduce on the device, per chunk, with no host round trip.

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
from numba import cuda

from .. import arrays
from ..arrays import DeviceArray
from ..ops import Op
from . import dtypes as _dt
from . import kernels as _k
from . import launch

_POOLED = 6  # pinned host buffers (and device scratch) kept for reuse


def _resolve_stream(stream: Any) -> Any:
    """A stream object with ``synchronize`` (numba's, or the caller's in the simulator), or None for "no stream"."""
    if stream is None:
        return None
    if _k.SIM:  # the simulator runs everything at once: only a stream it can wait on (numba's) matters
        return stream if callable(getattr(stream, "synchronize", None)) else None
    s = launch._stream(stream)
    if isinstance(s, int):  # 0: the legacy default stream
        return None if _k.SIM else cuda.default_stream()
    return s


def wrap(arr: Any) -> DeviceArray:
    """A DeviceArray over a CUDA array (a numba device array, CuPy, torch ...), flattened."""
    return arrays.device_array(arr, "array", "pycoll.cuda")


def device_view(d: DeviceArray, dtype: Any = np.uint8) -> Any:
    """``d`` as a 1-D array of ``dtype`` that numba kernels and copies take (a simulator array under the simulator)."""
    dtype = np.dtype(dtype)
    if _k.SIM:  # "device" addresses are host addresses: a NumPy array over them, kept alive by ``owner``
        owner = d.owner
        host = getattr(owner, "_ary", None) if getattr(owner, "__cuda_ndarray__", False) is True else None
        if host is not None:
            raw = host.reshape(-1, order="A").view(np.uint8)
            raw = raw[d.start : d.start + d.nbytes]
        elif d.nbytes:
            import ctypes

            raw = np.frombuffer((ctypes.c_char * d.nbytes).from_address(d.ptr), np.uint8)
        else:
            raw = np.empty(0, np.uint8)
        return launch.DeviceNDArray(raw.view(dtype))
    iface = {"shape": (d.nbytes,), "typestr": "|u1", "data": (d.ptr if d.nbytes else 0, False), "strides": None,
             "version": 3}
    raw = cuda.from_cuda_array_interface(iface, owner=d.owner, sync=False)
    return raw if dtype == np.uint8 else raw.view(dtype)


def _storage(d: DeviceArray) -> Any:
    return device_view(d, _dt.layout(d.dtype).storage)


class CudaMemory:
    """MemoryBackend on DeviceArrays: pycoll.cuda kernels launched on one stream, scratch from the device.

    ``reduce``/``copy``/``scale`` only queue work on the stream; ``synchronize`` waits for it.
    """

    name = "cuda"

    def __init__(self, stream: Any = None) -> None:
        self.user_stream = stream
        self.stream = _resolve_stream(stream)
        self._free: list[DeviceArray] = []

    def _s(self) -> Any:
        return self.stream if self.stream is not None else 0

    def reduce(self, op: Op, a: DeviceArray, b: DeviceArray, out: DeviceArray) -> None:
        if out.size or a.size or b.size:  # sizes that differ still reach reduce2, which names them
            launch.reduce2(op, _storage(out), _storage(a), _storage(b), dtype=out.dtype, stream=self._s())

    def copy(self, dst: DeviceArray, src: DeviceArray) -> None:
        if dst.nbytes and dst.ptr != src.ptr:
            launch.copy(device_view(dst), device_view(src), stream=self._s())

    def scale(self, arr: DeviceArray, divisor: int) -> None:
        if arr.size:
            launch.scale(_storage(arr), divisor, dtype=arr.dtype, stream=self._s())

    def scratch(self, count: int, dtype: np.dtype) -> DeviceArray:
        """``count`` elements of device memory (contents undefined), from the pool when one fits."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        fits = [i for i, raw in enumerate(self._free) if raw.nbytes >= nbytes]
        if fits:
            raw = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        else:
            raw = wrap(cuda.device_array(max(nbytes, 64), np.uint8))
        return dataclasses.replace(raw, size=count, dtype=dtype)

    def release(self, arr: DeviceArray) -> None:
        self._free.append(dataclasses.replace(arr, start=0, size=_alloc_bytes(arr), dtype=np.dtype(np.uint8)))
        if len(self._free) > _POOLED:
            del self._free[min(range(len(self._free)), key=lambda i: self._free[i].nbytes)]

    # ---- staging -----------------------------------------------------------------------------
    def wait_for_inputs(self) -> None:
        """Without a stream, wait for all work on the device (the caller's kernels may be on any stream)."""
        if self.stream is None:
            cuda.synchronize()

    def to_host(self, dst: np.ndarray, src: DeviceArray) -> None:
        """Queue ``dst[:] = src`` (device to host) on the stream."""
        if src.nbytes:
            device_view(src).copy_to_host(dst.view(np.uint8), stream=self._s())

    def to_device(self, dst: DeviceArray, src: np.ndarray) -> None:
        """Queue ``dst[:] = src`` (host to device) on the stream."""
        if dst.nbytes:
            device_view(dst).copy_to_device(src.view(np.uint8), stream=self._s())

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        elif _k.SIM:
            cuda.synchronize()
        else:
            cuda.default_stream().synchronize()


def _alloc_bytes(arr: DeviceArray) -> int:
    return int(getattr(arr.owner, "nbytes", arr.start + arr.nbytes))


# ---- pinned host buffers, shared by every staged call of the process ----------------------------------------------
_PINNED: list[np.ndarray] = []


def pinned(count: int, dtype: Any) -> np.ndarray:
    """A page-locked host array of ``count`` elements (contents undefined), from the pool when one fits."""
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    fits = [i for i, raw in enumerate(_PINNED) if raw.nbytes >= nbytes]
    if fits:
        raw = _PINNED.pop(min(fits, key=lambda i: _PINNED[i].nbytes))
    else:
        raw = np.asarray(cuda.pinned_array(max(nbytes, 64), np.uint8))
    return raw[:nbytes].view(dtype)


def unpin(arr: np.ndarray) -> None:
    raw = arr
    while isinstance(raw.base, np.ndarray):
        raw = raw.base
    if raw.dtype == np.uint8 and raw.ndim == 1 and raw.nbytes >= 64:
        _PINNED.append(raw)
        if len(_PINNED) > _POOLED:
            del _PINNED[min(range(len(_PINNED)), key=lambda i: _PINNED[i].nbytes)]


# ---- a collective on device buffers, staged through host memory -----------------------------------------------------


def on_device(call: Any) -> bool:
    return isinstance(call.send, DeviceArray) or isinstance(call.recv, DeviceArray)


def _recv_written(call: Any, rank: int) -> Optional[list[tuple[int, int]]]:
    """The (offset, count) spans of ``recv`` this rank's call writes; None where the whole buffer is written."""
    n = call.recv.size
    if call.coll in ("allreduce", "reduce", "scatter", "broadcast"):
        return None
    if call.coll == "reduce_scatter":
        spans = [(0, call.counts[rank])]
    else:  # allgather, gather, alltoall: one block per rank
        spans = [(d, c) for c, d in zip(call.counts, call.displs) if c]
    covered = sorted(spans)
    end = 0
    for d, c in covered:
        if d != end:
            return spans
        end = d + c
    return None if end == n else spans


class Staged:
    """One collective's device buffers mirrored in pinned host memory; ``call`` is the host call to schedule."""

    def __init__(self, call: Any, rank: int, stream: Any) -> None:
        self.mem = CudaMemory(stream)
        self.device = call
        self._host: list[np.ndarray] = []
        send, recv = call.send, call.recv
        hsend = hrecv = None
        self.copy_back = recv is not None and not (call.coll == "broadcast" and call.root == rank)
        stage_recv_in = recv is not None and (
            call.in_place or not self.copy_back or _recv_written(call, rank) is not None
        )
        self.mem.wait_for_inputs()
        if recv is not None:
            hrecv = self._pinned(recv)
            if stage_recv_in:
                self.mem.to_host(hrecv, recv)
        if send is not None:
            inside = recv is not None and recv.ptr <= send.ptr and send.ptr + send.nbytes <= recv.ptr + recv.nbytes
            if inside and stage_recv_in:  # in place: the input is a view into recv, as for host buffers
                off = (send.ptr - recv.ptr) // recv.dtype.itemsize
                hsend = hrecv[off : off + send.size].view(send.dtype) if send.size else hrecv[:0].view(send.dtype)
            else:
                hsend = self._pinned(send)
                self.mem.to_host(hsend, send)
        self.mem.synchronize()  # the host copies are complete before any byte is sent
        self.call = dataclasses.replace(call, send=hsend, recv=hrecv)

    def _pinned(self, d: DeviceArray) -> np.ndarray:
        arr = pinned(d.nbytes, np.uint8).view(d.dtype)
        self._host.append(arr)
        return arr

    def finish(self) -> None:
        """Copy the result to the device on the stream and wait for it; then give the host buffers back."""
        if self.copy_back:
            self.mem.to_device(self.device.recv, self.call.recv)
            self.mem.synchronize()
        self.discard()

    def discard(self) -> None:
        for arr in self._host:
            unpin(arr)
        self._host = []
