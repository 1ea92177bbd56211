"""Kill-point trials: forked rank processes run random collectives, one is SIGKILLed, the survivors must fail fast.

Each trial starts a start-up store here, forks ``p`` ranks (so no interpreter start-up per rank), waits until
they are up, lets them run a random mix of collectives for a random time, then kills one with SIGKILL: before,
inside or between calls. Every survivor must raise a ``PeerFailureError`` naming the dead rank and the
operation with its sequence number. Recorded per trial: the time from the kill to each survivor's error,
hangs (a survivor that does not fail within ``--hang-after`` seconds) and ``/dev/shm`` entries left behind.

    python tests/faults/kill_trials.py --trials 100 --seed 1 --json out.json
"""

from __future__ import annotations

import argparse
import faulthandler
import glob
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from pycoll.bootstrap.store import new_token  # noqa: E402
from pycoll.bootstrap.store_server import TCPStoreServer  # noqa: E402

COLLECTIVES = ("Allreduce", "Iallreduce", "Bcast", "Allgather", "Reduce_scatter_block", "Reduce", "Alltoall", "Barrier", "Dup-Allreduce")
COUNTS = (1, 7, 1000, 65536, 1 << 20)  # float32 elements per rank: small ones finish, large ones are killed mid-way
_OP_WITH_SEQ = re.compile(r"\w.* #\d+")


def _shm_entries(job_id: str) -> list[str]:
    """This job's segments still in /dev/shm (every name carries the job id)."""
    return sorted(glob.glob(f"/dev/shm/pycoll-{glob.escape(job_id)}-*")) if job_id else []


def _plan(rng: random.Random, collectives: tuple[str, ...] = COLLECTIVES) -> list[tuple[str, int]]:
    return [(rng.choice(collectives), rng.choice(COUNTS)) for _ in range(rng.randint(3, 12))]


def _run_one(comm: Any, dup: Any, name: str, count: int, p: int) -> None:
    from pycoll import MPI

    if name == "Barrier":
        comm.Barrier()
        return
    send = np.ones(count * (p if name in ("Reduce_scatter_block", "Alltoall") else 1), np.float32)
    if name in ("Allreduce", "Dup-Allreduce"):
        (dup if name.startswith("Dup") else comm).Allreduce(send, np.empty_like(send), op=MPI.SUM)
    elif name == "Iallreduce":
        comm.Iallreduce(send, np.empty_like(send), op=MPI.SUM).Wait()
    elif name == "Bcast":
        comm.Bcast(send, root=count % p)
    elif name == "Allgather":
        comm.Allgather(send, np.empty(count * p, np.float32))
    elif name == "Reduce_scatter_block":
        comm.Reduce_scatter_block(send, np.empty(count, np.float32), op=MPI.SUM)
    elif name == "Reduce":
        comm.Reduce(send, np.empty_like(send), op=MPI.SUM, root=0)
    elif name == "Alltoall":
        comm.Alltoall(send, np.empty_like(send))


def _rank_main(rank: int, p: int, plan: list[tuple[str, int]], ready_fd: int, out_fd: int, give_up_s: float,
               stack_file: str) -> None:
    """One forked rank: start pycoll, say ready, loop over the plan until an error; report it and exit. SIGUSR1
    writes every thread's stack to ``stack_file`` (the trial asks a rank that hangs)."""
    report: dict[str, Any] = {"rank": rank}
    faulthandler.register(signal.SIGUSR1, file=open(stack_file, "w"), all_threads=True)
    try:
        from pycoll import MPI

        comm = MPI.COMM_WORLD
        dup = comm.Dup()
        for name, count in plan:  # one pass first: compiled kernels load before the kill, not after it
            _run_one(comm, dup, name, count, p)
        os.write(ready_fd, b"r")
        end = time.monotonic() + give_up_s
        while time.monotonic() < end:
            for name, count in plan:
                _run_one(comm, dup, name, count, p)
        report.update(outcome="no error")
    except BaseException as exc:  # noqa: BLE001 - every outcome is reported
        report.update(
            outcome="error", t=time.monotonic(), cls=type(exc).__name__, msg=str(exc),
            mro=[c.__name__ for c in type(exc).__mro__], op=getattr(exc, "op", None), peers=list(getattr(exc, "peers", ()) or ()),
        )
    os.write(out_fd, (json.dumps(report) + "\n").encode())
    os._exit(0)


def _read_lines(fd: int, into: list[str], buf: bytearray) -> None:
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return
    buf += chunk
    while b"\n" in buf:
        line, _, rest = bytes(buf).partition(b"\n")
        buf[:] = rest
        into.append(line.decode())


def trial(rng: random.Random, index: int, hang_after: float, env: dict[str, str], ranks: tuple[int, ...] = (2, 3, 4, 5),
          transports: tuple[str, ...] = ("shm", "tcp"), collectives: tuple[str, ...] = COLLECTIVES) -> dict[str, Any]:
    p = rng.choice(ranks)
    transport = rng.choice(transports)
    victim = rng.randrange(p)
    plans = _plan(rng, collectives)
    delay = rng.uniform(0.0, 0.4)
    token = new_token()
    stacks = tempfile.mkdtemp(prefix="pycoll-kill-stacks-")
    hung_stacks: dict[int, str] = {}
    server = TCPStoreServer("127.0.0.1", 0, token=token)
    host, port = server.start()
    ready_r, ready_w = os.pipe()
    out_r, out_w = os.pipe()
    pids: list[int] = []
    base_env = dict(env, PYCOLL_SIZE=str(p), PYCOLL_STORE_ADDR=f"{host}:{port}", PYCOLL_JOB_TOKEN=token)
    if transport == "tcp":
        base_env["PYCOLL_SHM_DISABLE"] = "1"
    for r in range(p):
        pid = os.fork()
        if pid == 0:  # the rank
            try:
                os.close(ready_r)
                os.close(out_r)
                os.environ.update(base_env, PYCOLL_RANK=str(r), PYCOLL_LOCAL_RANK=str(r), PYCOLL_LOCAL_SIZE=str(p))
                if transport == "shm":
                    os.environ.pop("PYCOLL_SHM_DISABLE", None)
                _rank_main(r, p, plans, ready_w, out_w, hang_after + 30, os.path.join(stacks, f"rank{r}"))
            finally:
                os._exit(3)
        pids.append(pid)
    os.close(ready_w)
    os.close(out_w)
    os.set_blocking(out_r, False)
    record: dict[str, Any] = {"trial": index, "ranks": p, "transport": transport, "victim": victim, "plan": plans}
    lines: list[str] = []
    buf = bytearray()
    try:
        got = b""
        start_by = time.monotonic() + 60
        while len(got) < p and time.monotonic() < start_by:
            got += os.read(ready_r, p - len(got))
            if not got:
                break
        if len(got) < p:
            record["setup_failed"] = True
            time.sleep(0.5)
            _read_lines(out_r, lines, buf)
            record["reports"] = [json.loads(line) for line in lines]
            return record
        time.sleep(delay)
        os.kill(pids[victim], signal.SIGKILL)
        t_kill = time.monotonic()
        waiting = {pid for i, pid in enumerate(pids) if i != victim}
        deadline = t_kill + hang_after
        while waiting and time.monotonic() < deadline:
            for pid in list(waiting):
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done:
                    waiting.discard(pid)
            _read_lines(out_r, lines, buf)
            time.sleep(0.005)
        _read_lines(out_r, lines, buf)
        record["hung"] = sorted(pids.index(pid) for pid in waiting)
        for pid in waiting:  # where each one waits, for the report
            os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5 if waiting else 0)
        for pid in waiting:
            with open(os.path.join(stacks, f"rank{pids.index(pid)}")) as f:
                hung_stacks[pids.index(pid)] = f.read()[-2500:]
            os.kill(pid, signal.SIGKILL)
        reports = [json.loads(line) for line in lines]
        record["reports"] = reports
        record["times"] = [round(r["t"] - t_kill, 4) for r in reports if r.get("outcome") == "error"]
        record["bad"] = [r for r in reports if not _named_well(r, victim)]
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        os.close(ready_r)
        os.close(out_r)
        job_id = (server.get_local("job_id") or b"").decode()
        server.stop()
        for name in os.listdir(stacks):
            os.unlink(os.path.join(stacks, name))
        os.rmdir(stacks)
    record["leaked"] = _shm_entries(job_id)
    if record.get("hung"):
        record["stacks"] = hung_stacks  # last: the test's message shows the end of its report
    return record


def _named_well(report: dict[str, Any], victim: int) -> bool:
    """A peer-failure error that names the dead rank and the operation with its sequence number."""
    return (
        report.get("outcome") == "error"
        and "PeerFailureError" in report.get("mro", ())
        and victim in report.get("peers", ())
        and bool(_OP_WITH_SEQ.fullmatch(report.get("op") or ""))
    )


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    times = [t for r in records for t in r.get("times", ())]
    return {
        "trials": len(records),
        "setup_failed": sum(1 for r in records if r.get("setup_failed")),
        "survivors": sum(len(r.get("reports", ())) + len(r.get("hung", ())) for r in records),
        "hangs": sum(len(r.get("hung", ())) for r in records),
        "leaks": sum(len(r.get("leaked", ())) for r in records),
        "badly_named": sum(len(r.get("bad", ())) for r in records),
        "max_time_to_error_s": max(times, default=None),
        "median_time_to_error_s": statistics.median(times) if times else None,
        "by_ranks": {p: sum(1 for r in records if r["ranks"] == p) for p in sorted({r["ranks"] for r in records})},
        "by_transport": {t: sum(1 for r in records if r["transport"] == t) for t in ("shm", "tcp")},
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hang-after", type=float, default=20.0, help="seconds after the kill that count as a hang")
    ap.add_argument("--json", help="write every trial and the summary here")
    ap.add_argument("--ranks", default="2,3,4,5", help="rank counts to draw from")
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--collectives", default=",".join(COLLECTIVES))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    # A communicator timeout far above the hang limit: what fires must be the liveness check, not a timeout.
    env = {"PYCOLL_TIMEOUT": "300", "PYCOLL_DEBUG": "WARN", "PYCOLL_ARENA_JIT_AFTER": os.environ.get("PYCOLL_ARENA_JIT_AFTER", "0")}
    from pycoll.algorithms import arena_jit

    if arena_jit.unavailable() is None:
        arena_jit.polls_for(50e-6)  # kernels loaded and the spin calibrated here; the forked ranks inherit both
    records = []
    for i in range(args.trials):
        rec = trial(rng, i, args.hang_after, env, tuple(int(x) for x in args.ranks.split(",")),
                    tuple(args.transports.split(",")), tuple(args.collectives.split(",")))
        records.append(rec)
        status = "hang" if rec.get("hung") else "bad" if rec.get("bad") else "setup failed" if rec.get("setup_failed") else "ok"
        print(f"trial {i}: {rec['ranks']} ranks over {rec['transport']}, kill rank {rec['victim']}: {status} "
              f"{max(rec.get('times') or [0]):.3f} s", flush=True)
    summary = summarize(records)
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"summary": summary, "trials": records}, fh, indent=1)
    return 0 if not (summary["hangs"] or summary["leaks"] or summary["badly_named"] or summary["setup_failed"]) else 1


if __name__ == "__main__":
    sys.exit(main())
