"""Loopback transport: the channel from a rank to itself, an in-process byte queue."""

from __future__ import annotations

from collections import deque

from .base import Barrier, Channel, PeerInfo, Transport


class LoopbackChannel(Channel):
    """Unbounded in-memory FIFO of immutable chunks; send never refuses bytes."""

    kind = "self"

    def __init__(self, peer: int) -> None:
        super().__init__(peer)
        self._chunks: deque[bytes] = deque()
        self._offset = 0  # consumed bytes of the first chunk

    def send_some(self, data: memoryview) -> int:
        if len(data):
            self._chunks.append(bytes(data))
        return len(data)

    def has_input(self) -> bool:
        return bool(self._chunks)

    def peek(self, want: int = 0) -> memoryview:
        if not self._chunks:
            return memoryview(b"")
        return memoryview(self._chunks[0])[self._offset :]

    def consume(self, n: int) -> None:
        while n:
            left = len(self._chunks[0]) - self._offset
            step = min(n, left)
            self._offset += step
            n -= step
            if self._offset == len(self._chunks[0]):
                self._chunks.popleft()
                self._offset = 0

    def close(self) -> None:
        self._chunks.clear()
        self._offset = 0


class LoopbackTransport(Transport):
    name = "self"

    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        return me.rank == peer.rank

    def connect(
        self, me: PeerInfo, peers: list[PeerInfo], job_id: str, barrier: Barrier, timeout: float
    ) -> dict[int, Channel]:
        return {p.rank: LoopbackChannel(p.rank) for p in peers}
