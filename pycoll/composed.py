"""Small collectives across hosts composed from two smaller communicators, as MPICH's SMP-aware collectives are.

A communicator whose ranks span hosts, with more than one rank on some host, runs a small blocking Allreduce or
a Barrier as three calls: one on each host's communicator, whose ranks share memory and so take the compiled arena
path, one among the hosts' first ranks (the leaders), over the network, and one more on each host's communicator.
Allreduce: reduce to the leader, allreduce among the leaders, broadcast from the leader. The network then carries
one message per host per step, and the steps inside a host cost a shared-memory meeting instead of a trip through
the point-to-point engine. Bcast and Reduce are not composed: their flat trees already cross the network once and
overlap the steps inside hosts, which the composition would run one after the other (measured slower, 4 ranks on
2 namespace hosts).

Every rank decides alike (the layout, the call's kind, size and op are the same everywhere), so every rank takes
the composed path or none does. ``PYCOLL_SMP_BYTES`` bounds the size; 0 turns it off.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .algorithms.base import Call
from .buffers import IN_PLACE
from .config import size_param
from .group import UNDEFINED

SMP_BYTES = size_param(
    "PYCOLL_SMP_BYTES", 64 << 10,
    "Largest blocking Allreduce (and every Barrier) that a communicator spanning hosts, with several ranks on some "
    "host, runs as a call inside each host, one among the hosts' first ranks and one more inside each host (the "
    "hosts' shared memory takes the compiled arena path). 0: never.")

_KINDS = ("allreduce", "barrier")


class HostComposition:
    """The per-host and leaders' communicators of one parent communicator, made on its first composed call."""

    def __init__(self, comm: Any) -> None:
        lay = comm._layout
        self.comm = comm
        self.host = lay.host_of[comm._rank]
        self.groups = lay.groups  # ranks of each host, in host order
        self.leader = self.groups[self.host][0] == comm._rank
        self.host_comm: Any = None
        self.leaders: Any = None

    @staticmethod
    def wanted(comm: Any) -> bool:
        """Whether ``comm``'s layout gains from composing: several hosts, and some host with several ranks."""
        lay = comm._layout
        return lay.hosts > 1 and max(lay.local_sizes) > 1 and SMP_BYTES.get() > 0

    def takes(self, call: Call) -> bool:
        """Whether this call is composed (the same answer on every rank for matching calls)."""
        limit = SMP_BYTES.get()
        if call.coll not in _KINDS or call.stream is not None or limit <= 0:
            return False
        if call.coll == "barrier":
            return True
        if call.size_bytes > limit or call.dtype.kind not in "biufc":
            return False
        return call.op is not None and call.op.commutative and not call.op.averages

    def _comms(self) -> None:
        if self.host_comm is None:  # collective on the parent: every rank makes them in the same call
            c = self.comm
            self.host_comm = c.Split(self.host, c._rank)
            leaders = c.Split(0 if self.leader else UNDEFINED, c._rank)
            self.leaders = leaders if self.leader else None

    def run(self, call: Call) -> None:
        self._comms()
        self.host_comm.timeout = self.comm.timeout  # the parent's, as the user may have changed it
        if self.leaders is not None:
            self.leaders.timeout = self.comm.timeout
        getattr(self, "_" + call.coll)(call)

    def free(self) -> None:
        """Release the two communicators (with their arena), as the parent is freed."""
        for c in (self.host_comm, self.leaders):
            if c is not None:
                c.free()
        self.host_comm = self.leaders = None

    # ---- the compositions ---------------------------------------------------------------------
    def _barrier(self, call: Call) -> None:
        self.host_comm.Barrier()
        if self.leaders is not None:
            self.leaders.Barrier()
        self.host_comm.Barrier()

    def _allreduce(self, call: Call) -> None:
        assert call.recv is not None and call.op is not None
        out = call.recv
        if self.leader:  # the host's partial result stays out of the user's buffer until the network step is done
            partial = out.copy() if call.in_place else np.empty_like(out)
            self.host_comm.Reduce(IN_PLACE if call.in_place else call.send, partial, call.op, 0)
            self.leaders.Allreduce(IN_PLACE, partial, call.op)
            out[...] = partial
        else:
            self.host_comm.Reduce(out if call.in_place else call.send, None, call.op, 0)
        self.host_comm.Bcast(out, 0)
