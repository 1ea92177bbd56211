"""Shared-memory transport: single-producer/single-consumer byte rings in /dev/shm between ranks of one host."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from typing import Any, Optional

from ..config import SHM_DIR, bool_param, size_param
from ..errors import PeerFailureError
from .base import Barrier, Channel, PeerInfo, Transport
from .futex import Futex, raise_flag

SHM_DISABLE = bool_param("PYCOLL_SHM_DISABLE", False, "Set to 1 to turn the shared-memory transport off (ranks of one host then use TCP).")
SHM_BUFFER = size_param(
    "PYCOLL_SHM_BUFFER", 4 << 20, "Bytes of each shared-memory ring (one per ordered pair of ranks on a host); rounded up to 4 KiB."
)

# Ring header: four 64-byte lines so the two writers never share a cache line, then the split table: one 64-byte
# slot per rendezvous in flight (by its id modulo the slots), where the sender and the receiver of a large message
# claim its chunks (pycoll.p2p_kernels: the receiver pulls from the front, the sender pushes from the back).
_TAIL, _HEAD, _SENDER_STATE, _RECEIVER_STATE = 0, 64, 128, 192
SPLIT_TABLE, SPLIT_SLOTS, SPLIT_SLOT_BYTES = 256, 64, 64
_HEADER = SPLIT_TABLE + SPLIT_SLOTS * SPLIT_SLOT_BYTES
_OPEN, _CLOSED = 0, 1
_UNKNOWN, _CAN_PULL, _CANNOT_PULL = 0, 1, 2  # receiver_state[1]: can the receiver read the sender's memory?


# Each segment's doorbell: in ring 0's receiver line, word 4 says "its owner sleeps", word 5 is the futex word.
_BELL = _RECEIVER_STATE + 32


class Doorbell:
    """The futex word of one rank's segment: that rank sleeps on it, its senders wake it after writing or reading."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self._flag = memoryview(mapping)[_BELL : _BELL + 8].cast("Q")
        self._cell = ctypes.c_uint32.from_buffer(mapping, _BELL + 8)
        self._futex = Futex(ctypes.addressof(self._cell))
        self.flag_address = ctypes.addressof(self._cell) - 8  # the flag word, for compiled code
        self._released = False

    def wake(self) -> None:
        """Wake the owner if it sleeps (one shared-memory read when it does not)."""
        if self._flag[0]:
            self._cell.value = (self._cell.value + 1) & 0xFFFFFFFF
            self._futex.wake()

    def sleep(self, seconds: float, ready) -> None:
        """Block at most ``seconds`` unless ``ready()``; a peer's write or read into our rings ends it early."""
        if self._released:  # its segment is gone (every channel closed): a plain nap
            time.sleep(seconds)
            return
        seen = self._cell.value
        raise_flag(self.flag_address)  # with a barrier: wakers bump the word only when they see the flag
        try:
            if not ready():
                self._futex.wait(seen, seconds)
        finally:
            self._flag[0] = 0

    def release(self) -> None:
        self._released = True
        try:
            self._flag.release()
        except BufferError:
            pass
        del self._cell


def segment_path(job_id: str, rank: int) -> str:
    return os.path.join(SHM_DIR.get(), f"pycoll-{job_id}-{rank}")


def _process_alive(pid: int) -> bool:
    """False if ``pid`` has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True


class _Ring:
    """One ring inside a mapped segment: counters in the header, data after it."""

    def __init__(self, mem: memoryview, offset: int, capacity: int) -> None:
        self.capacity = capacity
        header = mem[offset : offset + _HEADER]
        self.tail = header[_TAIL : _TAIL + 8].cast("Q")
        self.head = header[_HEAD : _HEAD + 8].cast("Q")
        self.sender_state = header[_SENDER_STATE : _SENDER_STATE + 64].cast("Q")  # [0] open/closed, [1:3] probe
        self.receiver_state = header[_RECEIVER_STATE : _RECEIVER_STATE + 64].cast("Q")  # [0] open/closed, [1] pull
        self.data = mem[offset + _HEADER : offset + _HEADER + capacity]
        self.header = header

    def release(self) -> None:
        for mv in (self.tail, self.head, self.sender_state, self.receiver_state, self.data, self.header):
            try:
                mv.release()
            except BufferError:  # an array still views it; the mapping goes away with the process
                pass


class ShmChannel(Channel):
    """Sends into the ring that lives in the peer's segment; receives from the ring in our own."""

    kind = "shm"

    def __init__(self, peer: int, peer_pid: int, out_ring: _Ring, in_ring: _Ring, owner: "ShmTransport",
                 bell: Optional[Doorbell] = None, peer_bell: Optional[Doorbell] = None) -> None:
        super().__init__(peer)
        self.bell = bell  # ours (shared by all our inbound rings): the engine sleeps on it
        self._peer_bell = peer_bell  # the peer's: rung after we write to it or free space it waits for
        self.peer_pid = peer_pid
        self._out = out_ring
        self._in = in_ring
        self._owner = owner
        # The counts live in the rings only (compiled code moves them too): our tail in the outbound ring, our head
        # in the inbound one; only this process writes either.
        self._tails = out_ring.tail
        self._heads = in_ring.head
        self._peer_head = out_ring.head[0]  # the peer's consumed count when last read (re-read only when short of room)
        self._closed = False
        self._flow_lane: Optional[tuple] = None  # lane_addresses, for exchanges in C (``flow``)

    def send_some(self, data: memoryview) -> int:
        ring = self._out
        cap = ring.capacity
        tail = self._tails[0]
        free = cap - (tail - ring.head[0])
        n = min(free, len(data))
        if n <= 0:
            if ring.receiver_state[0] == _CLOSED:
                raise PeerFailureError(f"rank {self.peer} closed its shared-memory channel", peers=[self.peer])
            return 0
        pos = tail % cap
        first = min(n, cap - pos)
        ring.data[pos : pos + first] = data[:first]
        if n > first:
            ring.data[: n - first] = data[first:n]
        self._tails[0] = tail + n  # publish after the bytes are in place
        if self._peer_bell is not None:
            self._peer_bell.wake()
        return n

    def reserve(self, n: int) -> Optional[memoryview]:
        """``n`` contiguous free bytes of the outbound ring to fill in place (then ``commit``), or None."""
        ring = self._out
        cap = ring.capacity
        tail = self._tails[0]
        pos = tail % cap
        if pos + n > cap:
            return None
        if cap - (tail - self._peer_head) < n:  # the peer's line is read only when the last reading is short
            self._peer_head = ring.head[0]
            if cap - (tail - self._peer_head) < n:
                return None
        return ring.data[pos : pos + n]

    def put_frame(self, pack_into: Any, header: tuple, payload: memoryview, at: int, total: int) -> bool:
        """Write one frame of ``total`` bytes in place and publish it: ``pack_into(ring, offset, *header)`` writes
        the header, ``payload`` goes ``at`` bytes after it; False, with nothing written, unless it fits whole."""
        ring = self._out
        cap = ring.capacity
        tail = self._tails[0]
        pos = tail % cap
        if pos + total > cap:
            return False
        if cap - (tail - self._peer_head) < total:
            self._peer_head = ring.head[0]
            if cap - (tail - self._peer_head) < total:
                return False
        data = ring.data
        pack_into(data, pos, *header)
        n = len(payload)
        if n:
            data[pos + at : pos + at + n] = payload
        self._tails[0] = tail + total
        bell = self._peer_bell
        if bell is not None and bell._flag[0]:
            bell.wake()
        return True

    def kernel_lane(self) -> tuple:
        """The rings as compiled code takes them: (data bytes, data as 64-bit words, header words) of the outbound
        ring, then of the inbound one; pair with ``tail``/``published`` and ``head``/``consumed``."""
        import numpy as np

        rings = []
        for ring in (self._out, self._in):
            data = np.frombuffer(ring.data, np.uint8)
            rings += [data, data.view(np.uint64), np.frombuffer(ring.header, np.uint64)]
        return tuple(rings)

    def lane_addresses(self) -> tuple[int, int, int, int, int, int, int]:
        """The rings as compiled code addresses them: (data, capacity, header) of the outbound ring, of the inbound
        one, then the address of the peer's doorbell flag (0: none); the writer's count is at a header's byte 0,
        the reader's at byte 64."""
        import numpy as np

        out = []
        for ring in (self._out, self._in):
            out += [np.frombuffer(ring.data, np.uint8).ctypes.data, ring.capacity,
                    np.frombuffer(ring.header, np.uint8).ctypes.data]
        bell = self._peer_bell
        out.append(bell.flag_address if bell is not None else 0)
        return tuple(out)  # type: ignore[return-value]

    def flow(self, head_out: Optional[bytes], out: Any, head_in: Optional[bytes], into: Any) -> tuple:
        """This channel's part of a C exchange beside sockets (``_tcpframe.exchange``; ``TcpChannel.flow``): its
        outgoing frame written into the peer's ring as room allows, the incoming one whose header is exactly
        ``head_in`` read out of ours straight into ``into``. The caller holds the engine's lock; the channel is open."""
        return (-1, self.block_part()[2], 0, 0, head_out, out, head_in, into)

    def settle(self, start: int, end: int) -> None:
        """After an exchange: the rings' counts moved in place, and nothing is staged here."""

    def block_part(self) -> tuple:
        """This channel's fixed part of an ``exchange_blocks`` flow (``TcpChannel.block_part``): no channel or
        descriptor, its rings as compiled code addresses them."""
        lane = self._flow_lane
        if lane is None:
            lane = self._flow_lane = self.lane_addresses()
        return (None, -1, lane)

    @property
    def tail(self) -> int:
        return self._tails[0]

    @property
    def head(self) -> int:
        return self._heads[0]

    def published(self, tail: int) -> None:
        """Compiled code wrote frames up to ``tail`` and stored it in the ring: wake a sleeping peer."""
        bell = self._peer_bell
        if bell is not None and bell._flag[0]:
            bell.wake()

    def consumed(self, head: int) -> None:
        """Compiled code consumed up to ``head`` and stored it in the ring: wake a sleeping peer."""
        bell = self._peer_bell
        if bell is not None and bell._flag[0]:
            bell.wake()

    def commit(self, n: int) -> None:
        """Publish ``n`` bytes written into the slot ``reserve`` gave."""
        self._tails[0] += n
        if self._peer_bell is not None:
            self._peer_bell.wake()

    @property
    def capacity(self) -> int:
        """Bytes of each of the channel's two rings."""
        return self._out.capacity

    def has_input(self) -> bool:
        """Cheap test for unread bytes (a closed channel shows in ``check_alive``); False once this end is closed
        (its rings are unmapped then)."""
        return not self._closed and self._in.tail[0] != self._heads[0]

    def peer_can_pull(self) -> Optional[bool]:
        """Whether the peer can read this process's memory by cross-memory attach (None: it has not checked yet)."""
        if self._closed:
            return False
        v = self._out.receiver_state[1]
        return None if v == _UNKNOWN else v == _CAN_PULL

    def peek(self, want: int = 0) -> memoryview:
        ring = self._in
        head = self._heads[0]
        avail = ring.tail[0] - head
        if avail == 0:
            if ring.sender_state[0] == _CLOSED:
                raise PeerFailureError(f"rank {self.peer} closed its shared-memory channel", peers=[self.peer])
            return ring.data[:0]
        pos = head % ring.capacity
        return ring.data[pos : pos + min(avail, ring.capacity - pos)]

    def consume(self, n: int) -> None:
        self._heads[0] += n
        if self._peer_bell is not None:
            self._peer_bell.wake()

    def _check_pull(self) -> None:
        """Read the peer's probe word by cross-memory attach; tell the peer (in our inbound ring) whether it worked."""
        from .cma import CrossMemory

        addr, expect = int(self._in.sender_state[1]), int(self._in.sender_state[2])
        cma = CrossMemory()
        reason = cma.probe(self.peer_pid, addr, expect.to_bytes(8, "little")) if addr else "the peer published no probe word"
        self._in.receiver_state[1] = _CAN_PULL if reason is None else _CANNOT_PULL

    @property
    def closed_by_peer(self) -> bool:
        """The peer closed this channel itself (a normal shutdown), rather than dying."""
        return bool(self._in.sender_state[0] == _CLOSED or self._out.receiver_state[0] == _CLOSED)

    def check_alive(self) -> Optional[str]:
        if self._in.sender_state[0] == _CLOSED or self._out.receiver_state[0] == _CLOSED:
            return f"rank {self.peer} closed its shared-memory channel"
        if not _process_alive(self.peer_pid):
            return f"rank {self.peer} (pid {self.peer_pid}) exited"
        return None

    def has_pending_output(self) -> bool:
        return not self._closed and self._out.head[0] != self._tails[0]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._out.sender_state[0] = _CLOSED
        self._in.receiver_state[0] = _CLOSED
        self._out.release()
        self._in.release()
        if self._peer_bell is not None:
            self._peer_bell.release()
            self._peer_bell = None
        self._owner._channel_closed()


class _Segment:
    """A mapped file in /dev/shm holding this rank's inbound rings, one per same-host peer."""

    def __init__(self, path: str, size: int, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.view = memoryview(self.mmap)

    def close(self) -> None:
        try:
            self.view.release()
            self.mmap.close()
        except BufferError:  # a ring view is still alive somewhere; the mapping goes with the process
            pass


class ShmTransport(Transport):
    """Each rank creates one segment with an inbound ring per local peer; peers map it, then it is unlinked."""

    name = "shm"

    def __init__(self) -> None:
        self.capacity = (max(SHM_BUFFER.get(), 4096) + 4095) // 4096 * 4096
        self._segments: list[_Segment] = []
        self._open_channels = 0
        self._bell: Optional[Doorbell] = None
        self._probe = ctypes.c_uint64(int.from_bytes(os.urandom(8), "little") | 1)  # read by peers over CMA

    def enabled(self) -> bool:
        return not SHM_DISABLE.get() and os.path.isdir(SHM_DIR.get())

    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        return me.rank != peer.rank and me.host_id == peer.host_id

    def _ring_offset(self, index: int) -> int:
        return index * (_HEADER + self.capacity)

    def connect(
        self, me: PeerInfo, peers: list[PeerInfo], job_id: str, barrier: Barrier, timeout: float
    ) -> dict[int, Channel]:
        # Ring k of rank r's segment receives from r's k-th local peer (sorted by rank).
        own_path = segment_path(job_id, me.rank)
        own: Optional[_Segment] = None
        channels: dict[int, Channel] = {}
        try:
            if peers:
                own = _Segment(own_path, self._ring_offset(len(peers)), create=True)
                self._segments.append(own)
            barrier("shm-created")
            for index, peer in enumerate(sorted(peers, key=lambda p: p.rank)):
                theirs = _Segment(segment_path(job_id, peer.rank), self._ring_offset(len(peers)), create=False)
                self._segments.append(theirs)
                # The peer's local peers are the same group with it swapped for us.
                group = sorted([p.rank for p in peers if p.rank != peer.rank] + [me.rank])
                out_ring = _Ring(theirs.view, self._ring_offset(group.index(me.rank)), self.capacity)
                in_ring = _Ring(own.view, self._ring_offset(index), self.capacity)  # type: ignore[union-attr]
                if self._bell is None:
                    self._bell = Doorbell(own.mmap)  # type: ignore[union-attr]
                channels[peer.rank] = ShmChannel(peer.rank, peer.pid, out_ring, in_ring, self, self._bell, Doorbell(theirs.mmap))
            self._open_channels = len(channels)
            for ch in channels.values():  # a word of ours the peer reads to see whether cross-memory attach works
                ch._out.sender_state[1] = ctypes.addressof(self._probe)  # type: ignore[attr-defined]
                ch._out.sender_state[2] = self._probe.value  # type: ignore[attr-defined]
            barrier("shm-attached")
            for ch in channels.values():
                ch._check_pull()  # type: ignore[attr-defined]
        except BaseException:
            # Set-up failed (a peer may have died between creating its segment and unlinking it): clear every
            # name of this job's host group, so that nothing outlives the job.
            for peer in peers:
                try:
                    os.unlink(segment_path(job_id, peer.rank))
                except OSError:
                    pass
            raise
        finally:
            # Every peer has mapped it (or set-up failed): the name is no longer needed, so nothing can leak.
            if own is not None:
                try:
                    os.unlink(own_path)
                except FileNotFoundError:
                    pass
        return channels

    def _channel_closed(self) -> None:
        self._open_channels -= 1
        if self._open_channels <= 0:
            self.close()

    def close(self) -> None:
        if self._bell is not None:
            self._bell.release()
            self._bell = None
        for seg in self._segments:
            seg.close()
        self._segments.clear()
