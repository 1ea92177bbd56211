"""`pycoll tune`: measure the collective algorithms on this machine and fit the cost model's constants.

The command starts a job with the local launcher (optionally on virtual hosts). In the job every rank
times each algorithm of allreduce, reduce-scatter, allgather and broadcast at a few sizes, forced one
at a time; rank 0 then fits the model's constants so that predicted times match the measured ones
(least squares on log time ratios), and saves them. A single-host job fits the shared-memory and CPU
constants; a multi-host job fits only the network ones and keeps the rest from the file it updates.
Last, it keeps each algorithm's measured / predicted ratio at every timed size of this exact layout, so
that on this layout selection follows the timings where the model's shape cannot.

Across hosts it first measures every host pair (one-way latency, the rates one way and both ways at once) between
the hosts' first ranks, and each host's memory (one core's copy and reduction rates), and writes them into a topology
file (``--topology``, default $PYCOLL_TOPO_FILE or ~/.cache/pycoll/topology.json); untuned jobs that load that file
price their links, the cores' socket copies and their memory-bound work from it.
On a real cluster the in-job part runs under any launcher:
``mpiexec -n N python -m pycoll.tune --links-only --topology FILE``.
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
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .algorithms import cost, cost_topology
from .algorithms.base import CHUNK_SIZE, Call, Layout
from .algorithms.registry import ALGORITHMS
from .algorithms.cost import CostModel
from .perf import metrics
from .topology.model import HostLink, HostMemory, Topology
from .topology import files as topology_files
from .topology.discover import TOPO_FILE

SIZES = (8, 4 << 10, 64 << 10, 1 << 20, 8 << 20)
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast")
# The memory rates (copy, reduction, cma) are measured directly, not fitted: reduce_GBps trades off against shm_GBps
# and would drift to nonsense.
LOCAL_PARAMS = ("shm_latency_us", "shm_GBps", "msg_us")
NET_PARAMS = ("net_latency_us", "net_GBps")


# ---- in the job -------------------------------------------------------------------------------------


def measure(comm: Any, sizes: tuple[int, ...], iters: int, layout: Layout) -> list[dict[str, Any]]:
    """Time every algorithm that accepts the layout, forced through PYCOLL_ALGO, at every size.

    The algorithms of one size are timed together, iteration by iteration (the perf worker's interleaving),
    so the machine's drifts do not pass for differences between them. Rank 0 returns the points.
    """
    from .perf import backends, worker

    backend = backends.make_backend("pycoll")
    probe = {c: Call(c, np.dtype(np.float32), recv=np.empty(0, np.float32)) for c in COLLECTIVES}
    points = []
    for coll in COLLECTIVES:
        runs = [{"label": name, "algo": name, "env": {"PYCOLL_ALGO": f"{coll}:{name}"}}
                for name, algo in ALGORITHMS[coll].items()
                if algo.cost is not None and algo.refusal(probe[coll], layout) is None]
        for nbytes in sizes:
            spec = {"np_dtype": "float32", "dtype": "float32", "itemsize": 4, "op": "sum", "root": 0, "warmup": 1,
                    "check": False, "iters": iters if nbytes <= (1 << 20) else max(3, iters // 3)}
            if metrics.round_size(coll, nbytes, 4, comm.Get_size())[1] == 0:
                continue
            for row in worker.measure(backend, spec, coll, nbytes, False, runs):
                points.append({"collective": coll, "algorithm": row["algo"], "bytes": row["bytes"],
                               "seconds": row["time_us"] * 1e-6})
    return points


def _pingpong(comm: Any, peer: int, first: bool, buf: np.ndarray, count: int) -> float:
    """Seconds for ``count`` round trips of ``buf`` with ``peer`` (``first`` sends first)."""
    from . import MPI

    spec = [buf, MPI.BYTE]
    t0 = time.perf_counter()
    for _ in range(count):
        if first:
            comm.Send(spec, peer, tag=71)
            comm.Recv(spec, peer, tag=71)
        else:
            comm.Recv(spec, peer, tag=71)
            comm.Send(spec, peer, tag=71)
    return time.perf_counter() - t0


def _one_way(pair: Any, root: int, buf: np.ndarray) -> float:
    """Seconds for ``buf`` to cross from ``root`` to the other rank of the two-rank ``pair`` as one frame (a Bcast),
    closed by a 1-byte reply (the root's Bcast returns once the kernel holds its bytes)."""
    from . import MPI

    ack = np.zeros(1, np.uint8)
    t0 = time.perf_counter()
    pair.Bcast([buf, MPI.BYTE], root=root)
    if pair.Get_rank() == root:
        pair.Recv([ack, MPI.BYTE], 1 - root, tag=73)
    else:
        pair.Send([ack, MPI.BYTE], root, tag=73)
    return time.perf_counter() - t0


def _both_ways(pair: Any, out: np.ndarray, into: np.ndarray) -> float:
    """Seconds for ``out`` to cross each way at once between the two ranks of ``pair`` (a Sendrecv)."""
    from . import MPI

    t0 = time.perf_counter()
    pair.Sendrecv([out, MPI.BYTE], 1 - pair.Get_rank(), 74, [into, MPI.BYTE], 1 - pair.Get_rank(), 74)
    return time.perf_counter() - t0


FRAMES_S = 0.5  # about how long each of a host pair's rates is timed (``measure_links``)
BOTH_WAYS_RETRIES = 2  # more readings of both ways at once where the first says the cores bound the link


def host_leaders(host_of: list[int]) -> dict[int, int]:
    """Each host's first rank, by host index (``host_of``: each rank's host)."""
    leaders: dict[int, int] = {}
    for rank, h in enumerate(host_of):
        leaders.setdefault(h, rank)
    return leaders


def measure_links(comm: Any, names: list[str], host_of: list[int], *, trips: int = 200, stream_bytes: int = 16 << 20,
                  rounds: int = 9) -> list[HostLink]:
    """Latency and rates between every pair of hosts, measured by their first ranks one pair at a time (the other
    ranks wait): half the median round trip of 1 byte; the median rate of ``stream_bytes`` sent one way as one frame,
    in each direction (the slower kept); and each way's rate with as many bytes sent both ways at once. Out of the
    caches, the last two tell the link from the cores: where the link is the bound, both ways cross as fast as one;
    where the cores' socket copies are, each way takes half of them. A busy moment on the machine reads like the
    second, so where the pair's first rank reads it, both ways are timed up to BOTH_WAYS_RETRIES more times and the
    fastest reading kept: load only ever slows a reading, and cores that really bound the link read the same again.
    Likewise one way is timed again where it reads slower than each way at once, which no link or core allows (on
    this VM, one tune of five read 0.85 GB/s one way and 1.89 each way at once; the others 3.1-3.5 one way).
    Every rank returns the links.

    Each rate is the median of up to ``rounds`` frames, as many as fit in about FRAMES_S and 3 at least (on a 1 Gbit/s
    link a 16 MiB frame takes 0.14 s, and a cluster has many pairs): on this VM's unshaped namespace link, four runs a
    few seconds apart read 3.2-4.8 GB/s one way with 3 frames, five with 9 read 3.7-3.9
    (perf/results/multihost/targets-three-links-span-plans/)."""
    from . import MPI

    leaders = host_leaders(host_of)
    me = comm.Get_rank()
    small = np.zeros(1, np.uint8)
    found: list[dict[str, Any]] = []
    hosts = sorted(leaders)
    for i, ha in enumerate(hosts):
        for hb in hosts[i + 1:]:
            a, b = leaders[ha], leaders[hb]
            pair = comm.Split(0 if me in (a, b) else MPI.UNDEFINED, 0 if me == a else 1)
            if pair != MPI.COMM_NULL:
                peer = b if me == a else a
                out, into = np.ones(stream_bytes, np.uint8), np.zeros(stream_bytes, np.uint8)
                _pingpong(comm, peer, me == a, small, 20)  # warm-up: connection, first-call paths
                trips_s = sorted(_pingpong(comm, peer, me == a, small, 1) for _ in range(trips))
                latency = trips_s[len(trips_s) // 2] / 2

                def rate(timed: Any) -> float:
                    first = timed()  # a shape's first call takes the schedule; the next ones the path being measured
                    # as many frames as fit in about FRAMES_S (3 at least, ``rounds`` at most), the pair agreeing
                    count = pair.bcast(max(3, min(rounds, int(FRAMES_S / max(first, 1e-6)))), root=0)
                    times = sorted(timed() for _ in range(count))
                    return stream_bytes / max(times[len(times) // 2] - latency, 1e-9)

                def one_way_rate() -> float:
                    return min(rate(lambda: _one_way(pair, root, out if pair.Get_rank() == root else into))
                               for root in (0, 1))

                def both_ways_rate() -> float:
                    return rate(lambda: _both_ways(pair, out, into))

                def fastest(reading: float, doubtful: Callable[[float], bool], again: Callable[[], float]) -> float:
                    """``reading``, timed ``again`` up to BOTH_WAYS_RETRIES times while the pair's first rank finds
                    it ``doubtful``; the fastest kept (load only ever slows a reading)."""
                    for _ in range(BOTH_WAYS_RETRIES):
                        if not pair.bcast(doubtful(reading), root=0):
                            break
                        reading = max(reading, again())
                    return reading

                one_way = one_way_rate()
                both = both_ways_rate()
                # each way at once faster than one way alone: a busy moment slowed the one-way reading
                one_way = fastest(one_way, lambda r: both > r, one_way_rate)
                # a reading that says the cores bound the link is taken again
                both = fastest(both, lambda r: cost_topology.tcp_rate(one_way / 1e9, r / 1e9) is not None, both_ways_rate)
                pair.Free()
                if me == a:
                    found.append({"a": names[ha], "b": names[hb], "GBps": round(one_way / 1e9, 4),
                                  "latency_us": round(latency * 1e6, 2), "both_ways_GBps": round(both / 1e9, 4)})
            comm.Barrier()  # one pair at a time: nothing else shares the links while it is timed
    stamp = f"pycoll tune, {time.strftime('%Y-%m-%d %H:%M')}"
    merged = [row for rows in comm.allgather(found) for row in rows]
    return [HostLink(source=stamp, **row) for row in merged]


def measure_memory(comm: Any, names: list[str], host_of: list[int], machine_of: list[str]) -> list[HostMemory]:
    """Each host's memory copy and reduction rates out of cache (`pycoll perf`'s limit line), measured by its first
    rank while the host's other ranks wait. Hosts that share a machine (network namespaces of one kernel) take turns,
    so that each reads one core's rate, as a host of its own would; separate machines measure at once. Every rank
    returns every host's."""
    from .perf.sweep import measure_limits

    leaders = host_leaders(host_of)
    turn: dict[int, int] = {}  # leader rank -> its turn among its machine's hosts
    seen: dict[str, int] = {}
    for h in sorted(leaders):
        machine_id = machine_of[leaders[h]]
        turn[leaders[h]] = seen.get(machine_id, 0)
        seen[machine_id] = turn[leaders[h]] + 1
    me = comm.Get_rank()
    found: list[HostMemory] = []
    stamp = f"pycoll tune, {time.strftime('%Y-%m-%d %H:%M')}"
    for k in range(max(seen.values(), default=0)):
        if turn.get(me) == k:
            limits = measure_limits()
            found.append(HostMemory(names[host_of[me]], limits["copy_GBps"], limits["reduce_GBps"], stamp))
        comm.Barrier()
    return [m for part in comm.allgather(found) for m in part]


def save_links(links: list[HostLink], cluster: Topology, path: str, memory: Sequence[HostMemory] = ()) -> str:
    """Write ``links`` (and the hosts' ``memory`` rates) into the topology file at ``path``: the file's own hosts are
    kept when it exists, else the job's merged topology is written. Replaces earlier measurements of the same pairs
    and hosts."""
    try:
        base = topology_files.load(path)
    except FileNotFoundError:
        base = dataclasses.replace(cluster, source="")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    base.with_links(links).with_memory(memory).dump(path)
    return path


def memory_rates(base: CostModel) -> CostModel:
    """``base`` with this host's memory-bound rates measured, not fitted: copy and reduction out of cache (64 MiB, as
    `pycoll perf`'s limit line; the model adds the cache's speed-up itself), cross-memory attach in proportion."""
    from .perf.sweep import measure_limits

    limits = measure_limits()
    return base.at_memory_speed(limits["copy_GBps"], limits["reduce_GBps"])


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


def fit_residuals(model: CostModel, points: list[dict[str, Any]], layout: Layout) -> CostModel:
    """Per algorithm, measured / predicted time at each timed size of this exact layout (other layouts' are kept)."""
    where = f"@{model.layout_key(layout)}"
    base = dataclasses.replace(model, residuals=tuple(r for r in model.residuals if not r[0].endswith(where)))
    tables: dict[str, dict[int, float]] = {}
    for pt in points:
        pred = predicted(base, pt, layout)
        if pred > 0 and pt["seconds"] > 0:
            key = f"{pt['collective']}:{pt['algorithm']}{where}"
            tables.setdefault(key, {})[int(pt["bytes"])] = round(pt["seconds"] / pred, 4)
    fresh = tuple((k, tuple(sorted(t.items()))) for k, t in tables.items())
    return dataclasses.replace(base, residuals=tuple(sorted(base.residuals + fresh)))


def default_topology_path() -> str:
    return os.path.join(os.path.dirname(cost.default_path()), "topology.json")


def worker(out: str, sizes: tuple[int, ...], iters: int, topology_out: str = "", links_only: bool = False) -> int:
    from . import MPI
    from .runtime import get_runtime, shared_machine_cores, shared_machine_memory

    comm = MPI.COMM_WORLD
    layout: Layout = comm._layout
    base = cost.current()
    rt = get_runtime()
    links: list[HostLink] = []
    host_memory: list[HostMemory] = []
    if layout.hosts > 1:
        names = [h.name for h in rt.topology.hosts]
        host_of = [d.host for d in rt.placement]
        links = measure_links(comm, names, host_of)
        host_memory = measure_memory(comm, names, host_of, [p.machine or p.host_id for p in rt.peers])
        if comm.Get_rank() == 0:
            path = save_links(links, rt.topology, topology_out or default_topology_path(), host_memory)
            print(f"pycoll tune: measured {len(links)} host pair(s) and {len(host_memory)} hosts' memory; saved in "
                  f"topology {path}")
            for lk in links:
                print(f"  {lk.a} - {lk.b}: {lk.latency_us:.1f} us one way, {lk.GBps:.3f} GB/s one way, "
                      f"{lk.both_ways_GBps:.3f} GB/s each way both ways at once")
            for m in host_memory:
                print(f"  {m.host}: memory copies {m.copy_GBps:.2f} GB/s, reduces {m.reduce_GBps:.2f} GB/s (one core)")
            if os.path.abspath(path) != os.path.abspath(TOPO_FILE.get() or "/nonexistent"):
                print(f"  jobs use it with PYCOLL_TOPO_FILE={path}")
    if links_only:
        return 0
    points = measure(comm, sizes, iters, layout)
    if comm.Get_rank() != 0:
        return 0
    cores = shared_machine_cores(rt.peers) or os.cpu_count() or 1  # namespace hosts share the cores
    memory = shared_machine_memory(rt.peers)  # ... and the memory's rate, as the job's model gives them (runtime)
    start = dataclasses.replace(base, chunk_bytes=CHUNK_SIZE.get(), cores=cores,
                                host_memory_GBps=base.host_memory_GBps * (memory or 1.0))
    if links:  # the fit starts from the measured links
        wire, latency, sockets = cost_topology.link_terms(links, start.tcp_cache_speedup)
        start = dataclasses.replace(start, net_GBps=wire, net_latency_us=latency, tcp_GBps=sockets or start.tcp_GBps)
    params = NET_PARAMS if layout.hosts > 1 else LOCAL_PARAMS
    if layout.hosts == 1:
        start = memory_rates(start)
    else:  # the fit starts from the hosts' measured memory, the slowest host's, as the job's model does
        slowest = rt.topology.with_memory(host_memory).memory_rates(range(len(rt.topology.hosts)))
        if slowest is not None:
            start = start.at_memory_speed(*slowest)
    before = misfit(start, points, layout)
    model = fit(dataclasses.replace(start, corrections=()), points, layout, params)
    model = fit_corrections(dataclasses.replace(model, corrections=start.corrections, residuals=()), points, layout)
    smooth = misfit(model, points, layout)  # the model's own fit, before the measured residuals
    model = fit_residuals(dataclasses.replace(model, residuals=start.residuals), points, layout)
    after = misfit(model, points, layout)
    model = dataclasses.replace(model, source=f"pycoll tune on {layout.size} ranks, {layout.hosts} hosts, "
                                               f"{time.strftime('%Y-%m-%d %H:%M')}")
    # the file keeps the whole machine's memory rate: a job takes its hosts' shares again
    saved = model if memory is None else dataclasses.replace(model, host_memory_GBps=base.host_memory_GBps)
    path = saved.save(out or None)
    report = {"path": path, "layout": list(layout.host_of), "fitted": list(params), "misfit_before": before,
              "misfit_model": smooth, "misfit_after": after, "model": model.to_json(), "points": [
                  dict(pt, predicted=predicted(model, pt, layout)) for pt in points]}
    with open(path + ".points.json", "w") as f:
        json.dump(report, f, indent=1)
    print(f"pycoll tune: fitted {', '.join(params)} on {len(points)} timings (rms log error {math.sqrt(before):.2f} "
          f"-> {math.sqrt(smooth):.2f}; measured residuals kept for layout {model.layout_key(layout)}); saved {path}")
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
    topo_out = os.path.abspath(args.topology or TOPO_FILE.get() or default_topology_path())
    cmd += ["--", sys.executable, "-m", "pycoll.tune", "--out", out, "--sizes", ",".join(map(str, args.sizes)),
            "--iters", str(args.iters), "--topology", topo_out] + (["--links-only"] if args.links_only else [])
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
                    "that picks among them. One host fits shared-memory and CPU constants; --hosts first measures each "
                    "host pair into the topology file, then fits the network constants.")
    p.add_argument("-n", "--np", dest="n", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--hosts", type=int, default=None, help="virtual hosts (network namespaces; needs root)")
    p.add_argument("--link-rate", default=None, help="shape the virtual links, e.g. 1gbit")
    p.add_argument("-o", "--output", default=None, help="where to save (default: $PYCOLL_TUNE_FILE or ~/.cache/pycoll/tuning.json)")
    p.add_argument("--sizes", type=_sizes, default=list(SIZES), help="message sizes to time, e.g. 8,64K,1M,8M")
    p.add_argument("--iters", type=int, default=10, help="timed calls per size (default 10)")
    p.add_argument("--fresh", action="store_true", help="start from the built-in defaults, not the existing file")
    p.add_argument("--topology", default=None,
                   help="with --hosts: the topology file that receives each host pair's latency and bandwidth "
                        "(default: $PYCOLL_TOPO_FILE, else ~/.cache/pycoll/topology.json)")
    p.add_argument("--links-only", action="store_true", help="with --hosts: measure the host pairs only, fit nothing")
    p.set_defaults(func=tune_command)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pycoll.tune", description="the in-job part of `pycoll tune`")
    p.add_argument("--out", default="")
    p.add_argument("--sizes", type=_sizes, default=list(SIZES))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--topology", default="")
    p.add_argument("--links-only", action="store_true")
    args = p.parse_args(argv)
    return worker(args.out, tuple(args.sizes), args.iters, args.topology, args.links_only)


if __name__ == "__main__":
    sys.exit(main())
