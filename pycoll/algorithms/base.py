"""What every algorithm sees: the call it serves (Call) and the verbs it may use (Steps)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Generator, Optional

import numpy as np

from ..config import size_param
from ..memory import MemoryBackend
from ..ops import Op
from ..p2p import Engine, Owner, Request, Sig

CHUNK_SIZE = size_param(
    "PYCOLL_CHUNK_SIZE", 512 << 10, "Bytes per pipelined chunk: algorithms cut each block into chunks of at most this size."
)

# A schedule is a generator that yields the requests it must wait for before its next step.
Schedule = Generator[tuple, None, None]


@dataclass
class Call:
    """One collective call, resolved: flat arrays over user memory, counts in elements."""

    coll: str  # allreduce, reduce_scatter, allgather, broadcast, reduce, alltoall, gather, scatter, barrier
    dtype: np.dtype
    send: Optional[np.ndarray] = None  # this rank's input (for in-place calls: a view of the input inside recv)
    recv: Optional[np.ndarray] = None  # this rank's output (None where MPI says it is not significant)
    op: Optional[Op] = None
    root: int = 0
    counts: list[int] = field(default_factory=list)  # per-rank block sizes (vector collectives)
    displs: list[int] = field(default_factory=list)  # per-rank block offsets into recv (or send for scatter)
    send_counts: list[int] = field(default_factory=list)  # alltoall(v): per-destination counts in send
    send_displs: list[int] = field(default_factory=list)
    in_place: bool = False

    @property
    def nbytes(self) -> int:
        """The message size selection uses: bytes of the largest user buffer on this rank."""
        sizes = [a.nbytes for a in (self.send, self.recv) if a is not None]
        return max(sizes, default=0)


def even_counts(n: int, parts: int) -> list[int]:
    """Split ``n`` elements into ``parts`` blocks whose sizes differ by at most one."""
    q, rem = divmod(n, parts)
    return [q + (i < rem) for i in range(parts)]


def offsets(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def split(arr: np.ndarray, parts: int) -> list[np.ndarray]:
    """``parts`` consecutive views of ``arr`` of near-equal size (some may be empty)."""
    return [arr[o : o + c] for o, c in zip(offsets(even_counts(arr.shape[0], parts)), even_counts(arr.shape[0], parts))]


class Steps:
    """The verbs of one collective call. Peers are ranks of the communicator; the engine sees world ranks."""

    def __init__(
        self,
        engine: Engine,
        rank: int,
        size: int,
        world: list[int],
        ctx: int,
        tag: int,
        sig: Sig,
        owner: Owner,
        mem: MemoryBackend,
    ) -> None:
        self.engine = engine
        self.rank = rank
        self.size = size
        self._world = world
        self._ctx = ctx
        self._tag = tag
        self._sig = sig
        self._owner = owner
        self.mem = mem
        self.chunk_bytes = max(CHUNK_SIZE.get(), 64)

    @property
    def owner(self) -> Owner:
        return self._owner

    def send(self, peer: int, arr: np.ndarray, sig: Optional[Sig] = None) -> Request:
        """Send ``arr`` to ``peer``; the request completes once the bytes are out of ``arr``."""
        return self.engine.isend(self._world[peer], arr, self._ctx, self._tag, sig or self._sig, self._owner)

    def recv(self, peer: int, arr: np.ndarray, sig: Optional[Sig] = None) -> Request:
        """Receive exactly ``arr.nbytes`` bytes from ``peer`` into ``arr``."""
        return self.engine.irecv(self._world[peer], arr, self._ctx, self._tag, sig or self._sig, self._owner)

    def recv_reduce(self, peer: int, local: np.ndarray, out: np.ndarray, op: Op) -> Request:
        """Receive from ``peer`` and write ``out = op(local, incoming)`` as bytes arrive (no staging array)."""
        return self.engine.irecv(
            self._world[peer], out, self._ctx, self._tag, self._sig, self._owner, local=local, ufunc=op.ufunc
        )

    def num_chunks(self, largest_block_bytes: int) -> int:
        """How many chunks every block is cut into, so that chunk k exists in every block."""
        return max(1, math.ceil(largest_block_bytes / self.chunk_bytes))
