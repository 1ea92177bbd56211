"""Where a torch group's host calls run, the caller's thread or the progress thread, and torch's intra-op threads
sized to this rank's share of the host's cores."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger("pycoll.torch")

INLINE_BYTES = 1 << 20  # host calls below this size run in the caller's thread when nothing is in flight
EVERY_SIZE = 1 << 62  # the inline limit where the machine's ranks have at most a core each (``share_cores``)
inline_bytes = [INLINE_BYTES]


def runs_inline(nbytes: int, opts: Any) -> bool:
    """Whether a host call of ``nbytes`` (-1: unknown) runs in the caller's thread when nothing is in flight."""
    return 0 <= nbytes and (nbytes < inline_bytes[0] or caller_waits(opts))


def caller_waits(opts: Any) -> bool:
    """Whether the caller waits for the call as soon as it is returned (torch sets ``asyncOp`` from ``async_op``;
    options made without it, as DDP's reducer makes them, say True)."""
    return opts is not None and getattr(opts, "asyncOp", True) is False


shared_cores: list[bool] = []  # set once the process's torch threads were sized for the host's ranks


def share_cores(ranks: int, cores: int) -> None:
    """Give torch's intra-op pool this rank's share of the cores where OMP_NUM_THREADS does not say, as torchrun does
    for several ranks on a node. Each rank's pool otherwise takes every core, and while one rank computes on all of
    them its peers wait in a collective for its result: 2 ranks on 2 cores, a small MLP's DDP step took 4-64 ms
    against 2-3 ms with one thread each. ``ranks``: the job's on this machine (namespaces included); ``cores``: theirs
    (pycoll.machine). Where the ranks have at most a core each, every host call runs in the caller's thread when
    nothing is in flight, at any size: handed to the progress thread, a DDP bucket's allreduce only took turns with
    the backward pass on the same cores, plus the hop (25 MB of gradients, 2 ranks on 2 cores: 78-81 against 65-79
    ms a step; 4 ranks: 166-192 against 154-158)."""
    shared_cores.append(True)
    if cores <= ranks:  # no core for the progress thread to overlap a call on: it would only take turns with torch
        inline_bytes[0] = EVERY_SIZE
    if os.environ.get("OMP_NUM_THREADS") or ranks <= 1:
        return
    share = max(1, cores // ranks)
    if torch.get_num_threads() > share:
        log.info("pycoll backend: torch's intra-op threads set to %d (%d ranks on this machine's %d cores; set "
                 "OMP_NUM_THREADS to choose)", share, ranks, cores)
        torch.set_num_threads(share)
