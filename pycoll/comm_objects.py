"""mpi4py's lowercase methods on Python objects (pickled), collective and point-to-point."""

from __future__ import annotations

import itertools
import pickle
import threading
import warnings
from typing import Any, Optional, Sequence

import numpy as np

from . import ops as _ops
from .buffers import IN_PLACE
from .errors import InvalidArgumentError
from .p2p_protocol import ANY_SOURCE, ANY_TAG
from .request import Request
from .status import Status


_LOCK_TABLES_LOCK = threading.Lock()  # guards the creation of Comm._lock_table entries
# The object collectives' one round: each rank's pickle goes in a fixed block (two int64 header words, then the
# pickle where it fits), so every call is one collective of a shape seen before, which runs on the planned fast
# path. Each kind of call keeps its own block, the same on every rank: it starts at FIRST_BLOCK bytes, a pickle that
# does not fit grows it (``_block_for``; each rank sees the same lengths), and a call whose pickles all fit a quarter
# of it shrinks it to fit them; past the largest block (BLOCK_MAX, and no more than BLOCKS_BYTES for the blocks of all ranks) the call
# takes a second round sized to the pickles.
FIRST_BLOCK = 256
BLOCK_MAX = 256 << 10
# The gather's exchange is an Allgather (every rank learns every length): past this block the non-roots would receive
# blocks they do not need, so larger pickles go by a second round, a Gatherv
GATHER_BLOCK_MAX = 8 << 10
BLOCKS_BYTES = 8 << 20
_HEAD = 16  # the block's header: this pickle's length, then the largest length its sender knows of


def _block_for(nbytes: int) -> int:
    """The block that holds ``nbytes``: a power of two, or from 8 KiB up the next quarter step between two (5/4,
    6/4, 7/4 of one), so that a block pads a pickle by at most a quarter where padding costs copies."""
    top = 1 << (nbytes - 1).bit_length()
    if top <= 8 << 10:
        return top
    step = top // 8  # quarter steps of the power below
    return -(-nbytes // step) * step


def _offsets(lengths: list[int]) -> list[int]:
    """Where each of pickles of ``lengths`` starts, laid end to end: a sized second round's displacements."""
    return [0, *itertools.accumulate(lengths)][:-1]


def _pickles(view: memoryview, block: int, lengths: list[int]) -> list[memoryview]:
    """The pickles of ``lengths`` bytes in consecutive blocks of ``view``."""
    if len(lengths) == 1:
        return [view[_HEAD : _HEAD + lengths[0]]]
    return [view[i * block + _HEAD : i * block + _HEAD + n] for i, n in enumerate(lengths)]


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class _Blocks:
    """One size of one kind's blocks: the send and receive buffers (arrays for the collective), and the byte and
    int64 views through which Python writes and reads them."""

    __slots__ = ("block", "room", "shrink_at", "send", "recv", "sview", "rview", "sq", "rq", "lengths", "largests")

    def __init__(self, block: int, nsend: int, nrecv: int, in_place: bool) -> None:
        self.block, self.room = block, block - _HEAD
        # a call whose largest pickle is at most this shrinks the block (to a quarter or less); none below the first
        self.shrink_at = block // 4 - _HEAD if block > FIRST_BLOCK else -1
        self.send = np.zeros(nsend * block, np.uint8)
        self.recv = self.send if in_place else np.zeros(nrecv * block, np.uint8)
        self.sview, self.rview = memoryview(self.send), memoryview(self.recv)
        self.sq, self.rq = self.sview.cast("q"), self.rview.cast("q")
        words = block // 8
        self.lengths, self.largests = self.rq[::words], self.rq[1::words]


class ObjectCalls:
    """The object methods of ``Comm`` (a mixin: ``Comm`` holds the state they use)."""

    # ---- Python objects (pickle) ---------------------------------------------------------------
    @staticmethod
    def _dumps(obj: Any) -> np.ndarray:
        return np.frombuffer(_pickled(obj), np.uint8)

    @staticmethod
    def _loads(data: Any) -> Any:
        """The object pickled in ``data`` (an array or a memoryview of bytes); None for an empty message (mpi4py)."""
        return pickle.loads(data) if len(data) else None

    def _allgather_bytes(self, data: bytes) -> list[Any]:
        """Every rank's bytes (``data`` here), in rank order: an Allgather of blocks, or where a pickle outgrows
        BLOCK_MAX an Allgatherv sized by the lengths the blocks carried."""
        got, lengths = self._exchange_blocks("allgather", [data], self.Allgather, 1, self._size)
        if got is not None:
            return got
        out, displs = np.empty(sum(lengths), np.uint8), _offsets(lengths)
        self.Allgatherv(np.frombuffer(data, np.uint8), [out, lengths, displs])
        return [out[d : d + c] for c, d in zip(lengths, displs)]

    def _block_bytes(self, kind: str) -> int:
        """This communicator's block for ``kind``'s object calls (the same on every rank)."""
        blocks = self.__dict__.get("_obj_blocks", {}).get(kind)
        return blocks.block if blocks is not None else FIRST_BLOCK

    def _block_fitting(self, kind: str, seen: int) -> int:
        """The block ``kind``'s next call uses after one whose largest pickle was ``seen`` bytes, as every rank
        computes it; 0 where that is past the largest block."""
        block = self._block_bytes(kind)
        fits = max(FIRST_BLOCK, _block_for(seen + _HEAD))
        if fits > block or fits * 4 <= block:  # grown to fit, or shrunk where a quarter would have done
            largest = GATHER_BLOCK_MAX if kind == "gather" else BLOCK_MAX
            if fits > min(largest, max(FIRST_BLOCK, BLOCKS_BYTES // self._size)):
                return 0
            return fits
        return block

    def _object_blocks(self, kind: str, block: int, nsend: int, nrecv: int, in_place: bool) -> "_Blocks":
        """``kind``'s blocks of ``block`` bytes (``nsend`` to send, ``nrecv`` to receive; ``in_place``: one buffer
        for both), now the ones its calls use; each size's buffers are kept, the two used last per kind, so that a
        call of a size seen before has the same shape (and plan)."""
        cache = self.__dict__.setdefault("_obj_buffers", {})
        blocks = cache.get((kind, block))
        if blocks is None:
            held = [key for key in cache if key[0] == kind]
            for key in held[: max(len(held) - 2, 0)]:
                del cache[key]
            blocks = cache[(kind, block)] = _Blocks(block, nsend, nrecv, in_place)
        self.__dict__.setdefault("_obj_blocks", {})[kind] = blocks
        return blocks

    def _exchange_blocks(self, kind: str, parts: Sequence[bytes], exchange: Any, nsend: int, nrecv: int,
                         in_place: bool = False) -> tuple[Optional[list[memoryview]], list[int]]:
        """One block exchange of ``parts`` (this rank's pickles, one per send block; ``nsend`` blocks, none given
        where this rank sends nothing): ``exchange(send, recv)`` is the collective, after which ``recv`` holds
        ``nrecv`` blocks. Returns their pickles (views into ``recv``, to be read before the next call) and lengths.
        A pickle larger than the block makes every rank grow the block and exchange again; past BLOCK_MAX the
        pickles are None and the caller takes a second round sized by the lengths. Every rank decides alike, from
        the headers it received: each block carries its pickle's length and the largest length its sender had, and
        every exchange here gives every rank a block from every sender (``in_place``: the blocks are sent from and
        received into one buffer, a Bcast's)."""
        largest = len(parts[0]) if len(parts) == 1 else max([len(p) for p in parts]) if parts else 0
        b = self.__dict__.get("_obj_blocks", {}).get(kind)
        if b is None:
            b = self._object_blocks(kind, FIRST_BLOCK, nsend, nrecv, in_place)
        while True:
            sq, sview, block, room = b.sq, b.sview, b.block, b.room
            at = 0
            for data in parts:
                n = len(data)
                sq[at >> 3] = n
                sq[(at >> 3) + 1] = largest
                if n <= room:
                    sview[at + _HEAD : at + _HEAD + n] = data
                at += block
            exchange(b.send, b.recv)
            if nrecv == 1:
                lengths, seen = [b.rq[0]], b.rq[1]
            else:
                lengths, seen = b.lengths.tolist(), max(b.largests.tolist())
            got = b
            if not b.shrink_at < seen <= room:  # a pickle did not fit, or all would fit a quarter of the block
                fitting = self._block_fitting(kind, seen)
                if not fitting:
                    return None, lengths
                b = self._object_blocks(kind, fitting, nsend, nrecv, in_place)
                if seen > room:
                    continue  # again, in the grown block
            return _pickles(got.rview, block, lengths), lengths

    def _lock_table(self) -> dict:
        """mpi4py's per-communicator locks of the object methods, by name (``MPI._comm_lock_table``)."""
        table = self.__dict__.get("_locks")
        if table is None:
            with _LOCK_TABLES_LOCK:
                table = self.__dict__.setdefault("_locks", {})
        return table

    def _obj_lock(self, key: Any) -> Any:
        table = self._lock_table()
        lock = table.get(key)
        if lock is None:
            with _LOCK_TABLES_LOCK:
                lock = table.setdefault(key, threading.Lock())
        return lock

    def bcast(self, obj: Any = None, root: int = 0) -> Any:
        root = self._check_root(root, "bcast")
        mine = self._rank == root
        with self._obj_lock("bcast"):  # as mpi4py: one thread at a time in this communicator's bcast
            data = _pickled(obj) if mine else b""

            got, lengths = self._exchange_blocks("bcast", [data] if mine else [],
                                                 lambda send, recv: self.Bcast(recv, root), 1, 1, True)
            if got is None:  # past BLOCK_MAX: a second Bcast of the length every rank now knows
                whole = np.frombuffer(data, np.uint8) if mine else np.empty(lengths[0], np.uint8)
                self.Bcast(whole, root)
                got = [whole]
        return obj if mine else self._loads(got[0])

    def allgather(self, sendobj: Any) -> list[Any]:
        return [self._loads(b) for b in self._allgather_bytes(_pickled(sendobj))]

    def allreduce(self, sendobj: Any, op: Any = _ops.SUM) -> Any:
        o = _ops.resolve(op)
        return o.reduce_objects(self.allgather(sendobj))

    def gather(self, sendobj: Any, root: int = 0) -> Optional[list[Any]]:
        root = self._check_root(root, "gather")
        data = _pickled(sendobj)
        # an Allgather of blocks: for small pickles it costs what a Gather does, and every rank learns the
        # lengths, so all agree on a second round
        got, lengths = self._exchange_blocks("gather", [data], self.Allgather, 1, self._size)
        if got is None:
            if self._rank != root:
                self.Gatherv(np.frombuffer(data, np.uint8), None, root)
                return None
            # the root's own pickle stays where it is (in place, a block of none): one copy fewer
            counts = lengths[:]
            counts[root] = 0
            out, displs = np.empty(sum(counts), np.uint8), _offsets(counts)
            self.Gatherv(IN_PLACE, [out, counts, displs], root)
            got = [out[d : d + c] for c, d in zip(counts, displs)]
            got[root] = data
        return [self._loads(b) for b in got] if self._rank == root else None

    def reduce(self, sendobj: Any, op: Any = _ops.SUM, root: int = 0) -> Any:
        o = _ops.resolve(op)
        values = self.gather(sendobj, root)
        return o.reduce_objects(values) if values is not None else None

    def scatter(self, sendobj: Optional[Sequence[Any]] = None, root: int = 0) -> Any:
        root = self._check_root(root, "scatter")
        mine = self._rank == root
        parts: list[bytes] = []
        if mine:
            if sendobj is None or len(sendobj) != self._size:
                raise InvalidArgumentError(f"scatter needs a sequence of {self._size} objects at the root", op="scatter", rank=self._rank)
            parts = [_pickled(o) for o in sendobj]
        got, lengths = self._exchange_blocks(
            "scatter", parts, lambda send, recv: self.Scatter(send if mine else None, recv, root), self._size, 1)
        if got is not None:
            return sendobj[root] if mine else self._loads(got[0])  # type: ignore[index]
        data = np.empty(lengths[0], np.uint8)
        if mine:
            self.Scatterv([np.frombuffer(b"".join(parts), np.uint8), [len(p) for p in parts]], data, root)
            return sendobj[root]  # type: ignore[index]
        self.Scatterv(None, data, root)
        return self._loads(data)

    def alltoall(self, sendobj: Sequence[Any]) -> list[Any]:
        if len(sendobj) != self._size:
            raise InvalidArgumentError(f"alltoall needs a sequence of {self._size} objects", op="alltoall", rank=self._rank)
        parts = [_pickled(o) for o in sendobj]
        got, lengths = self._exchange_blocks("alltoall", parts, self.Alltoall, self._size, self._size)
        if got is None:
            out = np.empty(sum(lengths), np.uint8)
            self.Alltoallv([np.frombuffer(b"".join(parts), np.uint8), [len(p) for p in parts]], [out, lengths])
            got = [out[d : d + c] for c, d in zip(lengths, _offsets(lengths))]
        return [self._loads(b) for b in got]

    def barrier(self) -> None:
        self.Barrier()

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        data = _pickled(obj)
        fast = self._fast
        if fast.send_now(data, dest, tag):  # one eager frame into the peer's ring, in C
            return
        fast.lanes or fast._lanes()  # counts towards loading the kernels, which the C calls need
        self._p2p_wait(self._isend_array(np.frombuffer(data, np.uint8), dest, tag, "send"))

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        data = _pickled(obj)
        fast = self._fast
        if fast.send_now(data, dest, tag):
            return Request._finished(None)
        fast.lanes or fast._lanes()
        return self._p2p_request(self._isend_array(np.frombuffer(data, np.uint8), dest, tag, "isend"))

    def ssend(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Send an object, returning once a receive on ``dest`` matched it."""
        self._p2p_wait(self._issend_array(self._dumps(obj), dest, tag, "ssend"))

    def issend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        return self._p2p_request(self._issend_array(self._dumps(obj), dest, tag, "issend"))

    def bsend(self, obj: Any, dest: int, tag: int = 0) -> None:
        self._bsend_array(self._dumps(obj), dest, tag, "bsend", copy=False)

    def ibsend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        return self._p2p_request(self._bsend_array(self._dumps(obj), dest, tag, "ibsend", copy=False))

    def recv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> Any:
        if buf is not None:  # as mpi4py warns; pycoll sizes the receive to the message whatever buf says
            warnings.warn("recv(): the 'buf' argument is deprecated and ignored", UserWarning, stacklevel=2)
        fast = self._fast
        got = fast.take_object_now(source, tag, fast.polls)  # spinning for it as a compiled Recv does
        if got:  # the message was next in the peer's ring: taken in C
            if status is not None:
                status.source, status.tag, status.nbytes = source, got[0], got[1]
            return self._loads(got[2])
        fast.lanes or fast._lanes()
        return self._p2p_request(self._irecv_array(None, source, tag, "recv"), True, self._loads).wait(status)

    def irecv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        fast = self._fast
        got = fast.take_object_now(source, tag, 0)
        if got:
            return Request._received_object(source, got[0], got[1], self._loads(got[2]))
        fast.lanes or fast._lanes()
        return self._p2p_request(self._irecv_array(None, source, tag, "irecv"), True, self._loads)

    def sendrecv(
        self, sendobj: Any, dest: int, sendtag: int = 0, recvbuf: Any = None, source: int = ANY_SOURCE, recvtag: int = ANY_TAG, status: Optional[Status] = None
    ) -> Any:
        rreq = self.irecv(None, source, recvtag)
        self.isend(sendobj, dest, sendtag).Wait()
        return rreq.wait(status)

