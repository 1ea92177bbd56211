"""Device memory for `pycoll perf --device cuda`: buffer allocation (CuPy or numba.cuda), GPU counts, the D2D copy limit."""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
import subprocess
import sys
import time
from typing import Any, Optional

import numpy as np

DEVICES = ("host", "cuda")
LIMIT_BYTES = 512 << 20  # the D2D copy of the limit line, on a real device
SIM_LIMIT_BYTES = 4 << 20  # under numba's simulator the "device" is host memory: keep it small


def simulator() -> bool:
    """True when numba.cuda will be (or is) its CPU simulator."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def local_rank() -> int:
    env = os.environ
    return int(env.get("PYCOLL_LOCAL_RANK", env.get("LOCAL_RANK", "0")) or 0)


def _carrier(dtype: np.dtype) -> np.dtype:
    """The dtype device libraries hold: bfloat16 travels as uint16 (CuPy and numba have no bfloat16)."""
    return np.dtype(np.uint16) if dtype.name == "bfloat16" else dtype


_OWN_MAPPING_BYTES = 1 << 20  # host buffers from this size get a mapping of their own
_HUGE_PAGE = 2 << 20


def host_buffer(n: int, dtype: Any) -> np.ndarray:
    """``n`` zeroed elements; from 1 MiB in a private mapping of their own, 2 MiB aligned and advised for huge pages.

    malloc serves a large array from a fresh mapping, or, once one that size was freed, from heap pages already
    mapped 4 KiB at a time; kernel copies (cma) from 4 KiB pages run at about half speed. A point of a sweep then
    depended on what ran before it: a mapping per buffer, like nccl-tests' one cudaMalloc, measures every point alike.
    """
    dt = np.dtype(dtype)
    nbytes = n * dt.itemsize
    if nbytes < _OWN_MAPPING_BYTES:
        return np.zeros(n, dt)
    m = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(m, np.uint8)  # the array keeps the mapping alive; it is unmapped with the last view
    skip = -raw.ctypes.data % _HUGE_PAGE
    return raw[skip : skip + nbytes].view(dt)


class HostArrays:
    """NumPy buffers: what every peer used before --device existed."""

    name = "host"
    stream: Any = None

    def from_host(self, host: np.ndarray) -> Any:
        out = host_buffer(host.size, host.dtype)
        np.copyto(out, host)
        return out

    def zeros(self, n: int, dtype: Any) -> Any:
        return host_buffer(n, dtype)

    def copy(self, dst: Any, src: Any) -> None:
        np.copyto(dst, src)

    def to_host(self, arr: Any, dtype: Any) -> np.ndarray:
        return arr

    def spec(self, arr: Any, dtype: Any) -> Any:
        """The buffer argument for pycoll / mpi4py."""
        return arr

    def sync(self) -> None:
        pass


class _DeviceBase(HostArrays):
    """Shared by the CuPy and numba adapters: bfloat16 in a uint16 carrier, named by the buffer spec."""

    def spec(self, arr: Any, dtype: Any) -> Any:
        if np.dtype(dtype).name == "bfloat16":
            from pycoll.datatypes import BFLOAT16

            return [arr, BFLOAT16]
        return arr

    def to_host(self, arr: Any, dtype: Any) -> np.ndarray:
        host = self._get(arr)
        return host.view(np.dtype(dtype)) if host.dtype != np.dtype(dtype) else host

    def _get(self, arr: Any) -> np.ndarray:
        raise NotImplementedError


class CupyArrays(_DeviceBase):
    """CuPy arrays on this rank's GPU (local rank modulo the GPU count), work queued on one non-blocking stream."""

    name = "cupy"

    def __init__(self, rank: Optional[int] = None) -> None:
        import cupy

        self.cp = cupy
        count = cupy.cuda.runtime.getDeviceCount()
        self.device = cupy.cuda.Device((local_rank() if rank is None else rank) % count)
        self.device.use()
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def from_host(self, host: np.ndarray) -> Any:
        src = host.view(_carrier(host.dtype))
        out = self.cp.empty(src.shape, src.dtype)
        out.set(src, stream=self.stream)
        self.stream.synchronize()
        return out

    def zeros(self, n: int, dtype: Any) -> Any:
        with self.stream:
            out = self.cp.zeros(n, _carrier(np.dtype(dtype)))
        self.stream.synchronize()
        return out

    def copy(self, dst: Any, src: Any) -> None:
        with self.stream:
            self.cp.copyto(dst, src)
        self.stream.synchronize()

    def _get(self, arr: Any) -> np.ndarray:
        return arr.get(stream=self.stream)  # blocking

    def sync(self) -> None:
        self.device.synchronize()  # the whole device, as a user without pycoll's internals would


class NumbaArrays(_DeviceBase):
    """numba.cuda device arrays (simulator arrays under NUMBA_ENABLE_CUDASIM=1), work queued on one stream."""

    name = "numba"

    def __init__(self, rank: Optional[int] = None) -> None:
        from numba import cuda

        self.cuda = cuda
        if not simulator():
            cuda.select_device((local_rank() if rank is None else rank) % len(cuda.gpus))
        self.stream = cuda.stream()

    def from_host(self, host: np.ndarray) -> Any:
        out = self.cuda.to_device(host.view(_carrier(host.dtype)), stream=self.stream)
        self.stream.synchronize()
        return out

    def zeros(self, n: int, dtype: Any) -> Any:
        return self.from_host(np.zeros(n, _carrier(np.dtype(dtype))))

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_to_device(src, stream=self.stream)
        self.stream.synchronize()

    def _get(self, arr: Any) -> np.ndarray:
        host = arr.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return host

    def sync(self) -> None:
        self.cuda.synchronize()


def cupy_usable() -> bool:
    """CuPy is installed and numba is not the simulator (CuPy always needs a real device)."""
    return not simulator() and importlib.util.find_spec("cupy") is not None


def arrays_for(device: str) -> HostArrays:
    """The allocator of one rank: NumPy for host; CuPy when importable, else numba.cuda, for cuda."""
    if device == "host":
        return HostArrays()
    if device != "cuda":
        raise ValueError(f"unknown device {device!r}; choose from {', '.join(DEVICES)}")
    return CupyArrays() if cupy_usable() else NumbaArrays()


def numba_cuda_missing() -> Optional[str]:
    """None when numba.cuda can run pycoll's device path here (a device, or the simulator), else why not."""
    if simulator():
        return None
    try:
        from numba import cuda
    except Exception as exc:  # numba without its CUDA target, a broken install
        return f"numba.cuda does not import ({type(exc).__name__}: {exc})"
    try:
        if cuda.is_available():
            return None
    except Exception as exc:  # no driver library
        return f"numba.cuda finds no CUDA driver ({type(exc).__name__})"
    return "no CUDA device (numba.cuda.is_available() is False); NUMBA_ENABLE_CUDASIM=1 runs the simulator"


def gpu_count() -> int:
    """GPUs this process sees (torch, else CuPy, else numba; 0 without any). Creates no CUDA context."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - no torch, or a broken CUDA install: try the next library
        pass
    if cupy_usable():
        try:
            import cupy

            return int(cupy.cuda.runtime.getDeviceCount())
        except Exception:  # noqa: BLE001 - no driver
            pass
    if not simulator() and numba_cuda_missing() is None:
        from numba import cuda

        return len(cuda.gpus)
    return 0


# ---- the limit line of device sweeps ---------------------------------------------------------------------------------


def _timed(fn: Any, sync: Any, repeats: int) -> float:
    """Median seconds of fn() followed by sync(), after one untimed call."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _text(name: Any) -> str:
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def measure_device_limits(nbytes: Optional[int] = None, repeats: int = 5) -> dict[str, Any]:
    """Device-to-device copy (cudaMemcpy D2D) and, with CuPy, a float32 add, as GB/s of nbytes / time."""
    nbytes = nbytes or (SIM_LIMIT_BYTES if simulator() else LIMIT_BYTES)
    n = nbytes // 4
    out: dict[str, Any] = {"memory": "cuda", "limit_bytes": n * 4}
    if cupy_usable():
        import cupy

        dev = cupy.cuda.Device(0)
        dev.use()
        a, b, c = cupy.ones(n, cupy.float32), cupy.full(n, 2.0, cupy.float32), cupy.empty(n, cupy.float32)
        copy = lambda: c.data.copy_from_device(a.data, n * 4)  # noqa: E731 - cudaMemcpy D2D
        add = lambda: cupy.add(a, b, out=c)  # noqa: E731
        out["copy_GBps"] = round(n * 4 / _timed(copy, dev.synchronize, repeats) / 1e9, 3)
        out["reduce_GBps"] = round(n * 4 / _timed(add, dev.synchronize, repeats) / 1e9, 3)
        out["device_name"] = _text(cupy.cuda.runtime.getDeviceProperties(0)["name"])
        out["via"] = "cupy"
        return out
    from numba import cuda

    a = cuda.to_device(np.ones(n, np.float32))
    c = cuda.device_array(n, np.float32)
    out["copy_GBps"] = round(n * 4 / _timed(lambda: c.copy_to_device(a), cuda.synchronize, repeats) / 1e9, 3)
    name = "numba simulator" if simulator() else cuda.get_current_device().name
    out["device_name"] = _text(name)
    out["via"] = "numba"
    return out


def device_limits(timeout: float = 180.0) -> dict[str, Any]:
    """measure_device_limits in a child process, so that this one holds no CUDA context or memory pool.

    On failure: {"memory": "cuda", "error": reason} (no copy_GBps, so no limit line is drawn)."""
    cmd = [sys.executable, "-m", "pycoll.perf.devices", "--limits"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"memory": "cuda", "error": f"the device copy measurement timed out after {timeout:g} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:]
        return {"memory": "cuda", "error": f"the device copy measurement failed (exit {proc.returncode}"
                                           + (f": {tail[0]}" if tail else "") + ")"}
    return json.loads(lines[-1])


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["--limits"]:
        print("usage: python -m pycoll.perf.devices --limits [NBYTES]", file=sys.stderr)
        return 2
    nbytes = int(argv[1]) if len(argv) > 1 else None
    print(json.dumps(measure_device_limits(nbytes)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
