"""mpi4py's lowercase methods on Python objects (pickled), collective and point-to-point."""

from __future__ import annotations

import pickle
import threading
import warnings
from typing import Any, Optional, Sequence

import numpy as np

from . import ops as _ops
from .errors import InvalidArgumentError
from .p2p_protocol import ANY_SOURCE, ANY_TAG
from .request import Request
from .status import Status


_LOCK_TABLES_LOCK = threading.Lock()  # guards the creation of Comm._lock_table entries


class ObjectCalls:
    """The object methods of ``Comm`` (a mixin: ``Comm`` holds the state they use)."""

    # ---- Python objects (pickle) ---------------------------------------------------------------
    @staticmethod
    def _dumps(obj: Any) -> np.ndarray:
        return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)

    @staticmethod
    def _loads(data: np.ndarray) -> Any:
        return pickle.loads(data.tobytes()) if data.size else None  # an empty message is None (mpi4py)

    def _allgather_bytes(self, data: np.ndarray) -> list[np.ndarray]:
        sizes = np.empty(self._size, np.int64)
        self.Allgather(np.array([data.size], np.int64), sizes)
        out = np.empty(int(sizes.sum()), np.uint8)
        counts = [int(s) for s in sizes]
        displs = [int(d) for d in np.concatenate(([0], np.cumsum(sizes)[:-1]))]
        self.Allgatherv(data, [out, counts, displs])
        return [out[d : d + c] for c, d in zip(counts, displs)]

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
        with self._obj_lock("bcast"):  # as mpi4py: one thread at a time in this communicator's bcast
            data = self._dumps(obj) if self._rank == root else None
            size = np.array([data.size if data is not None else 0], np.int64)
            self.Bcast(size, root)
            if data is None:
                data = np.empty(int(size[0]), np.uint8)
            self.Bcast(data, root)
        return obj if self._rank == root else self._loads(data)

    def allgather(self, sendobj: Any) -> list[Any]:
        return [self._loads(b) for b in self._allgather_bytes(self._dumps(sendobj))]

    def allreduce(self, sendobj: Any, op: Any = _ops.SUM) -> Any:
        o = _ops.resolve(op)
        return o.reduce_objects(self.allgather(sendobj))

    def gather(self, sendobj: Any, root: int = 0) -> Optional[list[Any]]:
        root = self._check_root(root, "gather")
        data = self._dumps(sendobj)
        sizes = np.empty(self._size, np.int64) if self._rank == root else None
        self.Gather(np.array([data.size], np.int64), sizes, root)
        if self._rank != root:
            self.Gatherv(data, None, root)
            return None
        assert sizes is not None
        counts = [int(s) for s in sizes]
        out = np.empty(sum(counts), np.uint8)
        displs = [int(d) for d in np.concatenate(([0], np.cumsum(sizes)[:-1]))]
        self.Gatherv(data, [out, counts, displs], root)
        return [self._loads(out[d : d + c]) for c, d in zip(counts, displs)]

    def reduce(self, sendobj: Any, op: Any = _ops.SUM, root: int = 0) -> Any:
        o = _ops.resolve(op)
        values = self.gather(sendobj, root)
        return o.reduce_objects(values) if values is not None else None

    def scatter(self, sendobj: Optional[Sequence[Any]] = None, root: int = 0) -> Any:
        root = self._check_root(root, "scatter")
        size = np.empty(1, np.int64)
        if self._rank == root:
            if sendobj is None or len(sendobj) != self._size:
                raise InvalidArgumentError(f"scatter needs a sequence of {self._size} objects at the root", op="scatter", rank=self._rank)
            parts = [self._dumps(o) for o in sendobj]
            sizes = np.array([p.size for p in parts], np.int64)
            self.Scatter(sizes, size, root)
            self.Scatterv([np.concatenate(parts) if parts else np.empty(0, np.uint8), [int(s) for s in sizes]], np.empty(parts[root].size, np.uint8), root)
            return sendobj[root]
        self.Scatter(None, size, root)
        data = np.empty(int(size[0]), np.uint8)
        self.Scatterv(None, data, root)
        return self._loads(data)

    def alltoall(self, sendobj: Sequence[Any]) -> list[Any]:
        if len(sendobj) != self._size:
            raise InvalidArgumentError(f"alltoall needs a sequence of {self._size} objects", op="alltoall", rank=self._rank)
        parts = [self._dumps(o) for o in sendobj]
        scounts = np.array([p.size for p in parts], np.int64)
        rcounts = np.empty(self._size, np.int64)
        self.Alltoall(scounts, rcounts)
        out = np.empty(int(rcounts.sum()), np.uint8)
        send = np.concatenate(parts) if parts else np.empty(0, np.uint8)
        self.Alltoallv([send, [int(c) for c in scounts]], [out, [int(c) for c in rcounts]])
        displs = np.concatenate(([0], np.cumsum(rcounts)[:-1]))
        return [self._loads(out[int(d) : int(d) + int(c)]) for c, d in zip(rcounts, displs)]

    def barrier(self) -> None:
        self.Barrier()

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        self._p2p_wait(self._isend_array(self._dumps(obj), dest, tag, "send"))

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        return self._p2p_request(self._isend_array(self._dumps(obj), dest, tag, "isend"))

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
        return self._p2p_request(self._irecv_array(None, source, tag, "recv"), True, self._loads).wait(status)

    def irecv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        return self._p2p_request(self._irecv_array(None, source, tag, "irecv"), True, self._loads)

    def sendrecv(
        self, sendobj: Any, dest: int, sendtag: int = 0, recvbuf: Any = None, source: int = ANY_SOURCE, recvtag: int = ANY_TAG, status: Optional[Status] = None
    ) -> Any:
        rreq = self.irecv(None, source, recvtag)
        self.isend(sendobj, dest, sendtag).Wait()
        return rreq.wait(status)

