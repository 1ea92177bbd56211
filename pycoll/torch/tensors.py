"""Torch tensors as the NumPy arrays pycoll moves, and torch's ReduceOp as pycoll's ops."""

from __future__ import annotations

from typing import Any, Optional

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist

from .. import ops as _ops
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


def reduce_op(opname: str, op: Any, dtype: torch.dtype, rank: Optional[int] = None) -> _ops.Op:
    """pycoll's op for torch's ReduceOp on ``dtype``, or an error naming the operation and why not."""
    kind = getattr(op, "op", op)
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
    if t.device.type != "cpu":
        raise InvalidArgumentError(f"{what} is on {t.device}; the pycoll backend takes CPU tensors (the GPU path is not there yet)", op=opname, rank=rank)
    if t.dtype not in DTYPES:
        raise InvalidArgumentError(f"{what} has dtype {t.dtype}, which the pycoll backend does not carry", op=opname, rank=rank)
    if t.is_sparse or t.layout != torch.strided:
        raise InvalidArgumentError(f"{what} has layout {t.layout}; only dense (strided) tensors are supported", op=opname, rank=rank)
    return t


def same_dtype(opname: str, tensors: list[torch.Tensor], dtype: torch.dtype, rank: Optional[int] = None) -> None:
    for t in tensors:
        if t.dtype != dtype:
            raise InvalidArgumentError(f"tensors of dtypes {dtype} and {t.dtype} in one call", op=opname, rank=rank)


def array(t: torch.Tensor) -> np.ndarray:
    """A flat NumPy view of a contiguous CPU tensor's memory (no copy)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().reshape(-1).view(ml_dtypes.bfloat16)
    if t.dtype == torch.bool:
        return t.view(torch.uint8).numpy().reshape(-1).view(np.bool_)
    return t.numpy().reshape(-1)


class Staged:
    """A tensor's flat array for pycoll: the tensor's own memory when contiguous, else a copy put back on ``done``."""

    __slots__ = ("tensor", "arr", "copy")

    def __init__(self, t: torch.Tensor, load: bool = True) -> None:
        self.tensor = t
        self.copy: Optional[torch.Tensor] = None
        if t.is_contiguous():
            self.arr = array(t)
        else:
            self.copy = t.detach().contiguous() if load else torch.empty(t.shape, dtype=t.dtype)
            self.arr = array(self.copy)

    def done(self) -> None:
        if self.copy is not None:
            with torch.no_grad():
                self.tensor.copy_(self.copy)


def flat_concat(tensors: list[torch.Tensor]) -> np.ndarray:
    """One new contiguous array holding ``tensors`` one after another."""
    if not tensors:
        return np.empty(0, np.uint8)
    return array(torch.cat([t.detach().reshape(-1) for t in tensors]))


def split_into(flat: np.ndarray, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``tensors`` (each keeps its shape)."""
    at = 0
    for t in tensors:
        n = t.numel()
        src = flat[at:at + n]
        at += n
        if t.is_contiguous():
            np.copyto(array(t), src)
        else:
            with torch.no_grad():
                t.copy_(_tensor_of(src, t.dtype).reshape(t.shape))


def _tensor_of(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    if dtype == torch.bool:
        return torch.from_numpy(arr.view(np.uint8)).view(torch.bool)
    return torch.from_numpy(arr)
