"""Stall scenario on 3 ranks: rank 0 waits in Allreduce while rank 1 waits in a Barrier (with rank 2 only) for rank 2, who sleeps."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pycoll import MPI  # noqa: E402

comm = MPI.COMM_WORLD
side = comm.Split(1 if comm.rank in (1, 2) else 0, comm.rank)  # ranks 1 and 2 only (rank 0 alone)
side.Set_name("side")
if comm.rank == 2:
    time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 3.0)
if comm.rank in (1, 2):
    side.Barrier()
out = np.zeros(4)
comm.Allreduce(np.ones(4), out)
assert out[0] == 3, out
print(f"rank {comm.rank} done", flush=True)
