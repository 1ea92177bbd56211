"""The mpi4py conformance job's machinery: fetch mpi4py's pinned source distribution, run one of its test files on pycoll at N ranks, merge the ranks' outcomes."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import harness

MPI4PY_VERSION = "4.1.2"  # the one pin: the sdist fetched and the test files run
RANK_SCRIPT = os.path.join(harness.TESTS, "mpi4py_rank.py")
FETCH_TIMEOUT_S = 300


def cache_dir() -> Path:
    """Where the sdist and its unpacked test folder live: outside the repository, under the user's cache."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pycoll" / f"mpi4py-{MPI4PY_VERSION}"


class FetchError(RuntimeError):
    """mpi4py's source distribution could not be fetched (no registry, no network) or unpacked."""


def _download_sdist(dest: Path) -> Path:
    """``pip download`` the pinned sdist into ``dest``; builds nothing (only mpi4py itself is taken as source,
    so pip's metadata step gets its build tools as wheels)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "mpi4py", "--quiet",
           "--dest", str(dest), f"mpi4py=={MPI4PY_VERSION}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise FetchError(f"`{' '.join(cmd)}` took over {FETCH_TIMEOUT_S} s") from None
    tarballs = sorted(dest.glob(f"mpi4py-{MPI4PY_VERSION}.tar.gz"))
    if proc.returncode != 0 or not tarballs:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise FetchError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): " + " | ".join(tail))
    return tarballs[0]


def fetch_testdir() -> Path:
    """mpi4py's test/ folder, unpacked from the pinned sdist once per cache; FetchError if it cannot be had."""
    root = cache_dir()
    testdir = root / "test"
    if (testdir / "main.py").is_file():
        return testdir
    tarball = _download_sdist(root / "sdist")
    prefix = f"mpi4py-{MPI4PY_VERSION}/test/"
    staging = Path(tempfile.mkdtemp(prefix="unpack-", dir=root))
    try:
        with tarfile.open(tarball) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
            tar.extractall(staging, members=members, filter="data")
        try:
            os.replace(staging / prefix, testdir)  # atomic: a concurrent fetch finds all or nothing
        except OSError:
            if not (testdir / "main.py").is_file():
                raise
    except (OSError, tarfile.TarError) as exc:
        raise FetchError(f"could not unpack {tarball}: {exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return testdir


@dataclass
class FileRun:
    """One mpi4py test file run at ``n`` ranks: each test id's outcome merged over the ranks."""

    module: str
    n: int
    proc: harness.Proc
    outcomes: Dict[str, str] = field(default_factory=dict)  # id -> "pass" | "fail" | "broken" | "skip"
    messages: Dict[str, str] = field(default_factory=dict)  # id -> first failing rank's message
    problems: List[str] = field(default_factory=list)  # the job itself went wrong (crash, hang, rank missing)
    backends: List[str] = field(default_factory=list)  # mpi4py's array backends the tests looped over (rank 0's)

    def ids(self, outcome: str) -> List[str]:
        return sorted(t for t, o in self.outcomes.items() if o == outcome)

    def counts(self) -> Dict[str, int]:
        return {o: len(self.ids(o)) for o in ("pass", "fail", "broken", "skip")}


# When ranks disagree on a test, the outcome ranked highest here wins.
_PRECEDENCE = {"skip": 0, "pass": 1, "broken": 2, "fail": 3}


def _merge(run: FileRun, ranks: Dict[int, dict]) -> None:
    """A test fails if it failed on any rank; is "broken" if it only met a communicator an earlier test broke; is
    skipped if every rank skipped it; passes otherwise. A test a rank was still in when it died fails."""
    for r in range(run.n):
        data = ranks.get(r)
        if data is None:
            run.problems.append(f"rank {r} wrote no results")
            continue
        if not data.get("finished"):
            where = data.get("current")
            run.problems.append(f"rank {r} did not finish" + (f"; it was running {where}" if where else ""))
        if r == 0:
            run.backends = list(data.get("backends", []))
        for tid, entry in data.get("tests", {}).items():
            outcome = entry["outcome"] if entry["outcome"] in _PRECEDENCE else "fail"
            message = entry.get("message", "") or f"rank {r} ended (crash or kill) inside this test"
            before = run.outcomes.get(tid)
            if before is not None and _PRECEDENCE[before] >= _PRECEDENCE[outcome]:
                continue
            run.outcomes[tid] = outcome
            if outcome in ("fail", "broken"):
                subtests = entry.get("subtests_failed") or []
                where = f"rank {r}" + (f", {len(subtests)} subtest(s) e.g. {subtests[0]}" if subtests else "")
                run.messages[tid] = f"[{where}] {message.strip()}"


def run_file(testdir: Path, module: str, n: int, *, timeout: float = 600.0, comm_timeout: float = 20.0,
             backends: Optional[str] = None, impl: str = "pycoll", hosts: int = 1) -> FileRun:
    """Run mpi4py's ``module`` (e.g. "test_cco_buf") on ``n`` ranks: pycoll through `pycoll run --mpi4py` (on
    ``hosts`` virtual hosts, network namespaces, where more than one), or with impl="mpi4py" the installed mpi4py
    under mpiexec (the reference the job is judged against)."""
    out_dir = tempfile.mkdtemp(prefix=f"pycoll-mpi4py-{module}-{n}-")
    try:
        argv = [harness.PYTHON, RANK_SCRIPT, "--testdir", str(testdir), "--out", out_dir, "--impl", impl, module]
        if backends:
            argv += ["--backends", backends]
        if impl == "pycoll":
            spread = ["--hosts", str(hosts)] if hosts > 1 else []
            cmd = [harness.PYTHON, "-m", "pycoll", "run", "-n", str(n), *spread, "--mpi4py", "--timeout",
                   str(int(timeout)), "--"] + argv
        else:
            cmd = harness.launcher_cmd(n, argv, "mpiexec")
        proc = harness.launch(cmd, harness.rank_env("shm", comm_timeout=comm_timeout), timeout=timeout + 30)
        run = FileRun(module, n, proc)
        ranks = {}
        for path in glob.glob(os.path.join(out_dir, "rank*.json")):
            with open(path) as fh:
                data = json.load(fh)
            ranks[int(data["rank"])] = data
        _merge(run, ranks)
        if proc.timed_out:
            run.problems.append(f"the job was killed after {timeout:.0f} s")
        elif proc.returncode != 0:
            run.problems.append(f"the launcher exited with code {proc.returncode}")
        return run
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
