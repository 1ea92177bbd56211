"""The local launcher `pycoll run -n N CMD ...`: a start-up store, N ranks (or on virtual hosts), and their clean-up."""

from __future__ import annotations

import argparse
import glob
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

from pycoll import forked_ranks
from pycoll.bootstrap.store import FAILED_KEY, new_token
from pycoll.bootstrap.store_server import TCPStoreServer
from pycoll.config import float_param, str_param
from pycoll.launched_ranks import Job

LAUNCH_GRACE = float_param(
    "PYCOLL_LAUNCH_GRACE",
    10.0,
    "`pycoll run`: seconds the other ranks get to finish after one rank failed, before SIGTERM then SIGKILL.",
)
BIND = str_param(
    "PYCOLL_BIND",
    "auto",
    "`pycoll run --hosts`: `auto` binds each rank of the virtual hosts to one of this machine's usable CPUs, a CPU "
    "of its own while there are enough, the hosts' first ranks (their leaders) first; `none` leaves placement to the "
    "scheduler.",
)
# What sizes the thread pools a rank's libraries start: OpenMP, OpenBLAS (under NumPy), MKL, torch's intra-op pool.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_PREFIX = "pycoll run"


def _status_text(code: int) -> str:
    """Describe a Popen return code (negative: killed by a signal)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (signal {-code})"
    return f"exited with code {code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _say(msg: str) -> None:
    print(f"{_PREFIX}: {msg}", file=sys.stderr, flush=True)


def _cleanup_shm(job_id: Optional[bytes]) -> None:
    """Remove the /dev/shm segments the ranks of this job may have left."""
    if not job_id:
        return
    text = job_id.decode(errors="replace")
    if not re.fullmatch(r"[0-9A-Za-z_.-]+", text):
        return  # never glob with an odd id
    dirs = {"/dev/shm", os.environ.get("PYCOLL_SHM_DIR") or "/dev/shm"}  # PYCOLL_SHM_DIR: see pycoll.transport.shm
    for d in dirs:
        for path in glob.glob(os.path.join(glob.escape(d), f"pycoll-{text}-*")):
            try:
                os.unlink(path)
            except OSError:
                pass


def plan_hosts(n: int, hosts: Optional[int] = None, ranks_per_host: Optional[Sequence[int]] = None) -> list[int]:
    """Ranks on each virtual host: the explicit list, else contiguous blocks as even as possible (larger first)."""
    if ranks_per_host is not None:
        counts = [int(c) for c in ranks_per_host]
        if hosts is not None and len(counts) != hosts:
            raise ValueError(f"--ranks-per-host lists {len(counts)} hosts but --hosts is {hosts}")
        if not counts or min(counts) < 1:
            raise ValueError(f"--ranks-per-host needs at least one rank per host, got {','.join(map(str, counts))}")
        if sum(counts) != n:
            raise ValueError(f"--ranks-per-host adds up to {sum(counts)} ranks but -n is {n}")
        return counts
    if hosts is None or hosts < 1:
        raise ValueError(f"--hosts must be at least 1, got {hosts}")
    if n < hosts:
        raise ValueError(f"-n {n} leaves hosts without ranks (--hosts {hosts})")
    base, extra = divmod(n, hosts)
    return [base + (1 if h < extra else 0) for h in range(hosts)]


def cpu_binding(placement: Sequence[int], cpus: Sequence[int]) -> list[Optional[int]]:
    """The CPU each rank of virtual hosts (``placement``: ranks per host) is bound to, or None for every rank where
    no ``cpus`` are known. Every host's first rank (its leader, which carries the host's steps between hosts) gets
    the next CPU, then every host's second rank, and so on, round the CPUs: with a CPU for each rank, no two ranks
    share one, and where the ranks outnumber the CPUs, leaders never share a CPU while there are CPUs for them.
    Left to the scheduler, 4 ranks on 2 hosts of a 2-core machine ran with both leaders on one CPU in about half
    the jobs, each small collective then taking 1.4-1.9x as long, and 2 ranks sometimes began on one CPU, where a
    small call took 10-15x as long until the scheduler moved one (perf/results/multihost/README.md, "Ranks on
    CPUs"). A host's ranks share its leader's CPU (4 ranks on 2 hosts of 2 CPUs: 0, 0, 1, 1): with each host's
    second rank on the other CPU (0, 1, 1, 0), six alternating rounds of 64 B calls read the Bcast 1.18-1.46x and
    the Reduce 0.96-1.26x as long, the Allreduce and Barrier 1.01-1.08x (2026-12-07)."""
    n = sum(placement)
    if not cpus:
        return [None] * n
    firsts = [sum(placement[:h]) for h in range(len(placement))]
    order = [firsts[h] + k for k in range(max(placement)) for h in range(len(placement)) if k < placement[h]]
    bound: list[Optional[int]] = [None] * n
    for i, rank in enumerate(order):
        bound[rank] = cpus[i % len(cpus)]
    return bound


def bind_mode(env: Optional[dict[str, str]] = None) -> str:
    """PYCOLL_BIND for a job (its ``env`` wins over the launcher's, as it does for the ranks): auto or none."""
    bind = (env or {}).get("PYCOLL_BIND") or BIND.get()
    if bind not in ("auto", "none"):
        raise ValueError(f"PYCOLL_BIND must be auto or none, got {bind!r}")
    return bind


def thread_share(n: int, env: dict[str, str]) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for ``n`` ranks on this machine where ``env`` sets none of THREAD_VARS, as torchrun
    does: each rank's share of the usable cores, at least one. Otherwise NumPy's OpenBLAS starts a thread per core
    in every rank, and those threads spin as it loads: 0.11 s of CPU per rank on the 2-core VM, where 4 ranks then
    share 2 cores with 4 spinning threads."""
    if n <= 1 or any(env.get(name) for name in THREAD_VARS):
        return {}
    from pycoll.machine import usable_cores

    return {"OMP_NUM_THREADS": str(max(1, usable_cores() // n))}


def _free_port(host: str) -> int:
    """A TCP port free on ``host`` now, for rank 0's torch store (env://) to listen on."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


MPI4PY_ALIAS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi4py_alias")


def mpi4py_path_first(pythonpath: str) -> str:
    """``pythonpath`` with pycoll's stand-in mpi4py package (pycoll/mpi4py_alias) first, ahead of an installed mpi4py."""
    rest = [p for p in pythonpath.split(os.pathsep) if p and p != MPI4PY_ALIAS_DIR]
    return os.pathsep.join([MPI4PY_ALIAS_DIR] + rest)


def _start_store(host: str, token: str) -> tuple[TCPStoreServer, tuple[str, int]]:
    server = TCPStoreServer(host, 0, token=token)
    return server, server.start()


def launch(
    n: int,
    cmd: list[str],
    *,
    env: Optional[dict[str, str]] = None,
    timeout: Optional[float] = None,
    tag_output: bool = False,
    hosts: Optional[int] = None,
    ranks_per_host: Optional[Sequence[int]] = None,
    link_rate: Optional[str] = None,
    mpi4py: bool = False,
) -> int:
    """Run ``cmd`` as ``n`` ranks; return 0, the first failed rank's code, or 124 on timeout.

    With ``hosts`` or ``ranks_per_host`` the ranks run on virtual hosts (pycoll.netns), in contiguous
    blocks, each rank inside its host's network namespace; the store listens in host 0's namespace.
    ``link_rate`` (e.g. "1gbit") shapes every virtual link. Raises NetnsError if namespaces can't be made.
    With ``mpi4py`` the ranks' ``import mpi4py`` and ``from mpi4py import MPI`` load pycoll (see mpi4py_path_first).
    """
    if n < 1:
        raise ValueError(f"-n must be at least 1, got {n}")
    if not cmd:
        raise ValueError("no command to run")
    placement = plan_hosts(n, hosts, ranks_per_host) if hosts is not None or ranks_per_host is not None else None
    if link_rate and placement is None:
        raise ValueError("--link-rate needs --hosts")
    bind = bind_mode(env)
    grace = LAUNCH_GRACE.get()
    launcher_pid = os.getpid()
    job = Job()
    stop_requests: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stop_requests.append(signum)
        # First signal: forward it. A second one: kill at once.
        job.signal_all(signum if len(stop_requests) == 1 else signal.SIGKILL)

    in_main = threading.current_thread() is threading.main_thread()
    old_handlers = {}
    if in_main:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal or the ssh session went
            old_handlers[sig] = signal.signal(sig, on_signal)
        old_handlers[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, job.suspend)  # Ctrl-Z stops the whole job
        old_handlers[signal.SIGCONT] = signal.signal(signal.SIGCONT, job.resume)
    vhosts = None
    server: Optional[TCPStoreServer] = None
    # The job token: the user's PYCOLL_JOB_TOKEN, else a fresh secret; only the ranks get it.
    token = (env or {}).get("PYCOLL_JOB_TOKEN") or os.environ.get("PYCOLL_JOB_TOKEN") or new_token()
    try:
        if placement is None:
            server = TCPStoreServer("127.0.0.1", 0, token=token)
            host, port = server.start()
            where = [(0, rank, n) for rank in range(n)]  # (host, local rank, local size) per rank
        else:
            from pycoll import netns

            vhosts = netns.VirtualHosts(len(placement), rate=link_rate).create()
            # A socket belongs to the namespace it was created in: make the store's in host 0.
            server, (host, port) = vhosts.call(0, _start_store, vhosts.addresses[0], token)
            where = [(h, i, c) for h, c in enumerate(placement) for i in range(c)]
        base = dict(os.environ)
        base.update(env or {})
        if mpi4py:
            base["PYTHONPATH"] = mpi4py_path_first(base.get("PYTHONPATH", ""))
        share = thread_share(n, base)
        base.update(share)
        torch_port = _free_port(host) if vhosts is None else vhosts.call(0, _free_port, host)
        binding: list[Optional[int]] = [None] * n
        if placement is not None and bind == "auto":
            from pycoll.machine import affinity, usable_cores

            cpus = sorted(affinity())
            binding = cpu_binding(placement, cpus if usable_cores() >= len(cpus) else [])  # a quota: no binding
        program = None  # set when the ranks are forked from here (pycoll.forked_ranks)
        for rank in range(n):
            h, local_rank, local_size = where[rank]
            child_env = dict(base)
            child_env.update(
                PYCOLL_RANK=str(rank),
                PYCOLL_SIZE=str(n),
                PYCOLL_LOCAL_RANK=str(local_rank),
                PYCOLL_LOCAL_SIZE=str(local_size),
                PYCOLL_STORE_ADDR=f"{host}:{port}",
                PYCOLL_JOB_TOKEN=token,
                # torch.distributed's env:// (init_process_group with no init_method) works under pycoll run too
                RANK=str(rank),
                WORLD_SIZE=str(n),
                LOCAL_RANK=str(local_rank),
                LOCAL_WORLD_SIZE=str(local_size),
                MASTER_ADDR=host,
                MASTER_PORT=str(torch_port),
            )
            argv = cmd
            if vhosts is not None:
                import shutil  # only here: it pulls in bz2 and lzma

                child_env["PYCOLL_SOCKET_ADDR"] = vhosts.addresses[h]  # TCP listens on its own host's address
                if link_rate and "PYCOLL_LINK_RATE" not in child_env:  # an exported one (even empty) wins
                    child_env["PYCOLL_LINK_RATE"] = link_rate  # the cost model then knows the shaped links
                argv = vhosts.exec_prefix(h) + cmd
                if shutil.which(cmd[0], path=child_env.get("PATH")) is None:  # `ip netns exec` would hide it
                    _say(f"cannot start rank {rank} ({' '.join(cmd)}): {cmd[0]}: command not found")
                    return 127
            if stop_requests and vhosts is not None:  # Ctrl-C during the (slower) set-up: start no more
                break
            if rank == 0 and vhosts is None and in_main:
                program = forked_ranks.python_program(
                    cmd, child_env, [MPI4PY_ALIAS_DIR] if mpi4py else (), preset=list(share))
                if program is not None and not forked_ranks.preload(share):
                    program = None
            try:
                if program is not None:
                    job.fork(rank, program, child_env, tag_output, server.forget_in_child if server else lambda: None)
                else:
                    job.spawn(rank, argv, child_env, tag_output, binding[rank])
            except OSError as exc:
                _say(f"cannot start rank {rank} ({' '.join(cmd)}): {exc}")
                return 127
        job.copy_forked_outputs()
        if stop_requests:  # a signal came while we were still setting up
            job.signal_all(stop_requests[0])
            if len(job.procs) < n:
                return 128 + stop_requests[0]
        def tell_store(rank: int, cause: str) -> None:
            if server is not None:
                import json

                server.set_local(FAILED_KEY, json.dumps({"rank": rank, "cause": cause}).encode())

        return _wait(job, n, grace, timeout, tell_store)
    finally:
        if os.getpid() == launcher_pid:  # not in a forked rank leaving after its program
            job.stop()
            job_id = server.get_local("job_id") if server is not None else None
            if server is not None:
                server.stop()
            if vhosts is not None:
                vhosts.close()  # before our handlers go: a second Ctrl-C must not cut the clean-up short
            if in_main:
                for sig, handler in old_handlers.items():
                    signal.signal(sig, handler)
            _cleanup_shm(job_id)


def _wait(job: Job, n: int, grace: float, timeout: Optional[float], on_failure: Callable[[int, str], None] = lambda r, c: None) -> int:
    """Wait for the ranks; apply the grace period after a failure and the job timeout.

    ``on_failure(rank, cause)`` runs at the first failure (the store then wakes ranks still starting up)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    failed: Optional[tuple[int, int]] = None
    grace_end: Optional[float] = None
    done = 0
    while done < n:
        now = time.monotonic()
        limits = [t for t in (deadline, grace_end) if t is not None]
        wait_s = min(limits) - now if limits else None
        try:
            # Bounded waits keep the main thread responsive to signals.
            rank, code = job.exits.get(timeout=0.5 if wait_s is None else max(min(wait_s, 0.5), 0.0))
        except queue.Empty:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                _say(f"timeout after {timeout:g} s; stopping {len(job.running())} running rank(s)")
                return 124
            if grace_end is not None and now >= grace_end:
                _say(f"stopping {len(job.running())} rank(s) still running {grace:g} s after rank {failed[0]} failed")
                break
            continue
        done += 1
        if code != 0 and failed is None:
            failed = (rank, code)
            _say(f"rank {rank} {_status_text(code)}")
            on_failure(rank, _status_text(code))
            grace_end = time.monotonic() + grace
    if failed is not None:
        return _exit_code(failed[1])
    return 0


def _counts(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of rank counts: {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return values


def add_run_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``pycoll run``."""
    p = subparsers.add_parser(
        "run",
        help="run a command as N local ranks",
        description="Run CMD as N ranks on this host, like `mpiexec -n N CMD`. With --hosts, the ranks are "
        "spread over virtual hosts: network namespaces of this machine, joined by a virtual switch (needs root).",
    )
    p.add_argument("-n", "--np", dest="n", type=int, required=True, help="number of ranks")
    p.add_argument("--tag-output", action="store_true", help="prefix every output line with [rank]")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="kill the job after S seconds (exit 124)")
    p.add_argument("--hosts", type=int, default=None, metavar="H",
                   help="place the ranks on H virtual hosts, in contiguous blocks as even as possible")
    p.add_argument("--ranks-per-host", type=_counts, default=None, metavar="A,B,...",
                   help="ranks on each virtual host, e.g. 2,1,2 (implies --hosts 3)")
    p.add_argument("--link-rate", default=None, metavar="RATE",
                   help="shape every virtual link, both ways, to RATE (tc units: 100mbit, 1gbit, 10gbit)")
    p.add_argument("--mpi4py", action="store_true",
                   help="run an unchanged mpi4py program on pycoll: the ranks' `from mpi4py import MPI` (and "
                   "`import mpi4py`, `mpi4py.rc`, `mpi4py.get_config()`) load pycoll's stand-in package, put first "
                   "on their PYTHONPATH, instead of an installed mpi4py")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD", help="the command and its arguments")
    p.set_defaults(func=run_command)
    return p


def run_command(args: argparse.Namespace) -> int:
    """Entry point of ``pycoll run``."""
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        _say("no command given (usage: pycoll run -n N [--hosts H] [--tag-output] [--timeout S] [--mpi4py] [--] CMD ...)")
        return 2
    if args.n < 1:
        _say(f"-n must be at least 1, got {args.n}")
        return 2
    hosts, per_host, rate = args.hosts, args.ranks_per_host, args.link_rate
    virtual = hosts is not None or per_host is not None
    try:
        if virtual:
            plan_hosts(args.n, hosts, per_host)
            bind_mode()
        elif rate:
            raise ValueError("--link-rate needs --hosts")
        if rate:
            from pycoll.config import parse_rate

            parse_rate(rate)
    except ValueError as exc:
        _say(str(exc))
        return 2
    if not virtual:
        return launch(args.n, cmd, timeout=args.timeout, tag_output=args.tag_output, mpi4py=args.mpi4py)
    from pycoll import netns

    reason = netns.prerequisite_missing(need_tc=bool(rate))  # the rest shows when the namespaces are made
    if reason:
        _say(f"--hosts needs network namespaces, which cannot be made here: {reason}")
        return 1
    try:
        return launch(args.n, cmd, timeout=args.timeout, tag_output=args.tag_output,
                      hosts=hosts, ranks_per_host=per_host, link_rate=rate, mpi4py=args.mpi4py)
    except netns.NetnsError as exc:  # the virtual hosts could not be set up
        _say(str(exc))
        return 1
