"""Abort scenarios on 3 ranks: ``thread`` (Comm.Abort(terminate=False) from another thread) or ``exit`` (MPI's Abort)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pycoll import MPI, errors  # noqa: E402

mode, out_dir = sys.argv[1], sys.argv[2]
comm = MPI.COMM_WORLD
spare = comm.Dup()  # another communicator: it must survive a non-terminating Abort of COMM_WORLD
report: dict = {"rank": comm.rank}
if comm.rank == 0:
    aborted_at: list[float] = []

    def abort_later() -> None:
        time.sleep(0.5)
        aborted_at.append(time.monotonic())
        comm.Abort(3, terminate=(mode == "exit"))

    threading.Thread(target=abort_later, daemon=True).start()
if comm.rank == 2:
    time.sleep(1.5)  # joins after the abort
start = time.monotonic()
try:
    comm.Allreduce(np.ones(1 << 16), np.empty(1 << 16))
    report["outcome"] = "completed"
except errors.PycollError as exc:
    report.update(outcome=type(exc).__name__, mro=[c.__name__ for c in type(exc).__mro__], msg=str(exc),
                  peers=list(exc.peers), op=exc.op, after=time.monotonic() - start)
    if comm.rank == 0:
        report["after_abort"] = time.monotonic() - aborted_at[0]
try:
    comm.Barrier()
    report["later"] = "completed"
except errors.PycollError as exc:
    report["later"] = type(exc).__name__
if mode == "thread":  # the other communicator still works
    got = np.zeros(2)
    spare.Allreduce(np.ones(2), got)
    report["spare"] = float(got[0])
with open(os.path.join(out_dir, f"abort{comm.rank}.json"), "w") as fh:
    json.dump(report, fh)
