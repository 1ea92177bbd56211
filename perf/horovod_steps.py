"""Training steps through Horovod's API on pycoll (fusion on and off) beside DDP on pycoll and on gloo, same processes.

The model has many small parameter tensors, as Horovod's fusion is for: 200 bias-free linear layers of 4-64 KiB
each (widths cycling through 32, 64 and 128) between two 1024x1024 layers (4 MiB each), float32. Each round runs
every variant for ``--steps`` timed steps after 2 warm-up steps, in the order: no communication (each rank steps
its own model, the floor of every variant), DDP on gloo, DDP on pycoll,
``DistributedOptimizer`` with fusion, the same with fusion off (threshold 0), and with fusion and the background
thread's overlap forced on (``PYCOLL_HVD_OVERLAP=on``: where the ranks fill the host's cores, ``auto`` leaves it off);
the variants alternate over ``--rounds``. Horovod's engine is started for its variants and shut down before the DDP
ones (one thread calls pycoll at a time). A step's time is the slowest rank's; each variant's figure is the median over all its steps.

    flock /tmp/pycoll-bench.lock pycoll run -n 2 -- python perf/horovod_steps.py --json perf/results/horovod/steps-np2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import pycoll.horovod.torch as hvd
from pycoll.horovod.torch import processes as hvd_processes
import pycoll.torch  # noqa: F401  (the "pycoll" backend)

WIDTHS = [32, 64, 128]


def make_model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, WIDTHS[0], bias=False)]
    for i in range(layers):
        mods += [nn.Linear(WIDTHS[i % 3], WIDTHS[(i + 1) % 3], bias=False), nn.ReLU()]
    mods += [nn.Linear(WIDTHS[layers % 3], 1024, bias=False), nn.Linear(1024, 1024)]
    return nn.Sequential(*mods)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(32, 1024, generator=g), torch.randn(32, 1024, generator=g)


def steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, rank: int, barrier) -> list[float]:
    times = []
    for k in range(n + 2):
        x, y = batch(k, rank)
        barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if k >= 2:
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    dist.init_process_group("pycoll")
    gloo = dist.new_group(backend="gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    shapes = [tuple(p.shape) for p in make_model(args.layers).parameters()]
    small = [s for s in shapes if 4 << 10 <= 4 * int(torch.tensor(s).prod()) <= 64 << 10]
    variants = (("hvd-fusion", True, None), ("hvd-no-fusion", False, None), ("hvd-fusion-overlap-on", True, True))
    times: dict[str, list[float]] = {"no-communication": [], "ddp-gloo": [], "ddp-pycoll": [],
                                     **{v[0]: [] for v in variants}}
    counters: dict[str, list] = {v[0]: [] for v in variants}
    for _ in range(args.rounds):
        # the floor: every rank steps its own model side by side, nothing reduced (no step with communication is faster)
        model = make_model(args.layers)
        times["no-communication"] += steps(model, torch.optim.SGD(model.parameters(), lr=1e-4), args.steps, rank,
                                           lambda: dist.barrier(group=gloo))
        for name, group in (("ddp-gloo", gloo), ("ddp-pycoll", None)):
            model = DDP(make_model(args.layers), process_group=group)
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            times[name] += steps(model, opt, args.steps, rank, lambda: dist.barrier(group=gloo))
            del model, opt
        hvd.init()
        engine, loop = hvd_processes.current_state().engine, hvd_processes.current_state().loop
        fused, overlap = engine.threshold or 64 << 20, loop.overlap
        for name, fusion, overlap_on in variants:
            engine.threshold = fused if fusion else 0  # the same engine, fusion on or off (read at each cycle)
            loop.overlap = overlap if overlap_on is None else overlap_on  # PYCOLL_HVD_OVERLAP's choice, or forced on
            model = make_model(args.layers)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                           named_parameters=model.named_parameters())
            before = (engine.cycles, engine.fused_calls)
            times[name] += steps(model, opt, args.steps, rank, hvd.barrier)
            counters[name].append((engine.cycles - before[0], engine.fused_calls - before[1]))
            del model, opt
        hvd.shutdown()
    # the slowest rank's time for each step
    slowest = {}
    for name, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
        slowest[name] = t.tolist()
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in slowest.items()}
        print(f"{size} ranks, {len(shapes)} parameter tensors ({len(small)} of 4-64 KiB), "
              f"{sum(int(torch.tensor(s).prod()) for s in shapes) * 4 / 1e6:.1f} MB of gradients; ms per step (median "
              f"of {args.rounds} x {args.steps}):")
        for k, v in med.items():
            print(f"  {k:14s} {v:8.2f}")
        print(f"  fusion speed-up over no fusion: {med['hvd-no-fusion'] / med['hvd-fusion']:.2f}x (target >= 2); "
              f"fusion / DDP on pycoll: {med['hvd-fusion'] / med['ddp-pycoll']:.2f} (target <= 1.2); "
              f"fusion / DDP on gloo: {med['hvd-fusion'] / med['ddp-gloo']:.2f}")
        print(f"  no fusion over no communication: {med['hvd-no-fusion'] / med['no-communication']:.2f}x (the most any "
              f"fusion could gain: a fused step takes at least the step without communication)")
        if args.json:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
            with open(args.json, "w") as f:
                json.dump({"ranks": size, "tensors": len(shapes), "small_tensors": len(small), "median_ms": med,
                           "step_ms": {k: [x * 1e3 for x in v] for k, v in slowest.items()},
                           "engine_cycles_and_fused_calls_per_round": counters, "commit": commit,
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": platform.python_version(),
                           "torch": torch.__version__, "layers": args.layers, "steps": args.steps,
                           "rounds": args.rounds}, f, indent=1)
    dist.barrier(group=gloo)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
