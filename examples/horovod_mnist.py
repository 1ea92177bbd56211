"""A Horovod PyTorch training script, MNIST-style, on synthetic data: only its import line differs from Horovod's.

    pycoll run -n 2 -- python examples/horovod_mnist.py
    pycoll run -n 2 -- python examples/horovod_mnist.py --ddp gloo --save ddp.pt   # the same training, DDP on gloo
    pycoll run -n 2 -- python examples/horovod_mnist.py --save hvd.pt              # compare the two files

The data are random 28x28 images with labels from a fixed seed; each rank trains on its shard (DistributedSampler).
``--ddp gloo`` (or ``pycoll``) runs the same steps with torch's DistributedDataParallel instead of Horovod's
DistributedOptimizer, so the final parameters can be compared.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data as tud

import pycoll.horovod.torch as hvd  # was: import horovod.torch as hvd


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(n: int, seed: int) -> tud.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return tud.TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


def metric_average(value: float, name: str) -> float:
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--momentum", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--fp16-allreduce", action="store_true")
    ap.add_argument("--ddp", choices=["gloo", "pycoll"], help="train with DistributedDataParallel instead")
    ap.add_argument("--save", help="write the final parameters here (rank 0)")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    if args.ddp:
        import torch.distributed as dist

        import pycoll.torch  # noqa: F401  (the "pycoll" backend)

        dist.init_process_group("pycoll")
        group = dist.new_group(backend="gloo") if args.ddp == "gloo" else None
        rank, size = dist.get_rank(), dist.get_world_size()
    else:
        hvd.init()
        rank, size = hvd.rank(), hvd.size()

    data = synthetic_mnist(args.samples, args.seed)
    sampler = tud.distributed.DistributedSampler(data, num_replicas=size, rank=rank, shuffle=False)
    loader = tud.DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=args.momentum)
    if args.ddp:
        model = nn.parallel.DistributedDataParallel(model, process_group=group)
    else:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression)
    for epoch in range(args.epochs):
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            optimizer.step()
        if not args.ddp:
            loss_avg = metric_average(loss.item(), "avg_loss")
            if rank == 0:
                print(f"epoch {epoch}: loss {loss_avg:.4f}", flush=True)
    if args.save and rank == 0:
        net = model.module if args.ddp else model
        torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, args.save)
    if args.ddp:
        import torch.distributed as dist

        del model, optimizer  # DDP's reducer holds the group: gone before the groups are
        dist.barrier()
        dist.destroy_process_group()
    else:
        hvd.shutdown()


if __name__ == "__main__":
    main()
