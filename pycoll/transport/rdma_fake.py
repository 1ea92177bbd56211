"""A fake RDMA NIC in shared memory: RDMA WRITE (with immediate) as memory copies between processes of one host.

It implements the thin layer's interface (``rdma_proto.Provider``/``Nic``/``Endpoint``) so that the RDMA
channel, its credits, pipelining and failure handling run between real pycoll processes without a device
(``PYCOLL_IB_FAKE=1``). It is strict where hardware would be: a write with immediate that finds no posted
receive puts the queue pair in error (receiver-not-ready), as does a write outside the remote region; a write
whose source changes before its completion fails; a peer process that is gone makes the next completions
fail (transport retry exceeded).

Registered regions that peers write into are files in PYCOLL_SHM_DIR named after the job, mapped by the
peer on its first write; each queue pair's inbound completions are a small ring in such a file too.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import random
import socket
import struct
import time
import zlib
from collections import deque
from typing import Optional

import numpy as np

from .rdma_memory import Region
from .rdma_proto import Completion, Endpoint, Nic, NoRdma, PortInfo, Provider
from ..config import SHM_DIR
from .shm import _process_alive, _Segment

_PAGE = 4096
_MR_HEADER = struct.Struct("<QQ")  # base address, length: lets a peer turn a remote address into an offset
# Queue-pair file: words [receives posted (owner), writes arrived (peer), closed (owner)], then (imm, len) slots.
_POSTED, _ARRIVED, _CLOSED = 0, 1, 2
_QP_WORDS = 8
_NICS = itertools.count()
_LIVENESS_S = 0.2  # how often a queue pair with traffic outstanding checks that its peer process lives


def _host_key() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _checksum(addr: int, length: int) -> int:
    return zlib.crc32((ctypes.c_char * length).from_address(addr)) if length else 0


class _Mapped(_Segment):
    """A file in PYCOLL_SHM_DIR mapped here: one of ours (created), or a peer's (its size read from the file)."""

    def __init__(self, path: str, size: int = 0, create: bool = False) -> None:
        super().__init__(path, size or os.stat(path).st_size, create)
        self.path = path

    def address(self, offset: int) -> int:
        arr = np.frombuffer(self.view, np.uint8, count=1, offset=offset)
        addr = int(arr.ctypes.data)
        del arr  # drop the export, so that the mapping can be closed later
        return addr

    def remove(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


class FakeEndpoint(Endpoint):
    """An RC queue pair between two processes: writes are memmoves into the peer's mapped regions."""

    def __init__(self, nic: "FakeNic", index: int, send_depth: int, recv_depth: int) -> None:
        self.nic = nic
        self.index = index
        self.send_depth, self.recv_depth = send_depth, recv_depth
        size = _QP_WORDS * 8 + recv_depth * 8
        self._file = _Mapped(f"{nic.prefix}{nic.owner}-qp{index}", size, create=True)
        self._words = self._file.view[: _QP_WORDS * 8].cast("Q")
        self._slots = self._file.view[_QP_WORDS * 8 :].cast("I")
        self._polled = 0  # arrivals turned into completions
        self._posted = 0
        # completions of our writes, returned by the next poll, with a checksum of each write's source
        self._done: deque[tuple[Completion, int, int, int]] = deque()
        self._error: Optional[str] = None
        self._remote: Optional[dict] = None
        self._peer_qp: Optional[_Mapped] = None
        self._peer_words: Optional[memoryview] = None
        self._peer_slots: Optional[memoryview] = None
        self._regions: dict[int, tuple[_Mapped, int, int, int]] = {}  # rkey -> (mapping, base, length, data address)
        self._checked = time.monotonic()
        self.closed = False

    def address(self) -> dict:
        return {"pid": os.getpid(), "owner": self.nic.owner, "qpn": self.index, "psn": random.getrandbits(24), "lid": 1, "gid": self.nic.port.gid}

    def connect(self, remote: dict) -> None:
        self._remote = remote
        self._peer_qp = _Mapped(f"{self.nic.prefix}{remote['owner']}-qp{remote['qpn']}")
        self._peer_words = self._peer_qp.view[: _QP_WORDS * 8].cast("Q")
        self._peer_slots = self._peer_qp.view[_QP_WORDS * 8 :].cast("I")

    def fail(self, why: str) -> None:
        """Put the queue pair in error (tests, and the checks below): every outstanding write completes in error."""
        if self._error is None:
            self._error = why
            self._done = deque((c._replace(ok=False, status=why), 0, 0, 0) for c, _, _, _ in self._done)

    def _remote_region(self, rkey: int) -> tuple[_Mapped, int, int, int]:
        got = self._regions.get(rkey)
        if got is None:
            assert self._remote is not None
            mapped = _Mapped(f"{self.nic.prefix}{self._remote['owner']}-mr{rkey}")
            base, length = _MR_HEADER.unpack_from(mapped.view, 0)
            got = self._regions[rkey] = (mapped, base, length, mapped.address(_PAGE))
        return got

    def post_write(self, wr_id: int, src: Region, offset: int, length: int, raddr: int, rkey: int, imm: Optional[int]) -> None:
        if self._remote is None:
            raise RuntimeError("post_write on a queue pair that is not connected")
        if len(self._done) >= self.send_depth:
            raise RuntimeError(f"send queue full ({self.send_depth} writes outstanding)")
        if self._error is None:
            self._write(src, offset, length, raddr, rkey, imm)
        ok = self._error is None
        # A device reads the source some time before the completion: a sender that changes it earlier is caught.
        crc = _checksum(src.addr + offset, length) if ok else 0
        self._done.append((Completion(wr_id, ok, status=self._error or ""), src.addr + offset, length, crc))

    def _write(self, src: Region, offset: int, length: int, raddr: int, rkey: int, imm: Optional[int]) -> None:
        assert self._peer_words is not None and self._peer_slots is not None
        if self._peer_words[_CLOSED]:
            self.fail("remote queue pair destroyed (transport retry counter exceeded)")
            return
        try:
            _, base, size, data = self._remote_region(rkey)
        except (OSError, ValueError, struct.error):
            self.fail(f"remote access error: no region with rkey {rkey}")
            return
        if raddr < base or raddr + length > base + size or offset < 0 or offset + length > src.length:
            self.fail(f"remote access error: [{raddr:#x}, +{length}) is outside region {rkey} [{base:#x}, +{size})")
            return
        if imm is not None:
            arrived = self._peer_words[_ARRIVED]
            if self._peer_words[_POSTED] <= arrived:
                self.fail("receiver not ready: a write with immediate found no posted receive (RNR retry exceeded)")
                return
        if length:
            ctypes.memmove(data + (raddr - base), src.addr + offset, length)
        if imm is not None:
            slot = (arrived % self.recv_depth) * 2
            self._peer_slots[slot] = imm
            self._peer_slots[slot + 1] = length
            self._peer_words[_ARRIVED] = arrived + 1  # published after the bytes and the slot

    def post_recv(self, count: int) -> None:
        if self._posted - self._polled + count > self.recv_depth:
            raise RuntimeError(f"receive queue full ({self.recv_depth})")
        self._posted += count
        self._words[_POSTED] = self._posted

    def poll(self, max_entries: int) -> list[Completion]:
        out: list[Completion] = []
        if self._done and self._error is None and self._remote is not None:
            now = time.monotonic()
            if now - self._checked > _LIVENESS_S:
                self._checked = now
                if not _process_alive(int(self._remote["pid"])):
                    self.fail(f"transport retry counter exceeded (pid {self._remote['pid']} is gone)")
        while self._done and len(out) < max_entries:
            c, addr, length, crc = self._done.popleft()
            if c.ok and _checksum(addr, length) != crc:
                c = c._replace(ok=False, status="local protection error: the write's source changed before its completion")
            out.append(c)
        arrived = self._words[_ARRIVED]
        while self._polled < arrived and len(out) < max_entries:
            slot = (self._polled % self.recv_depth) * 2
            out.append(Completion(0, True, recv=True, imm=self._slots[slot], nbytes=self._slots[slot + 1]))
            self._polled += 1
        return out

    def error(self) -> Optional[str]:
        if self._error is None and self._remote is not None and not _process_alive(int(self._remote["pid"])):
            self.fail(f"transport retry counter exceeded (pid {self._remote['pid']} is gone)")
        return self._error

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._words[_CLOSED] = 1
        for mv in (self._words, self._slots, self._peer_words, self._peer_slots):
            if mv is not None:
                mv.release()
        for mapped in [m for m, _, _, _ in self._regions.values()] + ([self._peer_qp] if self._peer_qp else []):
            mapped.close()
        self._regions.clear()
        self._file.remove()


class FakeNic(Nic):
    """The fake port of one process: regions are files peers map, user registrations are bookkeeping."""

    def __init__(self, port: PortInfo, job_id: str) -> None:
        self.port = port
        # named like the shm transport's segments, so the launcher removes what a crashed rank left
        self.prefix = os.path.join(SHM_DIR.get(), f"pycoll-{job_id}-fakeib-")
        self._next = 0
        self.owner = f"{os.getpid()}n{next(_NICS)}"  # names this NIC's files (several may share a process)
        self._files: dict[int, _Mapped] = {}
        self._endpoints: list[FakeEndpoint] = []
        self.registered = self.deregistered = 0  # user-memory registrations (the MR cache's traffic)

    def _key(self) -> int:
        self._next += 1
        return self._next

    def alloc(self, length: int) -> Region:
        key = self._key()
        mapped = _Mapped(f"{self.prefix}{self.owner}-mr{key}", _PAGE + length, create=True)
        addr = mapped.address(_PAGE)
        _MR_HEADER.pack_into(mapped.view, 0, addr, length)
        self._files[key] = mapped
        return Region(addr, length, key, key, mapped.view[_PAGE:], handle=("alloc", key))

    def register(self, addr: int, length: int) -> Region:
        self.registered += 1
        key = self._key()
        return Region(addr, length, key, 0, None, handle=("user", key))

    def deregister(self, region: Region) -> None:
        kind, key = region.handle
        if kind == "user":
            self.deregistered += 1
            return
        mapped = self._files.pop(key, None)
        if mapped is not None:
            mapped.remove()

    def endpoint(self, send_depth: int, recv_depth: int) -> Endpoint:
        ep = FakeEndpoint(self, self._key(), send_depth, recv_depth)
        self._endpoints.append(ep)
        return ep

    def close(self) -> None:
        for ep in self._endpoints:
            ep.close()
        self._endpoints.clear()
        for mapped in self._files.values():
            mapped.remove()
        self._files.clear()


class FakeProvider(Provider):
    """One fake device with one active port; its fabric is this host (peers must share /dev/shm)."""

    name = "fake"

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices

    def ports(self) -> list[PortInfo]:
        if not os.path.isdir(SHM_DIR.get()):
            raise NoRdma(f"the fake NIC needs {SHM_DIR.get()}")
        fabric = "fake:" + _host_key()
        return [PortInfo(f"fake{i}", 1, True, "fake", lid=1, gid=f"fe80::{i + 1}", gid_index=0, fabric=fabric) for i in range(self.devices)]

    def open(self, port: PortInfo, job_id: str) -> Nic:
        return FakeNic(port, job_id)
