"""Training steps on the "pycoll" backend beside gloo, in the same processes: DDP on a model with about 25 MB of
gradients (several buckets) and FSDP2 (``fully_shard``) on a smaller MLP.

Each run alternates the backends over ``--rounds`` rounds of ``--steps`` steps (the first steps of each round are
warm-up) and reports the median step time of each, the slowest rank's. Run it alone on the machine:

    flock /tmp/pycoll-bench.lock pycoll run -n 2 -- python perf/torch_training.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

import pycoll.torch  # noqa: F401


def ddp_model() -> torch.nn.Module:
    torch.manual_seed(0)  # 2 x 1536 x 1536 + 1536 x 512 + 512 x 1536 + ...: about 6.3 M parameters, 25 MB of float32
    return torch.nn.Sequential(torch.nn.Linear(512, 1536), torch.nn.ReLU(), torch.nn.Linear(1536, 1536),
                               torch.nn.ReLU(), torch.nn.Linear(1536, 1536), torch.nn.ReLU(),
                               torch.nn.Linear(1536, 512))


def fsdp_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 256))


def _steps(model: torch.nn.Module, width: int, steps: int, warmup: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for k in range(steps + warmup):
        x = torch.randn(32, width, generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def ddp_steps(group, steps: int, warmup: int) -> list[float]:
    return _steps(DDP(ddp_model(), process_group=group), 512, steps, warmup)  # default 25 MB buckets


def fsdp_steps(group, steps: int, warmup: int) -> list[float]:
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    model = fsdp_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _steps(model, 256, steps, warmup)


def _slowest(ms: float) -> float:
    t = torch.tensor([ms], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    dist.init_process_group("pycoll")
    groups = {"pycoll": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    times: dict = {(w, b): [] for w in ("ddp", "fsdp2") for b in groups}
    for rnd in range(args.rounds):
        order = list(groups) if rnd % 2 == 0 else list(groups)[::-1]
        for backend in order:
            times[("ddp", backend)] += ddp_steps(groups[backend], args.steps, args.warmup)
            times[("fsdp2", backend)] += fsdp_steps(groups[backend], args.steps, args.warmup)
    med = {k: _slowest(1e3 * statistics.median(v)) for k, v in times.items()}
    if dist.get_rank() == 0:
        n = dist.get_world_size()
        print(f"# training steps, {n} ranks, median ms per step (slowest rank), {args.rounds} rounds x {args.steps} steps")
        print("| workload | pycoll ms | gloo ms | pycoll / gloo |")
        print("|---|---:|---:|---:|")
        for w in ("ddp", "fsdp2"):
            print(f"| {w} | {med[(w, 'pycoll')]:.1f} | {med[(w, 'gloo')]:.1f} | {med[(w, 'pycoll')] / med[(w, 'gloo')]:.2f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": n, "torch": torch.__version__, "median_ms": {f"{w}/{b}": v for (w, b), v in med.items()},
                           "args": vars(args)}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
