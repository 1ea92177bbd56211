"""``ProcessGroupPycoll``: torch.distributed's operations on CPU and CUDA tensors, carried by pycoll communicators;
the reductions, point-to-point and synchronisation here, the data movement in ``movement.py``."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from ..buffers import IN_PLACE
from ..comm import Comm
from ..errors import InvalidArgumentError
from ..p2p_protocol import ANY_SOURCE
from ..request import Request
from ..status import Status
from . import tensors as T
from .progress import Job, ProgressThread
from .movement import DataMovement
from .threads import runs_inline
from .work import DoneWork, PycollWork, all_of


log = logging.getLogger("pycoll.torch")

BACKEND = "pycoll"


class ProcessGroupPycoll(DataMovement, dist.ProcessGroup):
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
        if blocking is not None and runs_inline(nbytes, opts) and self._coalescing is None:
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
        if opts is None:
            opts = dist.AllreduceOptions()
        if len(tensors) == 1:
            t = tensors[0]
            if isinstance(t, torch.Tensor):
                if t.layout == torch.sparse_coo:
                    return self._sparse_allreduce(name, tensors, opts.reduceOp)
                # the common host call, checked in the fewest steps: a dense, contiguous CPU tensor of a known dtype
                if (t.is_cpu and not T.is_device(t) and t.layout == torch.strided and t.dtype in T.DTYPES
                        and t.is_contiguous()
                        and runs_inline(t.nbytes, opts)):
                    op = self._op(name, opts.reduceOp, t.dtype)
                    if self._progress.run_now(self.comm.Allreduce, IN_PLACE, T.call_view(t), op):
                        return DoneWork(tensors)
        t = self._one(name, tensors)
        op = self._op(name, opts.reduceOp, t.dtype)
        at = self._place(name, [t])
        buf = T.Staged(t)
        return self._submit(name, lambda: [self.comm.Iallreduce(IN_PLACE, buf.arr, op, stream=at.stream)],
                            lambda: (buf.done(), tensors)[1], at=at,
                            blocking=lambda: self.comm.Allreduce(IN_PLACE, buf.arr, op), nbytes=T.tensor_nbytes(t), opts=opts)

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
                            blocking=lambda: self.comm.Reduce_scatter_block(send.arr, buf.arr, op), nbytes=T.tensor_nbytes(input),
                            opts=opts)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> PycollWork:
        return self._each("reduce_scatter_tensor_coalesced", outputs, inputs, lambda o, i: self.reduce_scatter_single(o, i, opts))

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
        return PycollWork(all_of(futures, []))

    def shutdown(self) -> None:
        """Nothing to release per group: the communicator's messages are drained by pycoll at exit."""
