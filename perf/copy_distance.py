"""How the distance between a copy's source and destination within a page moves its speed, here and in calls.

Two parts, both in one run:
- this machine alone: one process_vm_readv and one np.copyto of each size, the destination 0, 16, 48 or 2048 bytes
  past the source modulo a page (on AMD Zen, `rep movsb` runs several times slower at 1-31 bytes);
- point-to-point and collectives under `pycoll run` and `mpiexec` side by side (rounds alternate), every rank's send
  and receive buffers placed at that distance from each other, as two arrays allocated one after the other on the
  heap are (16 bytes apart).

    python perf/copy_distance.py --out perf/results/copy-distance
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PAGE = 4096
DISTANCES = (0, 16, 48, 2048)
KIB, MIB = 1 << 10, 1 << 20
CALLS = (("Sendrecv", 64 * KIB), ("Sendrecv", MIB), ("Send/Recv pingpong", MIB), ("Allgather", 64 * KIB),
         ("Allgather", MIB), ("Bcast", MIB), ("Alltoall", 64 * KIB))


def placed(n: int, dist: int, fill: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(send, receive, the buffer under both): receive lies ``dist`` bytes past send modulo a page; each starts 16
    bytes into a page as NumPy's large arrays do."""
    buf = np.zeros(2 * n + 4 * PAGE, np.uint8)
    s = (-buf.ctypes.data) % PAGE + 16
    r = s + ((n + PAGE - 1) // PAGE + 1) * PAGE + dist
    send, recv = buf[s:s + n], buf[r:r + n]
    send[:] = fill
    return send, recv, buf


def machine_part(rounds: int) -> list[dict]:
    """process_vm_readv (from a child) and np.copyto at each distance and size, medians in µs."""
    libc = ctypes.CDLL(None, use_errno=True)

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    rows = []
    for n in (64 * KIB, 256 * KIB, MIB):
        for dist in DISTANCES:
            src, dst, _keep = placed(n, dist, 1)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the peer whose memory is read: the same layout as the parent
                os.read(r, 1)
                os._exit(0)
            loc, rem = IoVec(dst.ctypes.data, n), IoVec(src.ctypes.data, n)
            vm, cp = [], []
            for _ in range(rounds):
                t = time.perf_counter()
                libc.process_vm_readv(pid, ctypes.byref(loc), 1, ctypes.byref(rem), 1, 0)
                vm.append(time.perf_counter() - t)
                t = time.perf_counter()
                np.copyto(dst, src)
                cp.append(time.perf_counter() - t)
            os.write(w, b"x")
            os.waitpid(pid, 0)
            rows.append({"bytes": n, "distance": dist, "process_vm_readv_us": statistics.median(vm) * 1e6,
                         "np_copyto_us": statistics.median(cp) * 1e6})
    return rows


# ---------------------------------------------------------------------------------------------- rank program

def program(module: str, result: str, iters: int) -> None:
    if module == "pycoll":
        from pycoll import MPI
    else:
        from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    other = 1 - rank
    B = MPI.BYTE
    out = []
    for call, n in CALLS:
        for dist in DISTANCES:
            if call in ("Allgather", "Alltoall"):
                send, recv, keep = placed(n * size, dist, rank + 1)
                send = send[:n * size] if call == "Alltoall" else send[:n]
                fn = (lambda: comm.Allgather([send, n, B], [recv, n, B])) if call == "Allgather" else (
                    lambda: comm.Alltoall([send, n, B], [recv, n, B]))
            else:
                send, recv, keep = placed(n, dist, rank + 1)
                if call == "Sendrecv":
                    fn = lambda: comm.Sendrecv([send, n, B], other, 0, [recv, n, B], other, 0)  # noqa: E731
                elif call == "Bcast":
                    fn = lambda: comm.Bcast([send if rank == 0 else recv, n, B], root=0)  # noqa: E731
                elif rank == 0:
                    fn = lambda: (comm.Send([send, n, B], 1, 1), comm.Recv([recv, n, B], 1, 1))  # noqa: E731
                else:
                    fn = lambda: (comm.Recv([recv, n, B], 0, 1), comm.Send([recv, n, B], 0, 1))  # noqa: E731
            for _ in range(5):
                fn()
            comm.Barrier()
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            worst = comm.allreduce(statistics.median(times), op=MPI.MAX)
            if call == "Send/Recv pingpong":
                worst /= 2  # one way
            out.append({"call": call, "bytes": n, "distance": dist, "us": worst * 1e6})
            del keep
    if rank == 0:
        Path(result).write_text(json.dumps(out))


# ---------------------------------------------------------------------------------------------- driver

def run_peer(peer: str, iters: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "r.json")
        prog = [sys.executable, os.path.abspath(__file__), "--program", peer, "--result", result, "--iters", str(iters)]
        if peer == "pycoll":
            cmd = [sys.executable, "-m", "pycoll", "run", "-n", "2", "--", *prog]
        else:
            from pycoll.perf.peers import find_mpiexec

            cmd = [find_mpiexec() or "mpiexec", "-n", "2", *prog]
        subprocess.run(cmd, check=True, timeout=600)
        return json.loads(Path(result).read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="perf/results/copy-distance")
    p.add_argument("--rounds", type=int, default=3, help="alternating runs of each peer; medians reported")
    p.add_argument("--iters", type=int, default=200, help="timed calls per point")
    p.add_argument("--program", choices=("pycoll", "mpi4py"), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.program:
        program(args.program, args.result, args.iters)
        return 0
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    machine = machine_part(200)
    runs: dict[str, list[list[dict]]] = {"mpi4py": [], "pycoll": []}
    for _ in range(args.rounds):
        for peer in ("mpi4py", "pycoll"):
            runs[peer].append(run_peer(peer, args.iters))
    rows = []
    for i, point in enumerate(runs["pycoll"][0]):
        mpich = statistics.median(r[i]["us"] for r in runs["mpi4py"])
        ours = statistics.median(r[i]["us"] for r in runs["pycoll"])
        rows.append({**{k: point[k] for k in ("call", "bytes", "distance")}, "mpich_us": mpich, "pycoll_us": ours,
                     "ratio": ours / mpich})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python perf/copy_distance.py " + " ".join(sys.argv[1:])
    (out / "copy-distance.json").write_text(json.dumps({"when": stamp, "command": cmd, "machine": machine,
                                                         "calls": rows}, indent=1))
    lines = [f"# Copies by the distance between source and destination within a page", "",
             f"`{cmd}`, {stamp}, 2 ranks; medians of {args.rounds} alternating runs per peer.", "",
             "## This machine alone (µs)", "", "| bytes | distance | process_vm_readv | np.copyto |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['bytes']} | {r['distance']} | {r['process_vm_readv_us']:.1f} | {r['np_copyto_us']:.1f} |"
              for r in machine]
    lines += ["", "## Calls, receive buffer at that distance past the send buffer (µs)", "",
              "| call | bytes | distance | MPICH | pycoll | ratio |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['call']} | {r['bytes']} | {r['distance']} | {r['mpich_us']:.1f} | {r['pycoll_us']:.1f} | "
              f"{r['ratio']:.2f} |" for r in rows]
    (out / "copy-distance.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
