"""Price a `pycoll perf --hosts` sweep's measured points again, offline, with the cost model as this tree builds it for
the sweep's job (or with constants changed by ``--set``), and count the predictions within 25 % of the measured time.

Each point's size as selection saw it is found by pricing the recorded algorithm at the candidate sizes (the call's
bytes, a rank's share, all ranks' bytes) with the baseline model and keeping the one that gives the recorded
prediction; points none reproduces are listed and left out.

    python perf/reprice_sweep.py perf/results/multihost/after-chunks-through-c/sweep-unshaped.json \
        [--topology FILE] [--set tcp_GBps=4.0 --set net_GBps=4.0] [--rows]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Optional

from pycoll import composed
from pycoll.algorithms import cost, cost_topology
from pycoll.algorithms.base import Layout
from pycoll.algorithms.registry import ALGORITHMS
from pycoll.runtime import with_link_rate

MIB = 1 << 20


def job_model(record: dict[str, Any], topology: Optional[str]) -> cost.CostModel:
    """The model a job of namespace hosts on this one machine builds: the built-in constants, the link from the
    topology file (measured) or the built-in one, the user's rate where given, and each host's share of the
    machine's cores and memory."""
    base = cost.CostModel()
    link_GBps, link_us = base.net_GBps, base.net_latency_us  # a veth reports no speed the topology takes
    if topology:
        from pycoll.topology import files

        topo = files.load(topology)
        link = topo.links[0]
        link_GBps, link_us = link.GBps, link.latency_us
        cores_rate = cost_topology.tcp_rate(link.GBps, link.both_ways_GBps)
        base = dataclasses.replace(base, tcp_GBps=cores_rate or base.tcp_GBps)
    model = dataclasses.replace(base, net_GBps=link_GBps, net_latency_us=link_us)
    if record.get("link_rate"):  # the launcher's --link-rate, as PYCOLL_LINK_RATE
        model = with_link_rate(model, record["link_rate"])
    machine = os.cpu_count() or 1
    per_host = record["nranks"] // record.get("hosts", 2)
    cores = max(1, machine * per_host // record["nranks"])  # a host's share of the machine's cores by its ranks
    return dataclasses.replace(model, cores=cores, host_memory_GBps=model.host_memory_GBps * per_host / record["nranks"])


def price(model: cost.CostModel, record: dict[str, Any], nbytes: int) -> float:
    lay = Layout(tuple(r * record.get("hosts", 2) // record["nranks"] for r in range(record["nranks"])))
    if record["algo_used"] == "composed":
        return composed.predict(model, record["collective"], nbytes, lay, root=max(record.get("root", 0), 0)) * 1e6
    return ALGORITHMS[record["collective"]][record["algo_used"]].predict(model, nbytes, lay) * 1e6


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
    ap.add_argument("--rows", action="store_true", help="every point, not only the counts")
    args = ap.parse_args(argv)
    changes = {k: float(v) for k, v in (s.split("=", 1) for s in args.set)}
    recorded = {k: float(v) for k, v in (s.split("=", 1) for s in args.recorded_set)}
    within = before = total = 0
    for path in args.files:
        for r in json.loads(path.read_text())["records"]:
            if r.get("peer") != "pycoll" or r.get("inplace") or not r.get("predicted_us") or r["bytes"] < args.from_bytes:
                continue
            base = job_model(r, args.topology)
            then, p = dataclasses.replace(base, **recorded), r["nranks"]
            sizes = [r["bytes"], r["bytes"] // p, r["bytes"] * p]
            found = [n for n in sizes if math.isclose(price(then, r, n), r["predicted_us"], rel_tol=0.02)]
            if not found:
                print(f"{path.name} {r['collective']} {p} {r['bytes']} {r['algo_used']}: recorded "
                      f"{r['predicted_us']:.0f} µs reproduced by no size (baseline {price(then, r, sizes[0]):.0f})")
                continue
            model = dataclasses.replace(base, **changes)
            if args.measured_memory and r.get("limit_copy_GBps"):
                model = model.at_memory_speed(r["limit_copy_GBps"], r["limit_reduce_GBps"])
            new = price(model, r, found[0])
            ratio, old = new / r["time_us"], r["predicted_us"] / r["time_us"]
            total += 1
            within += 1 / 1.25 <= ratio <= 1.25
            before += 1 / 1.25 <= old <= 1.25
            if args.rows:
                print(f"{path.name:22} {r['collective']:15} {p} {r['bytes'] // MIB:3d} MiB {r['algo_used']:13} "
                      f"measured {r['time_us']:8.0f}  recorded {old:5.2f}  now {ratio:5.2f}{'' if 1 / 1.25 <= ratio <= 1.25 else ' (off)'}")
    print(f"{within} of {total} within 25 % (recorded: {before})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
