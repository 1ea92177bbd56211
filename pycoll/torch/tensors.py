"""Torch tensors as the buffers pycoll moves (NumPy views of CPU tensors, CUDA views of GPU ones), and torch's ReduceOp as pycoll's ops."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist

from .. import ops as _ops
from ..datatypes import BFLOAT16
from ..errors import InvalidArgumentError

# torch dtype -> NumPy dtype of the same bits; bfloat16 goes through ml_dtypes, which NumPy lacks.
DTYPES: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}

_RED = dist.ReduceOp.RedOpType
OPS = {
    _RED.SUM: _ops.SUM,
    _RED.PRODUCT: _ops.PROD,
    _RED.MIN: _ops.MIN,
    _RED.MAX: _ops.MAX,
    _RED.AVG: _ops.AVG,
    _RED.BAND: _ops.BAND,
    _RED.BOR: _ops.BOR,
    _RED.BXOR: _ops.BXOR,
}


_CHOSEN: dict = {}  # (ReduceOp or RedOpType, as torch passed it; dtype) -> pycoll's op, for pairs that passed the checks below


def reduce_op(opname: str, op: Any, dtype: torch.dtype, rank: Optional[int] = None) -> _ops.Op:
    """pycoll's op for torch's ReduceOp on ``dtype``, or an error naming the operation and why not."""
    try:  # a ReduceOp hashes and compares by its kind, as its RedOpType does: either is a key as it comes
        return _CHOSEN[(op, dtype)]
    except (KeyError, TypeError):
        pass
    kind = getattr(op, "op", op)
    found = _reduce_op(opname, kind, dtype, rank)
    try:  # (a premultiplied sum, whose factor its hash leaves out, is refused above and never kept)
        _CHOSEN[(op, dtype)] = found
    except TypeError:
        pass
    return found


def _reduce_op(opname: str, kind: Any, dtype: torch.dtype, rank: Optional[int]) -> _ops.Op:
    found = OPS.get(kind)
    if found is None:
        raise InvalidArgumentError(f"ReduceOp {getattr(kind, 'name', kind)} is not supported by the pycoll backend", op=opname, rank=rank)
    if dtype == torch.bool and found in (_ops.SUM, _ops.MAX):  # torch's bool sum and max are logical or
        return _ops.LOR
    if dtype == torch.bool and found in (_ops.PROD, _ops.MIN):
        return _ops.LAND
    reason = found.check(DTYPES[dtype]) if dtype in DTYPES else None
    if reason:
        raise InvalidArgumentError(f"ReduceOp {kind.name} on {dtype}: {reason}", op=opname, rank=rank)
    return found


def check_tensor(opname: str, t: Any, what: str = "tensor", rank: Optional[int] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{what} is a {type(t).__name__}, not a torch.Tensor", op=opname, rank=rank)
    if t.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"{what} is on {t.device}; the pycoll backend takes CPU and CUDA tensors", op=opname, rank=rank)
    if t.dtype not in DTYPES:
        raise InvalidArgumentError(f"{what} has dtype {t.dtype}, which the pycoll backend does not carry", op=opname, rank=rank)
    if t.is_sparse or t.layout != torch.strided:
        raise InvalidArgumentError(f"{what} has layout {t.layout}; only dense (strided) tensors are supported", op=opname, rank=rank)
    return t


def same_dtype(opname: str, tensors: list[torch.Tensor], dtype: torch.dtype, rank: Optional[int] = None) -> None:
    for t in tensors:
        if t.dtype != dtype:
            raise InvalidArgumentError(f"tensors of dtypes {dtype} and {t.dtype} in one call", op=opname, rank=rank)


def same_device(opname: str, tensors: list[torch.Tensor], device: torch.device, rank: Optional[int] = None) -> None:
    """All tensors of one call on one device: CPU, or one GPU (pycoll, like NCCL, does not mix them)."""
    for t in tensors:
        if t.device != device:
            raise InvalidArgumentError(f"tensors on {device} and {t.device} in one call", op=opname, rank=rank)


# ---- CUDA tensors ------------------------------------------------------------------------------------------------
# The three functions below are the only places that touch the CUDA runtime; tests/torch_ranks/cuda_sim.py swaps
# them to run the device path on CPU tensors under numba's simulator.


def is_device(t: torch.Tensor) -> bool:
    """True for a CUDA tensor: it goes through pycoll's device-buffer path."""
    return t.is_cuda


def current_stream(device: torch.device) -> Any:
    """The caller's current stream on ``device``: pycoll queues its copies there (``stream=``)."""
    return torch.cuda.current_stream(device)


def device_scope(device: torch.device, stream: Any) -> ContextManager[Any]:
    """``device`` and ``stream`` current in this thread, for torch and for numba.cuda (pycoll's copies), which
    share the device's primary context: without it numba would take GPU 0's in a thread that never chose one."""
    from numba import cuda

    index = device.index if device.index is not None else torch.cuda.current_device()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(index))
    if stream is not None:
        stack.enter_context(torch.cuda.stream(stream))
    stack.enter_context(cuda.gpus[index])
    return stack


class CudaView:
    """A contiguous CUDA tensor's memory, flat, as ``__cuda_array_interface__`` (bfloat16 as its uint16 carrier).

    Built by hand rather than taken from torch: torch exports no bfloat16, and refuses tensors that require grad."""

    __slots__ = ("tensor", "_iface")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t  # keeps the memory alive while pycoll uses it
        carrier = np.dtype(np.uint16) if t.dtype == torch.bfloat16 else DTYPES[t.dtype]
        n = t.numel()
        self._iface = {"shape": (n,), "typestr": carrier.str, "data": (t.data_ptr() if n else 0, False),
                       "strides": None, "version": 3}

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self._iface


def buffer(t: torch.Tensor) -> Any:
    """The pycoll buffer argument for a contiguous tensor: a NumPy view (CPU) or a CUDA view with its datatype."""
    if not is_device(t):
        return array(t)
    view = CudaView(t.detach())
    return [view, BFLOAT16] if t.dtype == torch.bfloat16 else view


def vector(spec: Any, counts: list[int]) -> list[Any]:
    """``[buf, counts]`` for a buffer argument from ``buffer`` (``[view, counts, datatype]`` for a typed one)."""
    return [spec[0], counts, spec[1]] if isinstance(spec, list) else [spec, counts]


class Placement:
    """Where one call's tensors live: the CPU, or a GPU with the caller's current stream on it."""

    __slots__ = ("device", "stream", "cuda")

    def __init__(self, t: torch.Tensor) -> None:
        self.device = t.device
        self.cuda = is_device(t)
        self.stream = current_stream(t.device) if self.cuda else None

    def scope(self) -> ContextManager[Any]:
        return device_scope(self.device, self.stream) if self.cuda else contextlib.nullcontext()

    def synchronize(self) -> None:
        """Wait for the device copies queued on the caller's stream (a result is complete when its Work is)."""
        if self.stream is not None:
            self.stream.synchronize()


_PLAIN = frozenset(d for d in DTYPES if d not in (torch.bfloat16, torch.bool))


def array(t: torch.Tensor) -> np.ndarray:
    """A flat NumPy view of a contiguous CPU tensor's memory (no copy)."""
    t = t.detach()
    if t.dtype in _PLAIN:
        return t.numpy().reshape(-1) if t.dim() != 1 else t.numpy()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().reshape(-1).view(ml_dtypes.bfloat16)
    if t.dtype == torch.bool:
        return t.view(torch.uint8).numpy().reshape(-1).view(np.bool_)
    return t.numpy().reshape(-1)


class _Memory:
    """A raw address range as NumPy sees one (``__array_interface__``): a view made from it holds no tensor."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, nbytes: int) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


_VIEWS: dict[tuple[int, int, torch.dtype], np.ndarray] = {}
_VIEWS_KEPT = 64


def call_view(t: torch.Tensor) -> np.ndarray:
    """A flat NumPy view of a contiguous CPU tensor's memory for one blocking call that holds ``t`` throughout.

    The view is kept by the tensor's address, size and dtype and holds no reference to the tensor (so a bucket
    or parameter that a program passes call after call meets pycoll's caches as the same array, as a reused NumPy
    array does), which makes it valid only while some tensor owns exactly that memory: never keep it past the call.
    """
    address, nbytes, dtype = t.data_ptr(), t.nbytes, t.dtype
    key = (address, nbytes, dtype)
    view = _VIEWS.get(key)
    if view is None:
        if not nbytes:
            return array(t)
        if len(_VIEWS) >= _VIEWS_KEPT:
            _VIEWS.clear()
        view = _VIEWS[key] = np.asarray(_Memory(address, nbytes)).view(DTYPES[dtype])
    return view


class Staged:
    """A tensor's flat buffer for pycoll: the tensor's own memory when contiguous, else a copy put back on ``done``.

    ``arr`` is a NumPy view for a CPU tensor, a CUDA view (see ``buffer``) for a GPU one; ``host`` asks for the
    NumPy view of a tensor known to be in host memory (point-to-point, which takes host buffers only)."""

    __slots__ = ("tensor", "arr", "copy")

    def __init__(self, t: torch.Tensor, load: bool = True, host: bool = False) -> None:
        self.tensor = t
        self.copy: Optional[torch.Tensor] = None
        view = array if host else buffer
        if t.is_contiguous():
            self.arr = view(t)
        else:
            self.copy = t.detach().contiguous() if load else torch.empty(t.shape, dtype=t.dtype, device=t.device)
            self.arr = view(self.copy)

    def done(self) -> None:
        if self.copy is not None:
            with torch.no_grad():
                self.tensor.copy_(self.copy)


def huge_page_tensors() -> Optional[bool]:
    """Whether torch's CPU allocator advises huge pages for a new 2 MiB tensor (``THP_MEM_ALLOC_ENABLE``, which
    ``import pycoll.torch`` sets where unset; torch reads it at its first allocation, so a tensor made before that
    import decides): the kernel's flags on the tensor's mapping say. None where ``/proc/self/smaps`` is unreadable."""
    probe = torch.empty(2 << 20, dtype=torch.uint8)  # never touched: no page is faulted in
    return _advised_huge(probe.data_ptr())


def _advised_huge(address: int) -> Optional[bool]:
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and head == "VmFlags:":
                    return "hg" in line.split()
    except OSError:
        return None
    return False


def flat_concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One new contiguous 1-D tensor holding ``tensors`` one after another, where they live (CPU or GPU)."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def flat_empty(count: int, like: torch.Tensor) -> torch.Tensor:
    """A new 1-D tensor of ``count`` elements with ``like``'s dtype and device (contents undefined)."""
    return torch.empty(count, dtype=like.dtype, device=like.device)


def split_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of the 1-D ``flat`` into ``tensors`` (each keeps its shape), on their device."""
    at = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[at:at + n].reshape(t.shape))
            at += n


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def is_own_block(block: torch.Tensor, whole: torch.Tensor, rank: int) -> bool:
    """Whether ``block`` is exactly rank ``rank``'s block of ``whole`` (same memory, both contiguous)."""
    return (block.numel() > 0 and block.is_contiguous() and whole.is_contiguous() and block.device == whole.device
            and block.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
            and block.data_ptr() == whole.data_ptr() + rank * block.numel() * block.element_size())
