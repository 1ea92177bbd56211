"""The futex system call on a 32-bit word in shared memory: wait for it to change (with a timeout), or wake its waiters.

Both doorbells (the arena's and the shared-memory rings') sleep on one. Where there is no futex (another kernel, no
libc), a wait is a plain nap.
"""

from __future__ import annotations

import ctypes
import platform
import time
from typing import Optional

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "s390x": 238}.get(
    platform.machine().lower()
)
_WAIT, _WAKE, _WAKE_OP = 0, 1, 5
_OP_SET_1 = 1 << 12  # FUTEX_OP(FUTEX_OP_SET, 1, FUTEX_OP_CMP_EQ, 0): store 1; the comparison wakes nobody


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


def _load_syscall() -> Optional[ctypes._CFuncPtr]:  # type: ignore[name-defined]
    if _SYS_FUTEX is None:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load_syscall()


class Futex:
    """One futex word at ``addr`` (the address of a 32-bit cell in a shared mapping)."""

    __slots__ = ("_addr", "_ts")

    def __init__(self, addr: int) -> None:
        self._addr = ctypes.c_void_p(addr)
        self._ts = _Timespec()

    def wait(self, expected: int, seconds: float) -> None:
        """Sleep while the word holds ``expected``, for at most ``seconds`` (a wake or a change ends it early);
        without a futex, a plain nap of ``seconds``."""
        if _syscall is None:
            time.sleep(seconds)
            return
        self._ts.sec = int(seconds)
        self._ts.nsec = int((seconds - int(seconds)) * 1e9)
        _syscall(_SYS_FUTEX, self._addr, _WAIT, ctypes.c_uint32(expected), ctypes.byref(self._ts), None, 0)

    def wake(self) -> None:
        """Wake every waiter."""
        if _syscall is not None:
            _syscall(_SYS_FUTEX, self._addr, _WAKE, 0x7FFFFFFF, None, None, 0)


def raise_flag(addr: int) -> None:
    """Set the 32-bit word at ``addr`` (in a shared mapping) to 1 as an atomic exchange, with a full memory barrier:
    a sleeper raises its flag so, then checks for progress, and a waker that stores its progress and then reads the
    flag cannot both miss the other's store (a plain store may wait in the store buffer past the check). The kernel's
    FUTEX_WAKE_OP does the exchange, waking nobody; without a futex, a plain store."""
    if _syscall is None or _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _WAKE_OP, 0, None, ctypes.c_void_p(addr),
                                    _OP_SET_1) < 0:
        ctypes.c_uint32.from_address(addr).value = 1
