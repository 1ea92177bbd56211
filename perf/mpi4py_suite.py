"""mpi4py conformance report: pass/fail/skip counts of mpi4py's own test files run on pycoll, per file and rank count.

Fetches the pinned mpi4py sdist (tests/mpi4py_runner.py says where it is cached), runs each file through
`pycoll run --mpi4py` at each rank count on the array, NumPy and CPU DLPack backends, and prints a Markdown table
(the README's copy comes from here). Wrap it in the shared lock, as any rank job:

    flock -s /tmp/pycoll-bench.lock python perf/mpi4py_suite.py [--ranks 1,2,3,4] [--files test_op,...] [--json F]

``--impl mpi4py`` runs the same files on the installed mpi4py under mpiexec instead: the reference counts.
``--failures`` lists the failing test ids under the table; ``--expected`` prints them as entries for
tests/test_mpi4py_suite.py's EXPECTED_FAILURES (each with its error as a draft reason, to be reworded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path.insert(0, TESTS)

import mpi4py_runner  # noqa: E402

TARGET_FILES = ["test_cco_buf", "test_cco_nb_buf", "test_cco_vec", "test_cco_nb_vec", "test_cco_obj", "test_p2p_buf",
                "test_p2p_obj", "test_request", "test_status", "test_op"]
EXTRA_FILES = ["test_comm", "test_comm_topo", "test_group", "test_msgspec", "test_datatype", "test_cco_ngh_buf",
               "test_cco_ngh_obj"]


def _list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=_list, default=["1", "2", "3", "4"], help="rank counts (default 1,2,3,4)")
    p.add_argument("--files", type=_list, default=TARGET_FILES + EXTRA_FILES, help="mpi4py test modules")
    p.add_argument("--impl", choices=("pycoll", "mpi4py"), default="pycoll")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per file and rank count")
    p.add_argument("--failures", action="store_true", help="list the failing test ids")
    p.add_argument("--expected", action="store_true", help="print the failures as EXPECTED_FAILURES entries")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    try:
        testdir = mpi4py_runner.fetch_testdir()
    except mpi4py_runner.FetchError as exc:
        print(f"cannot fetch mpi4py {mpi4py_runner.MPI4PY_VERSION}: {exc}", file=sys.stderr)
        return 1
    ranks = [int(r) for r in args.ranks]
    print(f"mpi4py {mpi4py_runner.MPI4PY_VERSION} test files on {args.impl}; cells: passed / failed / skipped tests "
          "(broken: of the failed, those that only met a communicator an earlier failure broke)")
    print()
    print("| file | " + " | ".join(f"{n} rank{'s' if n > 1 else ''}" for n in ranks) + " |")
    print("|---|" + "---|" * len(ranks))
    results, listing = [], []
    failing_at: dict[str, list[int]] = {}  # test id -> rank counts it failed at
    reasons: dict[str, str] = {}
    for module in args.files:
        cells = []
        for n in ranks:
            t0 = time.monotonic()
            run = mpi4py_runner.run_file(testdir, module, n, timeout=args.timeout, impl=args.impl)
            c = run.counts()
            cell = f"{c['pass']} / {c['fail'] + c['broken']} / {c['skip']}"
            cell += f" ({c['broken']} broken)" if c["broken"] else ""
            cell += " (job: " + "; ".join(run.problems) + ")" if run.problems else ""
            cells.append(cell)
            results.append({"file": module, "ranks": n, **c, "problems": run.problems, "failing": run.ids("fail"),
                            "broken": run.ids("broken"), "seconds": round(time.monotonic() - t0, 1)})
            for tid in run.ids("fail"):
                reason = (run.messages.get(tid, "").strip().splitlines() or [""])[-1]
                listing.append(f"- {module} @{n}: {tid}: {reason}")
                failing_at.setdefault(tid, []).append(n)
                reasons.setdefault(tid, reason)
        print(f"| {module} | " + " | ".join(cells) + " |", flush=True)
    if args.failures and listing:
        print()
        print("\n".join(listing))
    if args.expected and failing_at:
        print()
        for tid, at in sorted(failing_at.items()):
            key = tid if at == ranks else f"{tid}@{','.join(map(str, at))}"
            print(f"    {json.dumps(key)}: {json.dumps(reasons[tid][:110])},")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"mpi4py": mpi4py_runner.MPI4PY_VERSION, "impl": args.impl, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
