"""DDP on the pycoll backend: train a small MLP on random data.

    torchrun --nproc-per-node 2 examples/ddp_mlp.py            # or: pycoll run -n 2 -- python examples/ddp_mlp.py
    ... examples/ddp_mlp.py --compare gloo --json out.json     # the same training on gloo, from the same seed

With ``--compare``, both trainings run in the same processes (pycoll's default group, a gloo group beside
it); the final parameters are compared and the median step time of each is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pycoll.torch  # noqa: F401  (registers the "pycoll" backend)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


def train(group: dist.ProcessGroup | None, steps: int) -> tuple[list[torch.Tensor], list[float], float]:
    """(final parameters, step times in s, last loss) of ``steps`` SGD steps with DDP over ``group``."""
    model = DDP(make_model(), process_group=group, bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rank, times, loss = dist.get_rank(), [], torch.zeros(())
    for step in range(steps):
        g = torch.Generator().manual_seed(10_000 * step + rank)  # each rank its own batch
        x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return [p.detach().clone() for p in model.parameters()], times, float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--compare", choices=["gloo"], help="also train on this backend and compare")
    ap.add_argument("--json", help="rank 0 writes the results here")
    args = ap.parse_args()
    dist.init_process_group("pycoll")
    rank = dist.get_rank()
    params, times, loss = train(None, args.steps)
    result = {"ranks": dist.get_world_size(), "steps": args.steps, "pycoll": {"loss": loss, "median_step_ms": 1e3 * statistics.median(times)}}
    if args.compare:
        other = dist.new_group(backend=args.compare)
        ref, ref_times, ref_loss = train(other, args.steps)
        diff = max(float((a - b).abs().max()) for a, b in zip(params, ref))
        same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(params, ref))
        result[args.compare] = {"loss": ref_loss, "median_step_ms": 1e3 * statistics.median(ref_times)}
        result["params_allclose"], result["max_abs_diff"] = same, diff
    if rank == 0:
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
