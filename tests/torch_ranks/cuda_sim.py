"""Rank program: the "pycoll" backend's CUDA-tensor path, on a GPU (--real) or on CPU tensors under numba's simulator.

pycoll.torch.tensors keeps every CUDA runtime call in three functions (is_device, current_stream, device_scope).
Without --real they are swapped so that CPU tensors take the device path: each operation hands pycoll hand-built
``__cuda_array_interface__`` views with a stream, pycoll stages them as device buffers (simulator memory is host
memory), and the results come back through the device-side copies (NUMBA_ENABLE_CUDASIM=1). With --real the
tensors are CUDA tensors on GPU local_rank % device_count. Two ranks or more.

Writes ``{out}/rank{r}.json`` with the checks made and any failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import traceback

import torch
import torch.distributed as dist

import pycoll.torch  # noqa: F401
import pycoll.torch.tensors as T


def _patch(real: bool) -> dict[str, int]:
    """Without ``real``: CPU tensors through the device path. Counts pycoll's device stagings and stream syncs."""
    from numba import cuda

    from pycoll.cuda import memory

    from pycoll.algorithms import cuda_ipc

    seen = {"staged": 0, "ipc": 0, "streams": 0, "syncs": 0}
    init, ipc_init = memory.Staged.__init__, cuda_ipc._Device.__init__

    def counting(self, call, rank, s):  # type: ignore[no-untyped-def]
        seen["staged"] += 1
        seen["streams"] += s is stream if not real else s is not None
        init(self, call, rank, s)

    def counting_ipc(self, st, call):  # type: ignore[no-untyped-def]  # an Allreduce on CUDA IPC buffers, not staged
        seen["ipc"] += 1
        seen["streams"] += call.stream is stream if not real else call.stream is not None
        ipc_init(self, st, call)

    memory.Staged.__init__ = counting
    cuda_ipc._Device.__init__ = counting_ipc
    if real:
        stream = None
        return seen
    assert cuda.is_available() and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "needs the simulator"
    stream = cuda.stream()
    real_sync = stream.synchronize

    def sync() -> None:
        seen["syncs"] += 1
        real_sync()

    stream.synchronize = sync
    T.is_device = lambda t: t.device.type == "cpu"
    T.current_stream = lambda device: stream
    T.device_scope = lambda device, s: contextlib.nullcontext()
    return seen


def run(r: int, n: int, fail: list[str], real: bool) -> int:
    seen = _patch(real)
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()) if real else \
        torch.device("cpu")
    if real:
        torch.cuda.set_device(dev)
    D = lambda x: x.to(dev)  # noqa: E731 - made on the CPU, then put where the test runs
    checks = 0

    def expect(cond: bool, what: str) -> None:
        nonlocal checks
        checks += 1
        if not cond:
            fail.append(what)

    def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        expect(got.device == dev, f"{what}: the result is on {got.device}, not {dev}")
        got = got.cpu()
        expect(got.dtype == want.dtype and got.shape == want.shape and bool(torch.equal(got, want)),
               f"{what}: got {got.flatten()[:6].tolist()}, want {want.flatten()[:6].tolist()}")

    ranks = range(n)
    # allreduce: float32, bfloat16 (uint16 carrier + datatype), a non-contiguous tensor, AVG, bool
    t = D(torch.arange(10, dtype=torch.float32) + r)
    dist.all_reduce(t)
    same(t, sum(torch.arange(10, dtype=torch.float32) + q for q in ranks), "allreduce float32")
    b = D(torch.full((7,), float(r + 1), dtype=torch.bfloat16))
    dist.all_reduce(b, op=dist.ReduceOp.MAX)
    same(b, torch.full((7,), float(n), dtype=torch.bfloat16), "allreduce bfloat16 max")
    m = D(torch.arange(12, dtype=torch.float64).reshape(3, 4) * (r + 1)).t()  # not contiguous
    dist.all_reduce(m, op=dist.ReduceOp.AVG)
    same(m, (torch.arange(12, dtype=torch.float64).reshape(3, 4) * sum(q + 1 for q in ranks) / n).t(), "allreduce avg")
    flags = D(torch.tensor([r == 0, False, True]))
    dist.all_reduce(flags)  # logical or
    same(flags, torch.tensor([True, False, True]), "allreduce bool")
    # async: the result is in place once wait() returns
    a = [D(torch.full((5,), float(k + r))) for k in range(3)]
    works = [dist.all_reduce(x, async_op=True) for x in a]
    for k, w in enumerate(works):
        w.wait()
        same(a[k], torch.full((5,), float(sum(k + q for q in ranks))), f"async allreduce {k}")
    # rooted and gathering operations
    x = D(torch.full((6,), float(r + 1), dtype=torch.int32))
    dist.broadcast(x, src=n - 1)
    same(x, torch.full((6,), n, dtype=torch.int32), "broadcast")
    x = D(torch.full((4,), float(r + 1)))
    dist.reduce(x, dst=0)
    if r == 0:
        same(x, torch.full((4,), float(sum(q + 1 for q in ranks))), "reduce at the root")
    outs = [D(torch.empty(3, dtype=torch.int64)) for _ in ranks]
    dist.all_gather(outs, D(torch.full((3,), r, dtype=torch.int64)))
    expect([o.cpu().tolist() for o in outs] == [[q] * 3 for q in ranks], f"all_gather {[o.cpu().tolist() for o in outs]}")
    uneven = [D(torch.empty(q + 1)) for q in ranks]
    dist.all_gather(uneven, D(torch.full((r + 1,), float(r))))
    expect([o.cpu().tolist() for o in uneven] == [[float(q)] * (q + 1) for q in ranks], "all_gather of uneven sizes")
    big = D(torch.empty(2 * n, dtype=torch.bfloat16))
    dist.all_gather_into_tensor(big, D(torch.full((2,), float(r), dtype=torch.bfloat16)))
    same(big, torch.tensor([float(q) for q in ranks for _ in range(2)], dtype=torch.bfloat16), "all_gather_into_tensor")
    out = D(torch.empty(3))
    dist.reduce_scatter_tensor(out, D(torch.arange(3 * n, dtype=torch.float32) + r))
    same(out, sum(torch.arange(3 * n, dtype=torch.float32)[3 * r:3 * r + 3] + q for q in ranks), "reduce_scatter_tensor")
    out = D(torch.empty(2))
    dist.reduce_scatter(out, [D(torch.full((2,), float(q + r))) for q in ranks])
    same(out, torch.full((2,), float(sum(r + q for q in ranks))), "reduce_scatter of a list")
    got = D(torch.empty(n, dtype=torch.int32))
    dist.all_to_all_single(got, D(torch.arange(n, dtype=torch.int32) + 10 * r))
    same(got, torch.tensor([10 * q + r for q in ranks], dtype=torch.int32), "all_to_all_single")
    lst = [D(torch.empty(2)) for _ in ranks]
    dist.all_to_all(lst, [D(torch.full((2,), float(10 * r + q))) for q in ranks])
    expect([v.cpu().tolist() for v in lst] == [[float(10 * q + r)] * 2 for q in ranks], "all_to_all of lists")
    gl = [D(torch.empty(2)) for _ in ranks] if r == 0 else None
    dist.gather(D(torch.full((2,), float(r))), gl, dst=0)
    if r == 0:
        expect([g.cpu().tolist() for g in gl] == [[float(q)] * 2 for q in ranks], "gather")
    sc = D(torch.empty(3))
    dist.scatter(sc, [D(torch.full((3,), float(q * 2))) for q in ranks] if r == 0 else None, src=0)
    same(sc, torch.full((3,), float(2 * r)), "scatter")
    # point-to-point: through host copies (pycoll's p2p takes host buffers)
    if r == 0:
        dist.send(D(torch.arange(5, dtype=torch.float32)), 1)
    elif r == 1:
        got = D(torch.zeros(5))
        dist.recv(got, 0)
        same(got, torch.arange(5, dtype=torch.float32), "send/recv")
    dist.barrier()
    if not real:  # on a GPU, pycoll may take a path that does not stage (CUDA IPC)
        calls = seen["staged"] + seen["ipc"]
        expect(calls >= 15, f"pycoll took {calls} device calls ({seen['ipc']} over CUDA IPC): the CUDA path was not taken")
        expect(seen["syncs"] >= 15, f"the caller's stream was synchronised {seen['syncs']} times")
    calls = seen["staged"] + seen["ipc"]
    expect(seen["streams"] == calls, f"{calls - seen['streams']} device calls without the caller's stream")
    return checks


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--real", action="store_true", help="CUDA tensors on a GPU instead of the simulator")
    args = p.parse_args()
    dist.init_process_group("pycoll")
    r, n = dist.get_rank(), dist.get_world_size()
    fail: list[str] = []
    res: dict = {"rank": r, "backend": dist.get_backend(), "failures": fail}
    try:
        res["checks"] = run(r, n, fail, args.real)
    except Exception:
        res["error"] = traceback.format_exc()
    with open(os.path.join(args.out, f"rank{r}.json"), "w") as fh:
        json.dump(res, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
