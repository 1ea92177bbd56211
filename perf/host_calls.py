"""Side-by-side suite of host calls: one OSU-style program run under MPICH (mpi4py) and under pycoll, same session."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

KIB, MIB = 1 << 10, 1 << 20
SIZES = [8, 4 * KIB, 64 * KIB, MIB]
POW4 = [8] + [4 ** k for k in range(2, 13)]  # 8 B, then every power of 4 from 16 B to 16 MiB
SWEPT_AT_4 = ("Allreduce", "Bcast", "Allgather")  # the calls with a 4-rank target at every size
BW_CALLS = ("Isend x16 bw", "Isend x64 bw")
# mpi4py's object calls (pickled), as programs make them: a bytes object of the size, NumPy arrays to reduce
OBJECT_CALLS = ("send/recv obj pingpong", "bcast obj", "reduce obj", "allreduce obj", "gather obj", "scatter obj",
                "allgather obj", "alltoall obj")
P2P_CALLS = ("Send/Recv pingpong", *BW_CALLS, "send/recv obj pingpong")  # timed on rank 0 alone
# the vector forms, as programs call them: [buf, counts, displs, MPI.FLOAT], every rank's block the size
VECTOR_CALLS = ("Gatherv", "Scatterv", "Allgatherv", "Alltoallv")
CALLS = ("Send/Recv pingpong", *BW_CALLS, "Bcast", "Reduce", "Allreduce", "Gather", "Scatter", "Allgather",
         "Allgather in place", "Alltoall", *VECTOR_CALLS, "Reduce_scatter_block", "Scan", "Exscan", "Sendrecv",
         "Barrier", *OBJECT_CALLS)
# Which method each call needs on the communicator (a module lacking it reports the call missing).
NEEDS = {"Send/Recv pingpong": "Send", "Isend x16 bw": "Isend", "Isend x64 bw": "Isend",
         "Allgather in place": "Allgather", "send/recv obj pingpong": "send"}
SLOT_BYTES = 64 * MIB  # windowed bandwidth: one receive slot per message while they fit, then reused
HALO_N, HALO_WIDTH, HALO_EVERY = 100_000, 16, 10  # stencil array, ghost cells each side, steps per Allreduce
FIRST_CALLS = 300


# ---------------------------------------------------------------------------------------------- rank program


def load_mpi(module: str) -> Any:
    """The one line a program changes: mpi4py's MPI or pycoll's."""
    if module == "pycoll":
        from pycoll import MPI
    else:
        from mpi4py import MPI
    return MPI


class Program:
    """What every rank runs: first-call latency, then each (call, size) point, then the halo exchange."""

    def __init__(self, MPI: Any, args: argparse.Namespace) -> None:
        self.MPI, self.args = MPI, args
        self.comm = MPI.COMM_WORLD
        self.rank, self.n = self.comm.Get_rank(), self.comm.Get_size()

    # -- timing helpers

    def agree_max(self, value: float) -> float:
        """The largest value over the ranks (object gather + bcast, which both modules have)."""
        got = self.comm.gather(value, root=0)
        return self.comm.bcast(max(got) if self.rank == 0 else None, root=0)

    def time_point(self, fn: Callable[[], Any], p2p: bool = False) -> tuple[float, int]:
        """(µs per call, iterations): enough back-to-back calls for about --target-s seconds (at least --min-iters),
        in 5 batches after a barrier each; a batch's time is its slowest rank's (rank 0's for p2p), the point's
        the median batch."""
        for _ in range(self.args.warmup):
            fn()
        self.comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        est = self.agree_max((time.perf_counter() - t0) / 3)
        iters = int(min(self.args.max_iters, max(self.args.min_iters, self.args.target_s / max(est, 1e-7))))
        per_batch = max(1, -(-iters // 5))
        mine = []
        for _ in range(5):
            self.comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(per_batch):
                fn()
            mine.append((time.perf_counter() - t0) / per_batch * 1e6)
        if p2p and self.rank != 0:
            mine = [0.0] * 5
        rows = self.comm.gather(mine, root=0)
        if self.rank != 0:
            return 0.0, per_batch * 5
        return statistics.median(max(col) for col in zip(*rows)), per_batch * 5

    # -- the calls

    def make(self, call: str, size: int) -> tuple[Callable[[], Any], Callable[[], bool], int]:
        """(one call, check of its result on this rank, how many messages one call is) with [buf, count, MPI.FLOAT]."""
        MPI, comm, n, r = self.MPI, self.comm, self.n, self.rank
        F, c = MPI.FLOAT, max(1, size // 4)
        mine = np.full(c, r + 1, np.float32)
        out = np.zeros(c, np.float32)
        outs = np.zeros(n * c, np.float32)
        blocks = np.repeat(np.arange(1, n + 1, dtype=np.float32), c)  # block b holds b + 1
        total = n * (n + 1) / 2
        left, right = (r - 1) % n, (r + 1) % n
        ok_all = lambda: True  # noqa: E731
        if call == "Send/Recv pingpong":  # rank 1 echoes rank 0's message; the others idle
            if r == 0:
                return lambda: (comm.Send([mine, c, F], 1, 1), comm.Recv([out, c, F], 1, 1)), lambda: bool(
                    (out == 1).all()), 2
            if r == 1:
                return lambda: (comm.Recv([out, c, F], 0, 1), comm.Send([out, c, F], 0, 1)), lambda: bool(
                    (out == 1).all()), 2
            return (lambda: None), ok_all, 2
        if call in BW_CALLS:
            window = 16 if "x16" in call else 64
            slots = max(1, min(window, SLOT_BYTES // (c * 4)))
            ack = np.zeros(1, np.float32)
            if r == 0:
                return (lambda: (MPI.Request.Waitall([comm.Isend([mine, c, F], 1, 1) for _ in range(window)]),
                                 comm.Recv([ack, 1, F], 1, 2))), ok_all, window
            if r == 1:
                slot = np.zeros(slots * c, np.float32)
                views = [slot[k * c:(k + 1) * c] for k in range(slots)]
                return (lambda: (MPI.Request.Waitall([comm.Irecv([views[i % slots], c, F], 0, 1)
                                                      for i in range(window)]),
                                 comm.Send([ack, 1, F], 0, 2))), lambda: bool((slot == 1).all()), window
            return (lambda: None), ok_all, window
        if call == "Bcast":
            buf = np.full(c, r + 1, np.float32)
            return lambda: comm.Bcast([buf, c, F], root=0), lambda: bool((buf == 1).all()), 1
        if call == "Reduce":
            return (lambda: comm.Reduce([mine, c, F], [out, c, F], op=MPI.SUM, root=0),
                    lambda: r != 0 or bool((out == total).all()), 1)
        if call == "Allreduce":
            return (lambda: comm.Allreduce([mine, c, F], [out, c, F], op=MPI.SUM),
                    lambda: bool((out == total).all()), 1)
        if call == "Gather":
            return (lambda: comm.Gather([mine, c, F], [outs, c, F] if r == 0 else None, root=0),
                    lambda: r != 0 or bool((outs == blocks).all()), 1)
        if call == "Scatter":
            return (lambda: comm.Scatter([blocks, c, F] if r == 0 else None, [out, c, F], root=0),
                    lambda: bool((out == r + 1).all()), 1)
        if call == "Allgather":
            return lambda: comm.Allgather([mine, c, F], [outs, c, F]), lambda: bool((outs == blocks).all()), 1
        if call == "Allgather in place":
            outs[r * c:(r + 1) * c] = r + 1
            return lambda: comm.Allgather(MPI.IN_PLACE, [outs, c, F]), lambda: bool((outs == blocks).all()), 1
        if call == "Alltoall":
            send = np.full(n * c, r + 1, np.float32)  # every block of rank b holds b + 1
            return lambda: comm.Alltoall([send, c, F], [outs, c, F]), lambda: bool((outs == blocks).all()), 1
        if call in VECTOR_CALLS:
            counts, displs = [c] * n, [q * c for q in range(n)]
            if call == "Gatherv":
                return (lambda: comm.Gatherv([mine, c, F], [outs, counts, displs, F] if r == 0 else None, root=0),
                        lambda: r != 0 or bool((outs == blocks).all()), 1)
            if call == "Scatterv":
                return (lambda: comm.Scatterv([blocks, counts, displs, F] if r == 0 else None, [out, c, F], root=0),
                        lambda: bool((out == r + 1).all()), 1)
            if call == "Allgatherv":
                return (lambda: comm.Allgatherv([mine, c, F], [outs, counts, displs, F]),
                        lambda: bool((outs == blocks).all()), 1)
            send = np.full(n * c, r + 1, np.float32)
            return (lambda: comm.Alltoallv([send, counts, displs, F], [outs, counts, displs, F]),
                    lambda: bool((outs == blocks).all()), 1)
        if call == "Reduce_scatter_block":
            send = np.full(n * c, r + 1, np.float32)
            return (lambda: comm.Reduce_scatter_block([send, c, F], [out, c, F], op=MPI.SUM),
                    lambda: bool((out == total).all()), 1)
        if call == "Scan":
            return (lambda: comm.Scan([mine, c, F], [out, c, F], op=MPI.SUM),
                    lambda: bool((out == (r + 1) * (r + 2) / 2).all()), 1)
        if call == "Exscan":  # rank 0's output is undefined
            return (lambda: comm.Exscan([mine, c, F], [out, c, F], op=MPI.SUM),
                    lambda: r == 0 or bool((out == r * (r + 1) / 2).all()), 1)
        if call == "Sendrecv":
            return (lambda: comm.Sendrecv([mine, c, F], right, 0, [out, c, F], left, 0),
                    lambda: bool((out == left + 1).all()), 1)
        if call == "Barrier":
            return comm.Barrier, ok_all, 1
        if call in OBJECT_CALLS:
            return self.make_object_call(call, size)
        raise ValueError(call)

    def make_object_call(self, call: str, size: int) -> tuple[Callable[[], Any], Callable[[], bool], int]:
        """``make`` for mpi4py's object calls: a bytes object of ``size`` bytes (rank r's filled with r + 1), or a
        float32 array of ``size`` bytes for the reductions."""
        comm, n, r = self.comm, self.n, self.rank
        mine = bytes([r + 1]) * size
        of = [bytes([q + 1]) * size for q in range(n)]
        arr = np.full(max(1, size // 4), r + 1, np.float32)
        total = n * (n + 1) / 2
        got: list[Any] = [None]

        def keep(value: Any) -> None:
            got[0] = value

        if call == "send/recv obj pingpong":  # rank 1 echoes rank 0's object
            if r == 0:
                return lambda: (comm.send(mine, 1, 1), keep(comm.recv(source=1, tag=1))), lambda: got[0] == mine, 2
            if r == 1:
                return lambda: comm.send(comm.recv(source=0, tag=1), 0, 1), lambda: True, 2
            return (lambda: None), lambda: True, 2
        if call == "bcast obj":
            return lambda: keep(comm.bcast(mine, root=0)), lambda: got[0] == of[0], 1
        if call == "reduce obj":
            return (lambda: keep(comm.reduce(arr, root=0)),
                    lambda: r != 0 or bool((got[0] == total).all()), 1)
        if call == "allreduce obj":
            return lambda: keep(comm.allreduce(arr)), lambda: bool((got[0] == total).all()), 1
        if call == "gather obj":
            return lambda: keep(comm.gather(mine, root=0)), lambda: got[0] == (of if r == 0 else None), 1
        if call == "scatter obj":
            return lambda: keep(comm.scatter(of if r == 0 else None, root=0)), lambda: got[0] == mine, 1
        if call == "allgather obj":
            return lambda: keep(comm.allgather(mine)), lambda: got[0] == of, 1
        if call == "alltoall obj":  # rank r sends rank q's own bytes: each gets its own back from everyone
            return lambda: keep(comm.alltoall(of)), lambda: got[0] == [mine] * n, 1
        raise ValueError(call)

    def point(self, call: str, size: int) -> dict[str, Any]:
        rec: dict[str, Any] = {"call": call, "size": size}
        method = NEEDS.get(call, call.split()[0])
        if not hasattr(self.comm, method):
            return dict(rec, missing=f"no Comm.{method}")
        if call in P2P_CALLS and self.n < 2:
            return dict(rec, missing="needs 2 ranks")
        try:
            fn, check, messages = self.make(call, size)
            us, iters = self.time_point(fn, p2p=call in P2P_CALLS)
            ok = self.comm.gather(check(), root=0)
        except Exception as exc:  # a pycoll error is raised on every rank; report it and go on
            return dict(rec, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200])
        # one way for the ping-pong, per message for the windows
        return dict(rec, us=us / messages, iters=iters, ok=bool(self.rank != 0 or all(ok)))

    def first_calls(self) -> dict[str, Any]:
        """Each of the first 300 small collectives timed alone (slowest rank); the slowest after the first."""
        MPI, comm, n = self.MPI, self.comm, self.n
        F = MPI.FLOAT
        a, b, g = np.ones(2, np.float32), np.zeros(2, np.float32), np.zeros(2 * n, np.float32)
        calls = [("Allreduce 8 B", lambda: comm.Allreduce([a, 2, F], [b, 2, F], op=MPI.SUM)),
                 ("Bcast 8 B", lambda: comm.Bcast([a, 2, F], root=0)),
                 ("Allgather 8 B", lambda: comm.Allgather([a, 2, F], [g, 2, F])),
                 ("Reduce 8 B", lambda: comm.Reduce([a, 2, F], [b, 2, F], op=MPI.SUM, root=0))]
        times = []
        for i in range(FIRST_CALLS):
            t0 = time.perf_counter()
            calls[i % len(calls)][1]()
            times.append((time.perf_counter() - t0) * 1e6)
        rows = comm.gather(times, root=0)
        if self.rank != 0:
            return {}
        worst = [max(col) for col in zip(*rows)]
        k = max(range(1, len(worst)), key=worst.__getitem__)
        return {"first_us": worst[0], "max_us": worst[k], "index": k + 1, "call": calls[k % len(calls)][0],
                "median_us": statistics.median(worst[1:])}

    def halo(self) -> dict[str, Any]:
        """1-D ring halo exchange: two Sendrecv per step, a 3-point stencil on 1e5 doubles, a scalar Allreduce
        every 10 steps; wall time per step of the slowest rank, median of 5 batches."""
        MPI, comm, n, r = self.MPI, self.comm, self.n, self.rank
        D, F, w = MPI.DOUBLE, MPI.FLOAT, HALO_WIDTH
        left, right = (r - 1) % n, (r + 1) % n
        u = np.random.default_rng(r).random(HALO_N + 2 * w)
        new = np.empty_like(u)
        f, g = np.zeros(1, np.float32), np.zeros(1, np.float32)

        def step(k: int) -> None:
            comm.Sendrecv([u[-2 * w:-w], w, D], right, 1, [u[:w], w, D], left, 1)
            comm.Sendrecv([u[w:2 * w], w, D], left, 2, [u[-w:], w, D], right, 2)
            np.add(u[:-2], u[2:], out=new[1:-1])
            new[1:-1] += 2 * u[1:-1]
            u[1:-1] = new[1:-1] * 0.25
            if k % HALO_EVERY == 0:
                f[0] = u[w:-w].sum()
                comm.Allreduce([f, 1, F], [g, 1, F], op=MPI.SUM)

        for k in range(HALO_EVERY * 2):
            step(k)
        steps = self.args.halo_steps
        mine = []
        for _ in range(5):
            comm.Barrier()
            t0 = time.perf_counter()
            for k in range(steps // 5):
                step(k)
            mine.append((time.perf_counter() - t0) / (steps // 5) * 1e6)
        rows = comm.gather(mine, root=0)
        return {"us": statistics.median(max(col) for col in zip(*rows)), "steps": steps} if self.rank == 0 else {}

    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        first = self.first_calls()  # before anything else warms the library up
        ready_s = self.compiled_ready(t0)
        points = [self.point(call, size) for call, size in plan(self.n, self.args.sizes, self.args.calls)]
        return {"np": self.n, "first300": first, "points": points, "halo": self.halo(), "kernels_ready_s": ready_s}

    def compiled_ready(self, t0: float) -> Optional[float]:
        """pycoll only: wait (at most 60 s) until its compiled kernels, loading in the background since start-up,
        are in, so the points time the steady state; seconds since the first call, the same on every rank."""
        try:
            from pycoll.algorithms import arena_jit
        except ImportError:
            return None
        if self.MPI.__name__.split(".")[0] != "pycoll":
            return None
        while not arena_jit.ready() and time.perf_counter() - t0 < 60 and arena_jit.ARENA_JIT.get():
            time.sleep(0.01)
        self.comm.Barrier()
        return round(time.perf_counter() - t0, 3)


def plan(n: int, sizes: list[int], calls: Sequence[str] = CALLS) -> list[tuple[str, int]]:
    """The (call, size) points of one job: each call (in the order given) at each size (Barrier once), at 4+ ranks
    the three swept calls at every power of 4 as well."""
    out = []
    for call in calls:
        if call == "Barrier":
            out.append((call, 0))
            continue
        extra = POW4 if n >= 4 and call in SWEPT_AT_4 and sizes == SIZES else []
        out += [(call, s) for s in sorted(set(sizes) | set(extra))]
    return out


def program_main(args: argparse.Namespace) -> int:
    MPI = load_mpi(args.module)
    result = Program(MPI, args).run()
    if MPI.COMM_WORLD.Get_rank() == 0:
        result["module"] = args.module
        Path(args.result).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------------------------- driver

PEERS = ("mpich", "pycoll")


def find_mpiexec() -> Optional[str]:
    from pycoll.perf.peers import find_mpiexec as find

    return find()


def program_cmd(peer: str, n: int, result: str, args: argparse.Namespace) -> list[str]:
    """The same program text for both: mpiexec + mpi4py, or `pycoll run` + pycoll.MPI."""
    prog = [sys.executable, os.path.abspath(__file__), "--program", "--module", "mpi4py" if peer == "mpich" else "pycoll",
            "--result", result, "--target-s", str(args.target_s), "--min-iters", str(args.min_iters),
            "--max-iters", str(args.max_iters), "--warmup", str(args.warmup), "--halo-steps", str(args.halo_steps),
            "--sizes", ",".join(map(str, args.sizes)), "--calls", ",".join(args.calls)]
    if peer == "mpich":
        return [find_mpiexec() or "mpiexec", "-n", str(n), *prog]
    return [sys.executable, "-m", "pycoll", "run", "-n", str(n), "--", *prog]


def run_program(peer: str, n: int, args: argparse.Namespace) -> tuple[Optional[dict[str, Any]], str]:
    """(the program's result, or None; why not)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        try:
            proc = subprocess.run(program_cmd(peer, n, result, args), capture_output=True, text=True,
                                  timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {args.timeout:g} s"
        if proc.returncode != 0 or not os.path.exists(result):
            tail = [ln for ln in (proc.stderr + proc.stdout).strip().splitlines() if ln.strip()][-3:]
            return None, f"exit code {proc.returncode}: " + " | ".join(tail)
        return json.loads(Path(result).read_text()), ""


def target(n: int, call: str, size: int) -> Optional[tuple[float, str]]:
    """(the largest pycoll/MPICH time ratio that passes, how the issue states it), or None: no target."""
    if call == "halo step":
        return 1.1, "<=1.1x"
    if n == 2:
        if call in BW_CALLS and size >= 64 * KIB:
            return 1 / 0.8, "bw>=0.8x"
        if size in (8, 4 * KIB) or call == "Barrier":
            return 2.0, "<=2x"
        if size in (64 * KIB, MIB):
            return 1.25, "<=1.25x"
    if n == 4 and call in SWEPT_AT_4 and 8 <= size <= 16 * MIB:
        return 1.5, "<=1.5x"
    return None


def merge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per point the median µs over the rounds that measured it (a point missing or failing anywhere stays so)."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for res in rounds:
        for p in res["points"]:
            cur = out.setdefault((p["call"], p["size"]), {"call": p["call"], "size": p["size"], "us": [], "ok": True})
            if "us" in p:
                cur["us"].append(p["us"])
                cur["ok"] &= p["ok"]
            else:
                cur["problem"] = ["missing", p["missing"]] if "missing" in p else ["error", p.get("error")]
        key = ("halo step", 0)
        out.setdefault(key, {"call": "halo step", "size": 0, "us": [], "ok": True})["us"].append(res["halo"]["us"])
    for cur in out.values():
        cur["rounds_us"] = sorted(cur["us"])
        cur["us"] = statistics.median(cur["us"]) if cur["us"] and "problem" not in cur else None
    first = [r["first300"] for r in rounds]
    worst = max(first, key=lambda f: f["max_us"])
    return {"points": list(out.values()), "first300": dict(worst, rounds_max_us=sorted(f["max_us"] for f in first))}


def human(size: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def build_rows(n: int, merged: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point: both times, the ratio, the target and the verdict."""
    mp, pc = merged.get("mpich"), merged.get("pycoll")
    keys = [(p["call"], p["size"]) for p in (mp or pc or {"points": []})["points"]]
    index = {name: {(p["call"], p["size"]): p for p in m["points"]} for name, m in merged.items() if m}
    rows = []
    for call, size in keys:
        a = index.get("mpich", {}).get((call, size), {})
        b = index.get("pycoll", {}).get((call, size), {})
        goal = target(n, call, size)
        row = {"np": n, "call": call, "size": size if call not in ("Barrier", "halo step") else None,
               "mpich_us": a.get("us"), "pycoll_us": b.get("us"), "ratio": None,
               "target": goal[1] if goal else "-", "verdict": "-"}
        if b.get("problem") or a.get("problem"):
            kind, why = b.get("problem") or a["problem"]
            row["verdict"], row["note"] = kind, why if b.get("problem") else f"MPICH: {why}"
        elif a.get("us") and b.get("us"):
            row["ratio"] = b["us"] / a["us"]
            if not (a["ok"] and b["ok"]):
                row["verdict"] = "WRONG"
                row["note"] = "result check failed: " + ", ".join(p for p, x in (("MPICH", a), ("pycoll", b))
                                                                    if not x["ok"])
            elif goal:
                row["verdict"] = "pass" if row["ratio"] <= goal[0] else "FAIL"
        elif not b:
            row["verdict"] = "no pycoll run"
        rows.append(row)
    if pc:
        f = pc["first300"]
        mf = (mp or {}).get("first300", {})
        rows.append({"np": n, "call": f"first {FIRST_CALLS} small calls, slowest (pycoll: #{f['index']}, {f['call']})",
                     "size": None, "mpich_us": mf.get("max_us"), "pycoll_us": f["max_us"], "ratio": None,
                     "target": "<20 ms", "verdict": "pass" if f["max_us"] < 20_000 else "FAIL"})
    return rows


def fmt_us(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 1000 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| ranks | call | size | MPICH µs | pycoll µs | ratio | target | result |",
             "|---:|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        verdict = r["verdict"] + (f" ({r['note']})" if r.get("note") else "")
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['np']} | {r['call']} | {human(r['size']) if r['size'] is not None else '-'} | "
                     f"{fmt_us(r['mpich_us'])} | {fmt_us(r['pycoll_us'])} | "
                     f"{ratio} | "
                     f"{r['target']} | {verdict} |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    judged = counts.get("pass", 0) + counts.get("FAIL", 0)
    return (f"{counts.get('pass', 0)}/{judged} targets pass; {counts.get('FAIL', 0)} fail, "
            f"{counts.get('missing', 0)} missing, {counts.get('error', 0)} errors, {counts.get('WRONG', 0)} wrong")


def driver_main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mpiexec = find_mpiexec()
    peers = [p for p in PEERS if p != "mpich" or mpiexec]
    if not mpiexec:
        print("# mpiexec not found: MPICH column left empty", flush=True)
    command = shlex.join(["python", "perf/host_calls.py", *sys.argv[1:]])
    started = time.monotonic()
    print(f"# {command}", flush=True)
    status = 0
    for n in args.np:
        per_peer: dict[str, list[dict[str, Any]]] = {p: [] for p in peers}
        failures: dict[str, list[str]] = {p: [] for p in peers}
        loads: list[float] = []  # the 1-minute load average after each run: others' work on a shared machine
        for rnd in range(args.rounds):
            order = peers if rnd % 2 == 0 else peers[::-1]  # alternate who goes first
            for peer in order:
                t0 = time.monotonic()
                res, why = run_program(peer, n, args)
                loads.append(round(os.getloadavg()[0], 2))
                print(f"# np={n} round {rnd + 1}/{args.rounds} {peer}: {'ok' if res else 'FAILED ' + why} "
                      f"({time.monotonic() - t0:.0f} s, load average {loads[-1]:.1f})", flush=True)
                if res:
                    per_peer[peer].append(res)
                else:
                    failures[peer].append(why)
        merged = {p: merge(r) if r else None for p, r in per_peer.items()}
        rows = build_rows(n, merged)
        table = markdown(rows)
        print(f"\n## {n} ranks\n\n{table}\n\n{summary(rows)}\n", flush=True)
        meta = {"command": command, "np": n, "rounds": args.rounds,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "host": socket.gethostname(), "cpus": os.cpu_count(), "python": platform.python_version(),
                "target_s": args.target_s, "min_iters": args.min_iters, "max_iters": args.max_iters,
                "sizes": args.sizes, "failures": failures, "load_averages": loads}
        stem = out / f"host-calls-np{n}"
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "raw": per_peer}, indent=1) + "\n")
        stem.with_suffix(".md").write_text(f"# host calls, {n} ranks\n\n`{command}`, {meta['date']}, 1-minute load "
                                           f"average after each run: {', '.join(map(str, loads))}\n\n{table}\n\n"
                                           f"{summary(rows)}\n")
        print(f"# wrote {stem}.json and {stem}.md", flush=True)
        if any(failures.values()) or not all(per_peer.values()):
            status = 1
    print(f"# total {time.monotonic() - started:.0f} s", flush=True)
    return status


def _sizes(text: str) -> list[int]:
    from pycoll.config import parse_size

    return sorted({parse_size(t) for t in text.split(",") if t.strip()})


def _calls(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in names if c not in CALLS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown calls {unknown}; the calls are: {', '.join(CALLS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--np", type=lambda t: [int(x) for x in t.split(",")], default=[2], help="rank counts (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per peer; medians reported (default 3)")
    p.add_argument("--out", default="perf/results/host-calls", help="folder for the JSON and markdown tables")
    p.add_argument("--target-s", dest="target_s", type=float, default=0.2, help="seconds of timed calls per point")
    p.add_argument("--min-iters", dest="min_iters", type=int, default=20)
    p.add_argument("--max-iters", dest="max_iters", type=int, default=20000)
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before each point")
    p.add_argument("--halo-steps", dest="halo_steps", type=int, default=1000)
    p.add_argument("--sizes", type=_sizes, default=list(SIZES), help="point sizes (default 8,4K,64K,1M)")
    p.add_argument("--calls", type=_calls, default=list(CALLS),
                   help="the calls to time, comma-separated, in this order (default: all, in the suite's order); "
                        "the points before a call can change its time, as they leave the process's memory")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one program run may take")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 2 ranks, 8 B and 64 KiB, one round, few iterations")
    # the rank program (run by the driver under mpiexec or pycoll run)
    p.add_argument("--program", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--module", choices=("mpi4py", "pycoll"), default=os.environ.get("HOST_CALLS_MPI", "mpi4py"),
                   help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.program:
        return program_main(args)
    if args.quick:
        args.np, args.rounds, args.sizes = [2], 1, [8, 64 * KIB]
        args.target_s, args.min_iters, args.max_iters, args.warmup, args.halo_steps = 0.005, 5, 200, 2, 50
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
