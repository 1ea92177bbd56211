"""Cross-memory attach: one kernel copy straight between two processes' memory (Linux process_vm_readv/writev)."""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from typing import Optional

import numpy as np

from ..config import bool_param
from ..memory import bounces_short_distance
from ..pages import BOUNCE_BYTES, PAGE, short_distance

CMA_DISABLE = bool_param(
    "PYCOLL_CMA_DISABLE", False, "Set to 1 to never copy between processes by cross-memory attach (the cma algorithms then use streams)."
)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class CrossMemory:
    """Copies between this process and a peer of the same user on this host, without staging.

    The kernel allows it where ptrace would be allowed (same uid, Yama ptrace_scope 0 or 1 with no
    restriction between siblings, no seccomp filter on the calls). ``probe`` says whether it works.
    One instance is used by one thread at a time: the iovecs are reused across calls.
    """

    def __init__(self) -> None:
        self._readv = self._writev = None
        self.reason: Optional[str] = None
        if CMA_DISABLE.get():
            self.reason = "cross-memory attach is turned off (PYCOLL_CMA_DISABLE)"
            return
        if not sys.platform.startswith("linux"):
            self.reason = "cross-memory attach needs Linux"
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            readv, writev = libc.process_vm_readv, libc.process_vm_writev
        except (OSError, AttributeError) as exc:
            self.reason = f"libc has no process_vm_readv ({exc})"
            return
        argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        for fn in (readv, writev):
            fn.argtypes = argtypes
            fn.restype = ctypes.c_ssize_t
        self._readv, self._writev = readv, writev
        self._local, self._remote = _IoVec(), _IoVec()
        self._bounce: Optional[np.ndarray] = None  # for copies at the short distance
        self._local_p, self._remote_p = ctypes.addressof(self._local), ctypes.addressof(self._remote)

    def function_address(self, kind: str) -> int:
        """The address of libc's process_vm_readv (``read``) or _writev (``write``), for compiled callers; 0: none."""
        fn = self._readv if kind == "read" else self._writev
        return int(ctypes.cast(fn, ctypes.c_void_p).value or 0) if fn is not None else 0

    @property
    def loaded(self) -> bool:
        return self._readv is not None

    @property
    def bounces(self) -> bool:
        """Whether copies at the short distance (``pages.short_distance``) go through a bounce buffer here: where
        this CPU's kernel copy runs them slowly (timed once per process, on this process's own memory)."""
        if not self.loaded:
            return False
        pid = os.getpid()
        try:
            return bounces_short_distance("kernel", lambda dst, src, n: self._move(self._readv, pid, dst, src, n))
        except OSError:  # the calls are refused here (a seccomp filter): no copy will bounce, and they say why
            return False

    def _transfer(self, fn, pid: int, local: int, remote: int, nbytes: int, reading: bool) -> None:
        if not short_distance(*((local, remote) if reading else (remote, local))) or not self.bounces:
            self._move(fn, pid, local, remote, nbytes)
            return
        chunk = min(nbytes, BOUNCE_BYTES)
        if self._bounce is None or self._bounce.nbytes < chunk + PAGE:
            self._bounce = np.empty(BOUNCE_BYTES + PAGE, np.uint8)
        b = self._bounce.ctypes.data
        b += (remote + PAGE // 2 - b) % PAGE
        for done in range(0, nbytes, chunk):
            m = min(chunk, nbytes - done)
            if reading:
                self._move(fn, pid, b, remote + done, m)
                ctypes.memmove(local + done, b, m)
            else:
                ctypes.memmove(b, local + done, m)
                self._move(fn, pid, b, remote + done, m)

    def _move(self, fn, pid: int, local: int, remote: int, nbytes: int) -> None:
        lo, re = self._local, self._remote
        done = 0
        while done < nbytes:
            lo.base, re.base = local + done, remote + done
            lo.len = re.len = nbytes - done
            n = fn(pid, self._local_p, 1, self._remote_p, 1, 0)
            if n <= 0:
                err = ctypes.get_errno() if n < 0 else errno.EIO
                if err == errno.EINTR:
                    continue
                exc = OSError(err, f"{fn.__name__} from pid {pid}: {os.strerror(err)}")
                exc.pid = pid  # type: ignore[attr-defined]  # ESRCH: that process is exiting or gone
                raise exc
            done += n

    def read(self, pid: int, dst: np.ndarray, remote_addr: int) -> None:
        """Copy ``dst.nbytes`` bytes at ``remote_addr`` in process ``pid`` into ``dst``."""
        if dst.nbytes:
            self._transfer(self._readv, pid, dst.ctypes.data, remote_addr, dst.nbytes, True)

    def write(self, pid: int, src: np.ndarray, remote_addr: int) -> None:
        """Copy ``src`` into process ``pid`` at ``remote_addr``."""
        if src.nbytes:
            self._transfer(self._writev, pid, src.ctypes.data, remote_addr, src.nbytes, False)

    def read_addr(self, pid: int, local_addr: int, remote_addr: int, nbytes: int) -> None:
        if nbytes:
            self._transfer(self._readv, pid, local_addr, remote_addr, nbytes, True)

    def write_addr(self, pid: int, local_addr: int, remote_addr: int, nbytes: int) -> None:
        if nbytes:
            self._transfer(self._writev, pid, local_addr, remote_addr, nbytes, False)

    def probe(self, pid: int, remote_addr: int, expect: bytes) -> Optional[str]:
        """None if reading ``len(expect)`` bytes at ``remote_addr`` in ``pid`` gives ``expect``, else why not."""
        if not self.loaded:
            return self.reason
        got = np.zeros(len(expect), np.uint8)
        try:
            self.read(pid, got, remote_addr)
        except OSError as exc:
            return f"process_vm_readv refused ({exc.strerror}); ptrace rules or a seccomp filter forbid it"
        if got.tobytes() != expect:
            return "process_vm_readv read the wrong bytes"
        return None
