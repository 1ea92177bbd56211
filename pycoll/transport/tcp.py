"""TCP transport: one non-blocking stream socket per pair of ranks, for ranks on different hosts."""

from __future__ import annotations

import errno
import socket
import struct
import time
from typing import Any, Optional

from ..config import size_param, str_param
from ..errors import PeerFailureError, TimeoutError
from .base import Barrier, Channel, PeerInfo, Transport

SOCKET_ADDR = str_param(
    "PYCOLL_SOCKET_ADDR",
    "",
    "IP address the TCP transport listens on; default: the local address this rank used to reach the bootstrap store.",
)
SOCKET_BUFFER = size_param("PYCOLL_SOCKET_BUFFER", 4 << 20, "SO_SNDBUF/SO_RCVBUF of each TCP connection (the kernel may cap it).")

_HANDSHAKE = struct.Struct("<16sI")  # job id (uuid bytes), connecting rank
_STAGING = 1 << 18


def _job_bytes(job_id: str) -> bytes:
    raw = job_id.encode()
    try:
        raw = bytes.fromhex(job_id)
    except ValueError:
        pass
    return raw[:16].ljust(16, b"\0")


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    size = SOCKET_BUFFER.get()
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, size)
        except OSError:
            pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("connection closed during handshake")
        data += chunk
    return bytes(data)


class TcpChannel(Channel):
    """A connected non-blocking socket with a small staging area for zero-copy-style peeks."""

    kind = "tcp"

    def __init__(self, peer: int, sock: socket.socket) -> None:
        super().__init__(peer)
        sock.setblocking(False)
        self.sock = sock
        self._stage = bytearray(_STAGING)
        self._view = memoryview(self._stage)
        self._start = 0
        self._end = 0
        self._fd = sock.fileno()

    def _failed(self, exc: BaseException) -> PeerFailureError:
        return PeerFailureError(f"connection to rank {self.peer} failed: {exc}", peers=[self.peer])

    def send_some(self, data: memoryview) -> int:
        try:
            return self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            raise self._failed(exc) from None

    def _fill(self, out: memoryview) -> int:
        try:
            n = self.sock.recv_into(out)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            raise self._failed(exc) from None
        if n == 0 and len(out):
            raise PeerFailureError(f"rank {self.peer} closed its TCP connection", peers=[self.peer])
        return n

    def recv_some(self, out: memoryview) -> int:
        staged = self._end - self._start
        if staged:
            n = min(staged, len(out))
            out[:n] = self._view[self._start : self._start + n]
            self.consume(n)
            return n
        return self._fill(out) if len(out) else 0

    def peek(self) -> memoryview:
        if self._end == len(self._stage) and self._start:
            left = self._end - self._start
            self._stage[:left] = self._view[self._start : self._end]
            self._start, self._end = 0, left
        if self._end < len(self._stage):
            self._end += self._fill(self._view[self._end :])
        return self._view[self._start : self._end]

    def consume(self, n: int) -> None:
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0

    def fileno(self) -> Optional[int]:
        return self._fd

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class TcpTransport(Transport):
    """Rank i connects to every lower rank and accepts from every higher one."""

    name = "tcp"

    def __init__(self) -> None:
        self._listener: Optional[socket.socket] = None

    def listen(self, me: PeerInfo, store_host: str) -> Any:
        host = SOCKET_ADDR.get() or store_host or "127.0.0.1"
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(256)
        self._listener = sock
        return [host, sock.getsockname()[1]]

    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        return me.rank != peer.rank and "tcp" in peer.addresses

    def connect(
        self, me: PeerInfo, peers: list[PeerInfo], job_id: str, barrier: Barrier, timeout: float
    ) -> dict[int, Channel]:
        deadline = time.monotonic() + timeout
        token = _job_bytes(job_id)
        channels: dict[int, Channel] = {}
        lower = [p for p in peers if p.rank < me.rank]
        higher = {p.rank for p in peers if p.rank > me.rank}
        for peer in lower:
            host, port = peer.addresses["tcp"]
            sock = self._dial(host, port, deadline, peer.rank)
            sock.sendall(_HANDSHAKE.pack(token, me.rank))
            _tune(sock)
            channels[peer.rank] = TcpChannel(peer.rank, sock)
        assert self._listener is not None or not higher
        while higher:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"TCP set-up: ranks {sorted(higher)} did not connect within {timeout:.0f} s",
                    op="init",
                    rank=me.rank,
                    peers=sorted(higher),
                )
            self._listener.settimeout(left)  # type: ignore[union-attr]
            try:
                sock, _ = self._listener.accept()  # type: ignore[union-attr]
            except socket.timeout:
                continue
            sock.settimeout(max(deadline - time.monotonic(), 0.1))
            try:
                got_token, rank = _HANDSHAKE.unpack(_recv_exact(sock, _HANDSHAKE.size))
            except (OSError, struct.error):
                sock.close()
                continue
            if got_token != token or rank not in higher:
                sock.close()  # a stray connection, not one of ours
                continue
            higher.discard(rank)
            _tune(sock)
            channels[rank] = TcpChannel(rank, sock)
        self.close()
        return channels

    @staticmethod
    def _dial(host: str, port: int, deadline: float, rank: int) -> socket.socket:
        delay = 0.01
        while True:
            try:
                return socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.1))
            except OSError as exc:
                if time.monotonic() + delay > deadline or exc.errno not in (errno.ECONNREFUSED, errno.EAGAIN, None):
                    raise PeerFailureError(f"cannot connect to rank {rank} at {host}:{port}: {exc}", op="init", peers=[rank]) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
