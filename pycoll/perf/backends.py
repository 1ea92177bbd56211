"""The libraries `pycoll perf` times, behind one interface: pycoll and mpi4py (MPI's calls, with buffer specs),
torch.distributed (gloo, NCCL, pycoll's backend) and CuPy's NCCL; each prepares one collective's call and its result."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, Optional

import numpy as np

from pycoll.perf import metrics
from pycoll.perf.devices import HostArrays
from pycoll.perf.reference import inputs, np_dtype, participates, window_slots


# A prepared call: run() does one collective; result() gives this rank's output as a host array (None: nothing to check).
Prepared = tuple[Callable[[], None], Callable[[], Optional[np.ndarray]]]


class Unsupported(Exception):
    """A collective this peer cannot run here: reported as a skip with this reason, not as a failure."""


MPI_TYPE_NAMES = {"float32": "FLOAT", "float64": "DOUBLE", "float16": "FLOAT16", "bfloat16": "BFLOAT16",
                  "int8": "INT8_T", "uint8": "UINT8_T", "int32": "INT32_T", "uint32": "UINT32_T",
                  "int64": "INT64_T", "uint64": "UINT64_T"}


def mpi_datatype(mpi: Any, dtype: Any) -> Any:
    """The module's own datatype constant (pycoll.MPI.FLOAT or mpi4py.MPI.FLOAT, ...) for a NumPy dtype."""
    dt = np.dtype(dtype)
    found = getattr(mpi, MPI_TYPE_NAMES.get(dt.name, ""), None)
    if found is None:  # mpi4py names half precision only through its typecode table
        found = getattr(mpi, "_typedict", {}).get(dt.char)
    if found is None:
        raise Unsupported(f"{mpi.__name__} has no datatype constant for {dt.name}")
    return found


class Backend:
    """One peer's API: rank/size, barrier, sync, object gather and the collectives."""

    name = ""
    rank = 0
    size = 1
    memory = "host"  # where its buffers live: host or cuda
    takes_buffer_modes = False  # whether --buffers applies (pycoll and mpi4py); torch and CuPy peers ignore it
    buffers: Optional[str] = None  # the --buffers mode in force, None where it does not apply

    def barrier(self) -> None: ...

    def sync(self) -> None: ...

    def gather(self, obj: Any) -> list[Any]: ...

    def most(self, value: int) -> int:
        """The largest of every rank's ``value``, on every rank."""
        return value

    def prepare(self, coll: str, inplace: bool, count: int, dtype: str, op: str, root: int) -> Prepared: ...

    def variants(self, count: int) -> None:
        """Make ready the communicators of ``count`` interleaved runs (collective; see ``on``)."""

    @contextlib.contextmanager
    def on(self, variant: int) -> Iterator[None]:
        """Inside: calls prepared (and their record read) on interleaved run ``variant``'s own communicator."""
        yield

    def close(self) -> None: ...


class _MpiStyle(Backend):
    """pycoll.MPI and mpi4py share the buffer API; only the module differs. ``arrays`` allocates the buffers
    (NumPy, or device arrays for pycoll with --device cuda, passed with the allocator's stream)."""

    takes_buffer_modes = True

    def __init__(self, name: str, mpi: Any, native_avg: bool, arrays: Optional[HostArrays] = None) -> None:
        self.name, self.MPI, self.native_avg = name, mpi, native_avg
        self.arrays = arrays or HostArrays()
        self.memory = "host" if self.arrays.name == "host" else "cuda"
        self.comm = mpi.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        # the benchmark's own object calls go on a copy, so that the timed communicator's record of what it ran
        # (the algorithm and size a point's prediction reads) holds the timed calls only
        self.control = self.comm.Dup()
        # each forced algorithm interleaved in a job (--interleave) runs on a copy of its own, as in a job of its
        # own: on one communicator every switch of PYCOLL_ALGO made the plans of the shape give up their fast paths
        self._variant_comms: list[Any] = []

    def variants(self, count: int) -> None:
        while len(self._variant_comms) < count - 1:
            self._variant_comms.append(self.comm.Dup())

    @contextlib.contextmanager
    def on(self, variant: int) -> Iterator[None]:
        if variant == 0:
            yield
            return
        timed, self.comm = self.comm, self._variant_comms[variant - 1]
        try:
            yield
        finally:
            self.comm = timed

    def barrier(self) -> None:
        self.comm.Barrier()

    def sync(self) -> None:
        self.arrays.sync()

    def gather(self, obj: Any) -> list[Any]:
        return self.control.gather(obj, root=0) or []

    def most(self, value: int) -> int:
        return int(self.control.allreduce(value, op=self.MPI.MAX))

    def close(self) -> None:
        for c in self._variant_comms:
            c.Free()
        self.control.Free()

    def prepare(self, coll: str, inplace: bool, count: int, dtype: str, op: str, root: int) -> Prepared:
        MPI, comm, n, rank, A = self.MPI, self.comm, self.size, self.rank, self.arrays
        dt = np_dtype(dtype)
        avg = op == "avg" and not self.native_avg  # mpi4py has no AVG: SUM, then divide (timed)
        if avg and self.memory != "host":
            raise ValueError("a peer without AVG takes host buffers only")
        if coll == "scan" and op == "avg":
            raise Unsupported("MPI_Scan has no average; choose another -o")
        if coll == "scan" and not hasattr(comm, "Scan"):
            raise Unsupported(f"{self.name}'s communicator has no Scan")
        if coll in ("sendrecv",) + tuple(metrics.P2P) and self.memory != "host":
            raise Unsupported("pycoll's point-to-point calls take host buffers only")
        if coll in metrics.P2P and n < 2:
            raise Unsupported(f"{coll} needs 2 ranks")
        mop = MPI.SUM if avg else getattr(MPI, op.upper())
        mode = self.buffers or "array"
        fresh_host = mode == "fresh" and self.memory == "host"
        DT = mpi_datatype(MPI, dt) if mode in ("spec", "fresh") else None
        kw = {"stream": A.stream} if A.stream is not None else {}  # pycoll's stream= (device buffers only)

        def new_in(length: int, r: int = rank) -> Any:
            host = inputs(r, length, op, dt)  # with fresh: a new NumPy array, already written
            return host if fresh_host else A.from_host(host)

        def new_out(length: int) -> Any:
            if fresh_host:  # the user's np.empty, written once so that first-touch faults stay out of the timing
                out = np.empty(length, dt)
                out.fill(0)
                return out
            return A.zeros(length, dt)

        def B(x: Any, cnt: int) -> Any:
            """The buffer argument: [buf, count, MPI.<TYPE>] (spec, fresh) or the bare array (array)."""
            return [x, cnt, DT] if DT is not None else A.spec(x, dt)

        def scale(a: np.ndarray) -> None:
            if avg:
                if np.issubdtype(dt, np.integer):
                    np.floor_divide(a, n, out=a)
                else:
                    np.divide(a, n, out=a)

        ip = MPI.IN_PLACE
        c = count
        big = n * count if coll in ("reduce_scatter", "alltoall") or (coll == "scatter" and rank == root) else count
        send = new_in(big)
        recv = new_out(n * count if coll in ("allgather", "alltoall") or (coll == "gather" and rank == root)
                       else count)
        out: Any = recv
        run: Callable[[], Any]
        if coll == "allreduce":
            if inplace:
                out = send
                run = lambda: (comm.Allreduce(ip, B(send, c), op=mop, **kw), scale(send))
            else:
                run = lambda: (comm.Allreduce(B(send, c), B(recv, c), op=mop, **kw), scale(recv))
        elif coll == "reduce_scatter":  # counts in buffer specs are per block, as in MPI's C API
            if inplace:
                out = send[:count]
                run = lambda: (comm.Reduce_scatter_block(ip, B(send, c), op=mop, **kw), scale(send[:count]))
            else:
                run = lambda: (comm.Reduce_scatter_block(B(send, c), B(recv, c), op=mop, **kw), scale(recv))
        elif coll == "allgather":
            if inplace:
                A.copy(recv[rank * count:(rank + 1) * count], send)
                run = lambda: comm.Allgather(ip, B(recv, c), **kw)
            else:
                run = lambda: comm.Allgather(B(send, c), B(recv, c), **kw)
        elif coll == "broadcast":
            # MPI has no out-of-place Bcast: both modes broadcast one buffer that the root filled
            out = send
            run = lambda: comm.Bcast(B(send, c), root=root, **kw)
        elif coll == "reduce":
            if inplace and rank == root:
                out = send
                run = lambda: (comm.Reduce(ip, B(send, c), op=mop, root=root, **kw), scale(send))
            elif inplace:
                run = lambda: comm.Reduce(B(send, c), None, op=mop, root=root, **kw)
            else:
                run = lambda: (comm.Reduce(B(send, c), B(recv, c), op=mop, root=root, **kw), rank == root and scale(recv))
        elif coll == "alltoall":
            if inplace:
                out = send
                run = lambda: comm.Alltoall(ip, B(send, c), **kw)
            else:
                run = lambda: comm.Alltoall(B(send, c), B(recv, c), **kw)
        elif coll == "gather":  # in place: the root's block already sits in recvbuf
            if rank != root:
                out = None
                run = lambda: comm.Gather(B(send, c), None, root=root, **kw)
            elif inplace:
                A.copy(recv[root * count:(root + 1) * count], send)
                run = lambda: comm.Gather(ip, B(recv, c), root=root, **kw)
            else:
                run = lambda: comm.Gather(B(send, c), B(recv, c), root=root, **kw)
        elif coll == "scatter":  # in place: the root's block stays in sendbuf
            if rank != root:
                run = lambda: comm.Scatter(None, B(recv, c), root=root, **kw)
            elif inplace:
                out = send[root * count:(root + 1) * count]
                run = lambda: comm.Scatter(B(send, c), ip, root=root, **kw)
            else:
                run = lambda: comm.Scatter(B(send, c), B(recv, c), root=root, **kw)
        elif coll == "scan":
            if inplace:
                out = send
                run = lambda: comm.Scan(ip, B(send, c), op=mop, **kw)
            else:
                run = lambda: comm.Scan(B(send, c), B(recv, c), op=mop, **kw)
        elif coll == "sendrecv":  # nccl-tests' sendrecv: to rank+1, from rank-1
            right, left = (rank + 1) % n, (rank - 1) % n
            run = lambda: comm.Sendrecv(B(send, c), right, 0, B(recv, c), left, 0)
        elif coll == "barrier":
            out = None
            run = comm.Barrier
        elif coll == "pingpong":  # rank 1 echoes what it received; other ranks idle
            run = _pingpong(comm, rank, lambda: B(send, c), lambda: B(recv, c))
            out = recv if rank < 2 else None
        elif coll == "p2p_bw":
            return self._p2p_bw(count, dt, new_in, new_out, B)
        else:
            raise ValueError(coll)
        return run, (lambda: None) if out is None else (lambda: A.to_host(out, dt))

    def _p2p_bw(self, count: int, dt: np.dtype, new_in: Callable[[int], Any], new_out: Callable[[int], Any],
                B: Callable[[Any, int], Any]) -> Prepared:
        """osu_bw's loop: rank 0 sends a window of Isends to rank 1 (Irecvs into slots), Waitall, 1-element ack back."""
        comm, Waitall, rank, W = self.comm, self.MPI.Request.Waitall, self.rank, metrics.P2P_WINDOW
        ack = new_out(1)
        if rank == 0:
            send = new_in(count)

            def run() -> None:
                Waitall([comm.Isend(B(send, count), 1, 1) for _ in range(W)])
                comm.Recv(B(ack, 1), 1, 2)
            return run, lambda: None
        if rank != 1:
            return (lambda: None), (lambda: None)
        slots = window_slots(count, dt.itemsize)
        recv = new_out(slots * count)
        views = [recv[k * count:(k + 1) * count] for k in range(slots)]

        def run1() -> None:
            Waitall([comm.Irecv(B(views[i % slots], count), 0, 1) for i in range(W)])
            comm.Send(B(ack, 1), 0, 2)
        return run1, lambda: self.arrays.to_host(recv, dt)


def _pingpong(comm: Any, rank: int, send: Callable[[], Any], recv: Callable[[], Any]) -> Callable[[], Any]:
    """One round trip between ranks 0 and 1 (tag 1); the buffer arguments are built inside the timed call."""
    if rank == 0:
        return lambda: (comm.Send(send(), 1, 1), comm.Recv(recv(), 1, 1))
    if rank == 1:
        return lambda: (comm.Recv(recv(), 0, 1), comm.Send(recv(), 0, 1))
    return lambda: None


class _Torch(Backend):
    """torch.distributed with gloo (CPU tensors) or nccl (CUDA tensors)."""

    def __init__(self, name: str, device: str = "host") -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.name = torch, dist, name
        env = os.environ
        for src, dst in (("PYCOLL_RANK", "RANK"), ("PYCOLL_SIZE", "WORLD_SIZE")):
            if src in env:
                env[dst] = env[src]
        if not env.get("MASTER_ADDR"):  # on virtual hosts: host 0, where `pycoll run` put its store
            store = env.get("PYCOLL_STORE_ADDR", "")
            env["MASTER_ADDR"] = store.rpartition(":")[0].strip("[]") or "127.0.0.1"
        self.device = torch.device("cpu")
        if name == "nccl" or device == "cuda":  # one GPU per local rank, shared round robin when there are fewer
            local = int(env.get("PYCOLL_LOCAL_RANK", env.get("LOCAL_RANK", "0")))
            self.device = torch.device("cuda", local % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        dist.init_process_group(name, init_method="env://")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.memory = "cuda" if self.device.type == "cuda" else "host"

    def barrier(self) -> None:
        self.dist.barrier()

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        self.dist.all_gather_object(out, obj)
        return out

    def most(self, value: int) -> int:
        return max(self.gather(value))

    def close(self) -> None:
        self.dist.destroy_process_group()

    def prepare(self, coll: str, inplace: bool, count: int, dtype: str, op: str, root: int) -> Prepared:
        torch, dist, n, rank = self.torch, self.dist, self.size, self.rank
        tdt = getattr(torch, dtype)
        if coll == "scan":
            raise Unsupported("torch.distributed has no scan")
        if coll in metrics.P2P and n < 2:
            raise Unsupported(f"{coll} needs 2 ranks")
        if coll == "sendrecv" and n < 2:
            raise Unsupported("torch.distributed does not send to its own rank")
        avg = op == "avg" and self.name != "nccl"  # gloo has no AVG: SUM, then divide (timed)
        top = dist.ReduceOp.SUM if avg else getattr(dist.ReduceOp, {"prod": "PRODUCT"}.get(op, op.upper()))
        big = n * count if coll in ("reduce_scatter", "alltoall") or (coll == "scatter" and rank == root) else count
        send = torch.from_numpy(inputs(rank, big, op, np.float32 if tdt == self.torch.float32 else np.float64)).to(tdt).to(self.device)
        recv = torch.zeros(n * count if coll in ("allgather", "alltoall") or (coll == "gather" and rank == root)
                           else count, dtype=tdt, device=self.device)

        def scale(t: Any) -> None:
            if avg:
                t.div_(n, rounding_mode="floor") if not t.is_floating_point() else t.div_(n)

        out = recv
        if coll == "allreduce":
            if inplace:
                out = send
                run = lambda: (dist.all_reduce(send, op=top), scale(send))
            else:  # torch has no out-of-place all_reduce: copy, then reduce in place (both timed)
                run = lambda: (recv.copy_(send), dist.all_reduce(recv, op=top), scale(recv))
        elif coll == "reduce_scatter":
            if inplace:
                out = send.narrow(0, rank * count, count)
                run = lambda: (dist.reduce_scatter_tensor(out, send, op=top), scale(out))
            else:
                run = lambda: (dist.reduce_scatter_tensor(recv, send, op=top), scale(recv))
        elif coll == "allgather":
            if inplace:
                part = recv.narrow(0, rank * count, count)
                part.copy_(send)
                run = lambda: dist.all_gather_into_tensor(recv, part)
            else:
                run = lambda: dist.all_gather_into_tensor(recv, send)
        elif coll == "broadcast":
            out = send  # as for MPI: one buffer, filled on the root
            run = lambda: dist.broadcast(send, src=root)
        elif coll == "reduce":
            if inplace:
                out = send
                run = lambda: (dist.reduce(send, dst=root, op=top), rank == root and scale(send))
            else:  # copy, then reduce in place (both timed)
                run = lambda: (recv.copy_(send), dist.reduce(recv, dst=root, op=top), rank == root and scale(recv))
        elif coll == "alltoall":
            if inplace:  # no in-place all_to_all_single: copy to scratch, exchange back (both timed)
                out, tmp = send, torch.empty_like(send)
                run = lambda: (tmp.copy_(send), dist.all_to_all_single(send, tmp))
            else:
                run = lambda: dist.all_to_all_single(recv, send)
        elif coll == "gather":  # in place: the root sends from its own block of the output
            src = send
            if inplace and rank == root:
                src = recv.narrow(0, root * count, count)
                src.copy_(send)
            parts = list(recv.split(count)) if rank == root else None
            run = lambda: dist.gather(src, gather_list=parts, dst=root)
        elif coll == "scatter":  # torch has no in-place scatter: both modes run out of place
            parts = list(send.split(count)) if rank == root else None
            run = lambda: dist.scatter(recv, scatter_list=parts, src=root)
        elif coll == "sendrecv":
            pair = [dist.P2POp(dist.isend, send, (rank + 1) % n), dist.P2POp(dist.irecv, recv, (rank - 1) % n)]
            run = lambda: [w.wait() for w in dist.batch_isend_irecv(pair)]
        elif coll == "barrier":
            run = dist.barrier
        elif coll == "pingpong":
            run = {0: lambda: (dist.send(send, 1), dist.recv(recv, 1)),
                   1: lambda: (dist.recv(recv, 0), dist.send(recv, 0))}.get(rank, lambda: None)
        elif coll == "p2p_bw":
            ack, W = torch.zeros(1, dtype=tdt, device=self.device), metrics.P2P_WINDOW
            slots = window_slots(count, send.element_size())
            if rank == 1:
                recv = out = torch.zeros(slots * count, dtype=tdt, device=self.device)
            parts = list(recv.split(count))
            run = {0: lambda: ([w.wait() for w in [dist.isend(send, 1, tag=1) for _ in range(W)]],
                               dist.recv(ack, 1, tag=2)),
                   1: lambda: ([w.wait() for w in [dist.irecv(parts[i % slots], 0, tag=1) for i in range(W)]],
                               dist.send(ack, 0, tag=2))}.get(rank, lambda: None)
        else:
            raise ValueError(coll)
        if not participates(coll, rank, root):
            return run, lambda: None
        return run, lambda: out.to(torch.float64).cpu().numpy()


class _CupyNccl(_MpiStyle):
    """NCCL through CuPy's cupy.cuda.nccl, for a torch without CUDA; pycoll's host communicator (the base
    class's) hands out the NCCL unique id and does the barriers and gathers. CuPy buffers, one stream."""

    # NumPy dtype name or op -> (cupy.cuda.nccl constant, its value in nccl.h where CuPy lacks the name)
    DTYPES = {"int8": ("NCCL_INT8", 0), "uint8": ("NCCL_UINT8", 1), "int32": ("NCCL_INT32", 2),
              "uint32": ("NCCL_UINT32", 3), "int64": ("NCCL_INT64", 4), "uint64": ("NCCL_UINT64", 5),
              "float16": ("NCCL_FLOAT16", 6), "float32": ("NCCL_FLOAT32", 7), "float64": ("NCCL_FLOAT64", 8),
              "bfloat16": ("NCCL_BFLOAT16", 9)}
    takes_buffer_modes = False
    OPS = {"sum": ("NCCL_SUM", 0), "prod": ("NCCL_PROD", 1), "max": ("NCCL_MAX", 2), "min": ("NCCL_MIN", 3),
           "avg": ("NCCL_AVG", 4)}

    def __init__(self) -> None:
        from cupy.cuda import nccl

        from pycoll import MPI as pmpi
        from pycoll.perf.devices import CupyArrays

        super().__init__("nccl", pmpi, native_avg=True, arrays=CupyArrays())
        self.nccl = nccl
        uid = self.comm.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        self.nc = nccl.NcclCommunicator(self.size, uid, self.rank)

    def close(self) -> None:
        self.nc.destroy()
        super().close()

    def _const(self, table: dict[str, tuple[str, int]], key: str) -> int:
        name, value = table[key]
        return int(getattr(self.nccl, name, value))

    def prepare(self, coll: str, inplace: bool, count: int, dtype: str, op: str, root: int) -> Prepared:
        A, c, n, rank, nccl = self.arrays, self.nc, self.size, self.rank, self.nccl
        if coll not in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall"):
            raise Unsupported(f"{coll} is not written for the cupy.cuda.nccl route (torch's nccl runs it)")
        dt = np_dtype(dtype)
        t, o, s = self._const(self.DTYPES, dtype), self._const(self.OPS, op), A.stream.ptr
        big = n * count if coll in ("reduce_scatter", "alltoall") else count
        send = A.from_host(inputs(rank, big, op, dt))
        recv = A.zeros(n * count if coll in ("allgather", "alltoall") else count, dt)
        ptr = lambda x: x.data.ptr  # noqa: E731
        out = recv
        if coll == "allreduce":
            out = send if inplace else recv
            run = lambda: c.allReduce(ptr(send), ptr(out), count, t, o, s)
        elif coll == "reduce_scatter":  # in place: NCCL's recvbuff is sendbuff + rank * recvcount
            out = send[rank * count:(rank + 1) * count] if inplace else recv
            run = lambda: c.reduceScatter(ptr(send), ptr(out), count, t, o, s)
        elif coll == "allgather":
            src = send
            if inplace:
                src = recv[rank * count:(rank + 1) * count]
                A.copy(src, send)
            run = lambda: c.allGather(ptr(src), ptr(recv), count, t, s)
        elif coll == "broadcast":
            out = send  # one buffer filled on the root, as for the other peers
            run = lambda: c.broadcast(ptr(send), ptr(send), count, t, root, s)
        elif coll == "reduce":
            out = send if inplace else recv
            run = lambda: c.reduce(ptr(send), ptr(out), count, t, o, root, s)
        elif coll == "alltoall":  # NCCL has no alltoall call: grouped send/recv, as nccl-tests does
            src, out = send, recv
            pre: Callable[[], Any] = lambda: None  # noqa: E731
            if inplace:  # no in-place form either: copy to scratch, exchange back (both timed)
                src, out = A.zeros(n * count, dt), send
                pre = lambda: A.cp.copyto(src, send)  # noqa: E731 - inside the stream block below
            step = count * dt.itemsize

            def run() -> None:
                with A.stream:
                    pre()
                nccl.groupStart()
                for peer in range(n):
                    c.send(ptr(src) + peer * step, count, t, peer, s)
                    c.recv(ptr(out) + peer * step, count, t, peer, s)
                nccl.groupEnd()
        else:
            raise ValueError(coll)
        if coll == "reduce" and rank != root:
            return run, lambda: None
        return run, lambda: A.to_host(out, dt)


def make_backend(peer: str, device: str = "host", nccl_via: Optional[str] = None) -> Backend:
    """Select the peer's API; ``device`` cuda puts pycoll's and gloo's buffers on the GPU (nccl's always are)."""
    if peer == "pycoll":
        # A sweep measures the steady state: the compiled arena kernels loaded before the first point rather than in
        # the background while the first points run (the user's setting wins; perf/host_calls.py times a start).
        os.environ.setdefault("PYCOLL_ARENA_JIT_LOAD", "now")
        from pycoll import MPI as pmpi
        from pycoll.perf.devices import arrays_for

        return _MpiStyle("pycoll", pmpi, native_avg=True, arrays=arrays_for(device))
    if peer == "mpi":
        from mpi4py import MPI as mmpi
        return _MpiStyle("mpi", mmpi, native_avg=False)
    if peer == "nccl" and nccl_via == "cupy":
        return _CupyNccl()
    if peer in ("gloo", "nccl"):
        return _Torch(peer, device)
    raise ValueError(f"unknown peer {peer!r}")
