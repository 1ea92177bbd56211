"""``ProcessGroupPycoll``: torch.distributed's operations on CPU and CUDA tensors, carried by pycoll communicators."""

from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from .. import runtime as _runtime
from ..bootstrap.rendezvous import from_torch_store
from ..buffers import IN_PLACE
from ..comm import Comm, group_comm
from ..errors import InvalidArgumentError
from ..p2p import ANY_SOURCE
from ..request import Request, Status
from . import tensors as T
from .progress import Job, ProgressThread

log = logging.getLogger("pycoll.torch")

BACKEND = "pycoll"
INLINE_BYTES = 1 << 20  # host calls below this size run in the caller's thread when nothing is in flight
EVERY_SIZE = 1 << 62  # the inline limit where the machine's ranks have at most a core each (``_share_cores``)
_inline_bytes = [INLINE_BYTES]

_lock = threading.Lock()
_progress: Optional[ProgressThread] = None


def _progress_thread(rt: _runtime.Runtime) -> ProgressThread:
    global _progress
    with _lock:
        if _progress is None:
            _progress = ProgressThread(rt.engine)
        return _progress


class PycollWork(dist.Work):
    """The handle of one operation: ``wait()`` blocks until it completes (raising its error), ``get_future()``
    gives a ``torch.futures.Future`` whose value is the operation's output tensors, as with gloo."""

    def __init__(self, future: Future, source: Optional[Callable[[], int]] = None) -> None:
        super().__init__()
        self._future = future
        self._source = source

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        self._future.wait()  # raises the operation's error
        return True

    def get_future(self) -> Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True

    def exception(self) -> Optional[BaseException]:
        if not self._future.done():
            return None
        try:
            self._future.value()
        except Exception as exc:
            return exc
        return None

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._future.value()

    def _source_rank(self) -> int:
        self.wait()
        if self._source is None:
            raise RuntimeError("source rank is only known for a receive from any source")
        return self._source()

    source_rank = _source_rank


class _DoneWork(dist.Work):
    """The handle of a call that completed before it was returned (run inline): its future is made if asked for."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        return True

    def get_future(self) -> Future:
        fut: Future = Future()
        fut.set_result(self._result)
        return fut

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Optional[BaseException]:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._result


class ProcessGroupPycoll(dist.ProcessGroup):
    """A torch.distributed process group whose operations run on a pycoll communicator.

    Every operation is checked in the caller's thread (a bad dtype, op or device raises at once, naming
    the operation), then runs on pycoll's progress thread; with ``async_op=True`` the caller gets a
    ``PycollWork`` back at once, so DDP's bucketed allreduces overlap the backward pass.
    """

    def __init__(self, comm: Comm, progress: ProgressThread, timeout: float) -> None:
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self._progress = progress
        self._timeout = timeout
        self._coalescing: Optional[list[Future]] = None
        self._group_name = ""
        self._group_desc = ""

    def getBackendName(self) -> str:  # noqa: N802
        return BACKEND

    # torch keeps a group's name in the backends it registers for each device; a process group written in Python
    # has none, so it keeps its own. With a name, torch can resolve the group from it: DeviceMesh, DTensor, the
    # functional collectives (and so FSDP2) and destroy_process_group(group) all do.
    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    @property
    def name(self) -> str:  # type: ignore[override]
        return BACKEND

    def __repr__(self) -> str:
        return f"ProcessGroupPycoll(rank={self.comm.rank}, size={self.comm.size})"

    # ---- plumbing ---------------------------------------------------------------------------
    def _submit(self, name: str, start: Callable[[], list[Request]], finish: Callable[[], Any],
                source: Optional[Callable[[], int]] = None, at: Optional[T.Placement] = None,
                blocking: Optional[Callable[[], None]] = None, nbytes: int = -1, opts: Any = None) -> PycollWork:
        """Queue the call for the progress thread: ``start`` posts it nonblocking, ``blocking`` (host tensors only)
        is the same call made blocking, which the thread prefers when nothing else is in flight. A call of
        ``nbytes`` under the inline limit (INLINE_BYTES, or EVERY_SIZE without a spare core) runs that way at once
        in the caller's thread when nothing is in flight: blocking it that long costs less than the hop to the thread and back. So does a call of any size whose
        caller waits for it at once (``opts.asyncOp`` False: torch's ``async_op=False``)."""
        if at is not None and at.cuda:
            blocking = None
        if blocking is not None and _runs_inline(nbytes, opts) and self._coalescing is None:
            job = Job(name, start, finish, self._timeout, None, blocking)
            if self._progress.run_inline(job):
                return PycollWork(job.future, source)
        scope = None
        if at is not None and at.cuda:  # the result is on the device, in the caller's stream, when the Work completes
            done = finish
            scope = at.scope

            def finish() -> Any:
                out = done()
                at.synchronize()
                return out

        fut = self._progress.submit(Job(name, start, finish, self._timeout, scope, blocking))
        if self._coalescing is not None:
            self._coalescing.append(fut)
        return PycollWork(fut, source)

    def _tensor(self, name: str, t: Any, what: str = "tensor") -> torch.Tensor:
        return T.check_tensor(name, t, what, self.comm.rank)

    def _op(self, name: str, op: Any, dtype: torch.dtype) -> Any:
        return T.reduce_op(name, op, dtype, self.comm.rank)

    def _dtypes(self, name: str, tensors: list[torch.Tensor], dtype: torch.dtype) -> None:
        T.same_dtype(name, tensors, dtype, self.comm.rank)

    def _place(self, name: str, tensors: list[torch.Tensor]) -> T.Placement:
        """Where the call's tensors are (all on one device), with the caller's stream for a GPU."""
        T.same_device(name, tensors, tensors[0].device, self.comm.rank)
        return T.Placement(tensors[0])

    def _one(self, name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        if len(tensors) != 1:
            raise InvalidArgumentError(f"takes one tensor per call, got {len(tensors)}", op=name, rank=self.comm.rank)
        return self._tensor(name, tensors[0])

    def _root(self, name: str, root: int) -> int:
        if not 0 <= root < self.comm.size:
            raise InvalidArgumentError(f"root {root} is not a rank of this {self.comm.size}-rank group", op=name, rank=self.comm.rank)
        return root

    def _checked_list(self, name: str, tensors: list[torch.Tensor], dtype: torch.dtype, what: str) -> list[torch.Tensor]:
        if len(tensors) != self.comm.size:
            raise InvalidArgumentError(f"{what} has {len(tensors)} tensors, not one per rank ({self.comm.size})", op=name, rank=self.comm.rank)
        for t in tensors:
            self._tensor(name, t, what)
        self._dtypes(name, tensors, dtype)
        return tensors

    # ---- reductions -------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> PycollWork:
        name = "allreduce"
        if len(tensors) == 1 and isinstance(tensors[0], torch.Tensor) and tensors[0].layout == torch.sparse_coo:
            return self._sparse_allreduce(name, tensors, (opts or dist.AllreduceOptions()).reduceOp)
        t = self._one(name, tensors)
        op = self._op(name, (opts or dist.AllreduceOptions()).reduceOp, t.dtype)
        if not T.is_device(t) and t.is_contiguous() and _runs_inline(_nbytes(t), opts):  # the common host call
            arr = T.array(t)
            if self._progress.run_now(lambda: self.comm.Allreduce(IN_PLACE, arr, op)):
                return _DoneWork(tensors)
        at = self._place(name, [t])
        buf = T.Staged(t)
        return self._submit(name, lambda: [self.comm.Iallreduce(IN_PLACE, buf.arr, op, stream=at.stream)],
                            lambda: (buf.done(), tensors)[1], at=at,
                            blocking=lambda: self.comm.Allreduce(IN_PLACE, buf.arr, op), nbytes=_nbytes(t), opts=opts)

    def _sparse_allreduce(self, name: str, tensors: list[torch.Tensor], op: Any) -> PycollWork:
        """A sparse (COO) sum as gloo does it: every rank gathers every rank's indices and values, in rank order, and
        sums the duplicates (coalesce); the input tensor becomes the coalesced sum, the same bits on every rank."""
        t = tensors[0]
        if op != dist.ReduceOp.SUM:
            raise InvalidArgumentError(f"sparse tensors are reduced with SUM only, not {op}", op=name, rank=self.comm.rank)
        if t.device.type != "cpu":
            raise InvalidArgumentError(f"sparse tensors are reduced on the CPU; this one is on {t.device}", op=name,
                                       rank=self.comm.rank)
        mine = t.coalesce()
        indices = mine.indices().t().contiguous()  # (nnz, sparse dims): one rank's rows are contiguous
        values = mine.values().contiguous()
        row_values = int(np.prod(values.shape[1:], dtype=np.int64))  # elements per index (dense dimensions)
        nnz = np.array([indices.shape[0]], np.int64)
        nnz_all = np.zeros(self.comm.size, np.int64)

        def finish() -> list[torch.Tensor]:
            comm, sparse_dims = self.comm, indices.shape[1]
            counts = [int(k) for k in nnz_all]
            all_indices = np.empty((sum(counts), sparse_dims), np.int64)
            comm.Allgatherv(indices.numpy(), [all_indices, [k * sparse_dims for k in counts]])
            value_bytes = values.view(torch.uint8).numpy().reshape(-1) if values.numel() else np.empty(0, np.uint8)
            row_bytes = row_values * values.element_size()
            all_values = np.empty(sum(counts) * row_bytes, np.uint8)
            comm.Allgatherv(value_bytes, [all_values, [k * row_bytes for k in counts]])
            gathered = torch.from_numpy(all_values).view(values.dtype).reshape(sum(counts), *values.shape[1:])
            total = torch.sparse_coo_tensor(torch.from_numpy(all_indices).t(), gathered, t.shape).coalesce()
            with torch.no_grad():
                t.copy_(total)
            return tensors

        return self._submit(name, lambda: [self.comm.Iallgather(nnz, nnz_all)], finish)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> PycollWork:
        name = "allreduce_coalesced"
        if not tensors:
            return self._submit(name, lambda: [], lambda: tensors)
        for t in tensors:
            self._tensor(name, t)
        self._dtypes(name, tensors, tensors[0].dtype)
        op = self._op(name, (opts or dist.AllreduceCoalescedOptions()).reduceOp, tensors[0].dtype)
        at = self._place(name, tensors)
        flat = T.flat_concat(tensors)
        return self._submit(name, lambda: [self.comm.Iallreduce(IN_PLACE, T.buffer(flat), op, stream=at.stream)],
                            lambda: (T.split_into(flat, tensors), tensors)[1], at=at)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> PycollWork:
        name = "reduce"
        t = self._one(name, tensors)
        opts = opts or dist.ReduceOptions()
        root = self._root(name, opts.rootRank)
        op = self._op(name, opts.reduceOp, t.dtype)
        at = self._place(name, [t])
        buf = T.Staged(t)
        if self.comm.rank == root:
            start = lambda: [self.comm.Ireduce(IN_PLACE, buf.arr, op, root, stream=at.stream)]  # noqa: E731
        else:
            start = lambda: [self.comm.Ireduce(buf.arr, None, op, root, stream=at.stream)]  # noqa: E731
        return self._submit(name, start, lambda: (buf.done(), tensors)[1], at=at)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> PycollWork:
        name = "reduce_scatter"
        out = self._one(name, outputs)
        if len(inputs) != 1:
            raise InvalidArgumentError(f"takes one input list, got {len(inputs)}", op=name, rank=self.comm.rank)
        parts = self._checked_list(name, inputs[0], out.dtype, "input_list")
        if parts[self.comm.rank].numel() != out.numel():
            raise InvalidArgumentError(
                f"output has {out.numel()} elements, input_list[{self.comm.rank}] {parts[self.comm.rank].numel()}", op=name, rank=self.comm.rank
            )
        op = self._op(name, (opts or dist.ReduceScatterOptions()).reduceOp, out.dtype)
        at = self._place(name, [out, *parts])
        send = T.flat_concat(parts)
        counts = [p.numel() for p in parts]
        buf = T.Staged(out, load=False)
        return self._submit(name, lambda: [self.comm.Ireduce_scatter(T.buffer(send), buf.arr, counts, op, stream=at.stream)],
                            lambda: (buf.done(), outputs)[1], at=at)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> PycollWork:  # noqa: A002
        name = "reduce_scatter_tensor"
        self._tensor(name, output, "output")
        self._tensor(name, input, "input")
        self._dtypes(name, [input], output.dtype)
        if input.numel() != output.numel() * self.comm.size:
            raise InvalidArgumentError(
                f"input has {input.numel()} elements, not {self.comm.size} x output's {output.numel()}", op=name, rank=self.comm.rank
            )
        op = self._op(name, (opts or dist.ReduceScatterOptions()).reduceOp, output.dtype)
        at = self._place(name, [output, input])
        send, buf = T.Staged(input), T.Staged(output, load=False)
        return self._submit(name, lambda: [self.comm.Ireduce_scatter_block(send.arr, buf.arr, op, stream=at.stream)],
                            lambda: (buf.done(), [output])[1], at=at,
                            blocking=lambda: self.comm.Reduce_scatter_block(send.arr, buf.arr, op), nbytes=_nbytes(input),
                            opts=opts)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> PycollWork:
        return self._each("reduce_scatter_tensor_coalesced", outputs, inputs, lambda o, i: self.reduce_scatter_single(o, i, opts))

    # ---- data movement ----------------------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> PycollWork:
        name = "broadcast"
        t = self._one(name, tensors)
        root = self._root(name, (opts or dist.BroadcastOptions()).rootRank)
        at = self._place(name, [t])
        buf = T.Staged(t)
        return self._submit(name, lambda: [self.comm.Ibcast(buf.arr, root, stream=at.stream)],
                            lambda: (buf.done(), tensors)[1], at=at, blocking=lambda: self.comm.Bcast(buf.arr, root),
                            nbytes=_nbytes(t), opts=opts)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> PycollWork:
        name = "all_gather"
        t = self._one(name, inputs)
        if len(outputs) != 1:
            raise InvalidArgumentError(f"takes one output list, got {len(outputs)}", op=name, rank=self.comm.rank)
        outs = self._checked_list(name, outputs[0], t.dtype, "tensor_list")
        counts = [o.numel() for o in outs]
        if counts[self.comm.rank] != t.numel():
            raise InvalidArgumentError(
                f"tensor has {t.numel()} elements, tensor_list[{self.comm.rank}] {counts[self.comm.rank]}", op=name, rank=self.comm.rank
            )
        at = self._place(name, [t, *outs])
        send = T.Staged(t)
        recv = T.flat_empty(sum(counts), t)
        if len(set(counts)) == 1:
            start = lambda: [self.comm.Iallgather(send.arr, T.buffer(recv), stream=at.stream)]  # noqa: E731
        else:
            start = lambda: [self.comm.Iallgatherv(send.arr, T.vector(T.buffer(recv), counts), stream=at.stream)]  # noqa: E731
        return self._submit(name, start, lambda: (T.split_into(recv, outs), outputs)[1], at=at)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> PycollWork:  # noqa: A002
        name = "all_gather_into_tensor"
        self._tensor(name, output, "output")
        self._tensor(name, input, "input")
        self._dtypes(name, [input], output.dtype)
        if output.numel() != input.numel() * self.comm.size:
            raise InvalidArgumentError(
                f"output has {output.numel()} elements, not {self.comm.size} x input's {input.numel()}", op=name, rank=self.comm.rank
            )
        at = self._place(name, [output, input])
        if _is_own_block(input, output, self.comm.rank):  # FSDP2 gathers from its slice of the output: in place
            whole = T.Staged(output)
            return self._submit(name, lambda: [self.comm.Iallgather(IN_PLACE, whole.arr, stream=at.stream)],
                                lambda: (whole.done(), [output])[1], at=at,
                                blocking=lambda: self.comm.Allgather(IN_PLACE, whole.arr), nbytes=_nbytes(output), opts=opts)
        send, buf = T.Staged(input), T.Staged(output, load=False)
        return self._submit(name, lambda: [self.comm.Iallgather(send.arr, buf.arr, stream=at.stream)],
                            lambda: (buf.done(), [output])[1], at=at, blocking=lambda: self.comm.Allgather(send.arr, buf.arr),
                            nbytes=_nbytes(output), opts=opts)

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> PycollWork:
        """torch's layout: ``outputs[rank][k]`` receives rank ``rank``'s ``inputs[k]``."""
        name = "all_gather_coalesced"
        if len(outputs) != self.comm.size:
            raise InvalidArgumentError(f"output_tensor_lists has {len(outputs)} lists, not one per rank ({self.comm.size})",
                                       op=name, rank=self.comm.rank)
        for q, row in enumerate(outputs):
            if len(row) != len(inputs):
                raise InvalidArgumentError(f"output_tensor_lists[{q}] has {len(row)} tensors for {len(inputs)} inputs",
                                           op=name, rank=self.comm.rank)
        per_input = [[row[k] for row in outputs] for k in range(len(inputs))]
        works = [self.allgather([per_input[k]], [t], opts) for k, t in enumerate(inputs)]
        return PycollWork(_all_of([w.get_future() for w in works], outputs))

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> PycollWork:
        return self._each("all_gather_into_tensor_coalesced", outputs, inputs, lambda o, i: self.all_gather_single(o, i, opts))

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> PycollWork:
        name = "gather"
        t = self._one(name, inputs)
        root = self._root(name, (opts or dist.GatherOptions()).rootRank)
        at = self._place(name, [t])
        send = T.Staged(t)
        if self.comm.rank != root:
            if outputs and any(outputs):
                raise InvalidArgumentError("gather_list must be empty on ranks other than the root", op=name, rank=self.comm.rank)
            return self._submit(name, lambda: [self.comm.Igatherv(send.arr, None, root, stream=at.stream)], lambda: [], at=at)
        if len(outputs) != 1:
            raise InvalidArgumentError(f"the root takes one gather_list, got {len(outputs)}", op=name, rank=self.comm.rank)
        outs = self._checked_list(name, outputs[0], t.dtype, "gather_list")
        self._place(name, [t, *outs])
        counts = [o.numel() for o in outs]
        recv = T.flat_empty(sum(counts), t)
        return self._submit(name, lambda: [self.comm.Igatherv(send.arr, T.vector(T.buffer(recv), counts), root, stream=at.stream)],
                            lambda: (T.split_into(recv, outs), outputs)[1], at=at)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> PycollWork:
        name = "scatter"
        out = self._one(name, outputs)
        root = self._root(name, (opts or dist.ScatterOptions()).rootRank)
        at = self._place(name, [out])
        buf = T.Staged(out, load=False)
        if self.comm.rank != root:
            if inputs and any(inputs):
                raise InvalidArgumentError("scatter_list must be empty on ranks other than the root", op=name, rank=self.comm.rank)
            return self._submit(name, lambda: [self.comm.Iscatterv(None, buf.arr, root, stream=at.stream)],
                                lambda: (buf.done(), outputs)[1], at=at)
        if len(inputs) != 1:
            raise InvalidArgumentError(f"the root takes one scatter_list, got {len(inputs)}", op=name, rank=self.comm.rank)
        parts = self._checked_list(name, inputs[0], out.dtype, "scatter_list")
        self._place(name, [out, *parts])
        counts = [p.numel() for p in parts]
        send = T.flat_concat(parts)
        return self._submit(name, lambda: [self.comm.Iscatterv(T.vector(T.buffer(send), counts), buf.arr, root, stream=at.stream)],
                            lambda: (buf.done(), outputs)[1], at=at)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> PycollWork:
        name = "all_to_all"
        if not inputs:
            raise InvalidArgumentError("input_tensor_list is empty", op=name, rank=self.comm.rank)
        dtype = self._tensor(name, inputs[0], "input_tensor_list").dtype
        ins = self._checked_list(name, inputs, dtype, "input_tensor_list")
        outs = self._checked_list(name, outputs, dtype, "output_tensor_list")
        at = self._place(name, [*ins, *outs])
        scounts, rcounts = [t.numel() for t in ins], [t.numel() for t in outs]
        send = T.flat_concat(ins)
        recv = T.flat_empty(sum(rcounts), send)
        return self._submit(name, lambda: [self.comm.Ialltoallv(T.vector(T.buffer(send), scounts), T.vector(T.buffer(recv), rcounts),
                                                                stream=at.stream)],
                            lambda: (T.split_into(recv, outs), outputs)[1], at=at)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],  # noqa: A002
                          input_split_sizes: list[int], opts: Any = None) -> PycollWork:
        name = "all_to_all_single"
        self._tensor(name, output, "output")
        self._tensor(name, input, "input")
        self._dtypes(name, [input], output.dtype)
        scounts = self._split_counts(name, input, input_split_sizes, "input")
        rcounts = self._split_counts(name, output, output_split_sizes, "output")
        at = self._place(name, [output, input])
        send, buf = T.Staged(input), T.Staged(output, load=False)
        return self._submit(name, lambda: [self.comm.Ialltoallv(T.vector(send.arr, scounts), T.vector(buf.arr, rcounts),
                                                                stream=at.stream)],
                            lambda: (buf.done(), [output])[1], at=at)

    def _split_counts(self, name: str, t: torch.Tensor, splits: list[int], what: str) -> list[int]:
        """Elements per rank for a split of ``t`` along its first dimension (even when ``splits`` is empty)."""
        p = self.comm.size
        rows = t.shape[0] if t.dim() else 1
        per_row = t.numel() // rows if rows else 0
        if not splits:
            if rows % p:
                raise InvalidArgumentError(f"{what}'s first dimension {rows} does not split evenly over {p} ranks", op=name, rank=self.comm.rank)
            return [rows // p * per_row] * p
        if len(splits) != p or sum(splits) != rows or min(splits) < 0:
            raise InvalidArgumentError(
                f"{what}_split_sizes {list(splits)} must be {p} sizes summing to the first dimension {rows}", op=name, rank=self.comm.rank
            )
        return [int(s) * per_row for s in splits]

    def _each(self, name: str, outputs: list, inputs: list, one: Callable[[Any, Any], PycollWork]) -> PycollWork:
        """A coalesced call: one operation per pair, one handle that completes when all have."""
        if len(outputs) != len(inputs):
            raise InvalidArgumentError(f"{len(outputs)} outputs for {len(inputs)} inputs", op=name, rank=self.comm.rank)
        works = [one(o, i) for o, i in zip(outputs, inputs)]
        return PycollWork(_all_of([w.get_future() for w in works], outputs))

    # ---- point-to-point and synchronisation -----------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> PycollWork:
        name = "send"
        t = self._one(name, tensors)
        self._peer(name, dst)
        at = self._place(name, [t])
        # pycoll's point-to-point moves host buffers: a CUDA tensor is copied to the host here (in stream order)
        buf = T.Staged(t.detach().cpu() if at.cuda else t, host=True)
        return self._submit(name, lambda: [self.comm.Isend(buf.arr, dst, tag)], lambda: tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> PycollWork:
        self._peer("recv", src)
        return self._recv("recv", tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> PycollWork:
        return self._recv("recv", tensors, ANY_SOURCE, tag)

    def _recv(self, name: str, tensors: list[torch.Tensor], src: int, tag: int) -> PycollWork:
        t = self._one(name, tensors)
        at = self._place(name, [t])
        host = torch.empty(t.shape, dtype=t.dtype) if at.cuda else t  # received on the host, then copied over
        buf = T.Staged(host, load=False, host=True)
        status = Status()
        reqs: list[Request] = []

        def start() -> list[Request]:
            reqs.append(self.comm.Irecv(buf.arr, src, tag))
            return reqs

        def finish() -> list[torch.Tensor]:
            reqs[0].Wait(status)  # completed already: fills the status
            if status.nbytes != buf.arr.nbytes:
                raise InvalidArgumentError(
                    f"received {status.count} bytes from rank {status.Get_source()}, the tensor holds {buf.arr.nbytes}", op=name, rank=self.comm.rank
                )
            buf.done()
            if at.cuda:
                with torch.no_grad():
                    t.copy_(host)
            return tensors

        return self._submit(name, start, finish, source=status.Get_source, at=at)

    def _peer(self, name: str, peer: int) -> None:
        if not 0 <= peer < self.comm.size:
            raise InvalidArgumentError(f"rank {peer} is not in this {self.comm.size}-rank group", op=name, rank=self.comm.rank)

    def barrier(self, opts: Any = None) -> PycollWork:
        return self._submit("barrier", lambda: [self.comm.Ibarrier()], lambda: [], blocking=self.comm.Barrier, nbytes=0)

    # ---- coalescing (batch_isend_irecv and friends) ----------------------------------------------
    def _start_coalescing(self, device: Any = None) -> None:
        self._coalescing = []

    def _end_coalescing(self, device: Any = None) -> PycollWork:
        futures, self._coalescing = self._coalescing or [], None
        return PycollWork(_all_of(futures, []))

    def shutdown(self) -> None:
        """Nothing to release per group: the communicator's messages are drained by pycoll at exit."""


def _runs_inline(nbytes: int, opts: Any) -> bool:
    """Whether a host call of ``nbytes`` (-1: unknown) runs in the caller's thread when nothing is in flight."""
    return 0 <= nbytes and (nbytes < _inline_bytes[0] or _waits(opts))


def _waits(opts: Any) -> bool:
    """Whether the caller waits for the call as soon as it is returned (torch sets ``asyncOp`` from ``async_op``;
    options made without it, as DDP's reducer makes them, say True)."""
    return opts is not None and getattr(opts, "asyncOp", True) is False


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_own_block(block: torch.Tensor, whole: torch.Tensor, rank: int) -> bool:
    """Whether ``block`` is exactly rank ``rank``'s block of ``whole`` (same memory, both contiguous)."""
    return (block.numel() > 0 and block.is_contiguous() and whole.is_contiguous() and block.device == whole.device
            and block.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
            and block.data_ptr() == whole.data_ptr() + rank * block.numel() * block.element_size())


def _all_of(futures: list[Future], value: Any) -> Future:
    """A future done when every one of ``futures`` is, with the first error if any failed."""
    done: Future = Future()
    if not futures:
        done.set_result(value)
        return done

    def settle(_: Any) -> None:
        for f in futures:
            try:
                f.value()
            except Exception as exc:
                done.set_exception(exc)
                return
        done.set_result(value)

    torch.futures.collect_all(futures).add_done_callback(settle)
    return done


# ---- registration ------------------------------------------------------------------------------
class Options:
    """pycoll's options for one torch group: ``init_process_group("pycoll", pg_options=Options(reproducible=True))``
    or ``new_group(..., pg_options=...)``. ``reproducible``: the group's reductions return, bit for bit, the rank-order
    left fold (docs/reproducibility.md); None follows ``PYCOLL_REPRODUCIBLE``."""

    def __init__(self, reproducible: Optional[bool] = None) -> None:
        self.reproducible = reproducible

    def __repr__(self) -> str:
        return f"pycoll.torch.Options(reproducible={self.reproducible!r})"


def _apply(comm: Any, options: Any) -> None:
    """Set what ``options`` (an ``Options``, a dict with the same keys, or None) asks of the group's communicator."""
    if options is None:
        return
    wanted = options.get("reproducible") if isinstance(options, dict) else getattr(options, "reproducible", None)
    if wanted is not None:
        comm.reproducible = bool(wanted)


def _create(common: Any, backend_options: Any = None) -> ProcessGroupPycoll:
    """torch's constructor hook (extended API): one pycoll communicator per torch group (``backend_options`` is the
    group's ``pg_options``: see ``Options``)."""
    timeout = common.timeout.total_seconds() if common.timeout is not None else None
    ranks = list(common.global_ranks_in_group) or list(range(common.group_size))
    rt = _runtime.current()
    if rt is None:
        if len(ranks) != common.group_size or ranks != sorted(ranks) or common.group_size != _world_size(ranks):
            raise InvalidArgumentError("the first pycoll process group must be the default (world) group", op="init_process_group")
        info = from_torch_store(common.store, common.group_rank, common.group_size, timeout or 300.0)
        rt = _runtime.get_runtime(timeout, info)
    if not _shared_cores:
        _share_cores(len(rt.machine_ranks), rt.machine_cores)
    if common.group_size > rt.size or ranks[common.group_rank] != rt.rank:
        raise InvalidArgumentError(
            f"torch's rank {ranks[common.group_rank]} of this group is pycoll's rank {rt.rank}: the pycoll job and the torch job differ",
            op="init_process_group",
        )
    comm = group_comm(rt, ranks, f"torch:{common.group_id}")
    comm.timeout = timeout or rt.timeout  # every wait on this group's communicator honours the group's timeout
    _apply(comm, backend_options)
    return ProcessGroupPycoll(comm, _progress_thread(rt), comm.timeout)


_shared_cores: list[bool] = []  # set once the process's torch threads were sized for the host's ranks


def _share_cores(ranks: int, cores: int) -> None:
    """Give torch's intra-op pool this rank's share of the cores where OMP_NUM_THREADS does not say, as torchrun does
    for several ranks on a node. Each rank's pool otherwise takes every core, and while one rank computes on all of
    them its peers wait in a collective for its result: 2 ranks on 2 cores, a small MLP's DDP step took 4-64 ms
    against 2-3 ms with one thread each. ``ranks``: the job's on this machine (namespaces included); ``cores``: theirs
    (pycoll.machine). Where the ranks have at most a core each, every host call runs in the caller's thread when
    nothing is in flight, at any size: handed to the progress thread, a DDP bucket's allreduce only took turns with
    the backward pass on the same cores, plus the hop (25 MB of gradients, 2 ranks on 2 cores: 78-81 against 65-79
    ms a step; 4 ranks: 166-192 against 154-158)."""
    _shared_cores.append(True)
    if cores <= ranks:  # no core for the progress thread to overlap a call on: it would only take turns with torch
        _inline_bytes[0] = EVERY_SIZE
    if os.environ.get("OMP_NUM_THREADS") or ranks <= 1:
        return
    share = max(1, cores // ranks)
    if torch.get_num_threads() > share:
        log.info("pycoll backend: torch's intra-op threads set to %d (%d ranks on this machine's %d cores; set "
                 "OMP_NUM_THREADS to choose)", share, ranks, cores)
        torch.set_num_threads(share)


def _world_size(ranks: list[int]) -> int:
    return max(ranks) + 1 if ranks else 0


def register() -> None:
    """Make ``"pycoll"`` a torch.distributed backend (idempotent)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
