"""Rank program: every pycoll.horovod.torch operation checked against NumPy, on 1 to 4 ranks.

Writes ``{out}/rank{r}.json``: the checks made, the failures, a digest of every result (fusion on and off must give
the same), and the engine's counters. ``--part`` picks a part: ``ops`` (the default), ``join``, ``errors``
(mismatches, a stall warning), ``order`` (named tensors in a random order per rank, repeated: the cache).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
import traceback

import numpy as np
import torch

import pycoll.horovod.torch as hvd
from pycoll.horovod.torch import processes as hvd_processes
from pycoll.errors import MismatchError

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
COUNTS = [0, 1, 7, 1000]


class Checker:
    def __init__(self) -> None:
        self.checks, self.failures = 0, []
        self.digest = hashlib.sha256()

    def expect(self, cond: bool, what: str) -> None:
        self.checks += 1
        if not cond:
            self.failures.append(what)

    def same(self, got: torch.Tensor, want: np.ndarray, what: str, exact: bool = True) -> None:
        g = got.detach().to(torch.float64).numpy() if got.dtype in (torch.bfloat16, torch.float16) else got.numpy()
        w = np.asarray(want)
        if got.numel():
            self.digest.update(got.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        if g.shape != w.shape:
            self.expect(False, f"{what}: shape {g.shape}, want {w.shape}")
        elif exact:
            self.expect(np.array_equal(g, w.astype(g.dtype)), f"{what}: {g.ravel()[:6]} != {w.ravel()[:6]}")
        else:
            self.expect(np.allclose(g, w, rtol=2e-2, atol=1e-2), f"{what}: {g.ravel()[:6]} !~ {w.ravel()[:6]}")


def data(dtype: torch.dtype, count: int, r: int, salt: int) -> torch.Tensor:
    """Small integers (exact in every dtype, sums and products too), different on every rank."""
    rng = np.random.default_rng(1000 * r + salt)
    lo = 1 if dtype == torch.uint8 else -3
    return torch.from_numpy(rng.integers(lo, 4, count).astype(np.float64)).to(dtype)


def ref_reduce(op: int, inputs: list[np.ndarray]) -> np.ndarray:
    stack = np.stack(inputs).astype(np.float64)
    if op in (hvd.Sum, hvd.Average):
        out = stack.sum(0)
        return out / len(inputs) if op == hvd.Average else out
    return {hvd.Min: stack.min(0), hvd.Max: stack.max(0), hvd.Product: stack.prod(0)}[op]


def as_np(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy()


def part_ops(ck: Checker, r: int, n: int) -> None:
    salt = 0
    for dtype in DTYPES:
        for count in COUNTS:
            for op in (hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product):
                if op == hvd.Product and dtype == torch.uint8 and n > 3:
                    continue  # 3**4 overflows uint8
                salt += 1
                inputs = [as_np(data(dtype, count, q, salt)) for q in range(n)]
                want = ref_reduce(op, inputs)
                integer = not dtype.is_floating_point
                if op == hvd.Average and integer:
                    want = np.trunc(want)  # Horovod scales integers and truncates
                elif op == hvd.Average and dtype in (torch.float32, torch.float64):  # the sum times 1/n, as Horovod
                    kind = np.float32 if dtype == torch.float32 else np.float64
                    want = ref_reduce(hvd.Sum, inputs).astype(kind) * kind(1.0 / n)
                exact = not (op == hvd.Average and dtype in (torch.float16, torch.bfloat16))
                what = f"allreduce {dtype} n={count} op={op}"
                mine = data(dtype, count, r, salt)
                ck.same(hvd.allreduce(mine, op=op, name=f"ar.{salt}"), want, what, exact)
                ck.same(mine, inputs[r], what + " (input untouched)")
                inplace = data(dtype, count, r, salt)
                hvd.allreduce_(inplace, op=op, name=f"ar_.{salt}")
                ck.same(inplace, want, what + " in place", exact)
    # scales, compression, non-contiguous, grouped
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4) + r
    base = sum(np.arange(12, dtype=np.float64).reshape(3, 4) + q for q in range(n))
    ck.same(hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5, name="scaled"), base, "scales")
    ck.same(hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16, name="fp16"), base, "fp16 compression")
    ck.expect(hvd.allreduce(t, compression=hvd.Compression.fp16).dtype == torch.float32, "fp16 comes back float32")
    nc = (torch.arange(24, dtype=torch.float64).reshape(4, 6) + r).t()
    want = sum(np.arange(24, dtype=np.float64).reshape(4, 6).T + q for q in range(n))
    ck.same(hvd.allreduce(nc, op=hvd.Sum, name="nc"), want, "non-contiguous")
    hvd.allreduce_(nc, op=hvd.Sum, name="nc_")
    ck.same(nc, want, "non-contiguous in place")
    group = [torch.full((k + 1,), float(r + k)) for k in range(5)]
    outs = hvd.grouped_allreduce(group, op=hvd.Sum, name="grp")
    for k, o in enumerate(outs):
        ck.same(o, np.full(k + 1, float(sum(q + k for q in range(n)))), f"grouped {k}")
    hvd.grouped_allreduce_(group, op=hvd.Average)
    for k, o in enumerate(group):
        ck.same(o, np.full(k + 1, sum(q + k for q in range(n)) / n), f"grouped in place {k}")
    # scales applied on the way into and out of the fusion buffer: floats, and integers truncated at each scaling
    scaled = [torch.full((k + 2,), float(r + k)) for k in range(4)]
    outs = hvd.grouped_allreduce(scaled, op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.25, name="grp.scaled")
    for k, o in enumerate(outs):
        ck.same(o, np.full(k + 2, sum(3.0 * (q + k) for q in range(n)) * 0.25), f"grouped scaled {k}")
    ints = [torch.full((k + 3,), 2 * r + k + 1, dtype=torch.int32) for k in range(3)]
    hvd.grouped_allreduce_(ints, op=hvd.Sum, prescale_factor=1.5, postscale_factor=0.5, name="grp.int")
    for k, o in enumerate(ints):
        total = sum(int((2 * q + k + 1) * 1.5) for q in range(n))
        ck.same(o, np.full(k + 3, int(total * 0.5), np.int32), f"grouped int scaled {k}")
    # allgather: first dimensions differ by rank (rank 0 sends none when n > 1)
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        rows = [q if n > 1 else 2 for q in range(n)]
        mine = torch.full((rows[r], 3), float(r + 1)).to(dtype)
        want = np.concatenate([np.full((rows[q], 3), float(q + 1)) for q in range(n)])
        ck.same(hvd.allgather(mine, name=f"ag.{dtype}"), want, f"allgather {dtype}")
    ck.same(hvd.allgather(torch.tensor(float(r))), np.arange(n, dtype=np.float32), "allgather of a scalar")
    # broadcast from every root, new tensor and in place
    for root in range(n):
        t = torch.arange(9, dtype=torch.float64) * (r + 1)
        ck.same(hvd.broadcast(t, root, name=f"bc.{root}"), np.arange(9) * (root + 1), f"broadcast root {root}")
        ck.same(t, np.arange(9) * (r + 1), f"broadcast root {root}: input untouched")
        hvd.broadcast_(t, root, name=f"bc_.{root}")
        ck.same(t, np.arange(9) * (root + 1), f"broadcast_ root {root}")
    # alltoall: equal parts, then rank q sends (q + d) % 3 rows of width 2 to rank d
    out, received = hvd.alltoall(torch.arange(2 * n) + 100 * r)
    ck.same(out, np.concatenate([np.arange(2 * r, 2 * r + 2) + 100 * q for q in range(n)]), "alltoall equal")
    ck.expect(received.tolist() == [2] * n, f"alltoall received splits {received.tolist()}")
    splits = [(r + d) % 3 for d in range(n)]
    rows = torch.cat([torch.full((k, 2), float(10 * r + d)) for d, k in enumerate(splits)]) if sum(splits) else \
        torch.zeros(0, 2)
    out, received = hvd.alltoall(rows, splits=splits, name="a2a.splits")
    want = np.concatenate([np.full(((q + r) % 3, 2), float(10 * q + r)) for q in range(n)]) if n else None
    ck.same(out, want.reshape(-1, 2), "alltoall with splits")
    ck.expect(received.tolist() == [(q + r) % 3 for q in range(n)], f"alltoall splits received {received.tolist()}")
    # reducescatter: 2n+1 rows, the first ranks one more
    t = torch.arange((2 * n + 1) * 2, dtype=torch.float32).reshape(2 * n + 1, 2) + r
    full = sum(np.arange((2 * n + 1) * 2, dtype=np.float64).reshape(2 * n + 1, 2) + q for q in range(n))
    start = sum(2 + (1 if q < 1 else 0) for q in range(r))
    mine = 2 + (1 if r < 1 else 0)
    ck.same(hvd.reducescatter(t, op=hvd.Sum, name="rs"), full[start:start + mine], "reducescatter sum")
    ck.same(hvd.reducescatter(t, name="rs.avg"), full[start:start + mine] / n, "reducescatter average")
    # objects, barrier, async handles and poll
    ck.expect(hvd.broadcast_object({"from": r, "list": list(range(r + 3))}, root_rank=n - 1) ==
              {"from": n - 1, "list": list(range(n + 2))}, "broadcast_object")
    ck.expect(hvd.allgather_object(("rank", r) * (r + 1)) == [("rank", q) * (q + 1) for q in range(n)],
              "allgather_object")
    for _ in range(3):
        hvd.barrier()
    handles = [hvd.allreduce_async(torch.full((4,), float(k + r)), op=hvd.Sum, name=f"async.{k}") for k in range(8)]
    for k in reversed(range(8)):
        got = hvd.synchronize(handles[k])
        ck.same(got, np.full(4, float(sum(k + q for q in range(n)))), f"async {k}")
    h = hvd.allreduce_async(torch.ones(3), name="polled")
    while not hvd.poll(h):
        time.sleep(0.001)
    ck.same(hvd.synchronize(h), np.ones(3), "poll then synchronize")
    try:
        hvd.synchronize(h)
        ck.expect(False, "a handle synchronized twice raised nothing")
    except ValueError:
        ck.expect(True, "")
    # a process set of the first two ranks (every rank creates it)
    if n >= 2:
        ps = hvd.add_process_set([0, 1])
        if r < 2:
            got = hvd.allreduce(torch.full((3,), float(r + 1)), op=hvd.Sum, process_set=ps, name="ps")
            ck.same(got, np.full(3, 3.0), "process set allreduce")
            ck.expect(ps.size() == 2 and ps.rank() == r, "process set rank and size")
        else:
            ck.expect(not ps.included(), "a rank outside the set is not included")
        hvd.barrier()
        hvd.remove_process_set(ps)


def part_join(ck: Checker, r: int, n: int) -> None:
    """Rank q runs q + 1 steps, then joins; a step's sum counts only the ranks still in (the others add zeros)."""
    for step in range(r + 1):
        got = hvd.allreduce(torch.full((5,), float(r + 1)), op=hvd.Sum, name="step")
        ck.same(got, np.full(5, float(sum(q + 1 for q in range(n) if q >= step))), f"step {step} with joined ranks")
    last = hvd.join()
    ck.expect(last == n - 1, f"join returned {last}, the last to join is {n - 1}")
    got = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after-join")
    ck.same(got, np.full(2, float(n)), "allreduce after everyone joined")


def part_errors(ck: Checker, r: int, n: int) -> None:
    # shapes that differ: every rank gets a MismatchError naming the tensor; the engine goes on
    try:
        hvd.allreduce(torch.ones(3 + (r == n - 1)), name="bad.shape")
        ck.expect(n == 1, "a shape mismatch raised nothing")
    except MismatchError as exc:
        ck.expect("bad.shape" in str(exc) and "shape" in str(exc) and str(n - 1) in str(exc),
                  f"the mismatch names the tensor, the field and the rank: {exc}")
    try:
        hvd.allreduce(torch.ones(2), op=hvd.Sum if r else hvd.Max, name="bad.op")
        ck.expect(n == 1, "an op mismatch raised nothing")
    except MismatchError as exc:
        ck.expect("bad.op" in str(exc) and " op" in str(exc), f"the op mismatch: {exc}")
    ck.same(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="fine"), np.full(2, float(n)), "the engine goes on")
    # a cached tensor whose shape changes on every rank: the cache entry is dropped, it is negotiated again
    for k in (3, 3, 5, 5):
        ck.same(hvd.allreduce(torch.ones(k), op=hvd.Sum, name="reshaped"), np.full(k, float(n)), f"reshaped {k}")
    # a stall: the last rank submits 1.5 s after the others; rank 0 warns, naming it
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("pycoll.horovod").addHandler(Keep())
    if r == n - 1:
        time.sleep(1.5)
    ck.same(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="late"), np.full(2, float(n)), "the late tensor")
    if r == 0 and n > 1:
        stalls = [m for m in records if "stall" in m and "late" in m]
        ck.expect(bool(stalls) and f"[{n - 1}]" in stalls[0], f"a stall warning names rank {n - 1}: {records}")
    try:
        hvd.allreduce(torch.ones(2), op=hvd.Adasum)
        ck.expect(False, "Adasum raised nothing")
    except NotImplementedError as exc:
        ck.expect("Adasum" in str(exc), f"Adasum's error: {exc}")


def part_order(ck: Checker, r: int, n: int) -> None:
    """20 named tensors submitted in a different random order on every rank, 6 times: right every time, and once
    the set repeats the cache answers (no more rounds through the coordinator)."""
    rng = np.random.default_rng(r)
    engine = hvd_processes.current_state().engine
    negotiations = []
    for it in range(6):
        order = rng.permutation(20)
        handles = {k: hvd.allreduce_async(torch.full((k + 1,), float(r * k + it)), op=hvd.Sum, name=f"g.{k}")
                   for k in order}
        for k in range(20):
            ck.same(hvd.synchronize(handles[k]), np.full(k + 1, float(sum(q * k + it for q in range(n)))),
                    f"iteration {it} tensor {k}")
        hvd.barrier()
        negotiations.append(engine.negotiations)
    ck.expect(negotiations[-1] == negotiations[2], f"rounds through the coordinator once cached: {negotiations}")
    ck.expect(len(engine.cached) >= 20, f"{len(engine.cached)} cache entries")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--part", default="ops", choices=["ops", "join", "errors", "order"])
    args = ap.parse_args()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    ck = Checker()
    result: dict = {"rank": r}
    try:
        {"ops": part_ops, "join": part_join, "errors": part_errors, "order": part_order}[args.part](ck, r, n)
    except Exception:
        result["error"] = traceback.format_exc()
    engine = hvd_processes.current_state().engine
    result.update(checks=ck.checks, failures=ck.failures, digest=ck.digest.hexdigest(), cycles=engine.cycles,
                  negotiations=engine.negotiations, fused=engine.fused_calls, size=n,
                  overlap=hvd_processes.current_state().loop.overlap)
    hvd.shutdown()
    with open(os.path.join(args.out, f"rank{r}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
