"""Rank-side entry point: runs a batch of test cases on MPI.COMM_WORLD and writes one JSON result per rank.

Usage (one process per rank, started by ``python -m pycoll run`` or ``mpiexec``)::

    python tests/rank_main.py [--out DIR] [--impl pycoll|mpi4py] CASE_OR_PATTERN...

``--out`` defaults to $PYCOLL_TEST_OUT; ``--impl`` to $PYCOLL_TEST_IMPL or ``pycoll``.
Each rank writes DIR/rank<R>.json (rewritten before every case, so a crash leaves the
last case started) and exits 0 when it recorded no failure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (HERE, ROOT):  # the repo's pycoll first, then the cases package
    if _p in sys.path:
        sys.path.remove(_p)
    sys.path.insert(0, _p)

import cases  # noqa: E402
from cases import CASES, Ctx, SkipCase  # noqa: E402

RANK_ENV_VARS = ("PYCOLL_RANK", "RANK", "PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")


def _env_rank() -> str:
    for var in RANK_ENV_VARS:
        if os.environ.get(var):
            return os.environ[var]
    return f"pid{os.getpid()}"


def _atomic_write(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1, default=repr)
    os.replace(tmp, path)


def _local_error(exc: BaseException) -> bool:
    """An argument error pycoll raises before communicating (not a mismatch): the comm stays usable."""
    try:
        from pycoll.errors import InvalidArgumentError, MismatchError
    except ImportError:
        return False
    return isinstance(exc, InvalidArgumentError) and not isinstance(exc, MismatchError)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="*", help="case ids or fnmatch patterns (e.g. 'reduce.*')")
    p.add_argument("--out", default=os.environ.get("PYCOLL_TEST_OUT"), help="directory for rank<R>.json")
    p.add_argument("--impl", default=os.environ.get("PYCOLL_TEST_IMPL", "pycoll"), choices=("pycoll", "mpi4py"))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--list", action="store_true", help="print the case ids and exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        cases.load_all()
        print("\n".join(CASES))
        return 0
    ids = cases.resolve(args.cases or ["*"])
    if args.out:
        os.makedirs(args.out, exist_ok=True)

    t_start = time.perf_counter()
    try:
        if args.impl == "pycoll":
            from pycoll import MPI
        else:
            from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
    except BaseException:  # noqa: BLE001 - report start-up failures too
        tb = traceback.format_exc()
        sys.stderr.write(f"[rank_main] start-up failed:\n{tb}")
        if args.out:
            _atomic_write(os.path.join(args.out, f"startup-{_env_rank()}.json"), {"startup_error": tb, "pid": os.getpid()})
        return 2

    ctx = Ctx(MPI, comm, args.impl, seed=args.seed, out_dir=args.out)
    result = {
        "rank": rank,
        "size": size,
        "impl": args.impl,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "cases": ids,
        "done": [],
        "skipped": {},
        "raised": {},
        "current": None,
        "aborted": None,
        "finished": False,
        "failures": ctx.failures,
        "notes": ctx.notes,
        "records": ctx.records,
        "checks": 0,
        "durations": {},
        "startup_s": round(time.perf_counter() - t_start, 3),
    }
    path = os.path.join(args.out, f"rank{rank}.json") if args.out else None

    def write() -> None:
        result["checks"] = ctx.checks
        if path:
            _atomic_write(path, result)

    ctx.flush = write
    for cid in ids:
        result["current"] = cid
        ctx.begin(cid)
        write()
        t0 = time.perf_counter()
        try:
            CASES[cid](ctx)
        except SkipCase as exc:
            result["skipped"][cid] = str(exc)
        except BaseException as exc:  # noqa: BLE001 - any other error ends this rank's batch
            ctx.fail("exception", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            result["durations"][cid] = round(time.perf_counter() - t0, 3)
            if _local_error(exc):
                result["raised"][cid] = f"{type(exc).__name__}: {exc}"
                continue  # raised before any communication: the next case can still run
            result["aborted"] = cid
            break
        result["durations"][cid] = round(time.perf_counter() - t0, 3)
        result["done"].append(cid)
    result["current"] = None
    result["finished"] = result["aborted"] is None
    result["total_s"] = round(time.perf_counter() - t_start, 3)
    write()
    if ctx.failures:
        sys.stderr.write(f"[rank_main] rank {rank}: {len(ctx.failures)} failure(s); first: {ctx.failures[0]}\n")
    if not path:
        print(json.dumps({k: result[k] for k in ("rank", "done", "skipped", "failures", "checks")}, default=repr))
    return 1 if ctx.failures else 0


if __name__ == "__main__":
    sys.exit(main())
