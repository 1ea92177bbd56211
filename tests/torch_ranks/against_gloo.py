"""Rank program: every torch.distributed operation on the "pycoll" backend, compared with gloo's result.

Run under a launcher (pycoll run, torchrun). The default group is pycoll's; a gloo group over the same
ranks computes the reference. Writes ``{out}/rank{r}.json`` with the checks made and any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

import pycoll.torch  # noqa: F401  (registers the backend)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8]
COUNTS = [1, 7, 1000, 65537]
R = dist.ReduceOp


class Checker:
    def __init__(self, rank: int) -> None:
        self.rank, self.checks, self.failures = rank, 0, []

    def same(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.checks += 1
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            self.failures.append(f"{what}: got {got.flatten()[:6].tolist()}... want {want.flatten()[:6].tolist()}...")


def data(rank: int, count: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Small integer values, the same on every run, exact in every dtype and under 3-rank products."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * count + salt)
    return torch.randint(1, 5, (count,), generator=g).to(dtype)


def ops_for(dtype: torch.dtype) -> list:
    if dtype.is_floating_point:
        return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]


def run(ck: Checker, gloo: dist.ProcessGroup) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    for dtype in DTYPES:
        for count in COUNTS:
            tag = f"{dtype}/{count}"
            x = data(r, count, dtype)
            for op in ops_for(dtype):
                got = x.clone()
                dist.all_reduce(got, op=op)
                want = x.clone()
                if op == R.AVG:  # gloo has no AVG: its SUM, divided as torch divides
                    dist.all_reduce(want, op=R.SUM, group=gloo)
                    want = want / n
                else:
                    dist.all_reduce(want, op=op, group=gloo)
                ck.same(f"all_reduce {op} {tag}", got, want)
            # a non-contiguous tensor, reduced in place through a copy
            pair = torch.stack([x, x], dim=1)  # column 0 is a strided view
            dist.all_reduce(pair[:, 0])
            want = x.clone()
            dist.all_reduce(want, group=gloo)
            ck.same(f"all_reduce non-contiguous {tag}", pair[:, 0].contiguous(), want)
            ck.same(f"all_reduce non-contiguous, other column untouched {tag}", pair[:, 1].contiguous(), x)
            for root in range(n):
                got, want = x.clone(), x.clone()
                dist.broadcast(got, root)
                dist.broadcast(want, root, group=gloo)
                ck.same(f"broadcast root {root} {tag}", got, want)
                got, want = x.clone(), x.clone()
                dist.reduce(got, root, op=R.MAX)
                dist.reduce(want, root, op=R.MAX, group=gloo)
                if r == root:
                    ck.same(f"reduce root {root} {tag}", got, want)
            outs, refs = [torch.empty(count, dtype=dtype) for _ in range(n)], [torch.empty(count, dtype=dtype) for _ in range(n)]
            dist.all_gather(outs, x)
            dist.all_gather(refs, x, group=gloo)
            for q in range(n):
                ck.same(f"all_gather [{q}] {tag}", outs[q], refs[q])
            got, want = torch.empty(n * count, dtype=dtype), torch.empty(n * count, dtype=dtype)
            dist.all_gather_into_tensor(got, x)
            dist.all_gather_into_tensor(want, x, group=gloo)
            ck.same(f"all_gather_into_tensor {tag}", got, want)
            parts = [data(r, count, dtype, salt=q + 1) for q in range(n)]
            got, want = torch.empty(count, dtype=dtype), torch.empty(count, dtype=dtype)
            dist.reduce_scatter(got, parts)
            _reduce_scatter_reference(want, parts, gloo)
            ck.same(f"reduce_scatter {tag}", got, want)
            flat = torch.cat(parts)
            got = torch.empty(count, dtype=dtype)
            dist.reduce_scatter_tensor(got, flat)
            ck.same(f"reduce_scatter_tensor {tag}", got, want)
            outs, refs = [torch.empty(count, dtype=dtype) for _ in range(n)], [torch.empty(count, dtype=dtype) for _ in range(n)]
            dist.all_to_all(outs, parts)
            dist.all_to_all(refs, parts, group=gloo)
            for q in range(n):
                ck.same(f"all_to_all [{q}] {tag}", outs[q], refs[q])
            for root in (0, n - 1):
                gl = [torch.empty(count, dtype=dtype) for _ in range(n)] if r == root else None
                gr = [torch.empty(count, dtype=dtype) for _ in range(n)] if r == root else None
                dist.gather(x, gl, dst=root)
                dist.gather(x, gr, dst=root, group=gloo)
                if r == root:
                    for q in range(n):
                        ck.same(f"gather root {root} [{q}] {tag}", gl[q], gr[q])
                got, want = torch.empty(count, dtype=dtype), torch.empty(count, dtype=dtype)
                dist.scatter(got, parts if r == root else None, src=root)
                dist.scatter(want, parts if r == root else None, src=root, group=gloo)
                ck.same(f"scatter root {root} {tag}", got, want)
        # all_gather_coalesced: outputs[rank][k] is rank's inputs[k]; as many inputs as ranks (where a transposed
        # layout would pass silently) and one more (where it would raise)
        for k_inputs in (n, n + 1):
            ins = [data(r, 3 + k, dtype, salt=k) for k in range(k_inputs)]
            outs = [[torch.empty(3 + k, dtype=dtype) for k in range(k_inputs)] for _ in range(n)]
            refs = [[torch.empty(3 + k, dtype=dtype) for k in range(k_inputs)] for _ in range(n)]
            dist.all_gather_coalesced(outs, ins)
            dist.all_gather_coalesced(refs, ins, group=gloo)
            for q in range(n):
                for k in range(k_inputs):
                    ck.same(f"all_gather_coalesced [{q}][{k}] of {k_inputs} {dtype}", outs[q][k], refs[q][k])
        # all_to_all_single, even and with uneven split sizes (rank q sends q+1+r rows to each... per peer)
        rows_in = [(r + q) % 3 + 1 for q in range(n)]
        rows_out = [(q + r) % 3 + 1 for q in range(n)]
        inp = torch.arange(sum(rows_in) * 2).reshape(-1, 2).to(dtype) + r
        got, want = torch.empty(sum(rows_out), 2, dtype=dtype), torch.empty(sum(rows_out), 2, dtype=dtype)
        dist.all_to_all_single(got, inp, rows_out, rows_in)
        dist.all_to_all_single(want, inp, rows_out, rows_in, group=gloo)
        ck.same(f"all_to_all_single uneven {dtype}", got, want)
        inp = data(r, 6 * n, dtype)
        got, want = torch.empty(6 * n, dtype=dtype), torch.empty(6 * n, dtype=dtype)
        dist.all_to_all_single(got, inp)
        dist.all_to_all_single(want, inp, group=gloo)
        ck.same(f"all_to_all_single even {dtype}", got, want)
    _sparse(ck, r, gloo)
    _point_to_point(ck, r, n)
    _subgroups(ck, r, n)
    dist.barrier()
    ck.checks += 1


def _reduce_scatter_reference(out: torch.Tensor, parts: list[torch.Tensor], gloo: dist.ProcessGroup) -> None:
    """gloo's reduce_scatter where it has one, else its allreduce of the whole list, then this rank's block."""
    try:
        dist.reduce_scatter(out, parts, group=gloo)
    except (RuntimeError, NotImplementedError):
        whole = torch.cat(parts)
        dist.all_reduce(whole, group=gloo)
        out.copy_(whole.view(len(parts), -1)[dist.get_rank()])


def _point_to_point(ck: Checker, r: int, n: int) -> None:
    for dtype in DTYPES:
        nxt, prv = (r + 1) % n, (r - 1) % n
        x = data(r, 513, dtype)
        got = torch.empty(513, dtype=dtype)
        reqs = [dist.isend(x, nxt), dist.irecv(got, prv)]
        for w in reqs:
            w.wait()
        ck.same(f"isend/irecv ring {dtype}", got, data(prv, 513, dtype))
    if r == 0:  # receive from any source: every other rank sends its rank
        seen = set()
        for _ in range(n - 1):
            t = torch.empty(1, dtype=torch.int64)
            src = dist.recv(t)
            ck.same(f"recv any source from {src}", t, torch.tensor([src]))
            seen.add(src)
        ck.checks += 1
        if seen != set(range(1, n)):
            ck.failures.append(f"recv any source saw {sorted(seen)}")
    else:
        dist.send(torch.tensor([r]), 0)


def _subgroups(ck: Checker, r: int, n: int) -> None:
    members = [0, n - 1]
    sub = dist.new_group(members)
    sub_gloo = dist.new_group(members, backend="gloo")
    x = data(r, 100, torch.float32)
    if r in members:
        got, want = x.clone(), x.clone()
        dist.all_reduce(got, group=sub)
        dist.all_reduce(want, group=sub_gloo)
        ck.same("subgroup all_reduce", got, want)
        got, want = x.clone(), x.clone()
        dist.broadcast(got, src=n - 1, group=sub)
        dist.broadcast(want, src=n - 1, group=sub_gloo)
        ck.same("subgroup broadcast from global rank n-1", got, want)


def _sparse(ck: Checker, r: int, gloo: dist.ProcessGroup) -> None:
    """Sparse (COO) all_reduce, as embedding gradients use it: with and without dense dimensions, a rank with
    no entries, repeated indices."""
    for dtype in (torch.float32, torch.float64, torch.int64):
        for dense in ((), (3,)):
            g = torch.Generator().manual_seed(r + 11)
            nnz = 0 if r == 1 else 5 + r
            idx = torch.randint(0, 6, (2, nnz), generator=g)
            val = torch.randint(1, 9, (nnz, *dense), generator=g).to(dtype)
            got = torch.sparse_coo_tensor(idx, val, (6, 6, *dense))
            want = got.clone()
            dist.all_reduce(got)
            dist.all_reduce(want, group=gloo)
            ck.same(f"sparse all_reduce {dtype} dense {dense}", got.to_dense(), want.to_dense())
            ck.checks += 1
            if got.layout != torch.sparse_coo:
                ck.failures.append(f"sparse all_reduce {dtype}: the result's layout is {got.layout}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--init", default="env", choices=["env", "store", "tcp"])
    ap.add_argument("--quick", action="store_true", help="float32 and int64, two counts: for the launcher variants")
    args = ap.parse_args()
    if args.quick:
        DTYPES[:] = [torch.float32, torch.int64]
        COUNTS[:] = [7, 1000]
    if args.init == "env":
        dist.init_process_group("pycoll")
    elif args.init == "store":
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, rank == 0)
        dist.init_process_group("pycoll", store=store, rank=rank, world_size=size)
    else:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        url = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        dist.init_process_group("pycoll", init_method=url, rank=rank, world_size=size)
    ck = Checker(dist.get_rank())
    result = {"rank": dist.get_rank(), "backend": dist.get_backend()}
    try:
        gloo = dist.new_group(backend="gloo")
        run(ck, gloo)
    except Exception:
        result["error"] = traceback.format_exc()
    result.update(checks=ck.checks, failures=ck.failures)
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
