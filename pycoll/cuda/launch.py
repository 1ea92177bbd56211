"""Launchers for the CUDA kernels: pick the kernel for (op, dtype), size the grid and launch it on a stream."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda

from .. import datatypes as _datatypes
from .. import ops as _ops
from . import dtypes as _dt
from . import kernels as _k

if _k.SIM:
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray as DeviceNDArray
else:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

BLOCK = 256  # threads per block on a device
SIM_BLOCK = 32  # the simulator runs every thread as a Python thread: keep blocks small there
SIM_MAX_BLOCKS = 4  # and grids too, so that small test arrays exercise the grid-stride loop

_WORDS = (np.dtype(np.uint64), np.dtype(np.uint32), np.dtype(np.uint16), np.dtype(np.uint8))
_BITWISE = ("BAND", "BOR", "BXOR")  # width-agnostic: may run on whole words


def is_simulator() -> bool:
    """True when numba.cuda is the CPU simulator (NUMBA_ENABLE_CUDASIM=1 before numba.cuda was imported)."""
    return _k.SIM


@functools.cache
def _max_blocks(device_id: int, block: int) -> int:
    dev = cuda.get_current_device()
    per_sm = max(1, dev.MAX_THREADS_PER_MULTI_PROCESSOR // block)
    return dev.MULTIPROCESSOR_COUNT * per_sm


def launch_config(n: int, block: int | None = None) -> tuple[int, int]:
    """(blocks, threads per block) for a grid-stride loop over ``n`` items: one full wave of the device at most."""
    if _k.SIM:
        block = block or SIM_BLOCK
        cap = SIM_MAX_BLOCKS
    else:
        block = block or BLOCK
        cap = _max_blocks(cuda.get_current_device().id, block)
    return max(1, min(-(-n // block), cap)), block


@dataclass(frozen=True)
class KernelSet:
    """The kernels for one (op, dtype); each is a numba dispatcher, compiled on first launch per signature."""

    op: _ops.Op
    layout: _dt.Layout

    @property
    def reduce2(self) -> Any:
        return _k.pairwise(self.layout.dtype, self.op.name)

    @property
    def reduce_copy(self) -> Any:
        return _k.pairwise(self.layout.dtype, self.op.name, dual=True)

    @property
    def reduce2_avg(self) -> Any:
        return _k.pairwise(self.layout.dtype, self.op.name, finish=True)

    @property
    def reduce_copy_avg(self) -> Any:
        return _k.pairwise(self.layout.dtype, self.op.name, dual=True, finish=True)

    def nary(self, finish: bool = False, in_dtype: bool = False) -> Any:
        """The n-ary kernel (``kernels.nary``): AVG's division when ``finish``; every step rounded when ``in_dtype``."""
        return _k.nary(self.layout.dtype, self.op.name, finish, in_dtype)


@functools.cache
def _kernel_set(op: _ops.Op, dtype: np.dtype) -> KernelSet:
    why = _dt.check(op, dtype)
    if why is not None:
        raise TypeError(why)
    return KernelSet(op, _dt.layout(dtype))


def get_kernels(op: Any, dtype: Any) -> KernelSet:
    """The KernelSet for ``op`` (an Op or a name) over ``dtype``; TypeError where pycoll or the device cannot reduce."""
    return _kernel_set(_ops.resolve(op), _datatypes.resolve(dtype))


def supported(op: Any, dtype: Any) -> str | None:
    """None if the kernels reduce ``dtype`` with ``op``, else the reason."""
    return _dt.check(op, dtype)


# --- arguments --------------------------------------------------------------------------------------------------


def _stream(stream: Any) -> Any:
    """A numba stream from None/0 (the default stream), a numba Stream, a raw handle, or a CuPy/PyTorch stream."""
    if _k.SIM:  # the simulator runs launches synchronously; it takes its own streams or 0
        return 0 if stream is None or isinstance(stream, int) else stream
    if stream is None:
        return 0
    if isinstance(stream, int):
        return cuda.external_stream(stream) if stream else 0
    for attr in ("ptr", "cuda_stream"):  # cupy.cuda.Stream, torch.cuda.Stream
        handle = getattr(stream, attr, None)
        if isinstance(handle, int):
            return cuda.external_stream(handle) if handle else 0
    return stream  # a numba Stream


def _array(x: Any, what: str) -> Any:
    """``x`` as a 1-D contiguous array the kernels can take: device memory, or host memory in the simulator."""
    if isinstance(x, DeviceNDArray):
        arr = x
    elif _k.SIM and isinstance(x, np.ndarray):  # the simulator's "device memory": wrapped, not copied
        arr = DeviceNDArray(x)
    elif cuda.is_cuda_array(x):  # CuPy, PyTorch, ...: no sync on the exporter's stream, ordering is the caller's
        arr = cuda.as_cuda_array(x, sync=False)
    else:
        raise TypeError(f"{what} is not CUDA device memory ({type(x).__name__}; no __cuda_array_interface__)")
    shape = tuple(arr.shape)
    if len(shape) != 1:
        raise ValueError(f"{what} must be 1-D, got shape {shape}")
    if shape[0] > 1 and arr.strides[0] != arr.dtype.itemsize:
        raise ValueError(f"{what} must be contiguous, got stride {arr.strides[0]} for {arr.dtype.itemsize}-byte items")
    return arr


def _address(arr: Any) -> int:
    iface = getattr(arr, "__cuda_array_interface__", None) or arr.__array_interface__
    return int(iface["data"][0])


def _storage(arrs: Sequence[Any], dtype: Any, what: Sequence[str]) -> tuple[list[Any], np.dtype]:
    """The arrays viewed as their layout's storage dtype, and the logical dtype.

    Without ``dtype`` every array must have the first one's dtype; with it, any dtype of the same item size.
    """
    logical = _datatypes.resolve(dtype) if dtype is not None else np.dtype(arrs[0].dtype)
    lay = _dt.layout(logical)
    views = []
    for arr, name in zip(arrs, what):
        have = np.dtype(arr.dtype)
        ok = have.itemsize == logical.itemsize if dtype is not None else have == logical
        if not ok:
            raise TypeError(f"{name} has {have.name} elements, {what[0]} {logical.name} (pass dtype= to reinterpret)")
        views.append(arr if have == lay.storage else arr.view(lay.storage))
    return views, logical


def _same_size(arrs: Sequence[Any], what: Sequence[str]) -> int:
    n = int(arrs[0].size)
    for arr, name in zip(arrs[1:], what[1:]):
        if int(arr.size) != n:
            raise ValueError(f"{name} has {arr.size} elements, {what[0]} has {n}")
    return n


def _word(arrs: Sequence[Any], nbytes: int) -> np.dtype:
    """The widest unsigned word that divides ``nbytes`` and every array's address."""
    for w in _WORDS:
        if nbytes % w.itemsize == 0 and all(_address(a) % w.itemsize == 0 for a in arrs):
            return w
    return _WORDS[-1]


def _as_words(arr: Any, word: np.dtype) -> Any:
    if np.dtype(arr.dtype) == word:
        return arr
    if np.dtype(arr.dtype).itemsize != 1:
        arr = arr.view(np.uint8)
    return arr if word.itemsize == 1 else arr.view(word)


def _launch(kernel: Any, n: int, stream: Any, *args: Any) -> None:
    grid, block = launch_config(n)
    kernel[grid, block, _stream(stream)](*args)


# --- reductions -------------------------------------------------------------------------------------------------


def _pairwise(op: Any, out: Any, out2: Any, a: Any, b: Any, dtype: Any, divisor: Any, stream: Any) -> None:
    op = _ops.resolve(op)
    names = ["out", "a", "b"] + (["out2"] if out2 is not None else [])
    arrs = [_array(x, w) for x, w in zip([out, a, b, out2], names)]
    n = _same_size(arrs, names)
    views, logical = _storage(arrs, dtype, names)
    get_kernels(op, logical)  # raises TypeError for a pair the kernels do not reduce
    if divisor is not None and not op.averages:
        raise ValueError(f"a divisor goes with AVG, not {op.name}")
    if n == 0:
        return
    div = _dt.divisor_arg(logical, divisor, wide=False) if divisor is not None else np.float64(1)
    kdtype = logical
    if op.name in _BITWISE:  # and, or, xor of any integer width: whole words
        word = _word(views, n * logical.itemsize)
        if word.itemsize > logical.itemsize:
            views = [_as_words(v, word) for v in views]
            kdtype, n = word, n * logical.itemsize // word.itemsize
    kernel = _k.pairwise(kdtype, op.name, dual=out2 is not None, finish=divisor is not None)
    dst2 = views[3] if out2 is not None else views[0]
    _launch(kernel, n, stream, views[0], dst2, views[1], views[2], div)


def reduce2(op: Any, out: Any, a: Any, b: Any, *, dtype: Any = None, divisor: Any = None, stream: Any = None) -> None:
    """``out = a op b`` elementwise on the device; ``out`` may be ``a`` or ``b``.

    ``dtype`` names the element type when the arrays carry another of the same size (bfloat16 travels as uint16).
    AVG combines as SUM; with ``divisor`` (AVG only) the result is then divided, rounding as the host backend's
    reduce followed by scale does.
    """
    _pairwise(op, out, None, a, b, dtype, divisor, stream)


def reduce_copy(op: Any, out: Any, out2: Any, a: Any, b: Any, *, dtype: Any = None, divisor: Any = None,
                stream: Any = None) -> None:
    """``out = out2 = a op b``: reduce once, write two destinations (NCCL's recvReduceCopySend)."""
    _pairwise(op, out, out2, a, b, dtype, divisor, stream)


def reduce_many(op: Any, out: Any, srcs: Sequence[Any], *, dtype: Any = None, divisor: Any = None,
                stream: Any = None, in_dtype: bool = False) -> None:
    """``out = srcs[0] op srcs[1] op ...`` in the order given, accumulated wide and rounded once.

    For AVG the sum is divided by ``divisor``, default ``len(srcs)``, before the one rounding. ``out`` may be one of
    ``srcs``. At most MAX_SRCS sources; one source is a copy (then divided, for AVG). ``in_dtype``: round every
    partial result to the dtype, which gives NumPy's left fold bit for bit (float16 and bfloat16 differ otherwise).
    """
    op = _ops.resolve(op)
    srcs = list(srcs)
    if not 1 <= len(srcs) <= _dt.MAX_SRCS:
        raise ValueError(f"reduce_many takes 1 to {_dt.MAX_SRCS} sources, got {len(srcs)}")
    names = ["out"] + [f"srcs[{j}]" for j in range(len(srcs))]
    arrs = [_array(x, w) for x, w in zip([out] + srcs, names)]
    n = _same_size(arrs, names)
    views, logical = _storage(arrs, dtype, names)
    ks = get_kernels(op, logical)
    if divisor is not None and not op.averages:
        raise ValueError(f"a divisor goes with AVG, not {op.name}")
    if n == 0:
        return
    if op.averages:
        div = _dt.divisor_arg(logical, len(srcs) if divisor is None else divisor, wide=True)
    else:
        div = np.float64(1)
    kernel = ks.nary(finish=op.averages, in_dtype=in_dtype)
    _launch(kernel, n, stream, views[0], tuple(views[1:]), div)


def scale(arr: Any, divisor: float, *, out: Any = None, dtype: Any = None, stream: Any = None) -> None:
    """``out = arr / divisor`` (in place without ``out``), as the host backend's ``scale``; float and complex only."""
    names = ["arr", "out"]
    arrs = [_array(x, w) for x, w in zip([arr, arr if out is None else out], names)]
    n = _same_size(arrs, names)
    views, logical = _storage(arrs, dtype, names)
    div = _dt.divisor_arg(logical, divisor, wide=False)
    if n:
        _launch(_k.scale(logical), n, stream, views[1], views[0], div)


# --- copies -----------------------------------------------------------------------------------------------------


def copy(dst: Any, src: Any, *, dst2: Any = None, stream: Any = None) -> None:
    """``dst[:] = src`` (and ``dst2``) byte for byte, in the widest words the sizes and addresses allow.

    The arrays may differ in dtype but not in size in bytes; overlapping ``dst`` and ``src`` other than equal is undefined.
    """
    names = ["dst", "src"] + (["dst2"] if dst2 is not None else [])
    arrs = [_array(x, w) for x, w in zip([dst, src, dst2], names)]
    sizes = {int(a.size) * np.dtype(a.dtype).itemsize for a in arrs}
    if len(sizes) != 1:
        raise ValueError(f"copy needs equal sizes in bytes, got {', '.join(f'{w}={a.nbytes}' for w, a in zip(names, arrs))}")
    nbytes = sizes.pop()
    if nbytes == 0 or (dst2 is None and _address(arrs[0]) == _address(arrs[1])):
        return
    word = _word(arrs, nbytes)
    views = [_as_words(a, word) for a in arrs]
    n = nbytes // word.itemsize
    if dst2 is None:
        _launch(_k.copy_words, n, stream, views[0], views[1])
    else:
        _launch(_k.copy_words2, n, stream, views[0], views[2], views[1])


def copy_blocks(dst: Any, src: Any, nblocks: int, blocklen: int, *, dst_offset: int = 0, dst_stride: int | None = None,
                src_offset: int = 0, src_stride: int | None = None, stream: Any = None) -> None:
    """Copy ``nblocks`` blocks of ``blocklen`` elements: block k from ``src[src_offset + k*src_stride:]`` to
    ``dst[dst_offset + k*dst_stride:]`` (strides default to ``blocklen``; units are elements of the arrays' dtype)."""
    d, s = _array(dst, "dst"), _array(src, "src")
    item = np.dtype(d.dtype).itemsize
    if np.dtype(s.dtype).itemsize != item:
        raise TypeError(f"copy_blocks needs equal item sizes, got {d.dtype} and {s.dtype}")
    dst_stride = blocklen if dst_stride is None else dst_stride
    src_stride = blocklen if src_stride is None else src_stride
    if min(nblocks, blocklen, dst_offset, dst_stride, src_offset, src_stride) < 0:
        raise ValueError("copy_blocks takes no negative counts, offsets or strides")
    if nblocks == 0 or blocklen == 0:
        return
    for arr, off, stride, name in ((d, dst_offset, dst_stride, "dst"), (s, src_offset, src_stride, "src")):
        end = off + (nblocks - 1) * stride + blocklen
        if end > arr.size:
            raise ValueError(f"copy_blocks reaches element {end} of {name}, which has {arr.size}")
    # whole words when every block boundary, both base addresses and both sizes fall on one
    bounds = [v * item for v in (blocklen, dst_offset, dst_stride, src_offset, src_stride)]
    bounds += [_address(d), _address(s), d.size * item, s.size * item]
    word = next(w for w in _WORDS if all(b % w.itemsize == 0 for b in bounds))  # uint8 always fits

    def units(v: int) -> int:
        return v * item // word.itemsize

    bl = units(blocklen)
    _launch(_k.copy_blocks, nblocks * bl, stream, _as_words(d, word), _as_words(s, word), bl, nblocks * bl,
            units(dst_offset), units(dst_stride), units(src_offset), units(src_stride))
