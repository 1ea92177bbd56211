"""A small mpi4py program (distributed statistics, a transpose, a token ring) whose rank 0 prints deterministic results.

Run it with real MPI::

    mpiexec -n 4 python examples/mpi4py_program.py

or, after changing the import below to ``from pycoll import MPI``::

    python -m pycoll run -n 4 -- python examples/mpi4py_program.py

Every value is an integer or a short binary fraction, so every implementation and every
reduction order prints exactly the same text.
"""

import numpy as np
from mpi4py import MPI


def local_samples(rank, n):
    """This rank's share of a data set: small integers, different on every rank."""
    rng = np.random.default_rng(1000 + rank)
    return rng.integers(0, 16, size=n).astype(np.float64)


def main():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    report = []  # lines that rank 0 prints at the end

    # 1. configuration broadcast from rank 0 (Bcast of a buffer, bcast of an object)
    config = np.zeros(3, dtype=np.int64)
    if rank == 0:
        config[:] = [1000, 16, 7]  # samples per rank, histogram bins, seed-ish
    comm.Bcast(config, root=0)
    meta = comm.bcast({"name": "demo", "bins": int(config[1])} if rank == 0 else None, root=0)
    n_local, bins = int(config[0]), meta["bins"]
    report.append(f"config: samples/rank={n_local} bins={bins} name={meta['name']}")

    # 2. global sum, mean and extremes (Allreduce out of place and in place)
    x = local_samples(rank, n_local)
    stats = np.array([x.sum(), float(x.size)])
    total = np.zeros(2)
    comm.Allreduce(stats, total, op=MPI.SUM)
    mean = total[0] / total[1]
    lo = np.array([x.min()])
    hi = np.array([x.max()])
    comm.Allreduce(MPI.IN_PLACE, lo, op=MPI.MIN)
    comm.Allreduce(MPI.IN_PLACE, hi, op=MPI.MAX)
    report.append(f"sum={total[0]:.1f} n={int(total[1])} mean={mean:.6f} min={lo[0]:.0f} max={hi[0]:.0f}")

    # 3. a histogram summed in place, overlapped with local work (Iallreduce)
    hist = np.bincount(x.astype(np.int64), minlength=bins).astype(np.int64)
    req = comm.Iallreduce(MPI.IN_PLACE, hist, op=MPI.SUM)
    sq = np.array([float((x * x).sum())])  # local work while the reduction runs (integer-valued: exact)
    req.Wait()
    comm.Allreduce(MPI.IN_PLACE, sq, op=MPI.SUM)
    n_all, s_all = int(total[1]), int(total[0])
    report.append(f"histogram={hist.tolist()}")
    report.append(f"n^2*variance={n_all * int(sq[0]) - s_all * s_all}")

    # 4. who holds what (Allgather), then per-rank partial sums of a shared vector (Reduce_scatter_block)
    counts = np.array([int((x > mean).sum())], dtype=np.int64)
    all_counts = np.zeros(size, dtype=np.int64)
    comm.Allgather(counts, all_counts)
    report.append(f"above-mean per rank={all_counts.tolist()}")
    block = 4
    contrib = np.arange(size * block, dtype=np.int32) * (rank + 1)
    mine = np.zeros(block, dtype=np.int32)
    comm.Reduce_scatter_block(contrib, mine, op=MPI.SUM)
    pieces = comm.gather(mine.tolist(), root=0)
    if rank == 0:
        report.append(f"reduce_scatter_block pieces={pieces}")

    # 5. a distributed transpose (Alltoall): rank r holds row block r of an (size x size*2) matrix
    k = 2
    rows = (np.arange(size * k, dtype=np.int64) + 100 * rank).reshape(size, k)
    cols = np.zeros_like(rows)
    comm.Alltoall(rows, cols)
    gathered = comm.gather(cols.ravel().tolist(), root=0)
    if rank == 0:
        report.append(f"alltoall={gathered}")

    # 6. sub-communicators: even and odd ranks (Split), each sums its ranks' means
    sub = comm.Split(rank % 2, key=-rank)
    part = np.array([x.sum()])
    part_sum = np.zeros(1)
    sub.Allreduce(part, part_sum, op=MPI.SUM)
    sub_info = comm.gather((rank % 2, sub.Get_rank(), sub.Get_size(), part_sum[0]), root=0)
    sub.Free()
    if rank == 0:
        for color in (0, 1):
            members = [(r, sr, ss, s) for r, (c, sr, ss, s) in enumerate(sub_info) if c == color]
            if members:
                desc = ", ".join(f"world {r}->sub {sr}" for r, sr, _, _ in members)
                report.append(f"split color {color}: size={members[0][2]} sum={members[0][3]:.1f} ranks [{desc}]")

    # 7. objects: allgather of small records
    recs = comm.allgather({"rank": rank, "max": float(x.max()), "first": x[:3].tolist()})
    report.append("records=" + "; ".join(f"{d['rank']}:{d['max']:.0f}:{d['first']}" for d in recs))

    # 8. a token passed around a ring (Send/Recv), each rank adds its rank squared
    token = np.zeros(1, dtype=np.int64)
    if size > 1:
        if rank == 0:
            token[0] = 1
            comm.Send(token, dest=1, tag=7)
            comm.Recv(token, source=size - 1, tag=7)
        else:
            comm.Recv(token, source=rank - 1, tag=7)
            token[0] += rank * rank
            comm.Send(token, dest=(rank + 1) % size, tag=7)
    else:
        token[0] = 1
    report.append(f"ring token={int(token[0])}")

    comm.Barrier()
    if rank == 0:
        print(f"world size {size}")
        for line in report:
            print(line)


if __name__ == "__main__":
    main()
