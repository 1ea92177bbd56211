"""Start-up time: `pycoll run -n N python prog.py` against `mpiexec -n N python prog.py` (mpi4py), up to a first Barrier.

Each program imports MPI and calls ``MPI.COMM_WORLD.Barrier()`` once; the time is the whole command's wall time,
launcher included. The two commands run interleaved (which one goes first alternates), after one untimed
warm-up run each. Run it alone on the machine, e.g. ``flock /tmp/pycoll-bench.lock python perf/startup.py``.

With ``--hosts H`` the ranks run on H virtual hosts: `pycoll run --hosts H` makes its namespaces in every run (as
a user's job does), while hydra runs in namespaces made once beforehand, each proxy started in its host through
a launcher script (``pycoll.perf.mpi_hosts``): the namespaces' cost is counted against pycoll only.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROGRAMS = {
    "mpiexec": "from mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n",
    "pycoll": "from pycoll import MPI\nMPI.COMM_WORLD.Barrier()\n",
}
DEFAULT_JSON = Path(__file__).parent / "results" / "startup" / "startup.json"


def _tool(name: str) -> str:
    """``name`` next to this interpreter (the venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        sys.exit(f"startup.py: {name} not found (pip install 'pycoll[test]' puts mpiexec in the venv)")
    return found


def _package_bytecode(env: dict) -> str:
    """Whether pycoll's own modules have current bytecode beside them (written at install or by `pycoll warmup`),
    which Python reads even where PYTHONDONTWRITEBYTECODE stops it from writing any."""
    import importlib.util

    import pycoll

    sources = sorted(Path(pycoll.__file__).parent.glob("*.py"))
    cached = [(p, Path(importlib.util.cache_from_source(str(p)))) for p in sources]
    current = sum(1 for p, pyc in cached if pyc.is_file() and pyc.stat().st_mtime >= p.stat().st_mtime)
    writes = "not written (PYTHONDONTWRITEBYTECODE set)" if env.get("PYTHONDONTWRITEBYTECODE") else "written on import"
    return f"pycoll's own for {current} of its {len(sources)} top-level modules, {writes}"


def commands(n: int, workdir: Path, vhosts: Any = None) -> dict[str, list[str]]:
    """The two command lines, each running its program on ``n`` ranks (on ``vhosts``, virtual hosts, if given)."""
    progs = {}
    for name, text in PROGRAMS.items():
        path = workdir / f"barrier_{name}.py"
        path.write_text(text)
        progs[name] = str(path)
    if vhosts is None:
        return {
            "mpiexec": [_tool("mpiexec"), "-n", str(n), sys.executable, progs["mpiexec"]],
            "pycoll": [_tool("pycoll"), "run", "-n", str(n), sys.executable, progs["pycoll"]],
        }
    from pycoll.launcher import plan_hosts
    from pycoll.perf.mpi_hosts import hydra_argv

    counts = plan_hosts(n, vhosts.n_hosts)
    launcher = vhosts.write_launcher(str(workdir / "on-host"))
    return {
        "mpiexec": hydra_argv(_tool("mpiexec"), vhosts, counts, launcher, [sys.executable, progs["mpiexec"]]),
        "pycoll": [_tool("pycoll"), "run", "-n", str(n), "--hosts", str(vhosts.n_hosts), sys.executable,
                   progs["pycoll"]],
    }


def _children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def run_once(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and every process it reaped) of one run; exits if it fails."""
    cpu0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    elapsed, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if proc.returncode != 0:
        sys.exit(f"startup.py: {' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout.decode(errors='replace')}")
    return elapsed, cpu


def measure(cmds: dict[str, list[str]], runs: int, env: dict[str, str]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds of ``runs`` runs of each command, interleaved, after one warm-up each."""
    names = list(cmds)
    for name in names:
        run_once(cmds[name], env)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for i in range(runs):
        for name in names if i % 2 == 0 else names[::-1]:
            w, c = run_once(cmds[name], env)
            wall[name].append(w)
            cpu[name].append(c)
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--np", dest="n", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--runs", type=int, default=10, help="timed runs of each command (default 10)")
    p.add_argument("--hosts", type=int, default=None, metavar="H", help="run the ranks on H virtual hosts (needs root)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"where to write the results (default {DEFAULT_JSON})")
    p.add_argument("--pycache", metavar="DIR", default=None,
                   help="give both commands a bytecode cache in DIR, as an installed package has "
                   "(sets PYTHONPYCACHEPREFIX, clears PYTHONDONTWRITEBYTECODE; the warm-up run fills it)")
    args = p.parse_args(argv)
    env = dict(os.environ)
    if args.pycache:
        env["PYTHONPYCACHEPREFIX"] = os.path.abspath(args.pycache)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="pycoll-startup-") as tmp, contextlib.ExitStack() as stack:
        vhosts = None
        if args.hosts:
            from pycoll import netns
            from pycoll.perf.mpi_hosts import LINK_ENV

            vhosts = stack.enter_context(netns.VirtualHosts(args.hosts))
            env.update(LINK_ENV)  # MPICH's traffic between hosts on their links; pycoll ignores these
        cmds = commands(args.n, Path(tmp), vhosts)
        samples, cpu = measure(cmds, args.runs, env)
    load_after = os.getloadavg()[0]
    medians = {name: statistics.median(s) for name, s in samples.items()}
    ratio = medians["pycoll"] / medians["mpiexec"]
    bytecode = "cache in " + env["PYTHONPYCACHEPREFIX"] if args.pycache else _package_bytecode(env)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "ranks": args.n,
        "hosts": args.hosts or 1,
        "runs": args.runs,
        "bytecode": bytecode,
        "pythonpath": env.get("PYTHONPATH", ""),
        "load_avg_1min": [load_before, load_after],  # the machine is shared: a busy one slows both commands
        "commands": {name: " ".join(cmd) for name, cmd in cmds.items()},
        "samples_s": samples,
        "median_s": medians,
        "min_s": {name: min(s) for name, s in samples.items()},
        "ratio_pycoll_to_mpiexec": ratio,
        # CPU seconds of all the command's processes: less sensitive than wall time to a busy machine
        "cpu_samples_s": cpu,
        "cpu_median_s": {name: statistics.median(c) for name, c in cpu.items()},
    }
    where = f" on {args.hosts} virtual hosts" if args.hosts else ""
    print(f"start-up to the first Barrier, {args.n} ranks{where}, {args.runs} runs each, bytecode: {bytecode}, "
          f"load {load_before:.2f} -> {load_after:.2f}")
    print(f"{'command':<10} {'median s':>9} {'min s':>7} {'max s':>7} {'CPU s':>7}")
    for name, s in samples.items():
        print(f"{name:<10} {medians[name]:>9.3f} {min(s):>7.3f} {max(s):>7.3f} {statistics.median(cpu[name]):>7.3f}")
    print(f"ratio pycoll / mpiexec: {ratio:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
