"""A communicator of one rank: each blocking collective is at most one local copy, run as its plan's whole call.

With no peer there is nothing to meet, number against or wait for (MPICH and Open MPI copy locally too), so after
a call shape's first call (checked and scheduled like any other) its later calls copy ``send`` into ``recv`` here:
Reduce, Allreduce, Scan, Reduce_scatter(_block), Gather, Scatter, Allgather and Alltoall move their one block;
Barrier, Bcast, Exscan (rank 0's result is undefined) and in-place calls move nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import arrays
from .memory import HOST

if TYPE_CHECKING:  # pragma: no cover
    from .executor import Executor
    from .plans import Plan

_MOVES_NOTHING = ("barrier", "broadcast", "exscan")


def fast_path(x: "Executor", plan: "Plan") -> Any:
    """The plan's whole call on a one-rank communicator (``Plan.fast``), or False for calls it leaves to the
    schedule: device buffers, vector forms, and (at the call) buffers whose blocks differ in size or overlap."""
    t, c = plan.template, x.comm
    if c.size != 1 or t.stream is not None or t.vector:
        return False
    send_rb, recv_rb = plan.send, plan.recv
    copies = not (t.in_place or t.coll in _MOVES_NOTHING) and send_rb is not None and recv_rb is not None
    copy, overlaps = HOST.copy, arrays.overlaps

    def fast(args: tuple) -> bool:
        if c._freed or c._aborted is not None:
            return False  # the checks name it
        if copies:
            send, recv = send_rb.view(args), recv_rb.view(args)
            if send.size != recv.size:
                return False
            if send.size and (send is recv or send.base is not None or recv.base is not None) and overlaps(send, recv):
                return False
            copy(recv, send)
        c._seq += 1
        return True

    return fast
