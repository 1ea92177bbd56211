"""Rank program: the async Work and its future, and the errors of the "pycoll" backend. Two ranks or more.

Writes ``{out}/rank{r}.json`` with the checks made and any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import traceback

import torch
import torch.distributed as dist

import pycoll.torch  # noqa: F401
from pycoll import runtime as pycoll_runtime
from pycoll.errors import InvalidArgumentError
from pycoll.torch import registration, threads as torch_threads


def run(r: int, n: int, fail: list[str]) -> int:
    checks = 0

    def expect(cond: bool, what: str) -> None:
        nonlocal checks
        checks += 1
        if not cond:
            fail.append(what)

    # async: several in flight, completed out of order; wait() and the future's value
    ts = [torch.full((1000,), float(r + k)) for k in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for k in reversed(range(4)):
        expect(works[k].wait() is True, f"wait() of work {k} returned True")
        expect(works[k].is_completed(), f"work {k} completed after wait")
        expect(works[k].is_success(), f"work {k} succeeded")
        want = float(sum(q + k for q in range(n)))
        expect(bool((ts[k] == want).all()), f"async allreduce {k}: {ts[k][0].item()} != {want}")
    t = torch.ones(10)
    fut = dist.all_reduce(t, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2).wait()
    expect(bool((doubled == 2 * n).all()), f"future.then on allreduce gave {doubled[0].item()}")
    expect(fut.value()[0] is t, "the future's value is the reduced tensor itself")
    out = [torch.empty(3) for _ in range(n)]
    fut = dist.all_gather(out, torch.full((3,), float(r)), async_op=True).get_future()
    fut.wait()
    expect([o[0].item() for o in out] == [float(q) for q in range(n)], f"async all_gather gave {[o[0].item() for o in out]}")
    # a receive with a tensor too small: its Work raises, and the group still works afterwards
    if r == 0:
        dist.send(torch.ones(8), 1)
    elif r == 1:
        w = dist.irecv(torch.empty(4), 0)
        try:
            w.wait()
            expect(False, "a receive into a too-small tensor raised nothing")
        except Exception as exc:  # torch may wrap it
            expect("recv" in str(exc) and ("byte" in str(exc) or "large" in str(exc) or "trunc" in str(exc)),
                   f"the receive error names the operation and the cause: {exc}")
        expect(not w.is_success() and w.exception() is not None, "the failed Work reports its error")
    t = torch.ones(5)
    dist.all_reduce(t)
    expect(bool((t == n).all()), "allreduce after a failed receive")
    # bad input raises at once, in the caller, naming the operation; nothing is sent
    for what, call, words in [
        ("AVG on int64", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG), ["allreduce", "AVG"]),
        ("BAND on float", lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND), ["allreduce", "BAND"]),
        ("uint16 tensor", lambda: dist.all_reduce(torch.ones(2, dtype=torch.uint16)), ["allreduce", "uint16"]),
        ("meta device", lambda: dist.broadcast(torch.ones(2, device="meta"), 0), ["broadcast", "meta"]),
        ("bad split sizes", lambda: dist.all_to_all_single(torch.empty(4), torch.empty(4), [1] * n, [3] * n), ["all_to_all_single", "split"]),
        ("bad output size", lambda: dist.all_gather_into_tensor(torch.empty(3), torch.empty(2)), ["all_gather_into_tensor", "elements"]),
    ]:
        try:
            call()
            expect(False, f"{what}: no error")
        except InvalidArgumentError as exc:
            expect(all(w in str(exc) for w in words), f"{what}: the error names {words}: {exc}")
            expect(exc.rank == r, f"{what}: the error names rank {r}: {exc.rank}")
        except Exception as exc:
            expect(False, f"{what}: {type(exc).__name__} instead of InvalidArgumentError: {exc}")
    t = torch.ones(5)
    dist.all_reduce(t)
    expect(bool((t == n).all()), "allreduce after rejected calls")
    # a large call the caller waits for at once (async_op=False) runs in the caller's thread, pycoll's blocking call
    comm = dist.group.WORLD.comm
    rt = pycoll_runtime.current()
    no_spare = rt.machine_cores <= len(rt.machine_ranks)
    threads: list[threading.Thread] = []
    blocking, posting = comm.Allreduce, comm.Iallreduce
    comm.Allreduce = lambda *a, **k: (threads.append(threading.current_thread()), blocking(*a, **k))[1]
    comm.Iallreduce = lambda *a, **k: (threads.append(threading.current_thread()), posting(*a, **k))[1]
    try:
        big = torch.full((1 << 19,), float(r))  # 2 MiB, above the size that always runs inline
        dist.all_reduce(big)
        expect(threads == [threading.main_thread()], f"a blocking 2 MiB all_reduce ran in {threads}")
        expect(bool((big == sum(range(n))).all()), "blocking 2 MiB all_reduce")
        # with a core to spare for each rank, an async call from 1 MiB goes to the progress thread; where the
        # machine's ranks have a core each at most, it runs in the caller's thread (nothing to overlap on)
        expect(torch_threads.inline_bytes[0] == (torch_threads.EVERY_SIZE if no_spare else torch_threads.INLINE_BYTES),
               f"inline limit {torch_threads.inline_bytes[0]} for {len(rt.machine_ranks)} ranks on {rt.machine_cores} cores")
        want = sum(range(n))
        for spare in (True, False):
            torch_threads.inline_bytes[0] = torch_threads.INLINE_BYTES if spare else torch_threads.EVERY_SIZE
            with registration._progress._start_lock:  # the thread may still be leaving the last job, which it ran itself
                pass
            threads.clear()
            dist.all_reduce(big, async_op=True).wait()
            want *= n
            if spare:
                expect(len(threads) == 1 and threads[0] is not threading.main_thread(), f"an async 2 MiB all_reduce ran in {threads}")
            else:
                expect(threads == [threading.main_thread()], f"an async 2 MiB all_reduce without a spare core ran in {threads}")
            expect(bool((big == want).all()), f"async 2 MiB all_reduce (spare core: {spare})")
    finally:
        del comm.Allreduce, comm.Iallreduce
        torch_threads.inline_bytes[0] = torch_threads.EVERY_SIZE if no_spare else torch_threads.INLINE_BYTES
    # batch_isend_irecv (coalesced point-to-point)
    nxt, prv = (r + 1) % n, (r - 1) % n
    got = torch.empty(6)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((6,), float(r)), nxt), dist.P2POp(dist.irecv, got, prv)]):
        w.wait()
    expect(bool((got == prv).all()), f"batch_isend_irecv got {got[0].item()} from {prv}")
    return checks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("pycoll")
    r, n = dist.get_rank(), dist.get_world_size()
    fail: list[str] = []
    result: dict = {"rank": r}
    try:
        result["checks"] = run(r, n, fail)
    except Exception:
        result["error"] = traceback.format_exc()
    result["failures"] = fail
    with open(os.path.join(args.out, f"rank{r}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
