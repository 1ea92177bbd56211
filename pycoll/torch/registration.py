"""The ``pycoll`` backend's registration with torch.distributed: the constructor torch calls for each group, its
options, and the process's one progress thread."""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch.distributed as dist

from .. import runtime as _runtime
from ..bootstrap.rendezvous import from_torch_store
from ..comm import group_comm
from ..errors import InvalidArgumentError
from .backend import BACKEND, ProcessGroupPycoll
from .progress import ProgressThread
from .threads import share_cores, shared_cores

_lock = threading.Lock()
_progress: Optional[ProgressThread] = None


def _progress_thread(rt: _runtime.Runtime) -> ProgressThread:
    global _progress
    with _lock:
        if _progress is None:
            _progress = ProgressThread(rt.engine)
        return _progress


class Options:
    """pycoll's options for one torch group: ``init_process_group("pycoll", pg_options=Options(reproducible=True))``
    or ``new_group(..., pg_options=...)``. ``reproducible``: the group's reductions return, bit for bit, the rank-order
    left fold (docs/reproducibility.md); None follows ``PYCOLL_REPRODUCIBLE``."""

    def __init__(self, reproducible: Optional[bool] = None) -> None:
        self.reproducible = reproducible

    def __repr__(self) -> str:
        return f"pycoll.torch.Options(reproducible={self.reproducible!r})"


def _apply(comm: Any, options: Any) -> None:
    """Set what ``options`` (an ``Options``, a dict with the same keys, or None) asks of the group's communicator."""
    if options is None:
        return
    wanted = options.get("reproducible") if isinstance(options, dict) else getattr(options, "reproducible", None)
    if wanted is not None:
        comm.reproducible = bool(wanted)


def _create(common: Any, backend_options: Any = None) -> ProcessGroupPycoll:
    """torch's constructor hook (extended API): one pycoll communicator per torch group (``backend_options`` is the
    group's ``pg_options``: see ``Options``)."""
    timeout = common.timeout.total_seconds() if common.timeout is not None else None
    ranks = list(common.global_ranks_in_group) or list(range(common.group_size))
    rt = _runtime.current()
    if rt is None:
        if len(ranks) != common.group_size or ranks != sorted(ranks) or common.group_size != _world_size(ranks):
            raise InvalidArgumentError("the first pycoll process group must be the default (world) group", op="init_process_group")
        info = from_torch_store(common.store, common.group_rank, common.group_size, timeout or 300.0)
        rt = _runtime.get_runtime(timeout, info)
    if not shared_cores:
        share_cores(len(rt.machine_ranks), rt.machine_cores)
    if common.group_size > rt.size or ranks[common.group_rank] != rt.rank:
        raise InvalidArgumentError(
            f"torch's rank {ranks[common.group_rank]} of this group is pycoll's rank {rt.rank}: the pycoll job and the torch job differ",
            op="init_process_group",
        )
    comm = group_comm(rt, ranks, f"torch:{common.group_id}")
    comm.timeout = timeout or rt.timeout  # every wait on this group's communicator honours the group's timeout
    _apply(comm, backend_options)
    return ProcessGroupPycoll(comm, _progress_thread(rt), comm.timeout)


def _world_size(ranks: list[int]) -> int:
    return max(ranks) + 1 if ranks else 0


def register() -> None:
    """Make ``"pycoll"`` a torch.distributed backend (idempotent)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
