"""Collectives on CUDA device buffers (numba device arrays; the CUDA simulator or a GPU), checked against NumPy."""

# Run with NUMBA_ENABLE_CUDASIM=1 in the ranks' environment (tests/test_device_buffers.py), or on a GPU.
# Every case skips where numba.cuda has neither (and under mpi4py, which has no stream= argument).

from __future__ import annotations

import numpy as np

from . import BFLOAT16, case, reduce_ref, sentinel

COUNTS = (0, 1, 7, 33)
DTYPES = ("float32", "float16", "bfloat16", "int32")


def _cuda(ctx):
    if ctx.impl != "pycoll":
        ctx.skip("device buffers are a pycoll feature here")
    import os

    from numba import cuda

    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") in ("", "0") and not cuda.is_available():
        ctx.skip("neither the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) nor a CUDA device")
    return cuda


def _dtype(name):
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def _to_device(cuda, host):
    """A device copy of ``host`` and the spec naming it: bfloat16 travels in a uint16 carrier, named by the spec."""
    if host.dtype == BFLOAT16:
        dev = cuda.to_device(host.view(np.uint16))
        return dev, [dev, BFLOAT16]
    dev = cuda.to_device(host)
    return dev, dev


def _host(dev, dt):
    out = dev.copy_to_host()
    return out.view(dt) if np.dtype(dt) == BFLOAT16 else out


def _streams(cuda):
    """No stream, and a numba stream (a GPU orders the staging copies on it)."""
    return (None, cuda.stream())


@case
def case_allreduce(ctx):
    cuda = _cuda(ctx)
    comm, MPI = ctx.comm, ctx.MPI
    i = 0
    for op in ("SUM", "MAX"):
        for name in DTYPES:
            dt = _dtype(name)
            for count in COUNTS:
                inputs = [ctx.data(dt, count, r, op=op) for r in range(ctx.size)]
                expected = reduce_ref(op, inputs, dt)
                for inplace in (False, True):
                    stream = _streams(cuda)[i % 2]
                    i += 1
                    lab = f"Allreduce {op} {name} count={count} {'in' if inplace else 'out-of'}-place stream={stream is not None}"
                    send, send_spec = _to_device(cuda, inputs[ctx.rank])
                    if inplace:
                        comm.Allreduce(MPI.IN_PLACE, send_spec, op=ctx.op(op), stream=stream)
                        ctx.check(lab, _host(send, dt), expected)
                    else:
                        recv, recv_spec = _to_device(cuda, sentinel(dt, count))
                        comm.Allreduce(send_spec, recv_spec, op=ctx.op(op), stream=stream)
                        ctx.check(lab, _host(recv, dt), expected)
                        ctx.check(lab + " (sendbuf unchanged)", _host(send, dt), inputs[ctx.rank])


@case
def case_reduce_scatter_block(ctx):
    cuda = _cuda(ctx)
    comm, MPI = ctx.comm, ctx.MPI
    for name in ("float32", "bfloat16", "int32"):
        dt = _dtype(name)
        for each in (0, 1, 5):
            inputs = [ctx.data(dt, each * ctx.size, r) for r in range(ctx.size)]
            full = reduce_ref("SUM", inputs, dt)
            expected = full[ctx.rank * each : (ctx.rank + 1) * each]
            lab = f"Reduce_scatter_block {name} each={each}"
            send, send_spec = _to_device(cuda, inputs[ctx.rank])
            recv, recv_spec = _to_device(cuda, sentinel(dt, each))
            comm.Reduce_scatter_block(send_spec, recv_spec, op=MPI.SUM, stream=cuda.stream())
            ctx.check(lab + " out-of-place", _host(recv, dt), expected)
            comm.Reduce_scatter_block(MPI.IN_PLACE, send_spec, op=MPI.SUM)
            ctx.check(lab + " in-place", _host(send, dt)[:each], expected)


@case
def case_reduce_scatter_keeps_the_rest(ctx):
    """A recvbuf longer than this rank's block: the elements past it stay as they were on the device."""
    cuda = _cuda(ctx)
    comm, MPI = ctx.comm, ctx.MPI
    counts = [r + 1 for r in range(ctx.size)]
    inputs = [ctx.data(np.float32, sum(counts), r) for r in range(ctx.size)]
    full = reduce_ref("SUM", inputs, np.float32)
    lo = sum(counts[: ctx.rank])
    want = np.concatenate([full[lo : lo + counts[ctx.rank]], sentinel(np.float32, 3)])
    recv = cuda.to_device(sentinel(np.float32, counts[ctx.rank] + 3))
    comm.Reduce_scatter(cuda.to_device(inputs[ctx.rank]), recv, counts, op=MPI.SUM)
    ctx.check("Reduce_scatter tail untouched", recv.copy_to_host(), want)


@case
def case_allgather(ctx):
    cuda = _cuda(ctx)
    comm, MPI = ctx.comm, ctx.MPI
    for name in ("float32", "float16", "int32"):
        dt = _dtype(name)
        for count in COUNTS:
            blocks = [ctx.data(dt, count, r) for r in range(ctx.size)]
            expected = np.concatenate(blocks) if count else np.empty(0, dt)
            lab = f"Allgather {name} count={count}"
            recv = cuda.to_device(sentinel(dt, count * ctx.size))
            comm.Allgather(cuda.to_device(blocks[ctx.rank]), recv, stream=cuda.stream())
            ctx.check(lab + " out-of-place", recv.copy_to_host(), expected)
            mine = sentinel(dt, count * ctx.size)
            mine[ctx.rank * count : (ctx.rank + 1) * count] = blocks[ctx.rank]
            recv = cuda.to_device(mine)
            comm.Allgather(MPI.IN_PLACE, recv)
            ctx.check(lab + " in-place", recv.copy_to_host(), expected)


@case
def case_allgatherv_gaps(ctx):
    """Blocks with gaps between them: the gaps keep their device contents."""
    cuda = _cuda(ctx)
    comm = ctx.comm
    counts = [2 + r for r in range(ctx.size)]
    displs = [sum(counts[:r]) + 2 * r for r in range(ctx.size)]
    n = displs[-1] + counts[-1] + 1
    blocks = [ctx.data(np.int32, counts[r], r) for r in range(ctx.size)]
    want = sentinel(np.int32, n)
    for r in range(ctx.size):
        want[displs[r] : displs[r] + counts[r]] = blocks[r]
    recv = cuda.to_device(sentinel(np.int32, n))
    comm.Allgatherv(cuda.to_device(blocks[ctx.rank]), [recv, counts, displs])
    ctx.check("Allgatherv with gaps", recv.copy_to_host(), want)


@case
def case_bcast(ctx):
    cuda = _cuda(ctx)
    comm = ctx.comm
    for name in ("float32", "bfloat16", "int32"):
        dt = _dtype(name)
        for count in (0, 7):
            for root in range(ctx.size):
                data = ctx.data(dt, count, root)
                buf, spec = _to_device(cuda, data if ctx.rank == root else sentinel(dt, count))
                comm.Bcast(spec, root=root, stream=cuda.stream() if root % 2 else None)
                ctx.check(f"Bcast {name} count={count} root={root}", _host(buf, dt), data)


@case
def case_reduce(ctx):
    cuda = _cuda(ctx)
    comm, MPI = ctx.comm, ctx.MPI
    for op, name in (("SUM", "float32"), ("MAX", "int32"), ("SUM", "float16")):
        dt = _dtype(name)
        for count in (0, 7):
            inputs = [ctx.data(dt, count, r, op=op) for r in range(ctx.size)]
            expected = reduce_ref(op, inputs, dt)
            for root in range(ctx.size):
                for inplace in (False, True):
                    lab = f"Reduce {op} {name} count={count} root={root} {'in' if inplace else 'out-of'}-place"
                    send = cuda.to_device(inputs[ctx.rank])
                    if ctx.rank != root:
                        comm.Reduce(send, None, op=ctx.op(op), root=root)
                        ctx.check(lab + " (sendbuf unchanged)", send.copy_to_host(), inputs[ctx.rank])
                    elif inplace:
                        comm.Reduce(MPI.IN_PLACE, send, op=ctx.op(op), root=root, stream=cuda.stream())
                        ctx.check(lab, send.copy_to_host(), expected)
                    else:
                        recv = cuda.to_device(sentinel(dt, count))
                        comm.Reduce(send, recv, op=ctx.op(op), root=root)
                        ctx.check(lab, recv.copy_to_host(), expected)


@case
def case_nonblocking(ctx):
    """I-forms: the device result is in place when Wait (or a successful Test) returns."""
    cuda = _cuda(ctx)
    comm, MPI = ctx.comm, ctx.MPI
    inputs = [ctx.data(np.float32, 9, r) for r in range(ctx.size)]
    recv = cuda.to_device(sentinel(np.float32, 9))
    req = comm.Iallreduce(cuda.to_device(inputs[ctx.rank]), recv, op=MPI.SUM, stream=cuda.stream())
    req.Wait()
    ctx.check("Iallreduce", recv.copy_to_host(), reduce_ref("SUM", inputs, np.float32))
    gathered = cuda.to_device(sentinel(np.int32, 2 * ctx.size))
    req = comm.Iallgather(cuda.to_device(np.array([ctx.rank, -ctx.rank], np.int32)), gathered)
    while not req.Test():
        pass
    want = np.array([v for r in range(ctx.size) for v in (r, -r)], np.int32)
    ctx.check("Iallgather (Test)", gathered.copy_to_host(), want)
    buf = cuda.to_device(np.arange(4, dtype=np.int32) if ctx.rank == 0 else sentinel(np.int32, 4))
    comm.Ibcast(buf, root=0).Wait()
    ctx.check("Ibcast", buf.copy_to_host(), np.arange(4, dtype=np.int32))


@case
def case_stream_order(ctx):
    """Work queued on the stream before the call (a copy into sendbuf) is seen by the collective."""
    cuda = _cuda(ctx)
    from pycoll import cuda as pcuda

    comm, MPI = ctx.comm, ctx.MPI
    inputs = [ctx.data(np.float32, 33, r) for r in range(ctx.size)]
    stream = cuda.stream()
    src = cuda.to_device(inputs[ctx.rank])
    send = cuda.to_device(np.zeros(33, np.float32))
    recv = cuda.device_array(33, np.float32)
    pcuda.copy(send, src, stream=stream)  # queued, not waited for
    comm.Allreduce(send, recv, op=MPI.SUM, stream=stream)
    ctx.check("Allreduce after a copy on its stream", recv.copy_to_host(), reduce_ref("SUM", inputs, np.float32))


class _Exporter:
    """A CuPy-like object: only __cuda_array_interface__ (under the simulator its addresses are host addresses)."""

    def __init__(self, host, readonly=False):
        self._host = host
        self.__cuda_array_interface__ = {
            "shape": host.shape, "typestr": host.dtype.str, "data": (host.ctypes.data, readonly), "strides": None,
            "version": 3,
        }


@case
def case_array_interface(ctx):
    """Buffers exported only through __cuda_array_interface__ (as CuPy and torch do), 2-D, with raw stream handles."""
    cuda = _cuda(ctx)
    import os

    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") in ("", "0"):
        ctx.skip("host-memory exporters stand for device memory under the simulator only")
    comm, MPI = ctx.comm, ctx.MPI
    inputs = [ctx.data(np.float32, 12, r).reshape(3, 4) for r in range(ctx.size)]
    send_host, recv_host = inputs[ctx.rank].copy(), sentinel(np.float32, 12).reshape(3, 4)
    comm.Allreduce(_Exporter(send_host, readonly=True), _Exporter(recv_host), op=MPI.SUM, stream=0)
    ctx.check("Allreduce through __cuda_array_interface__", recv_host, reduce_ref("SUM", inputs, np.float32))
    del cuda


@case
def case_errors(ctx):
    """Mixed host/device buffers, non-contiguous and read-only device buffers: InvalidArgumentError at the call."""
    cuda = _cuda(ctx)
    from pycoll.errors import InvalidArgumentError

    comm, MPI = ctx.comm, ctx.MPI
    dev = cuda.to_device(np.ones(4, np.float32))
    host = np.zeros(4, np.float32)
    err = ctx.raises("device send, host recv", InvalidArgumentError, comm.Allreduce, dev, host, op=MPI.SUM)
    if err is not None:
        ctx.expect("NCCL" in str(err) and "both on the device" in str(err), "mixed error says why", str(err))
    ctx.raises("host send, device recv", InvalidArgumentError, comm.Allgather, host[:1], cuda.device_array(ctx.size, np.float32))
    strided = cuda.to_device(np.ones((4, 4), np.float32))[:, 1]
    err = ctx.raises("non-contiguous device buffer", InvalidArgumentError, comm.Allreduce, MPI.IN_PLACE, strided, op=MPI.SUM)
    if err is not None:
        ctx.expect("non-contiguous" in str(err), "non-contiguous error says so", str(err))
    ctx.raises("count past the device buffer", InvalidArgumentError, comm.Allreduce, [dev, 5], cuda.device_array(5, np.float32))
    err = ctx.raises("Send of a device buffer", InvalidArgumentError, comm.Send, dev, (ctx.rank + 1) % ctx.size)
    if err is not None:
        ctx.expect("host buffers only" in str(err), "point-to-point error says why", str(err))
    host_out = np.zeros(4, np.float32)
    comm.Allreduce(np.ones(4, np.float32), host_out, op=MPI.SUM, stream=cuda.stream())  # stream= ignored for host buffers
    ctx.check("host buffers with stream=", host_out, np.full(4, ctx.size, np.float32))
    # the communicator still works afterwards
    out = cuda.device_array(4, np.float32)
    comm.Allreduce(dev, out, op=MPI.SUM)
    ctx.check("Allreduce after the errors", out.copy_to_host(), np.full(4, ctx.size, np.float32))


@case
def case_gather_scatter_alltoall(ctx):
    """The rooted and all-to-all movements stage the same way."""
    cuda = _cuda(ctx)
    comm = ctx.comm
    n = ctx.size
    blocks = [ctx.data(np.int32, 3, r) for r in range(n)]
    for root in range(n):
        recv = cuda.to_device(sentinel(np.int32, 3 * n)) if ctx.rank == root else None
        comm.Gather(cuda.to_device(blocks[ctx.rank]), recv, root=root, stream=cuda.stream())
        if ctx.rank == root:
            ctx.check(f"Gather root={root}", recv.copy_to_host(), np.concatenate(blocks))
        send = cuda.to_device(np.concatenate(blocks)) if ctx.rank == root else None
        mine = cuda.to_device(sentinel(np.int32, 3))
        comm.Scatter(send, mine, root=root)
        ctx.check(f"Scatter root={root}", mine.copy_to_host(), blocks[ctx.rank])
    rows = [ctx.data(np.float32, 2 * n, r) for r in range(n)]
    recv = cuda.to_device(sentinel(np.float32, 2 * n))
    comm.Alltoall(cuda.to_device(rows[ctx.rank]), recv)
    want = np.concatenate([rows[r][2 * ctx.rank : 2 * ctx.rank + 2] for r in range(n)])
    ctx.check("Alltoall", recv.copy_to_host(), want)
