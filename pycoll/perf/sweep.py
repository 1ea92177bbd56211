"""The `pycoll perf` driver: runs each peer over each rank count, one job at a time, and reports."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import selectors
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

import pycoll
from pycoll.config import environ
from pycoll.perf import metrics
from pycoll.perf import peers as peers_mod
from pycoll.perf import report, worker
from pycoll.perf.metrics import median
from pycoll.perf.options import PerfOptions

LIMIT_BYTES = 64 << 20
BUFFERS_NOTE = {"spec": "pycoll and mpi get [buf, count, MPI.<TYPE>] specs",
                "array": "pycoll and mpi get bare NumPy arrays",
                "fresh": "pycoll and mpi get specs on new arrays before every timed call, allocation untimed"}


def measure_limits(nbytes: int = LIMIT_BYTES, repeats: int = 3) -> dict[str, float]:
    """This process's memory bandwidth: np.copyto and np.add(a, b, out=c) on float32 arrays, GB/s of size/time."""
    n = nbytes // 4
    a, b, c = np.ones(n, np.float32), np.full(n, 2.0, np.float32), np.empty(n, np.float32)
    np.copyto(c, a)  # touch the pages first
    copy_t, add_t = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(c, a)
        copy_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        np.add(a, b, out=c)
        add_t.append(time.perf_counter() - t0)
    return {"copy_GBps": round(nbytes / median(copy_t) / 1e9, 3), "reduce_GBps": round(nbytes / median(add_t) / 1e9, 3)}


@dataclass
class Job:
    """One peer run per rank count: a peer, or pycoll with algorithms forced through PYCOLL_ALGO."""

    peer: str
    label: str
    collectives: list[str]
    algo: Optional[str] = None  # "auto" for pycoll's own choice, a name when forced, None for other peers
    env: dict[str, str] = field(default_factory=dict)
    variants: list["Job"] = field(default_factory=list)  # forced runs interleaved in this job (--interleave)


def plan_jobs(opts: PerfOptions, runnable: list[str]) -> list[Job]:
    """The runnable peers, then one `pycoll[name]` job per forced algorithm name, and `pycoll[reproducible]`."""
    jobs = [Job(p, p, list(opts.collectives), "auto" if p == "pycoll" else None) for p in runnable]
    if opts.algos:  # next to forced runs, `pycoll` is the automatic choice even if PYCOLL_ALGO is exported
        for j in jobs:
            if j.peer == "pycoll":
                j.env["PYCOLL_ALGO"] = ""
    auto = next((j for j in jobs if j.peer == "pycoll"), None)
    for name, colls in opts.algo_groups():
        force = ",".join(f"{c}:{name}" for c in colls)
        forced = Job("pycoll", f"pycoll[{name}]", colls, name, {"PYCOLL_ALGO": force})
        if opts.interleave and auto is not None:
            auto.variants.append(forced)  # measured inside the automatic job, right after it at every point
        else:
            jobs.append(forced)
    if opts.reproducible and auto is not None:  # the mode chooses its own algorithms: "auto", under its own label
        rep = Job("pycoll", "pycoll[reproducible]", list(auto.collectives), "auto",
                  {"PYCOLL_REPRODUCIBLE": "1", "PYCOLL_ALGO": ""})
        if opts.interleave:
            auto.variants.append(rep)
        else:
            jobs.append(rep)
    return jobs


def worker_spec(opts: PerfOptions, peer: str, job: Optional[Job] = None, nccl_via: Optional[str] = None
                ) -> dict[str, Any]:
    job = job or Job(peer, peer, list(opts.collectives), "auto" if peer == "pycoll" else None)
    return {"peer": peer, "label": job.label, "algo": job.algo, "hosts": opts.hosts or 1, "link_rate": opts.link_rate,
            "device": opts.device, "nccl_via": nccl_via if peer == "nccl" else None,
            "collectives": job.collectives, "sizes": opts.sizes(), "modes": opts.modes(),
            "iters": opts.iters, "warmup": opts.warmup,
            "min_time": opts.min_time, "max_iters": opts.max_iters, "check": opts.check, "dtype": opts.dtype,
            "np_dtype": opts.np_dtype, "itemsize": opts.itemsize, "op": opts.op, "root": opts.root,
            "buffers": opts.buffers,
            "variants": [{"label": v.label, "algo": v.algo, "env": v.env, "collectives": v.collectives}
                         for v in job.variants]}


def parse_line(line: str) -> Optional[dict[str, Any]]:
    """A worker record, or None for any other output."""
    if not line.startswith(worker.MARKER):
        return None
    try:
        rec = json.loads(line[len(worker.MARKER):])
    except json.JSONDecodeError:
        return None
    return rec if isinstance(rec, dict) else None


def run_job(cmd: list[str], env: dict[str, str], timeout: float, progress: report.Progress,
            label: str) -> tuple[list[dict[str, Any]], Optional[str]]:
    """Run one job, parse its records as they arrive; returns (records, failure or None)."""
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryFile("w+") as errf:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=errf, text=True, bufsize=1)
        deadline = time.monotonic() + timeout
        failure: Optional[str] = None
        assert proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                failure = f"timed out after {timeout:g} s"
                break
            if not sel.select(timeout=min(left, 1.0)):
                continue
            line = proc.stdout.readline()
            if not line:
                break
            rec = parse_line(line)
            if rec is not None:
                records.append(rec)
                if "bytes" in rec:  # a measured point (not an error or a skip)
                    progress.advance(f"{label} {rec['collective']} {report.human(rec['bytes'])}")
        sel.close()
        rc = proc.wait()
        if failure is None and rc != 0:
            errf.seek(0)
            tail = [ln for ln in errf.read().strip().splitlines() if ln.strip()][-3:]
            failure = f"exit code {rc}" + (": " + " | ".join(tail) if tail else "")
    return records, failure


def _in_process(opts: PerfOptions, job: Job, nccl_via: Optional[str] = None
                ) -> tuple[list[dict[str, Any]], Optional[str]]:
    records: list[dict[str, Any]] = []
    with environ(job.env):  # PYCOLL_ALGO is read at every call
        worker.run_peer(worker_spec(opts, job.peer, job, nccl_via), records.append)
    return records, None


def _print_blocks(opts: PerfOptions, peer: str, records: list[dict[str, Any]],
                  collectives: Optional[list[str]] = None) -> None:
    for coll in collectives or opts.collectives:
        recs = [r for r in records if r["collective"] == coll and "error" not in r]
        errors = [r for r in records if r["collective"] == coll and "error" in r]
        nranks = (recs or errors or [{"nranks": 0}])[0]["nranks"]
        if recs:
            modes = [False] if coll in metrics.NO_INPLACE else opts.modes()
            print(report.format_block(peer, nranks, coll, opts.dtype, opts.op, recs, modes,
                                      hosts=opts.hosts, link_rate=opts.link_rate))
        for e in errors:
            print(f"# peer {peer}, {e['nranks']} ranks, {coll}: failed ({e['error']})")
        if recs or errors:
            print(flush=True)


PER_ROUND = ("round", "limit_copy_GBps", "limit_reduce_GBps")


def merge_rounds(per_round: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per point: the median time over the rounds that measured it, bandwidths recomputed from it.

    ``round_times_us`` lists every round's time, fastest first, ``round_iters`` how many timed calls each of those
    rounds ran (``--min-time`` decides it per round), and ``round_limits`` the host memory's [copy, reduce] GB/s
    measured before each of those rounds' jobs, in the same order."""
    if len(per_round) == 1:
        return [{k: v for k, v in r.items() if k != "round"} for r in per_round[0]]
    points: dict[tuple, list[dict[str, Any]]] = {}
    for recs in per_round:
        for r in recs:
            key = (r["peer"], r.get("algo"), r["collective"], r["nranks"], r["bytes"], r["inplace"])
            points.setdefault(key, []).append(r)
    out = []
    for recs in points.values():
        recs = sorted(recs, key=lambda r: r["time_us"])
        times = [r["time_us"] for r in recs]
        t = median(times)
        first = recs[0]
        merged = {k: v for k, v in first.items() if k not in PER_ROUND} | {
            "time_us": round(t, 3), "algbw_GBps": round(metrics.algbw(first["bytes"], t), 4),
            "busbw_GBps": round(metrics.busbw(first["collective"], first["nranks"], first["bytes"], t), 4),
            "wrong": sum(r["wrong"] for r in recs), "rounds": len(recs), "round_times_us": times,
            "round_iters": [r.get("iters") for r in recs]}
        if all("limit_copy_GBps" in r for r in recs):
            merged["round_limits"] = [[r["limit_copy_GBps"], r["limit_reduce_GBps"]] for r in recs]
        out.append(merged)
    return out


def _gpus(peer: str) -> int:
    """GPUs a job of ``peer`` may use (asked only for the peers that need one GPU per rank)."""
    if peer != "nccl":
        return 1 << 30
    from pycoll.perf import devices

    return devices.gpu_count()


def run_sweep(opts: PerfOptions) -> int:
    """Entry point of `pycoll perf`; returns the exit code (1 when a job failed or a result was wrong)."""
    in_mpi = peers_mod.inside_mpi_job()
    rank0 = True
    if in_mpi:
        rank0 = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == "0"
    out = sys.stdout if rank0 else open(os.devnull, "w")
    stdout, sys.stdout = sys.stdout, out
    try:
        return _sweep(opts, in_mpi, rank0)
    finally:
        sys.stdout = stdout


def sweep_limits(device: str) -> dict[str, Any]:
    """The limit line's numbers: host memory copy/add, or for --device cuda the device-to-device copy
    (``copy_GBps``, what `pycoll plot` draws) with the host's numbers kept as ``host_*``."""
    host = measure_limits()
    if device != "cuda":
        return host
    from pycoll.perf import devices

    return {**devices.device_limits(), "host_copy_GBps": host["copy_GBps"], "host_reduce_GBps": host["reduce_GBps"]}


def limit_line(limits: dict[str, Any]) -> str:
    """The console line that states the limits."""
    if limits.get("memory") != "cuda":
        return f"# limit: copy {limits['copy_GBps']:.2f} GB/s, reduce {limits['reduce_GBps']:.2f} GB/s"
    host = f"host copy {limits['host_copy_GBps']:.2f} GB/s"
    if "copy_GBps" not in limits:
        return f"# limit: device copy not measured ({limits.get('error', 'unknown reason')}); {host}"
    add = f", add {limits['reduce_GBps']:.2f} GB/s" if "reduce_GBps" in limits else ""
    return (f"# limit: device-to-device copy {limits['copy_GBps']:.2f} GB/s{add} on {limits.get('device_name', '?')} "
            f"({limits.get('via', '?')}, {limits.get('limit_bytes', 0) >> 20} MiB); {host}")


def _sweep(opts: PerfOptions, in_mpi: bool, rank0: bool) -> int:
    limits = sweep_limits(opts.device)
    print(f"# {opts.command()}")
    print(limit_line(limits))
    skipped: dict[str, str] = {}
    runnable = []
    if opts.hosts and in_mpi:
        print("# inside an mpiexec job: --hosts and --link-rate ignored")
        opts = dataclasses.replace(opts, hosts=None, link_rate=None)
    elif opts.hosts:
        from pycoll import netns

        reason = netns.unavailable(need_tc=bool(opts.link_rate))
        if reason:
            print(f"pycoll perf: --hosts needs network namespaces, which cannot be made here: {reason}",
                  file=sys.stderr)
            return 1
        rate = f", links shaped to {opts.link_rate} each way" if opts.link_rate else ""
        print(f"# ranks on {opts.hosts} virtual hosts (network namespaces){rate}")
    hosts = opts.hosts
    for peer in opts.peers:
        reason = peers_mod.unavailable(peer, in_mpi, opts.dtype, hosts, opts.device)
        if reason:
            skipped[peer] = reason
            print(f"{peer}: skipped ({reason})")
        else:
            runnable.append(peer)
    nccl_via = peers_mod.nccl_route()[0] if "nccl" in runnable else None
    ignoring = [p for p in runnable if p in ("gloo", "nccl")]
    print(f"# buffers: {opts.buffers} ({BUFFERS_NOTE[opts.buffers]})"
          + (f"; {' and '.join(ignoring)} ignore --buffers (torch tensors or device pointers)" if ignoring else ""))
    if nccl_via:
        print(f"# nccl through {'torch.distributed' if nccl_via == 'torch' else 'cupy.cuda.nccl'}")
    if opts.device == "cuda":
        from pycoll.perf import devices

        gpus = devices.gpu_count()
        where = "numba's CUDA simulator" if devices.simulator() else f"{gpus} GPU{'' if gpus == 1 else 's'}"
        print(f"# device buffers (--device cuda) on {where}; ranks share the GPUs round robin by local rank")
    jobs_skipped: list[dict[str, Any]] = []
    nps = opts.nps
    if in_mpi:
        print("# inside an mpiexec job: running on its ranks in-process, --np ignored")
        nps = [0]
    jobs = plan_jobs(opts, runnable)
    if opts.algos:
        forced = [j for job in jobs for j in [job] + job.variants if j.algo not in (None, "auto")]
        where = " (interleaved in the automatic job)" if opts.interleave else ""
        print(f"# forced algorithms{where}: " + "; ".join(f"{j.label} {j.env['PYCOLL_ALGO']}" for j in forced))
    print(flush=True)
    per_size = len(opts.sizes()) * len(opts.modes())
    total = len(nps) * sum(len(j.collectives) for job in jobs for j in [job] + job.variants) * per_size
    progress = report.Progress(total, opts.progress and sys.stderr.isatty() and rank0)
    records: list[dict[str, Any]] = []
    failed = False
    rounds = 1 if in_mpi else opts.rounds
    progress.total *= rounds
    for n in nps:
        per_round: list[list[dict[str, Any]]] = []
        for rnd in range(rounds):
            done_round: list[dict[str, Any]] = []
            for job in jobs[rnd % len(jobs):] + jobs[: rnd % len(jobs)] if jobs else []:
                label = f"{job.label} np={n}" if n else job.label
                start = progress.done
                why = None if in_mpi else peers_mod.job_unavailable(job.peer, n, _gpus(job.peer))
                if why:
                    recs, failure = [{"peer": job.label, "collective": c, "nranks": n, "skipped": why}
                                     for c in job.collectives], None
                elif in_mpi:
                    recs, failure = _in_process(opts, job, nccl_via)
                else:
                    spec = json.dumps(worker_spec(opts, job.peer, job, nccl_via))
                    cmd, env = peers_mod.launch_command(job.peer, n, spec, hosts, opts.link_rate, job.env)
                    memory = measure_limits()  # this VM's memory speed drifts: note it next to each job's times
                    recs, failure = run_job(cmd, env, opts.timeout, progress, label)
                    recs = [r if "skipped" in r else dict(r, limit_copy_GBps=memory["copy_GBps"],
                                                          limit_reduce_GBps=memory["reduce_GBps"]) for r in recs]
                skips = [r for r in recs if "skipped" in r]
                recs = [r for r in recs if "skipped" not in r]
                if skips and not recs:  # a job that could not run at all (NCCL's duplicate GPU): its exit is moot
                    failure = None
                for why in dict.fromkeys(r["skipped"] for r in skips):
                    if rnd == 0:
                        jobs_skipped.append({"peer": job.label, "nranks": n, "reason": why})
                    print(f"# peer {job.label}, {n} ranks: skipped ({why})", flush=True)
                progress.done = start + sum(len(j.collectives) for j in [job] + job.variants) * per_size
                progress.clear()
                if rounds == 1:
                    for part in [job] + job.variants:
                        _print_blocks(opts, part.label, [r for r in recs if r.get("peer") in (part.label, None)
                                                         or "error" in r and part is job], part.collectives)
                if failure:
                    failed = True
                    print(f"# peer {job.label}, {n} ranks: job failed ({failure})", flush=True)
                failed |= any("error" in r for r in recs)
                done_round += [dict(r, round=rnd) for r in recs if "error" not in r]
            per_round.append(done_round)
        merged = merge_rounds(per_round)
        if rounds > 1:
            for part in [p for job in jobs for p in [job] + job.variants]:
                _print_blocks(opts, part.label, [r for r in merged if r["peer"] == part.label], part.collectives)
        records += merged
    progress.clear()
    wrong = sum(r["wrong"] for r in records)
    if opts.check:
        print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'WRONG'}")
    if opts.json and rank0:
        meta = {"command": opts.command(),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "host": socket.gethostname(), "cpus": os.cpu_count() or 1, "python": platform.python_version(),
                "pycoll": pycoll.__version__, "peers_skipped": skipped, "hosts": hosts or 1,
                "link_rate": opts.link_rate if hosts else None, "algos": opts.algos, "device": opts.device,
                "jobs_skipped": jobs_skipped, "nccl_via": nccl_via, "buffers": opts.buffers}
        report.write_json(opts.json, meta, limits, records)
        print(f"# wrote {len(records)} records to {opts.json}")
    return 1 if failed or wrong else 0
