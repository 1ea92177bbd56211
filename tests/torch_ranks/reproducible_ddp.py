"""Rank program (3 ranks): DDP trains the same model from the same seed twice in reproducible mode, once with tiny
gradient buckets and once with one large bucket; the parameters must agree bit for bit, on every rank. The group's
mode comes from ``pg_options`` (pycoll.torch.Options), and a second group checks that PYCOLL_REPRODUCIBLE turns it
on too. Reductions of other sizes pick other algorithms by default, so without the mode the bits may differ. Then
torch's all_reduce (SUM, AVG), reduce and reduce_scatter_tensor are compared bit for bit with NumPy's left fold.

Writes ``{out}/rank{r}.json`` with the checks made and any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback

import functools

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pycoll.torch
from pycoll.torch import Options

STEPS = 8


def train(bucket_mb: float, group: dist.ProcessGroup, r: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    # 3.3 MB of gradients: one bucket of it takes another algorithm by default than the small ones do
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1024), torch.nn.Tanh(),
                                torch.nn.Linear(1024, 512), torch.nn.Tanh(), torch.nn.Linear(512, 8))
    ddp = DDP(model, bucket_cap_mb=bucket_mb, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + r)  # each rank its own batches
    for _ in range(STEPS):
        x = torch.randn(32, 64, generator=data)
        y = torch.randn(32, 8, generator=data)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))


def as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def fold(xs: list[torch.Tensor], avg: bool = False) -> np.ndarray:
    """NumPy's rank-order left fold of the ranks' tensors (AVG: then one division)."""
    arrs = [as_numpy(x) for x in xs]
    out = functools.reduce(np.add, arrs)
    return np.divide(out, arrs[0].dtype.type(len(arrs))) if avg else out


def torch_calls(group: dist.ProcessGroup, r: int, expect) -> None:
    p = dist.get_world_size(group)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for count in (9, 999, 3 * 70_000):  # p blocks each for reduce_scatter_tensor
            xs = [torch.randn(count, generator=torch.Generator().manual_seed(1000 * q + count)).to(dt) for q in range(p)]
            lab = f"{dt} count={count}"
            t = xs[r].clone()
            dist.all_reduce(t, group=group)
            expect(np.array_equal(as_numpy(t).view(np.uint8), fold(xs).view(np.uint8)), f"all_reduce {lab}")
            t = xs[r].clone()
            dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
            expect(np.array_equal(as_numpy(t).view(np.uint8), fold(xs, avg=True).view(np.uint8)), f"AVG {lab}")
            t = xs[r].clone()
            dist.reduce(t, dst=0, group=group)
            if r == 0:
                expect(np.array_equal(as_numpy(t).view(np.uint8), fold(xs).view(np.uint8)), f"reduce {lab}")
            out = torch.empty(count // p, dtype=dt)
            dist.reduce_scatter_tensor(out, xs[r].clone(), group=group)
            want = fold([x[r * (count // p):(r + 1) * (count // p)] for x in xs])
            expect(np.array_equal(as_numpy(out).view(np.uint8), want.view(np.uint8)), f"reduce_scatter_tensor {lab}")


def run(r: int, fail: list[str]) -> int:
    checks = 0

    def expect(cond: bool, what: str) -> None:
        nonlocal checks
        checks += 1
        if not cond:
            fail.append(what)

    group = dist.new_group([0, 1, 2], pg_options=Options(reproducible=True))
    small = train(0.001, group, r)  # a bucket per parameter, or nearly
    large = train(25.0, group, r)  # one bucket for the whole model
    expect(same_bits(small, large), "parameters trained with tiny and with one large bucket differ in their bits")
    gathered = [torch.cat([p.reshape(-1) for p in large]).clone() for _ in range(3)]
    dist.all_gather(gathered, torch.cat([p.reshape(-1) for p in large]))
    expect(all(torch.equal(gathered[0].view(torch.int32), g.view(torch.int32)) for g in gathered),
           "the ranks' parameters differ in their bits")
    torch_calls(group, r, expect)

    # the environment word alone: a group made without options follows it
    os.environ["PYCOLL_REPRODUCIBLE"] = "1"
    try:
        plain = dist.new_group([0, 1, 2])
        again = train(0.001, plain, r)
        expect(same_bits(again, large), "a group under PYCOLL_REPRODUCIBLE=1 trains other bits than the one "
                                        "with pg_options")
    finally:
        del os.environ["PYCOLL_REPRODUCIBLE"]
    return checks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    args = ap.parse_args()
    dist.init_process_group("pycoll")
    r = dist.get_rank()
    fail: list[str] = []
    result: dict = {"rank": r, "failures": fail}
    try:
        result["checks"] = run(r, fail)
    except Exception:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    with open(os.path.join(args.out, f"rank{r}.json"), "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    assert pycoll.torch.BACKEND == "pycoll"
    main()
