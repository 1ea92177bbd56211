"""Price a `pycoll perf --hosts` sweep's measured points again, offline, with the cost model as this tree builds it for
the sweep's job (or with constants changed by ``--set``), and count the predictions within 25 % of the measured time.

Each point's size as selection saw it is found by pricing the recorded algorithm at the candidate sizes (the call's
bytes, a rank's share, all ranks' bytes) with the baseline model and keeping the one that gives the recorded
prediction; points none reproduces are listed and left out. Where this tree's model prices a point differently from
the tree that recorded it, ``--recorded-tree`` finds the sizes with that tree's code (a worktree), so both trees'
prices can be set against the same measurements:

    python perf/reprice_sweep.py perf/results/multihost/after-chunks-through-c/sweep-unshaped.json \
        [--topology FILE] [--set tcp_GBps=4.0 --set net_GBps=4.0] [--recorded-tree DIR] [--median] [--rows]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from pycoll import composed, machine
from pycoll.algorithms import cost, cost_topology
from pycoll.algorithms.base import Layout
from pycoll.algorithms.registry import ALGORITHMS
from pycoll.runtime import with_link_rate

MIB = 1 << 20


def job_model(record: dict[str, Any], topology: Optional[str]) -> cost.CostModel:
    """The model a job of namespace hosts on this one machine builds: the built-in constants, the link (and the
    hosts' memory rates, where measured) from the topology file or the built-in one, the user's rate where given (a job
    without a topology file), and each host's share of the machine's cores and memory."""
    base = cost.CostModel()
    link_GBps, link_us = base.net_GBps, base.net_latency_us  # a veth reports no speed the topology takes
    if topology:
        from pycoll.topology import files

        topo = files.load(topology)
        link = topo.links[0]
        link_GBps, link_us = link.GBps, link.latency_us
        if hasattr(cost_topology, "wire_GBps"):  # (a tree from before it, under --recorded-tree, priced the reading)
            link_GBps = cost_topology.wire_GBps(link, base.tcp_cache_speedup)
        cores_rate = cost_topology.tcp_rate(link.GBps, link.both_ways_GBps)
        base = dataclasses.replace(base, tcp_GBps=cores_rate or base.tcp_GBps)
        # (a tree from before the hosts' memory was measured, under --recorded-tree, has none)
        memory = topo.memory_rates(range(len(topo.hosts))) if hasattr(topo, "memory_rates") else None
        if memory is not None:  # the hosts' memory as `pycoll tune --hosts` measured it
            base = base.at_memory_speed(*memory)
    model = dataclasses.replace(base, net_GBps=link_GBps, net_latency_us=link_us)
    if record.get("link_rate") and not topology:  # the launcher's --link-rate, as PYCOLL_LINK_RATE (a job given a
        # topology file runs with PYCOLL_LINK_RATE= exported empty, so that the measured link prices it)
        model = with_link_rate(model, record["link_rate"])
    machine = os.cpu_count() or 1
    per_host = record["nranks"] // record.get("hosts", 2)
    cores = max(1, machine * per_host // record["nranks"])  # a host's share of the machine's cores by its ranks
    return dataclasses.replace(model, cores=cores, host_memory_GBps=model.host_memory_GBps * per_host / record["nranks"])


def price(model: cost.CostModel, record: dict[str, Any], nbytes: int) -> float:
    lay = Layout(tuple(r * record.get("hosts", 2) // record["nranks"] for r in range(record["nranks"])))
    # the machine's load as the job's runtime set it: its ranks against its cores (oversubscribed hosts get larger
    # arena slots, so the slots and oneshot kernels price host steps that 64 KiB slots would refuse)
    machine.set_load(record["nranks"], os.cpu_count() or 1)
    if record["algo_used"] == "composed":
        return composed.predict(model, record["collective"], nbytes, lay, root=max(record.get("root", 0), 0)) * 1e6
    return ALGORITHMS[record["collective"]][record["algo_used"]].predict(model, nbytes, lay) * 1e6


def found_size(record: dict[str, Any], topology: Optional[str], recorded: dict[str, float]) -> Optional[int]:
    """The size at which this tree's baseline model (``recorded`` constants changed) gives the recorded prediction."""
    then, p = dataclasses.replace(job_model(record, topology), **recorded), record["nranks"]
    sizes = [record["bytes"], record["bytes"] // p, record["bytes"] * p]
    return next((n for n in sizes if math.isclose(price(then, record, n), record["predicted_us"], rel_tol=0.02)), None)


def sizes_by_tree(tree: str, files: list[Path], topology: Optional[str], recorded: list[str],
                  median: bool) -> dict[str, int]:
    """Each point's size as ``found_size`` finds it with the code of the tree at ``tree`` (run in a child process)."""
    args = [sys.executable, __file__, "--print-sizes", *map(str, files)] + [f"--recorded-set={r}" for r in recorded]
    args += ["--median"] if median else []
    if topology:
        args.append(f"--topology={topology}")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    return json.loads(subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout)


def medians(files: list[Path]) -> list[tuple[str, dict[str, Any]]]:
    """The first file's records with each point's time the median over all the files' jobs (``--median``)."""
    jobs = [json.loads(f.read_text())["records"] for f in files]

    def key(r: dict[str, Any]) -> tuple:
        return r.get("peer"), r["collective"], r["nranks"], r["bytes"], r.get("inplace"), r.get("root")

    times: dict[tuple, list[float]] = {}
    for records in jobs:
        for r in records:
            times.setdefault(key(r), []).append(r["time_us"])
    return [(f"{files[0]}:{i}", dict(r, time_us=statistics.median(times[key(r)]))) for i, r in enumerate(jobs[0])]


def points(files: list[Path], median: bool) -> list[tuple[str, dict[str, Any]]]:
    if median:
        return medians(files)
    return [(f"{f}:{i}", r) for f in files for i, r in enumerate(json.loads(f.read_text())["records"])]


def priced(r: dict[str, Any], from_bytes: int) -> bool:
    return r.get("peer") == "pycoll" and not r.get("inplace") and bool(r.get("predicted_us")) and r["bytes"] >= from_bytes


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--topology", help="the topology file the sweep ran with (PYCOLL_TOPO_FILE)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a constant of the model, changed")
    ap.add_argument("--recorded-set", action="append", default=[], metavar="NAME=VALUE",
                    help="a constant as the tree that recorded the sweep had it (to find each point's size)")
    ap.add_argument("--measured-memory", action="store_true",
                    help="price with the memory's copy and reduction rates the sweep measured (its limit line), as "
                         "`pycoll tune` on the host would give them")
    ap.add_argument("--from-bytes", type=int, default=MIB)
    ap.add_argument("--recorded-tree", metavar="DIR",
                    help="find each point's size with the code of this tree (a worktree of the commit that recorded it)")
    ap.add_argument("--median", action="store_true", help="the files are jobs of one sweep: price each point's median")
    ap.add_argument("--print-sizes", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rows", action="store_true", help="every point, not only the counts")
    args = ap.parse_args(argv)
    changes = {k: float(v) for k, v in (s.split("=", 1) for s in args.set)}
    recorded = {k: float(v) for k, v in (s.split("=", 1) for s in args.recorded_set)}
    chosen = [(where, r) for where, r in points(args.files, args.median) if priced(r, args.from_bytes)]
    if args.print_sizes:
        print(json.dumps({where: found_size(r, args.topology, recorded) for where, r in chosen}))
        return 0
    sizes = (sizes_by_tree(args.recorded_tree, args.files, args.topology, args.recorded_set, args.median) if args.recorded_tree
             else {where: found_size(r, args.topology, recorded) for where, r in chosen})
    within = before = total = 0
    for where, r in chosen:
        p, size = r["nranks"], sizes.get(where)
        if size is None:
            print(f"{where} {r['collective']} {p} {r['bytes']} {r['algo_used']}: recorded {r['predicted_us']:.0f} µs "
                  f"reproduced by no size")
            continue
        model = dataclasses.replace(job_model(r, args.topology), **changes)
        if args.measured_memory and r.get("limit_copy_GBps"):
            model = model.at_memory_speed(r["limit_copy_GBps"], r["limit_reduce_GBps"])
        new = price(model, r, size)
        ratio, old = new / r["time_us"], r["predicted_us"] / r["time_us"]
        total += 1
        within += 1 / 1.25 <= ratio <= 1.25
        before += 1 / 1.25 <= old <= 1.25
        if args.rows:
            print(f"{Path(where.rsplit(':', 1)[0]).name:22} {r['collective']:15} {p} {r['bytes'] // MIB:3d} MiB "
                  f"{r['algo_used']:13} measured {r['time_us']:8.0f}  recorded {old:5.2f}  now {ratio:5.2f}"
                  f"{'' if 1 / 1.25 <= ratio <= 1.25 else ' (off)'}")
    print(f"{within} of {total} within 25 % (recorded: {before})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
