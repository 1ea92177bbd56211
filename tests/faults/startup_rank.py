"""Start-up death: the last rank exits before it joins; the others must fail fast, naming it (OUT/startup<r>.json)."""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

rank, size = int(os.environ["PYCOLL_RANK"]), int(os.environ["PYCOLL_SIZE"])
if rank == size - 1:
    time.sleep(0.5)
    os._exit(3)
from pycoll import MPI, errors  # noqa: E402

t0 = time.time()
report: dict = {"rank": rank}
try:
    MPI.COMM_WORLD.Barrier()
    report["outcome"] = "completed"
except errors.PycollError as exc:
    report.update(outcome=type(exc).__name__, mro=[c.__name__ for c in type(exc).__mro__], msg=str(exc), peers=list(exc.peers))
report["after_s"] = time.time() - t0
with open(os.path.join(sys.argv[1], f"startup{rank}.json"), "w") as fh:
    json.dump(report, fh)
