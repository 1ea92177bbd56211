"""Horovod's PyTorch API, the tensor calls (``pycoll.horovod.torch`` re-exports them, with ``processes``' calls and
the optimizer).

Every operation is a named request to the process set's engine (``pycoll.horovod.engine``), which negotiates it
across ranks, fuses allreduces and runs them on pycoll. Tensors on the CPU are used in place; CUDA tensors are
staged through host memory. Horovod's async forms return an integer handle for ``poll`` and ``synchronize``.
"""

from __future__ import annotations

import itertools
import pickle
import warnings
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ...errors import InvalidArgumentError, NotProvidedError
from ...torch.tensors import DTYPES, array, check_tensor
from ..engine import Engine
from ..submissions import Request
from .compression import Compression
from .processes import HANDLES, ProcessSet, current_state, global_process_set, new_handle, synchronize, wait_requests

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather", "allgather_async", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "barrier", "join",
    "broadcast_object", "allgather_object",
]

# Horovod's reduction ops (its C enum's values).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Sum: "sum", Average: "sum", Min: "min", Max: "max", Product: "product"}
_noname = {k: itertools.count() for k in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")}


def _host_array(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a contiguous CPU tensor, in its shape (the backend's flat view, reshaped: no copy)."""
    return array(t).reshape(t.shape)


# dtypes whose CPU tensors torch views as NumPy arrays itself (bfloat16 goes through the backend's view)
_NUMPY_DTYPES = frozenset(d for d in DTYPES if d is not torch.bfloat16)


class _Staged:
    """A tensor as the engine sees it: its own memory if a contiguous CPU tensor, else a contiguous host copy whose
    result is put back (``back``)."""

    def __init__(self, t: torch.Tensor, op: str) -> None:
        if type(t) is torch.Tensor and t.is_cpu and t.dtype in _NUMPY_DTYPES and t.layout is torch.strided \
                and not t.requires_grad and t.is_contiguous():  # a gradient: its own memory, viewed at once
            self.tensor = self.host = t
            self.own = True
            self.array = t.numpy()
            return
        self.tensor = check_tensor(op, t)
        own = t.device.type == "cpu" and t.is_contiguous()
        self.host = t.detach() if own else t.detach().to("cpu", memory_format=torch.contiguous_format).contiguous()
        self.own = own
        self.array = _host_array(self.host)

    def back(self, result: torch.Tensor) -> torch.Tensor:
        """``result`` (a host tensor) where the caller's tensor lives."""
        return result if self.tensor.device.type == "cpu" else result.to(self.tensor.device)

    def put_back(self) -> torch.Tensor:
        """For an in-place call: the host copy's result written into the caller's tensor."""
        if not self.own:
            with torch.no_grad():
                self.tensor.copy_(self.host)
        return self.tensor


def _engine_of(process_set: ProcessSet, op: str) -> Engine:
    current_state()
    return process_set._engine(op)


def _op(op: Optional[int], average: Optional[bool], default: int, where: str) -> int:
    if average is not None:
        warnings.warn("the average argument is deprecated; use op=hvd.Average or op=hvd.Sum", DeprecationWarning,
                      stacklevel=3)
        if op is not None:
            raise ValueError("the op and average arguments cannot both be given")
        op = Average if average else Sum
    op = default if op is None else op
    if op == Adasum:
        raise NotProvidedError("Adasum is not built in pycoll; use hvd.Average or hvd.Sum", op=where)
    if op not in _OP_NAMES:
        raise InvalidArgumentError(f"unknown reduction op {op!r}", op=where)
    return op


def _name(kind: str, name: Optional[str]) -> str:
    return name if name is not None else f"{kind}.noname.{next(_noname[kind])}"


def _allreduce_request(tensor: torch.Tensor, name: str, op: int, prescale: float, postscale: float, engine: Engine,
                       in_place: bool, where: str) -> tuple[Request, Any]:
    staged = _Staged(tensor, where)
    if op == Average:
        postscale = postscale / engine.size
    if in_place:
        out = staged.array
        finish = lambda result: staged.put_back()  # noqa: E731
    else:
        result_t = torch.empty_like(staged.host, memory_format=torch.contiguous_format)
        out = _host_array(result_t)
        finish = lambda result: staged.back(result_t)  # noqa: E731
    req = Request(name=name, kind="allreduce", array=staged.array, out=out, op=_OP_NAMES[op],
                  prescale=float(prescale), postscale=float(postscale))
    return req, finish


def _allreduce_async(tensor: torch.Tensor, average: Optional[bool], name: Optional[str], op: Optional[int],
                     prescale_factor: float, postscale_factor: float, process_set: ProcessSet, in_place: bool) -> int:
    where = "allreduce_async_" if in_place else "allreduce_async"
    op = _op(op, average, Average, where)
    engine = _engine_of(process_set, where)
    req, finish = _allreduce_request(tensor, _name("allreduce", name), op, prescale_factor, postscale_factor, engine,
                                     in_place, where)
    engine.submit(req)
    return new_handle([req], lambda results: finish(results[0]))


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an allreduce of ``tensor`` into a new tensor (``op``: Average by default); a handle."""
    return _allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set, False)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place allreduce of ``tensor``; a handle."""
    return _allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set, True)


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Optional[int] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """The allreduce of ``tensor`` over the process set, as a new tensor (``compression`` applied around it)."""
    compressed, ctx = compression.compress(tensor)
    out = synchronize(allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor, process_set))
    return compression.decompress(out, ctx)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce of ``tensor``; the tensor."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def _grouped(tensors: Sequence[torch.Tensor], average: Optional[bool], name: Optional[str], op: Optional[int],
             prescale_factor: float, postscale_factor: float, process_set: ProcessSet, in_place: bool) -> int:
    where = "grouped_allreduce_async_" if in_place else "grouped_allreduce_async"
    op = _op(op, average, Average, where)
    engine = _engine_of(process_set, where)
    base = _name("allreduce", name)
    pairs = [_allreduce_request(t, f"{base}.{i}", op, prescale_factor, postscale_factor, engine, in_place, where)
             for i, t in enumerate(tensors)]
    with engine.loop.cond:  # one submission: the group negotiates in one cycle and is fused together
        for req, _ in pairs:
            engine.submit(req)
    return new_handle([req for req, _ in pairs], lambda results: [f(r) for (_, f), r in zip(pairs, results)])


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[int] = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor, process_set, False)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[int] = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor, process_set, True)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                      compression: Any = Compression.none, op: Optional[int] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list:
    pairs = [compression.compress(t) for t in tensors]
    outs = synchronize(grouped_allreduce_async([c for c, _ in pairs], average, name, op, prescale_factor,
                                               postscale_factor, process_set))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                       op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start gathering every rank's ``tensor`` along the first dimension (its length may differ by rank)."""
    engine = _engine_of(process_set, "allgather_async")
    staged = _Staged(tensor if tensor.dim() else tensor.reshape(1), "allgather_async")
    req = engine.submit(Request(name=_name("allgather", name), kind="allgather", array=staged.array,
                                extra=int(staged.array.shape[0])))

    def finish(results: list) -> torch.Tensor:
        out, _ = results[0]
        return staged.back(_tensor_of(out, tensor.dtype))

    return new_handle([req], finish)


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(allgather_async(tensor, name, process_set))


def _tensor_of(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor over a NumPy result, of ``dtype`` (bfloat16 and bool came as integer views)."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str], process_set: ProcessSet,
                     in_place: bool) -> int:
    where = "broadcast_async_" if in_place else "broadcast_async"
    engine = _engine_of(process_set, where)
    if not isinstance(root_rank, int) or not 0 <= root_rank < engine.size:
        raise InvalidArgumentError(f"root_rank {root_rank!r} is not a rank of the {engine.size} in the set", op=where)
    staged = _Staged(tensor, where)
    if in_place:
        out, finish = staged.array, (lambda result: staged.put_back())
    else:
        result_t = staged.host.clone(memory_format=torch.contiguous_format)
        out, finish = _host_array(result_t), (lambda result: staged.back(result_t))
    req = engine.submit(Request(name=_name("broadcast", name), kind="broadcast", array=staged.array, out=out,
                                root=root_rank))
    return new_handle([req], lambda results: finish(results[0]))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    return _broadcast_async(tensor, root_rank, name, process_set, False)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> int:
    return _broadcast_async(tensor, root_rank, name, process_set, True)


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``root_rank``'s ``tensor``, as a new tensor on every rank."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``tensor`` overwritten with ``root_rank``'s."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start sending ``splits[i]`` rows of ``tensor`` (in order) to rank ``i`` (equal parts when None)."""
    engine = _engine_of(process_set, "alltoall_async")
    t = check_tensor("alltoall_async", tensor)
    if t.dim() == 0:
        raise InvalidArgumentError("alltoall takes a tensor of at least one dimension", op="alltoall_async")
    first = int(t.shape[0])
    if splits is None:
        if first % engine.size:
            raise InvalidArgumentError(f"the first dimension ({first}) does not divide into {engine.size} equal parts; "
                                       "give splits", op="alltoall_async")
        parts = [first // engine.size] * engine.size
    else:
        parts = [int(k) for k in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(parts) != engine.size or any(k < 0 for k in parts) or sum(parts) != first:
            raise InvalidArgumentError(f"splits {parts} must be {engine.size} counts, none negative, summing to the "
                                       f"first dimension ({first})", op="alltoall_async")
    staged = _Staged(t, "alltoall_async")
    req = engine.submit(Request(name=_name("alltoall", name), kind="alltoall", array=staged.array, extra=tuple(parts)))

    def finish(results: list) -> tuple[torch.Tensor, torch.Tensor]:
        out, received = results[0]
        return staged.back(_tensor_of(out, t.dtype)), torch.tensor(received, dtype=torch.int32)

    return new_handle([req], finish)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows every rank sent this one, in rank order; how many came from each rank)."""
    return synchronize(alltoall_async(tensor, splits, name, process_set))


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Optional[int] = None,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` over the set and scattering its rows: rank ``i`` gets part ``i`` (the first ranks
    one row more where they do not divide evenly)."""
    op = _op(op, None, Average, "reducescatter_async")
    engine = _engine_of(process_set, "reducescatter_async")
    t = check_tensor("reducescatter_async", tensor)
    if t.dim() == 0:
        raise InvalidArgumentError("reducescatter takes a tensor of at least one dimension", op="reducescatter_async")
    staged = _Staged(t, "reducescatter_async")
    postscale = postscale_factor / engine.size if op == Average else postscale_factor
    req = engine.submit(Request(name=_name("reducescatter", name), kind="reducescatter", array=staged.array,
                                op=_OP_NAMES[op], prescale=float(prescale_factor), postscale=float(postscale)))
    return new_handle([req], lambda results: staged.back(_tensor_of(results[0], t.dtype)))


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression: Any = Compression.none,
                  op: Optional[int] = None, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    compressed, ctx = compression.compress(tensor)
    out = synchronize(reducescatter_async(compressed, name, op, process_set, prescale_factor, postscale_factor))
    return compression.decompress(out, ctx)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the set has called barrier."""
    wait_requests([_engine_of(process_set, "barrier").submit(Request(name="barrier", kind="barrier"))])


def join(device: int = -1) -> int:
    """This rank is out of data: it takes part in the others' allreduces with values that change nothing until
    every rank has joined; the rank that joined last."""
    return int(wait_requests([current_state().engine.join()])[0])


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``obj`` (pickled) on every rank of the set."""
    name = name or type(obj).__name__
    engine = _engine_of(process_set, "broadcast_object")
    payload = pickle.dumps(obj) if engine.rank == root_rank else b""
    length = broadcast_(torch.tensor([len(payload)], dtype=torch.int64), root_rank, f"{name}.sz", process_set)
    data = torch.zeros(int(length[0]), dtype=torch.uint8)
    if engine.rank == root_rank:
        data.numpy()[:] = np.frombuffer(payload, np.uint8)
    broadcast_(data, root_rank, f"{name}.t", process_set)
    return obj if engine.rank == root_rank else pickle.loads(data.numpy().tobytes())


def allgather_object(obj: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> list:
    """Every rank's ``obj`` (pickled), in rank order."""
    name = name or type(obj).__name__
    engine = _engine_of(process_set, "allgather_object")
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    handle = allgather_async(torch.from_numpy(payload.copy()), f"{name}.t", process_set)
    reqs = HANDLES[handle][0]
    _, firsts = wait_requests(reqs)[0]
    data = synchronize(handle).numpy()
    out, off = [], 0
    for n in firsts:
        out.append(pickle.loads(data[off:off + n].tobytes()))
        off += n
    assert len(out) == engine.size
    return out
