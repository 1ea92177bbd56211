"""CUDA device kernels (numba.cuda): reductions for every pycoll op and dtype, copies, and their launchers."""

# pycoll.cuda.dtypes imports without numba.cuda. The launchers load on first use and import numba.cuda:
# set NUMBA_ENABLE_CUDASIM=1 before that to run the kernels on the CPU simulator.

from __future__ import annotations

from typing import Any

from .dtypes import DTYPES, MAX_SRCS, Layout, layout, pairs

_LAUNCH = (
    "KernelSet",
    "copy",
    "copy_blocks",
    "get_kernels",
    "is_simulator",
    "launch_config",
    "reduce2",
    "reduce_copy",
    "reduce_many",
    "scale",
    "supported",
)

__all__ = ["DTYPES", "MAX_SRCS", "Layout", "layout", "pairs"]
__all__ += list(_LAUNCH)


def __getattr__(name: str) -> Any:
    if name in _LAUNCH:
        from . import launch

        return getattr(launch, name)
    raise AttributeError(f"module 'pycoll.cuda' has no attribute {name!r}")
