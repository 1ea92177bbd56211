"""Rank program: modern PyTorch on the "pycoll" backend against gloo in the same processes: group names, DeviceMesh,
DTensor redistribution, the functional collectives, the aliased all-gather FSDP2 issues, and FSDP2 training.

Run under a launcher (pycoll run, torchrun). Writes ``{out}/rank{r}.json`` with the checks made and any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import pycoll.torch  # noqa: F401  (registers the backend)


class Checker:
    def __init__(self) -> None:
        self.checks, self.failures = 0, []

    def same(self, what: str, got: torch.Tensor, want: torch.Tensor, exact: bool = True) -> None:
        self.checks += 1
        ok = got.shape == want.shape and got.dtype == want.dtype and (
            torch.equal(got, want) if exact else torch.allclose(got, want, rtol=1e-6, atol=1e-6))
        if not ok:
            self.failures.append(f"{what}: got {got.flatten()[:6].tolist()} want {want.flatten()[:6].tolist()}")

    def true(self, what: str, cond: bool) -> None:
        self.checks += 1
        if not cond:
            self.failures.append(what)


def names(ck: Checker, gloo: dist.ProcessGroup) -> None:
    world = dist.group.WORLD
    ck.true(f"the world group has a name ({world.group_name!r})", bool(world.group_name))
    sub = dist.new_group(list(range(dist.get_world_size())), backend="pycoll")
    ck.true("a subgroup's name differs from the world's", sub.group_name not in ("", world.group_name))
    x = torch.arange(4, dtype=torch.float32) + dist.get_rank()
    want = x.clone()
    dist.all_reduce(want, group=gloo)
    dist.all_reduce(x, group=sub)
    ck.same("all_reduce on a named subgroup", x, want)
    dist.destroy_process_group(sub)
    ck.true("a destroyed subgroup is gone", sub not in dist.distributed_c10d._world.pg_map)


def functional(ck: Checker, gloo: dist.ProcessGroup) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    x = torch.arange(6 * n, dtype=torch.float32) * (r + 1)
    for name, fn in [
        ("all_reduce", lambda g: fc.all_reduce(x, "sum", g)),
        ("all_gather_tensor", lambda g: fc.all_gather_tensor(x, 0, g)),
        ("reduce_scatter_tensor", lambda g: fc.reduce_scatter_tensor(x, "sum", 0, g)),
        ("all_to_all_single", lambda g: fc.all_to_all_single(x, None, None, g)),
        ("broadcast", lambda g: fc.broadcast(x, 1 % n, g)),
    ]:
        got = fc.wait_tensor(fn(world))
        want = fc.wait_tensor(fn(gloo))
        ck.same(f"functional {name}", got, want)


def dtensors(ck: Checker, mesh: DeviceMesh) -> None:
    n = dist.get_world_size()
    torch.manual_seed(7)
    full = torch.randn(4 * n, 3 * n)  # the same on every rank
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    ck.same("DTensor Shard(0) -> Replicate", sharded.redistribute(mesh, [Replicate()]).to_local(), full)
    ck.same("DTensor Shard(0) -> Shard(1)", sharded.redistribute(mesh, [Shard(1)]).full_tensor(), full)
    local = torch.full((2, 2), float(dist.get_rank() + 1))
    partial = torch.distributed.tensor.DTensor.from_local(local, mesh, [Partial()])
    ck.same("DTensor Partial -> Replicate", partial.redistribute(mesh, [Replicate()]).to_local(),
            torch.full((2, 2), float(n * (n + 1) // 2)))


def aliased_all_gather(ck: Checker, gloo: dist.ProcessGroup) -> None:
    """FSDP2's pattern: the input is this rank's slice of the output (taken as in place)."""
    r, n, k = dist.get_rank(), dist.get_world_size(), 5
    out = torch.zeros(n * k)
    out[r * k:(r + 1) * k] = torch.arange(k, dtype=torch.float32) + 10 * r
    dist.all_gather_into_tensor(out, out.narrow(0, r * k, k))
    want = torch.cat([torch.arange(k, dtype=torch.float32) + 10 * q for q in range(n)])
    ck.same("all_gather_into_tensor with the input inside the output", out, want)


def fsdp2(mesh: DeviceMesh, steps: int) -> list[torch.Tensor]:
    """A small MLP sharded with fully_shard over ``mesh``, ``steps`` SGD steps from a fixed seed: the full parameters."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    dist.init_process_group("pycoll")
    ck = Checker()
    result = {"rank": dist.get_rank(), "backend": dist.get_backend()}
    try:
        gloo = dist.new_group(backend="gloo")
        names(ck, gloo)
        functional(ck, gloo)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        ck.true("the mesh runs on the pycoll group", mesh.get_group().group_name == dist.group.WORLD.group_name)
        dtensors(ck, mesh)
        aliased_all_gather(ck, gloo)
        ours = fsdp2(mesh, args.steps)
        theirs = fsdp2(DeviceMesh.from_group(gloo, "cpu"), args.steps)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            ck.same(f"FSDP2 parameter {i} after {args.steps} steps", a, b, exact=False)
        result["fsdp2_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(ours, theirs))
    except Exception:
        result["error"] = traceback.format_exc()
    result.update(checks=ck.checks, failures=ck.failures)
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
