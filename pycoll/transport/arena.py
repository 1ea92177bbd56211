"""The host arena: one shared segment per single-host communicator, with flags, small data slots and a futex doorbell.

Collectives on it skip the byte streams: a rank posts its call (signature and buffer addresses) in its
control lines, then peers read small payloads from its slots or large ones straight from its memory by
cross-memory attach. Only the owner writes its lines; x86's store order makes a flag visible after the
bytes written before it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from ..config import size_param
from ..machine import oversubscribed
from .cma import CrossMemory
from .futex import Futex, raise_flag

ARENA_SLOT = size_param(
    "PYCOLL_ARENA_SLOT", 64 << 10,
    "Bytes of each rank's shared slots for small collectives (one-shot allreduce and kin); unset, 64 KiB, and up to "
    "1 MiB where a host's ranks outnumber its cores.",
)
# Ranks that outnumber cores meet as seldom as they can: every meeting waits for a descheduled peer, a trip through
# the scheduler (about 150 us), so there the one-meeting algorithms take messages up to this size (4 ranks on 2 cores,
# 256 KiB Allreduce: one-shot 259 us, cross-memory attach with its three meetings 973 us). Pages are touched only as used.
OVERSUBSCRIBED_SLOT = 1 << 20
ARENA_STAGE = size_param(
    "PYCOLL_ARENA_STAGE", 4 << 20, "Bytes of each rank's staging area: the chunk ring of the staged (pipelined) allreduce, reduce-scatter, allgather and broadcast."
)

_MAGIC = 0x70C0A1E4A
_PAGE = 4096
HEADER_WORDS = _PAGE // 8
BELL_BYTE = 128  # u32 futex word in the header's third cache line
# Header word: nonzero where the host's ranks outnumber its cores. There ranks sleep on the doorbell call after call,
# and every post bumps its word (a sleeper's flag is then a plain store); elsewhere a post bumps it only for a
# sleeper it sees, and a sleeper raises its flag with a barrier (``futex.raise_flag``: a system call per sleep).
RING_ALWAYS = 2
CTRL_WORDS = 256  # 2 KiB of control lines per rank
# Words of a rank's control block: line 0 identity, line 1 progress, then one 128-byte line per slot parity.
PID, PROBE, PROBE_VALUE, ATTACHED = 0, 1, 2, 3
DONE = 8
# Per parity, three lines: the call's arguments, then POST and READY on lines of their own, so a peer
# spinning on a flag never pulls the line that is being written word by word.
_SLOT_LINE = 24
KIND, ROOT, COUNT, VHASH, SEND, RECV, NBYTES, SEQ = range(8)


def slot_bytes_for(size: int) -> int:
    """The arena slot of a ``size``-rank communicator on one host: PYCOLL_ARENA_SLOT if set, else 64 KiB, or where the
    machine's ranks outnumber its cores (pycoll.machine), ``shared_core_slot_bytes``. The same on every rank of the
    host."""
    if ARENA_SLOT.is_set() or not oversubscribed(size):
        return ARENA_SLOT.get()
    return shared_core_slot_bytes(size)


def shared_core_slot_bytes(size: int) -> int:
    """The arena slot of a ``size``-rank communicator on a host whose ranks outnumber its cores: up to
    OVERSUBSCRIBED_SLOT (4 MiB over the ranks), at least PYCOLL_ARENA_SLOT. It depends on ``size`` alone, so ranks on
    other machines compute the same."""
    return max(ARENA_SLOT.get(), min(OVERSUBSCRIBED_SLOT, (4 << 20) // max(size, 1)))


def fold_seq(word: int, seq: int) -> int:
    """The posted VHASH word: the call's vector hash mixed with its call number, so that a post left over
    from another call of the same arguments never matches (SEQ holds the number in clear for waits)."""
    return (int(word) ^ (int(seq) * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF


POST, READY = 8, 16
# Operations whose slots and post lines are in use at once: a call that waits for no peer (a Bcast root) may run
# DEPTH - 1 calls ahead of the slowest, so ranks that share cores move several calls per time slice.
DEPTH = 4
# Chunk counters of the staged (pipelined) algorithms, one line each (monotonic over the arena's life).
STAGED = 16 + _SLOT_LINE * DEPTH
REDUCED, CONSUMED = STAGED + 8, STAGED + 16
# Set while the rank sleeps on the doorbell: read by every peer on every call, so on a line of its own that stays
# in their caches (beside DONE, which changes on every call, each read was a miss).
SLEEPING = CONSUMED + 16
_COUNTERS = {"staged": STAGED, "reduced": REDUCED, "consumed": CONSUMED, "done": DONE}


class Doorbell:
    """Sleep until a peer rings or a timeout passes: a futex on a shared word, else a short nap."""

    def __init__(self, mapping: mmap.mmap, words: memoryview, rank: int, size: int, ctrl_base: Callable[[int], int]) -> None:
        self._words = words
        self._mine = ctrl_base(rank) + SLEEPING
        self._sleepers = [ctrl_base(r) + SLEEPING for r in range(size) if r != rank]
        self._cell = ctypes.c_uint32.from_buffer(mapping, BELL_BYTE)
        self._futex = Futex(ctypes.addressof(self._cell))
        # this rank's SLEEPING word: the bell's cell sits BELL_BYTE bytes into the mapping
        self._flag_address = ctypes.addressof(self._cell) - BELL_BYTE + 8 * self._mine

    def ring(self) -> None:
        """Tell sleeping peers that something changed."""
        self._cell.value = (self._cell.value + 1) & 0xFFFFFFFF
        words = self._words
        if any(words[i] for i in self._sleepers):
            self.wake()

    def wake(self) -> None:
        """Wake every sleeper now (``ring`` without the bump, for callers that bumped the word themselves)."""
        self._futex.wake()

    def sleep(self, seconds: float, ready: Callable[[], bool]) -> None:
        """Block for at most ``seconds`` unless ``ready()`` turns true; a ring ends the sleep early."""
        seen = self._cell.value
        if self._words[RING_ALWAYS]:
            self._words[self._mine] = 1
        else:
            raise_flag(self._flag_address)  # with a barrier: wakers bump the bell only when they see the flag
        try:
            if not ready():
                self._futex.wait(seen, seconds)
        finally:
            self._words[self._mine] = 0

    def release(self) -> None:
        del self._cell


class ArenaUnavailable(Exception):
    """The arena could not be set up here (no /dev/shm, no space); callers fall back to byte streams."""


def _process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True


class HostArena:
    """One communicator's shared segment. Created by rank 0, mapped by the rest, unlinked once all have mapped it."""

    def __init__(self, path: str, rank: int, size: int, slot_bytes: int, create: bool, stage_bytes: int = 0) -> None:
        self.path, self.rank, self.size = path, rank, size
        self.slot_bytes = (max(slot_bytes, 64) + 63) // 64 * 64
        self.stage_bytes = (max(stage_bytes, 64 * size) + 4095) // 4096 * 4096 if stage_bytes else 0
        self._data_base = _PAGE + size * CTRL_WORDS * 8
        self._stage_base = self._data_base + size * DEPTH * self.slot_bytes
        total = self._stage_base + size * self.stage_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise ArenaUnavailable(f"cannot open {path}: {exc.strerror}") from None
        try:
            if create:
                os.ftruncate(fd, total)
            elif os.fstat(fd).st_size != total:
                raise ArenaUnavailable(f"{path} has {os.fstat(fd).st_size} bytes, expected {total}")
            self.mapping = mmap.mmap(fd, total)
        except OSError as exc:
            raise ArenaUnavailable(f"cannot map {path}: {exc.strerror}") from None
        finally:
            os.close(fd)
        self.words = memoryview(self.mapping).cast("Q")
        if create:
            self.words[1] = size
            self.words[RING_ALWAYS] = int(oversubscribed(size))
            self.words[0] = _MAGIC
        elif self.words[0] != _MAGIC or self.words[1] != size:
            self.close()
            raise ArenaUnavailable(f"{path} is not a {size}-rank pycoll arena")
        self.bell = Doorbell(self.mapping, self.words, rank, size, self.ctrl)
        self.cma = CrossMemory()
        self.cma_ok = False  # agreed by every rank at set-up
        self.pids: list[int] = [0] * size
        self._probe = np.frombuffer(os.urandom(8), np.uint64).copy()
        mine = self.ctrl(rank)
        self.words[mine + PID] = os.getpid()
        self.words[mine + PROBE] = self._probe.ctypes.data
        self.words[mine + PROBE_VALUE] = int(self._probe[0])
        self.words[mine + ATTACHED] = 1
        self.ops = 0  # arena operations started on this rank (the same sequence on every rank)
        self.rounds = 0  # staged rounds started on this rank (likewise)
        self.finished = 0  # arena operations this rank has completed
        self.seq = 0  # the communicator's call number of the operation being posted (see fold_seq)
        # True after an operation that did not wait for every peer (a Bcast root, a Gather leaf): the next one must
        # see every peer finish an earlier operation before it reuses that one's slots and lines (the slots kernels:
        # DEPTH back; anything else: two back, as the algorithms that alternate two buffers of their own expect)
        self.lagging = False
        self._slots = [
            [np.frombuffer(self.mapping, np.uint8, self.slot_bytes, self.slot_offset(r, k)) for k in range(DEPTH)]
            for r in range(size)
        ]
        self._views: dict[tuple, list[np.ndarray]] = {}
        self._kept: dict[tuple, Any] = {}  # ``kept``'s tables, one per key
        self.u64 = np.frombuffer(self.mapping, np.uint64)  # the same words as ``words``, for compiled code

    # ---- layout ----------------------------------------------------------------------------
    @staticmethod
    def ctrl(rank: int) -> int:
        return HEADER_WORDS + rank * CTRL_WORDS

    def line(self, rank: int, op: int) -> int:
        """First word of ``rank``'s post line for arena operation ``op``."""
        return self.ctrl(rank) + 16 + _SLOT_LINE * (op % DEPTH)

    def slot_offset(self, rank: int, index: int) -> int:
        """Where ``rank``'s slot ``index`` (0 to DEPTH - 1) starts in the mapping."""
        return self._data_base + (rank * DEPTH + index) * self.slot_bytes

    def slot(self, rank: int, op: int) -> np.ndarray:
        """``rank``'s byte slot for arena operation ``op`` (DEPTH of them in turn, so one op may lag behind others)."""
        return self._slots[rank][op % DEPTH]

    def slot_views(self, op: int, nbytes: int, dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's slot for ``op`` as ``nbytes`` of ``dtype``, in rank order; cached, as small calls repeat."""
        key = (op % DEPTH, nbytes, dtype)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 32:
                self._views.clear()
            views = self._views[key] = [self._slots[r][op % DEPTH][:nbytes].view(dtype) for r in range(self.size)]
        return views

    def kept(self, key: tuple, make: Callable[[], Any]) -> Any:
        """``make()``, made once per ``key`` on this arena: views and tables that the plans of every call shape
        share (a few per parity and dtype), so that a new shape's plan does not build them again."""
        got = self._kept.get(key)
        if got is None:
            got = self._kept[key] = make()
        return got

    def stage_offset(self, rank: int) -> int:
        """Where ``rank``'s staging area starts in the mapping (the ranks' areas follow each other)."""
        return self._stage_base + rank * self.stage_bytes

    def stage(self, rank: int) -> np.ndarray:
        """``rank``'s staging area (bytes): the ring the staged algorithms pass chunks through."""
        return np.frombuffer(self.mapping, np.uint8, self.stage_bytes, self.stage_offset(rank))

    def set_counter(self, what: str, value: int) -> None:
        self.words[self.ctrl(self.rank) + _COUNTERS[what]] = value
        self.bell.ring()

    # ---- set-up ----------------------------------------------------------------------------
    def attached(self) -> bool:
        return all(self.words[self.ctrl(r) + ATTACHED] for r in range(self.size))

    def read_pids(self) -> None:
        """Every rank's process id, from the segment (once all have mapped it)."""
        self.pids = [int(self.words[self.ctrl(r) + PID]) for r in range(self.size)]

    def probe_peers(self, ranks: Iterable[int]) -> Optional[str]:
        """Check cross-memory attach to ``ranks`` (each has mapped the segment); None if it works with all of them,
        else why not."""
        if not self.cma.loaded:
            return self.cma.reason
        for r in ranks:
            if r == self.rank:
                continue
            # The peer's probe word lives in its private memory; its value is in the segment.
            expect = int(self.words[self.ctrl(r) + PROBE_VALUE]).to_bytes(8, "little")
            why = self.cma.probe(int(self.words[self.ctrl(r) + PID]), int(self.words[self.ctrl(r) + PROBE]), expect)
            if why is not None:
                return f"rank {r}: {why}"
        return None

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # ---- posting and progress ----------------------------------------------------------------
    def post(self, op: int, sig: Sequence[int], send_addr: int = 0, recv_addr: int = 0, nbytes: int = 0) -> None:
        """Publish this rank's arguments for arena operation ``op`` (the POST word last)."""
        w, base = self.words, self.line(self.rank, op)
        w[base + KIND], w[base + ROOT], w[base + COUNT] = sig[0], sig[1], sig[2]
        w[base + VHASH] = fold_seq(sig[3], self.seq)
        w[base + SEND], w[base + RECV], w[base + NBYTES], w[base + SEQ] = send_addr, recv_addr, nbytes, self.seq
        w[base + POST] = op  # x86 keeps stores in order: a peer that sees POST sees the words above
        self.bell.ring()

    def mark_seq(self, op: int) -> None:
        """Write this rank's call number for ``op`` before a kernel posts it (kernels write the other words)."""
        self.words[self.line(self.rank, op) + SEQ] = self.seq

    def posted_by_others(self, op: int, ranks: Iterable[int]) -> list[int]:
        """The ranks among ``ranks`` whose post for ``op`` belongs to another call number (left over)."""
        w = self.words
        return [r for r in ranks if w[self.line(r, op) + SEQ] != self.seq]

    def set_ready(self, op: int) -> None:
        self.words[self.line(self.rank, op) + READY] = op
        self.bell.ring()

    def set_done(self, op: int) -> None:
        self.words[self.ctrl(self.rank) + DONE] = op
        self.finished = op
        self.bell.ring()

    def peer_sig(self, rank: int, op: int) -> tuple[int, int, int, int]:
        w, base = self.words, self.line(rank, op)
        return (int(w[base + KIND]), int(w[base + ROOT]), int(w[base + COUNT]), int(w[base + VHASH]))

    def peer_addrs(self, rank: int, op: int) -> tuple[int, int, int]:
        w, base = self.words, self.line(rank, op)
        return int(w[base + SEND]), int(w[base + RECV]), int(w[base + NBYTES])

    def has_posted(self, rank: int, op: int) -> bool:
        """Whether ``rank`` has posted for call ``op`` (it has entered that call)."""
        return self.words[self.line(rank, op) + POST] == op

    def caught_up(self, ops: int, others: Iterable[int]) -> bool:
        """Whether the operation after ``ops`` may start: the arena is not ``lagging``, or every one of ``others``
        finished operation ``ops - 1``, whose slots and lines it reuses (the arena then stops lagging)."""
        if self.lagging:
            if self.waiting_for("done", ops - 1, others):
                return False
            self.lagging = False
        return True

    def waiting_for(self, what: str, op: int, ranks: Iterable[int]) -> list[int]:
        """The ranks among ``ranks`` not yet at ``what`` for ``op``: post and ready match exactly, counters reach it."""
        w = self.words
        if what in _COUNTERS:
            index = _COUNTERS[what]
            return [r for r in ranks if w[self.ctrl(r) + index] < op]
        index = POST if what == "post" else READY
        return [r for r in ranks if w[self.line(r, op) + index] != op]

    def dead(self, ranks: Iterable[int]) -> list[int]:
        return [r for r in ranks if self.pids[r] and not _process_alive(self.pids[r])]

    def close(self) -> None:
        bell = getattr(self, "bell", None)
        if bell is not None:
            bell.release()
        self._slots = []
        self._views = {}
        self._kept = {}
        self.u64 = None  # type: ignore[assignment]
        try:
            self.words.release()
            self.mapping.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
