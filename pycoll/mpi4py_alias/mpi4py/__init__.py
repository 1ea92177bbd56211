"""Stand-in for the mpi4py package under `pycoll run --mpi4py`: `mpi4py.MPI` is pycoll.MPI, and `rc` and `get_config` exist."""

from __future__ import annotations

import sys
from typing import Any

# The mpi4py release whose API pycoll follows; programs that print or compare mpi4py.__version__ see this.
__version__ = "4.1.2"
__all__ = ["MPI", "rc", "get_config"]


class Rc:
    """mpi4py's run-time options. pycoll accepts and keeps them; it starts the same way whatever they say."""

    initialize = True
    threads = True
    thread_level = "multiple"
    finalize = None
    fast_reduce = True
    recv_mprobe = True
    irecv_bufsz = 32768
    errors = "exception"

    def __init__(self, **options: Any) -> None:
        self(**options)

    def __call__(self, **options: Any) -> None:
        unknown = [name for name in options if not hasattr(type(self), name)]
        if unknown:
            raise TypeError(f"mpi4py.rc: unknown option(s) {', '.join(map(repr, unknown))}")
        for name, value in options.items():
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if not hasattr(type(self), name):
            raise TypeError(f"mpi4py.rc: unknown option {name!r}")
        super().__setattr__(name, value)

    def __repr__(self) -> str:
        return f"<{__name__}.rc>"


rc = Rc()
sys.modules[f"{__name__}.rc"] = rc  # `from mpi4py import rc` and `import mpi4py.rc` both work, as in mpi4py


def get_config() -> dict[str, str]:
    """The MPI build configuration; pycoll is built against no MPI, so it is empty."""
    return {}
