"""The Horovod engine's knobs: pycoll's names, each falling back to Horovod's variable of the same meaning."""

from __future__ import annotations

import os
from typing import Any

from .. import machine
from ..config import parse_bool, float_param, int_param, size_param, str_param


FUSION_THRESHOLD = size_param(
    "PYCOLL_HVD_FUSION_THRESHOLD", 64 << 20,
    "Horovod engine: the most bytes of allreduce tensors packed into one call per cycle (default 64M; 0: no fusion). "
    "HOROVOD_FUSION_THRESHOLD is read where this is not set.",
)
CYCLE_TIME = float_param(
    "PYCOLL_HVD_CYCLE_TIME", 1.0,
    "Horovod engine: milliseconds from the start of one background cycle to the next while requests are in flight "
    "(default 1). HOROVOD_CYCLE_TIME is read where this is not set.",
)
OVERLAP = str_param(
    "PYCOLL_HVD_OVERLAP", "auto",
    "Horovod engine: whether the background thread reduces while the training thread computes. on: a cycle every "
    "cycle time (Horovod's way); off: cycles run when a caller waits for a result (synchronize, step, a blocking "
    "call), the background thread only 1 s after the last cycle; auto (default): on where this host has a core "
    "beyond its ranks, off where the ranks fill its cores (there a background reduction takes a core from the "
    "computation).",
)
TIMELINE = str_param(
    "PYCOLL_HVD_TIMELINE", "",
    "Horovod engine: a file for rank 0's Chrome-trace timeline (every tensor's phases). HOROVOD_TIMELINE is read "
    "where this is not set.",
)
STALL_CHECK = float_param(
    "PYCOLL_HVD_STALL_CHECK_TIME", 60.0,
    "Horovod engine: seconds a tensor may wait for ranks that have not submitted it before rank 0 warns, naming "
    "them (default 60; 0: never). HOROVOD_STALL_CHECK_TIME_SECONDS is read where this is not set.",
)
CACHE_CAPACITY = int_param(
    "PYCOLL_HVD_CACHE_CAPACITY", 1024,
    "Horovod engine: response cache entries (default 1024; 0: every request negotiated through rank 0). "
    "HOROVOD_CACHE_CAPACITY is read where this is not set.",
)


def knob_value(p: Any, horovod_name: str, parse: Any) -> Any:
    """A knob's value: pycoll's if set, else Horovod's variable of the same meaning, else pycoll's default."""
    if not p.is_set() and os.environ.get(horovod_name, "").strip():
        return parse(os.environ[horovod_name])
    return p.get()


def overlap_wanted() -> bool:
    """PYCOLL_HVD_OVERLAP: whether the background thread cycles while requests are in flight (``auto``: where the
    job's ranks on this host leave a core free)."""
    mode = OVERLAP.get()
    if mode.strip().lower() == "auto":
        return machine.free_cores() > 0
    try:
        return parse_bool(mode)  # on / off, and the spellings every boolean knob takes
    except ValueError:
        raise ValueError(f"PYCOLL_HVD_OVERLAP={mode!r}: expected on, off or auto") from None
