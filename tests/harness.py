"""Test harness: spawns N local ranks of tests/rank_main.py (pycoll launcher or mpiexec) and checks their JSON results."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
RANK_MAIN = os.path.join(TESTS, "rank_main.py")
PYTHON = sys.executable

if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

import cases  # noqa: E402

SIZES = (1, 2, 3, 4, 5)
TRANSPORTS = ("shm", "tcp")


# --------------------------------------------------------------------------------------------
# environment
# --------------------------------------------------------------------------------------------


def eventually(cond: Callable[[], bool], timeout: float = 10.0, poll: float = 0.01) -> bool:
    """Whether ``cond()`` came true within ``timeout`` seconds, asked every ``poll`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def sizes() -> List[int]:
    """World sizes to test: $PYCOLL_TEST_SIZES (e.g. "2,3") or 1..5."""
    raw = os.environ.get("PYCOLL_TEST_SIZES")
    return [int(x) for x in raw.split(",") if x.strip()] if raw else list(SIZES)


def transports() -> List[str]:
    raw = os.environ.get("PYCOLL_TEST_TRANSPORTS")
    return [x.strip() for x in raw.split(",") if x.strip()] if raw else list(TRANSPORTS)


TCP_SIZES = (2, 3, 5)  # one rank has no peer to reach; 4 ranks pair up as 2 do (and run on shm)


def jobs() -> List[Tuple[int, str]]:
    """(world size, transport) per job: every size on shm, and on tcp the sizes that differ for a socket (all of
    them when $PYCOLL_TEST_SIZES names the sizes)."""
    every = "PYCOLL_TEST_SIZES" in os.environ
    return [(n, t) for n in sizes() for t in transports() if t != "tcp" or every or n in TCP_SIZES]


def find_mpiexec() -> Optional[str]:
    """mpiexec next to the running interpreter (a venv with mpich), else on PATH."""
    here = os.path.join(os.path.dirname(PYTHON), "mpiexec")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    return shutil.which("mpiexec")


def have_mpi4py() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def library_missing() -> Optional[str]:
    """Why pycoll cannot be launched yet (None when it can)."""
    for rel in ("pycoll/comm.py", "pycoll/MPI.py", "pycoll/launcher.py"):
        if not os.path.exists(os.path.join(ROOT, rel)) and not os.path.isdir(os.path.join(ROOT, rel[:-3])):
            return f"{rel} does not exist yet"
    return None


def rank_env(transport: str = "shm", comm_timeout: Optional[float] = 60.0, extra: Optional[dict] = None) -> dict:
    """The environment of every rank: the repo's pycoll importable, the transport chosen, a finite timeout."""
    env = os.environ.copy()
    paths = [ROOT, TESTS] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PYCOLL_TEST_OUT", None)
    if transport == "tcp":
        env["PYCOLL_SHM_DISABLE"] = "1"
    elif transport == "shm":
        env.pop("PYCOLL_SHM_DISABLE", None)
    else:
        raise ValueError(f"unknown transport {transport!r}")
    if comm_timeout is not None:
        env["PYCOLL_TIMEOUT"] = str(comm_timeout)
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


def launcher_cmd(n: int, argv: Sequence[str], launcher: str = "pycoll", timeout: Optional[float] = None) -> List[str]:
    """The command that starts ``argv`` on n local ranks."""
    if launcher == "pycoll":
        cmd = [PYTHON, "-m", "pycoll", "run", "-n", str(n)]
        if timeout is not None:
            cmd += ["--timeout", str(int(timeout))]
        return cmd + ["--"] + list(argv)
    if launcher == "mpiexec":
        mpiexec = find_mpiexec()
        if mpiexec is None:
            raise RuntimeError("mpiexec not found")
        return [mpiexec, "-n", str(n)] + list(argv)
    raise ValueError(f"unknown launcher {launcher!r}")


@dataclass
class Proc:
    """A finished launch."""

    cmd: List[str]
    returncode: Optional[int]
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool


def launch(cmd: Sequence[str], env: dict, timeout: float, cwd: str = ROOT) -> Proc:
    """Run cmd in its own process group; on timeout, end that group (TERM, then KILL) and keep the output."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                out, err = proc.communicate(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        else:  # pragma: no cover
            out, err = "", ""
    finally:
        # ranks the launcher left behind in our group (it should not leave any)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return Proc(list(cmd), proc.returncode, out or "", err or "", time.monotonic() - t0, timed_out)


# --------------------------------------------------------------------------------------------
# a job of test cases
# --------------------------------------------------------------------------------------------


def _tail(text: str, limit: int = 4000) -> str:
    text = text.rstrip()
    return text if len(text) <= limit else "...\n" + text[-limit:]


@dataclass
class Result:
    """What every rank of one job reported."""

    n: int
    ids: List[str]
    proc: Proc
    out_dir: str
    label: str
    ranks: Dict[int, dict] = field(default_factory=dict)
    startup_errors: List[dict] = field(default_factory=list)

    # -- queries ----------------------------------------------------------------------------
    def failures(self) -> List[dict]:
        return [f for r in sorted(self.ranks) for f in self.ranks[r].get("failures", [])]

    def records(self, case_id: str, key: str = "outcome") -> Dict[int, object]:
        """rank -> the value a case stored with ctx.record(key, value)."""
        full = f"{case_id}:{key}"
        return {r: d["records"][full] for r, d in sorted(self.ranks.items()) if full in d.get("records", {})}

    def notes(self) -> List[str]:
        seen = []
        for d in self.ranks.values():
            for note in d.get("notes", []):
                if note not in seen:
                    seen.append(note)
        return seen

    def problems(self, require_exit_zero: bool = True) -> List[str]:
        """Everything wrong with this job; empty when every rank ran every case without a failure."""
        probs = []
        if self.proc.timed_out:
            probs.append(f"the job did not finish within its time limit ({self.proc.wall_s:.0f} s) and was killed")
        for err in self.startup_errors:
            probs.append(f"a rank failed to start:\n{err.get('startup_error')}")
        for r in range(self.n):
            d = self.ranks.get(r)
            if d is None:
                probs.append(f"rank {r}: wrote no result file")
                continue
            if d.get("size") != self.n:
                probs.append(f"rank {r}: comm size is {d.get('size')}, expected {self.n}")
            done = set(d.get("done", []))
            missing = [c for c in self.ids if c not in done and c not in d.get("raised", {})]
            if missing:
                where = d.get("aborted") or d.get("current")
                state = "aborted by an exception in" if d.get("aborted") else "was still running"
                probs.append(f"rank {r}: ran {len(done)}/{len(self.ids)} cases; {state} {where!r}; not done: {missing}")
        fails = self.failures()
        if fails:
            probs.append(f"{len(fails)} check(s) failed")
        if require_exit_zero and self.proc.returncode not in (0, None) and not fails and not probs:
            probs.append(f"launcher exit code {self.proc.returncode} although every rank passed")
        return probs

    def report(self, max_failures: int = 40) -> str:
        lines = [f"{self.label}", f"command: {' '.join(self.proc.cmd)}", f"exit code: {self.proc.returncode}, wall {self.proc.wall_s:.1f} s"]
        lines += [f"PROBLEM: {p}" for p in self.problems()]
        fails = self.failures()
        for f in fails[:max_failures]:
            msg = f"  [{f['case']}] rank {f['rank']}: {f['check']}: {f['message']}"
            if f.get("index") is not None or f.get("expected") is not None or f.get("got") is not None:
                msg += f"\n      index={f.get('index')} expected={f.get('expected')} got={f.get('got')}"
            lines.append(msg)
        if len(fails) > max_failures:
            lines.append(f"  ... and {len(fails) - max_failures} more")
        for r, d in sorted(self.ranks.items()):
            for key, val in d.get("records", {}).items():
                if isinstance(val, dict):
                    val = {k: v for k, v in val.items() if k not in ("mro", "traceback")}
                lines.append(f"  record rank {r} {key}: {val}")
        lines.append("---- launcher stdout (tail) ----\n" + _tail(self.proc.stdout, 2000))
        lines.append("---- launcher stderr (tail) ----\n" + _tail(self.proc.stderr))
        return "\n".join(lines)

    def slowest(self, k: int = 5) -> str:
        dur: Dict[str, float] = {}
        for d in self.ranks.values():
            for cid, s in d.get("durations", {}).items():
                dur[cid] = max(dur.get(cid, 0.0), s)
        top = sorted(dur.items(), key=lambda kv: -kv[1])[:k]
        return ", ".join(f"{c} {s:.2f}s" for c, s in top)

    def assert_ok(self, require_exit_zero: bool = True) -> "Result":
        probs = self.problems(require_exit_zero)
        if probs:
            import pytest

            pytest.fail(self.report(), pytrace=False)
        return self


def run_cases(
    n: int,
    patterns: Sequence[str],
    *,
    transport: str = "shm",
    launcher: str = "pycoll",
    impl: str = "pycoll",
    out_dir: Optional[str] = None,
    comm_timeout: Optional[float] = 60.0,
    job_timeout: float = 300.0,
    env: Optional[dict] = None,
) -> Result:
    """Start n ranks running the cases matching ``patterns``; collect every rank's JSON."""
    ids = cases.resolve(patterns)
    out_dir = out_dir or tempfile.mkdtemp(prefix="pycoll-test-")
    os.makedirs(out_dir, exist_ok=True)
    argv = [PYTHON, RANK_MAIN, "--out", out_dir, "--impl", impl] + list(ids)
    cmd = launcher_cmd(n, argv, launcher, timeout=job_timeout if launcher == "pycoll" else None)
    proc = launch(cmd, rank_env(transport, comm_timeout, env), timeout=job_timeout + 30)
    label = f"job: n={n} transport={transport} launcher={launcher} impl={impl} cases={len(ids)}"
    res = Result(n, ids, proc, out_dir, label)
    for path in glob.glob(os.path.join(out_dir, "rank*.json")):
        with open(path) as fh:
            data = json.load(fh)
        res.ranks[int(data["rank"])] = data
    for path in glob.glob(os.path.join(out_dir, "startup-*.json")):
        with open(path) as fh:
            res.startup_errors.append(json.load(fh))
    return res


# --------------------------------------------------------------------------------------------
# virtual hosts (network namespaces, pycoll.netns)
# --------------------------------------------------------------------------------------------


def multihost_unavailable(need_tc: bool = False) -> Optional[str]:
    """Why ranks cannot run on virtual hosts here (not root, no `ip`, namespaces refused); None when they can."""
    from pycoll import netns

    return netns.unavailable(need_tc=need_tc)


def hosts_launcher_cmd(
    n: int,
    argv: Sequence[str],
    hosts: Optional[int] = 2,
    ranks_per_host: Optional[Sequence[int]] = None,
    link_rate: Optional[str] = None,
    timeout: Optional[float] = None,
) -> List[str]:
    """`python -m pycoll run -n N --hosts H [--ranks-per-host A,B] [--link-rate R] -- ARGV`."""
    cmd = [PYTHON, "-m", "pycoll", "run", "-n", str(n)]
    if ranks_per_host is not None:
        cmd += ["--ranks-per-host", ",".join(map(str, ranks_per_host))]
    elif hosts is not None:
        cmd += ["--hosts", str(hosts)]
    if link_rate:
        cmd += ["--link-rate", link_rate]
    if timeout is not None:
        cmd += ["--timeout", str(int(timeout))]
    return cmd + ["--"] + list(argv)


def _is_command(argv: Sequence[str]) -> bool:
    first = argv[0] if argv else ""
    return os.path.isabs(first) or os.path.exists(first) or shutil.which(first) is not None


def run_on_hosts(
    cmd_or_cases,
    hosts: int = 2,
    n: int = 4,
    ranks_per_host: Optional[Sequence[int]] = None,
    link_rate: Optional[str] = None,
    env: Optional[dict] = None,
    timeout: float = 120.0,
    transport: str = "shm",
    comm_timeout: Optional[float] = 60.0,
):
    """Run n ranks on virtual hosts (network namespaces joined by a bridge; see pycoll.netns) and wait.

    ``cmd_or_cases`` is one of:
      * a str: Python source, run on every rank as ``python -c SOURCE``;
      * a list whose first item is a program (absolute path, existing file or on PATH): that argv;
      * otherwise a list of test case ids/patterns of tests/cases, run by tests/rank_main.py.
    Ranks are placed in contiguous blocks, as even as possible over ``hosts``, or as ``ranks_per_host``
    says (e.g. [2, 1, 2]); ranks on one host use shared memory, ranks on different hosts TCP.
    ``link_rate`` (e.g. "1gbit") shapes every link both ways; ``env`` adds to every rank's environment
    (rank_env(transport, comm_timeout, env): the repo's pycoll importable, a finite PYCOLL_TIMEOUT).

    Returns a Proc (returncode, stdout, stderr, wall_s, timed_out) for a command, or for test cases a
    Result as run_cases gives (``.proc`` holds the same fields; use ``.assert_ok()``). Skip a test with
    ``multihost_unavailable()`` first: without root or iproute2 the launcher exits 1.
    """
    if isinstance(cmd_or_cases, str):
        argv = [PYTHON, "-c", cmd_or_cases]
    elif _is_command(cmd_or_cases):
        argv = list(cmd_or_cases)
    else:
        return run_cases_on_hosts(cmd_or_cases, hosts=hosts, n=n, ranks_per_host=ranks_per_host, link_rate=link_rate,
                                  env=env, job_timeout=timeout, transport=transport, comm_timeout=comm_timeout)
    cmd = hosts_launcher_cmd(n, argv, hosts, ranks_per_host, link_rate, timeout)
    return launch(cmd, rank_env(transport, comm_timeout, env), timeout=timeout + 30)


def run_cases_on_hosts(
    patterns: Sequence[str],
    hosts: int = 2,
    n: int = 4,
    ranks_per_host: Optional[Sequence[int]] = None,
    link_rate: Optional[str] = None,
    env: Optional[dict] = None,
    job_timeout: float = 300.0,
    transport: str = "shm",
    comm_timeout: Optional[float] = 60.0,
    out_dir: Optional[str] = None,
) -> Result:
    """run_cases on virtual hosts: every rank runs the cases matching ``patterns``; collects each rank's JSON."""
    ids = cases.resolve(patterns)
    out_dir = out_dir or tempfile.mkdtemp(prefix="pycoll-test-")
    os.makedirs(out_dir, exist_ok=True)
    argv = [PYTHON, RANK_MAIN, "--out", out_dir, "--impl", "pycoll"] + list(ids)
    cmd = hosts_launcher_cmd(n, argv, hosts, ranks_per_host, link_rate, job_timeout)
    proc = launch(cmd, rank_env(transport, comm_timeout, env), timeout=job_timeout + 30)
    where = f"ranks_per_host={','.join(map(str, ranks_per_host))}" if ranks_per_host else f"hosts={hosts}"
    res = Result(n, ids, proc, out_dir, f"job: n={n} {where} link_rate={link_rate} cases={len(ids)}")
    for path in glob.glob(os.path.join(out_dir, "rank*.json")):
        with open(path) as fh:
            data = json.load(fh)
        res.ranks[int(data["rank"])] = data
    for path in glob.glob(os.path.join(out_dir, "startup-*.json")):
        with open(path) as fh:
            res.startup_errors.append(json.load(fh))
    return res


# --------------------------------------------------------------------------------------------
# rank scripts that write one report each (tests/torch_ranks, tests/horovod_ranks)
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(n: int, script, args: Sequence[str], env: Optional[dict] = None, launcher: str = "pycoll",
               timeout: float = 300) -> subprocess.CompletedProcess:
    """``script`` on ``n`` ranks under ``pycoll run`` (or torchrun), one intra-op thread each, ``env`` added."""
    full = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    if launcher == "pycoll":
        cmd = [PYTHON, "-m", "pycoll", "run", "-n", str(n), "--timeout", str(int(timeout - 20)), "--", PYTHON,
               str(script), *args]
    else:
        cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=full)


def rank_reports(proc: subprocess.CompletedProcess, out, n: int) -> List[dict]:
    """The ``rank*.json`` reports in ``out`` of a job: it exited 0, every rank reported, none raised or failed a
    check, each made at least one."""
    from pathlib import Path

    tail = f"\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    found = sorted(Path(out).glob("rank*.json"))
    assert proc.returncode == 0 and len(found) == n, f"exit {proc.returncode}, {len(found)} of {n} ranks reported{tail}"
    results = [json.loads(p.read_text()) for p in found]
    for res in results:
        assert "error" not in res, f"rank {res['rank']} raised:\n{res['error']}{tail}"
        assert not res["failures"], f"rank {res['rank']}: {len(res['failures'])} checks failed: {res['failures'][:10]}"
        assert res["checks"] > 0
    return results
