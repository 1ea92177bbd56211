"""A rank that loops Allreduce until an error, for the vanishing-host test; writes OUT/vanish<rank>.json."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pycoll import MPI, errors  # noqa: E402

out = sys.argv[1]
comm = MPI.COMM_WORLD
a, b = np.ones(1 << 14, np.float32), np.empty(1 << 14, np.float32)
comm.Allreduce(a, b)
open(os.path.join(out, f"ready{comm.rank}"), "w").close()
report: dict = {"rank": comm.rank}
end = time.time() + 60
try:
    while time.time() < end:
        comm.Allreduce(a, b)
    report["outcome"] = "no error"
except errors.PycollError as exc:
    report.update(outcome=type(exc).__name__, mro=[c.__name__ for c in type(exc).__mro__], msg=str(exc),
                  peers=list(exc.peers), op=exc.op, t=time.time())
with open(os.path.join(out, f"vanish{comm.rank}.json"), "w") as fh:
    json.dump(report, fh)
os._exit(0)  # the other host is unreachable: do not linger in shutdown
