"""`pycoll tune`: measure the collective algorithms on this machine and fit the cost model's constants.

The command starts a job with the local launcher (optionally on virtual hosts). In the job every rank
times each algorithm of allreduce, reduce-scatter, allgather and broadcast at a few sizes, forced one
at a time; rank 0 then fits the model's constants so that predicted times match the measured ones
(least squares on log time ratios), and saves them. A single-host job fits the shared-memory and CPU
constants; a multi-host job fits only the network ones and keeps the rest from the file it updates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Optional

import numpy as np

from .algorithms import ALGORITHMS, CHUNK_SIZE, Call, Layout, cost
from .algorithms.cost import CostModel

SIZES = (8, 4 << 10, 64 << 10, 1 << 20, 8 << 20)
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast")
LOCAL_PARAMS = ("shm_latency_us", "shm_GBps", "msg_us", "reduce_GBps")
NET_PARAMS = ("net_latency_us", "net_GBps")


# ---- in the job -------------------------------------------------------------------------------------


def _time_call(comm: Any, coll: str, nbytes: int, iters: int) -> float:
    """Median over ``iters`` of the slowest rank's time for one call of ``nbytes`` float32 bytes."""
    p = comm.Get_size()
    n = max(nbytes // 4, 1)
    if coll in ("reduce_scatter", "allgather"):
        n = max(n // p, 1)  # nbytes is the whole vector, as nccl-tests counts it
    send = np.ones(n * (p if coll == "reduce_scatter" else 1), np.float32)
    recv = np.empty(n * (p if coll == "allgather" else 1), np.float32)
    run = {
        "allreduce": lambda: comm.Allreduce(send, recv),
        "reduce_scatter": lambda: comm.Reduce_scatter_block(send, recv),
        "allgather": lambda: comm.Allgather(send, recv),
        "broadcast": lambda: comm.Bcast(send, root=0),
    }[coll]
    run()  # warm-up: pages, pools, connections
    times = np.empty(iters)
    slowest = np.empty(1)
    for i in range(iters):
        comm.Barrier()
        t0 = time.perf_counter()
        run()
        times[i] = time.perf_counter() - t0
    comm.Allreduce(np.array([np.median(times)]), slowest, op=_max())
    return float(slowest[0])


def _max() -> Any:
    from . import MPI

    return MPI.MAX


def measure(comm: Any, sizes: tuple[int, ...], iters: int, layout: Layout) -> list[dict[str, Any]]:
    """Time every algorithm that accepts the layout, forced through PYCOLL_ALGO, at every size."""
    points = []
    probe = {c: Call(c, np.dtype(np.float32), recv=np.empty(0, np.float32)) for c in COLLECTIVES}
    saved = os.environ.get("PYCOLL_ALGO")
    try:
        for coll in COLLECTIVES:
            for name, algo in ALGORITHMS[coll].items():
                if algo.cost is None or algo.refusal(probe[coll], layout) is not None:
                    continue
                os.environ["PYCOLL_ALGO"] = f"{coll}:{name}"
                for nbytes in sizes:
                    reps = iters if nbytes <= (1 << 20) else max(3, iters // 3)
                    points.append({"collective": coll, "algorithm": name, "bytes": nbytes,
                                   "seconds": _time_call(comm, coll, nbytes, reps)})
    finally:
        if saved is None:
            os.environ.pop("PYCOLL_ALGO", None)
        else:
            os.environ["PYCOLL_ALGO"] = saved
    return points


def measure_reduce_GBps(nbytes: int = 8 << 20) -> float:
    a, b = np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32)
    np.add(a, b, out=a)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.add(a, b, out=a)
        times.append(time.perf_counter() - t0)
    return nbytes / float(np.median(times)) / 1e9


# ---- the fit ------------------------------------------------------------------------------------------


def predicted(model: CostModel, point: dict[str, Any], layout: Layout) -> float:
    return ALGORITHMS[point["collective"]][point["algorithm"]].predict(model, point["bytes"], layout)


def misfit(model: CostModel, points: list[dict[str, Any]], layout: Layout) -> float:
    """Mean squared log ratio of predicted to measured time."""
    total = 0.0
    for pt in points:
        pred = max(predicted(model, pt, layout), 1e-9)
        total += math.log(pred / max(pt["seconds"], 1e-9)) ** 2
    return total / max(len(points), 1)


def fit(start: CostModel, points: list[dict[str, Any]], layout: Layout, params: tuple[str, ...],
        rounds: int = 60) -> CostModel:
    """Coordinate search in log space over ``params``, from ``start``; keeps every improvement."""
    best, best_err = start, misfit(start, points, layout)
    step = 2.0
    for _ in range(rounds):
        improved = False
        for name in params:
            for factor in (step, 1 / step):
                value = getattr(best, name) * factor
                trial = dataclasses.replace(best, **{name: value})
                err = misfit(trial, points, layout)
                if err < best_err - 1e-12:
                    best, best_err, improved = trial, err, True
        if not improved:
            step = math.sqrt(step)
            if step < 1.01:
                break
    return best


def fit_corrections(model: CostModel, points: list[dict[str, Any]], layout: Layout) -> CostModel:
    """Per algorithm, the latency and bandwidth factors (a, b) that best fit its timings: a·L + b·B ~ T.

    Least squares on relative error, so that small and large messages weigh alike; factors stay positive.
    """
    scope = model.scope(layout)
    base = dataclasses.replace(model, corrections=tuple(c for c in model.corrections if not c[0].endswith(f"@{scope}")))
    fitted = dict((c[0], (c[1], c[2])) for c in base.corrections)
    by_algo: dict[str, list[dict[str, Any]]] = {}
    for pt in points:
        by_algo.setdefault(f"{pt['collective']}:{pt['algorithm']}", []).append(pt)
    for key, pts in by_algo.items():
        coll, name = key.split(":")
        algo = ALGORITHMS[coll][name]
        rows, target = [], []
        for pt in pts:
            lat, bw = base.split(algo.cost, pt["bytes"], layout)
            rows.append([lat / pt["seconds"], bw / pt["seconds"]])
            target.append(1.0)
        a, b = np.linalg.lstsq(np.array(rows), np.array(target), rcond=None)[0]
        if a <= 0 or b <= 0:  # one term alone explains the timings better: fit a single common factor
            both = np.array(rows).sum(axis=1)
            a = b = float(np.sum(both) / np.sum(both * both))
        fitted[f"{key}@{scope}"] = (round(float(a), 4), round(float(b), 4))
    return dataclasses.replace(base, corrections=tuple(sorted((k, v[0], v[1]) for k, v in fitted.items())))


def worker(out: str, sizes: tuple[int, ...], iters: int) -> int:
    from . import MPI

    comm = MPI.COMM_WORLD
    layout: Layout = comm._layout
    base = cost.current()
    points = measure(comm, sizes, iters, layout)
    if comm.Get_rank() != 0:
        return 0
    start = dataclasses.replace(base, chunk_bytes=CHUNK_SIZE.get(), cores=os.cpu_count() or 1)
    params = NET_PARAMS if layout.hosts > 1 else LOCAL_PARAMS
    if layout.hosts == 1:
        start = dataclasses.replace(start, reduce_GBps=measure_reduce_GBps())
    before = misfit(start, points, layout)
    model = fit(dataclasses.replace(start, corrections=()), points, layout, params)
    model = fit_corrections(dataclasses.replace(model, corrections=start.corrections), points, layout)
    after = misfit(model, points, layout)
    model = dataclasses.replace(model, source=f"pycoll tune on {layout.size} ranks, {layout.hosts} hosts, "
                                               f"{time.strftime('%Y-%m-%d %H:%M')}")
    path = model.save(out or None)
    report = {"path": path, "layout": list(layout.host_of), "fitted": list(params), "misfit_before": before,
              "misfit_after": after, "model": model.to_json(), "points": [
                  dict(pt, predicted=predicted(model, pt, layout)) for pt in points]}
    with open(path + ".points.json", "w") as f:
        json.dump(report, f, indent=1)
    print(f"pycoll tune: fitted {', '.join(params)} on {len(points)} timings "
          f"(rms log error {math.sqrt(before):.2f} -> {math.sqrt(after):.2f}); saved {path}")
    for name in params:
        print(f"  {name} = {getattr(model, name):.4g}")
    return 0


# ---- the command ------------------------------------------------------------------------------------


def tune_command(args: argparse.Namespace) -> int:
    out = os.path.abspath(args.output or cost.TUNE_FILE.get() or cost.default_path())
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", str(args.n)]
    if args.hosts:
        cmd += ["--hosts", str(args.hosts)]
    if args.link_rate:
        cmd += ["--link-rate", args.link_rate]
    cmd += ["--", sys.executable, "-m", "pycoll.tune", "--out", out, "--sizes", ",".join(map(str, args.sizes)),
            "--iters", str(args.iters)]
    env = dict(os.environ)
    env.pop("PYCOLL_ALGO", None)
    # Start from the file being updated (constants this layout cannot observe are kept), or from the defaults.
    env["PYCOLL_TUNE_FILE"] = out if os.path.exists(out) and not args.fresh else cost.BUILTIN
    return subprocess.call(cmd, env=env)


def _sizes(text: str) -> list[int]:
    from .config import parse_size

    return [parse_size(t) for t in text.split(",") if t.strip()]


def add_tune_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune", help="fit the algorithm cost model to this machine and save it",
        description="Time every algorithm on N local ranks (optionally on virtual hosts) and fit the cost model "
                    "that picks among them. One host fits shared-memory and CPU constants; --hosts fits the network ones.")
    p.add_argument("-n", "--np", dest="n", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--hosts", type=int, default=None, help="virtual hosts (network namespaces; needs root)")
    p.add_argument("--link-rate", default=None, help="shape the virtual links, e.g. 1gbit")
    p.add_argument("-o", "--output", default=None, help="where to save (default: $PYCOLL_TUNE_FILE or ~/.cache/pycoll/tuning.json)")
    p.add_argument("--sizes", type=_sizes, default=list(SIZES), help="message sizes to time, e.g. 8,64K,1M,8M")
    p.add_argument("--iters", type=int, default=10, help="timed calls per size (default 10)")
    p.add_argument("--fresh", action="store_true", help="start from the built-in defaults, not the existing file")
    p.set_defaults(func=tune_command)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pycoll.tune", description="the in-job part of `pycoll tune`")
    p.add_argument("--out", default="")
    p.add_argument("--sizes", type=_sizes, default=list(SIZES))
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    return worker(args.out, tuple(args.sizes), args.iters)


if __name__ == "__main__":
    sys.exit(main())
