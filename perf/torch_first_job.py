"""A torch job's first calls on the "pycoll" backend, each timed: the slowest call after the first, from start-up.

What a new user's first job does, in a process that has made no collective yet: init_process_group, then a mix
of collectives at sizes from 4 KiB to 16 MiB (every one the first of its size and kind), then a few DDP steps on
a small MLP. Every call's wall time is kept, and each collective is made a second time to show what it costs warm;
the slowest rank's times are reported, with the slowest call other than the job's first. The kernels are those the install built ahead of time (``pip install`` runs the build; a
checkout without them builds them here first, as ``pycoll warmup`` does, and the job says so).

    flock /tmp/pycoll-bench.lock pycoll run -n 2 -- python perf/torch_first_job.py [--json FILE] [--backend gloo]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

T0 = time.perf_counter()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import pycoll.torch  # noqa: E402,F401

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]


def _calls(rank: int, world: int):
    """(label, call) in the order a first job makes them."""
    for nbytes in SIZES:
        n = nbytes // 4
        t = torch.ones(n)
        yield f"all_reduce {nbytes}", lambda t=t: dist.all_reduce(t)
        yield f"broadcast {nbytes}", lambda t=t: dist.broadcast(t, 0)
        out = torch.empty(n * world)
        yield f"all_gather_into_tensor {nbytes}", lambda t=t, out=out: dist.all_gather_into_tensor(out, t)
        small = torch.empty(n // world if n >= world else 1)
        src = torch.ones(small.numel() * world)
        yield f"reduce_scatter_tensor {nbytes}", lambda small=small, src=src: dist.reduce_scatter_tensor(small, src)
        yield f"all_reduce async {nbytes}", lambda t=t: dist.all_reduce(t, async_op=True).wait()
    yield "barrier", dist.barrier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--ddp-steps", type=int, default=5)
    ap.add_argument("--backend", default="pycoll", help="pycoll, or gloo for the same job on gloo")
    args = ap.parse_args()
    from pycoll import native

    built_here = native.load("arena") is None  # no ahead-of-time kernels: the first calls would build them
    t_init = time.perf_counter()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    init_s = time.perf_counter() - t_init
    warnings.simplefilter("ignore", FutureWarning)  # reduce_scatter_tensor's rename in newer torch
    labels, times, again = [], [], []
    for label, call in _calls(rank, world):
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        call()  # the same call once more: what the first one costs beyond it
        again.append(time.perf_counter() - t1)
        times.append(t1 - t0)
        labels.append(label)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))
    for step in range(args.ddp_steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        labels.append(f"DDP step {step}")
    again += [float("nan")] * (len(times) - len(again))
    slowest = torch.tensor([times, again], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    ms, ms_again = ([float(v) * 1e3 for v in row] for row in slowest)
    after_first = max(range(1, len(ms)), key=lambda i: ms[i])
    if rank == 0:
        print(f"# first torch job on {args.backend}, {world} ranks: start-up to init {(t_init - T0) * 1e3:.0f} ms, "
              f"init_process_group {init_s * 1e3:.0f} ms{' (kernels built here)' if built_here else ''}")
        print("| call | first, ms (slowest rank) | the same call again, ms |\n|---|---:|---:|")
        for label, v, w in zip(labels, ms, ms_again):
            print(f"| {label} | {v:.2f} | {'-' if w != w else f'{w:.2f}'} |")
        print(f"slowest after the first: {labels[after_first]}, {ms[after_first]:.1f} ms (target < 100 ms); "
              f"the same call again: {ms_again[after_first]:.1f} ms")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"backend": args.backend, "ranks": world, "import_ms": (t_init - T0) * 1e3, "init_ms": init_s * 1e3,
                           "kernels_built_here": built_here, "calls": [{"call": lab, "ms": v, "again_ms": w if w == w else None}
                                     for lab, v, w in zip(labels, ms, ms_again)],
                           "slowest_after_first": {"call": labels[after_first], "ms": ms[after_first]}}, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
