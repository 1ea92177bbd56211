"""Point-to-point on mpi4py's communicator: blocking, nonblocking, synchronous, buffered and persistent sends
and receives, Sendrecv, probes and matched receives, and the buffered-mode buffers (MPI-4.1)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from . import flat_bytes
from .errors import InvalidArgumentError
from .p2p_protocol import ANY_SOURCE, ANY_TAG, P2P_SIG, PROC_NULL, TAG_MAX, Owner
from .message import MESSAGE_NO_PROC, Message
from .request import Prequest, Request
from .status import Status

if TYPE_CHECKING:  # annotations only: the mixins are bases of Comm
    from .comm import Comm


_NO_BYTES = np.empty(0, np.uint8)


def _no_data(buf: Any) -> Optional[np.ndarray]:
    """A point-to-point buffer spec that says "no data" in mpi4py's spellings (``None``, ``[None, 0, datatype]``):
    an empty buffer; else None."""
    if buf is None:
        return _NO_BYTES
    if type(buf) in (list, tuple) and 1 <= len(buf) <= 3 and buf[0] is None:
        if all(x == 0 for x in buf[1:] if isinstance(x, (int, np.integer)) and not isinstance(x, bool)):
            return _NO_BYTES
    return None


class PointToPointCalls:
    """The point-to-point methods of ``Comm`` (a mixin: ``Comm`` holds the state they use)."""

    # ---- point-to-point ------------------------------------------------------------------------
    def _peer(self, peer: int, opname: str, allow_any: bool) -> int:
        if not isinstance(peer, (int, np.integer)):  # before any comparison: an array would compare elementwise
            raise InvalidArgumentError(f"rank {peer!r} is not an integer", op=opname, rank=self._rank)
        if peer == PROC_NULL or (allow_any and peer == ANY_SOURCE):
            return int(peer)
        if not 0 <= peer < self._size:
            raise InvalidArgumentError(f"rank {peer!r} is not in this {self._size}-rank communicator", op=opname, rank=self._rank)
        return self._world[int(peer)]

    def _tag(self, tag: int, opname: str, allow_any: bool) -> int:
        if not isinstance(tag, (int, np.integer)) or (tag < 0 and not (allow_any and tag == ANY_TAG)):
            raise InvalidArgumentError(f"tag {tag!r} must be a non-negative integer", op=opname, rank=self._rank)
        if tag > TAG_MAX:
            raise InvalidArgumentError(f"tag {tag!r} is above the largest tag, {TAG_MAX}", op=opname, rank=self._rank)
        return int(tag)

    def _p2p_ready(self, opname: str) -> Owner:
        """The communicator's point-to-point base owner, after the liveness checks (cheap while nothing failed)."""
        if self._freed or self._aborted is not None or self._engine.broken_here(self._ctx):
            self._live(opname)
        try:
            return self._p2p_base
        except AttributeError:
            self._p2p_base: Owner = self._owner("point-to-point", self._ctx)
            return self._p2p_base

    def _eager_ok(self, peer: int, tag: int, any_tag: bool = False) -> bool:
        """Whether a call naming ``peer`` (a rank here) and ``tag`` (>= 0, or ANY_TAG for a receive) may take the
        engine's eager path: plain ints in range on a live communicator; anything else goes through the checks of
        the posted path."""
        return (type(peer) is int and type(tag) is int and 0 <= peer < self._size and (0 <= tag <= TAG_MAX or any_tag and tag == ANY_TAG)
                and not (self._freed or self._aborted is not None or self._engine.broken_here(self._ctx)))

    def _isend_array(self, arr: np.ndarray, dest: int, tag: int, opname: str) -> Any:
        """The engine's send request (None for PROC_NULL); arguments checked in the common case by type alone."""
        base = self._p2p_ready(opname)
        if type(dest) is int and type(tag) is int and 0 <= dest < self._size and 0 <= tag <= TAG_MAX:
            peer = self._world[dest]
        else:
            peer = self._peer(dest, opname, False)
            tag = self._tag(tag, opname, False)
            if peer == PROC_NULL:
                return None
        return self._engine.isend(peer, arr, self._ctx, tag, P2P_SIG, base.call(opname, "dest", dest, tag))

    def _irecv_array(self, arr: Optional[np.ndarray], source: int, tag: int, opname: str) -> Any:
        """The engine's receive request (None for PROC_NULL)."""
        base = self._p2p_ready(opname)
        if type(source) is int and type(tag) is int and 0 <= source < self._size and -1 <= tag <= TAG_MAX:
            peer = self._world[source]
        else:
            peer = self._peer(source, opname, True)
            tag = self._tag(tag, opname, True)
            if peer == PROC_NULL:
                return None
        return self._engine.irecv(peer, arr, self._ctx, tag, None, base.call(opname, "source", source, tag))

    def _p2p_buf(self, buf: Any, opname: str, writable: bool = False) -> np.ndarray:
        """A host buffer for point-to-point, as flat bytes; device buffers are for collectives only in this build."""
        try:
            arr = flat_bytes.parse_bytes(buf, "buf", opname, writable)
        except InvalidArgumentError as exc:
            arr = _no_data(buf)
            if arr is None:
                raise InvalidArgumentError(exc.cause, op=exc.op or opname, rank=self._rank) from None
        if arr is None:
            raise InvalidArgumentError("point-to-point calls take host buffers only; device buffers work in collectives",
                                       op=opname, rank=self._rank)
        return arr

    def _p2p_request(self, req: Any, recv: bool = False, finish: Optional[Callable] = None) -> Request:
        if req is None:
            return Request.completed(Status._of(PROC_NULL, ANY_TAG, 0) if recv else None)
        return Request(self._engine, self, p2p=req, finish=finish)

    def _p2p_wait(self, req: Any, status: Optional[Status] = None) -> None:
        """Complete a blocking call's request: wait, raise its error, fill the status."""
        if req is None:
            if status is not None:
                status._fill(Status._of(PROC_NULL, ANY_TAG, 0))
            return
        if not req.done:
            self._engine.wait_one(req, self.timeout)
        if req.error is not None:
            raise req.error
        if status is not None:
            status.source, status.tag, status.nbytes = self._to_comm[req.source], req.recv_tag, req.nbytes

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:  # noqa: N802
        fast = self._fast
        if fast.send_now(buf, dest, tag):
            return Request._finished(None)  # an eager send in C: the frame is in the peer's ring
        arr = fast.isend(buf, dest, tag)
        if arr is True:
            return Request._finished(None)  # an eager send: the frame is in the peer's ring, the buffer free again
        if type(arr) is not np.ndarray:  # a rendezvous announced: done when the peer acknowledges it
            return Request._started(self._engine, self, arr)
        if self._eager_ok(dest, tag) and self._engine.send_eager(self._world[dest], arr, self._ctx, tag):
            return Request._finished(None)  # an eager send: the frame is in the peer's ring, the buffer free again
        return self._p2p_request(self._isend_array(arr, dest, tag, "Isend"))

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:  # noqa: N802
        fast = self._fast
        if fast.send_now(buf, dest, tag):
            return
        arr = fast.send(buf, dest, tag)
        if arr is None:
            return
        if self._eager_ok(dest, tag) and self._engine.send_eager(self._world[dest], arr, self._ctx, tag):
            return
        self._p2p_wait(self._isend_array(arr, dest, tag, "Send"))

    Rsend = Send  # ready mode: the receive is posted already; pycoll does not need to know

    def Irsend(self, buf: Any, dest: int, tag: int = 0) -> Request:  # noqa: N802
        return self._p2p_request(self._isend_array(self._p2p_buf(buf, "Irsend"), dest, tag, "Irsend"))

    def _issend_array(self, arr: np.ndarray, dest: int, tag: int, opname: str) -> Any:
        """The engine's synchronous send request (None for PROC_NULL): done once the receiver matched it."""
        base = self._p2p_ready(opname)
        peer = self._peer(dest, opname, False)
        tag = self._tag(tag, opname, False)
        if peer == PROC_NULL:
            return None
        return self._engine.issend(peer, arr, self._ctx, tag, base.call(opname, "dest", dest, tag))

    def Ssend(self, buf: Any, dest: int, tag: int = 0) -> None:  # noqa: N802
        """Send, returning once a receive on ``dest`` matched the message (synchronous mode)."""
        self._p2p_wait(self._issend_array(self._p2p_buf(buf, "Ssend"), dest, tag, "Ssend"))

    def Issend(self, buf: Any, dest: int, tag: int = 0) -> Request:  # noqa: N802
        """Nonblocking synchronous send: the request completes once a receive on ``dest`` matched the message."""
        return self._p2p_request(self._issend_array(self._p2p_buf(buf, "Issend"), dest, tag, "Issend"))

    def _bsend_array(self, arr: np.ndarray, dest: int, tag: int, opname: str, copy: bool = True) -> None:
        """Buffered mode: a copy of ``arr`` leaves in the background (later calls move it; a failure shows there,
        or in Flush_buffer, which waits for the sends still under way)."""
        req = self._isend_array(arr.copy() if copy else arr, dest, tag, opname)
        if req is not None and not req.done:
            pending = self.__dict__.setdefault("_bsends", [])
            if len(pending) >= 64:
                pending[:] = [r for r in pending if not r.done]
            pending.append(req)
            _BSENDING.add(self)

    # ---- buffered-mode buffers (MPI-4.1): kept and given back; pycoll's buffered sends copy into memory of their own
    def Attach_buffer(self, buf: Any) -> None:  # noqa: N802
        """Attach a buffer for this communicator's buffered sends: writable memory (e.g. from MPI.Alloc_mem),
        or None / MPI.BUFFER_AUTOMATIC. pycoll's Bsend copies each message into memory of its own and never
        runs out of space, so the buffer is only kept, not used, until Detach_buffer gives it back."""
        self._live("Attach_buffer")
        self.__dict__["_attached"] = attach_buffer(self.__dict__.get("_attached"), buf, "Attach_buffer", self._rank)

    def Detach_buffer(self) -> Any:  # noqa: N802
        """Give back the object Attach_buffer kept (BUFFER_AUTOMATIC for automatic buffering; None if nothing
        is attached). It returns at once: no buffered message lives in the buffer (Flush_buffer waits for them)."""
        self._live("Detach_buffer")
        return self.__dict__.pop("_attached", None)

    def Flush_buffer(self) -> None:  # noqa: N802
        """Wait until every buffered send made on this communicator has left (raises the first one's error)."""
        self._live("Flush_buffer")
        self._flush_bsends()

    def Iflush_buffer(self) -> Request:  # noqa: N802
        """Flush_buffer, then a request that is already complete."""
        self.Flush_buffer()
        return Request.completed()

    def _flush_bsends(self) -> None:
        pending = self.__dict__.pop("_bsends", [])
        _BSENDING.discard(self)
        first: Optional[BaseException] = None
        for req in pending:
            if not req.done:
                try:
                    self._engine.wait_one(req, self.timeout)
                except Exception as exc:  # noqa: BLE001 - the first failure is raised once every send was waited
                    first = first or exc
            first = first or req.error
        if first is not None:
            raise first

    def Bsend(self, buf: Any, dest: int, tag: int = 0) -> None:  # noqa: N802
        """Buffered send: returns at once, the message copied (pycoll needs no attached buffer)."""
        self._bsend_array(self._p2p_buf(buf, "Bsend"), dest, tag, "Bsend")

    def Ibsend(self, buf: Any, dest: int, tag: int = 0) -> Request:  # noqa: N802
        """Nonblocking buffered send: the request is complete once the message is copied, at once."""
        return self._p2p_request(self._bsend_array(self._p2p_buf(buf, "Ibsend"), dest, tag, "Ibsend"))

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:  # noqa: N802
        fast = self._fast
        got = fast.take_now(buf, source, tag)
        if got is not None:  # the message was next in the peer's ring: taken in C
            return Request._received(source, got[0], got[1])
        arr = fast.irecv(buf, source, tag)
        if type(arr) is tuple:  # the message was next in the peer's ring: taken
            return Request._received(source, arr[0], arr[1])
        if type(arr) is not np.ndarray:  # posted in the engine
            return Request._started(self._engine, self, arr)
        if self._eager_ok(source, tag, True):  # a matching message already at the head of the peer's ring: taken now
            got = self._engine.take_now(self._world[source], arr, self._ctx, tag)
            if got is not None:
                return Request._received(source, got[1], got[0])
        return self._p2p_request(self._irecv_array(arr, source, tag, "Irecv"), True)

    def Recv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> None:  # noqa: N802
        fast = self._fast
        got = fast.take_now(buf, source, tag)
        if got is not None:  # the message was next in the peer's ring: taken in C
            if status is not None:
                status.source, status.tag, status.nbytes = source, got[0], got[1]
            return
        arr = fast.recv(buf, source, tag, status)
        if arr is None:
            return
        if self._eager_ok(source, tag, True):
            got = self._engine.recv_eager(self._world[source], arr, self._ctx, tag)
            if got is not None:
                if status is not None:
                    status.source, status.tag, status.nbytes = source, got[1], got[0]
                return
        self._p2p_wait(self._irecv_array(arr, source, tag, "Recv"), status)

    def Sendrecv(  # noqa: N802
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
        status: Optional[Status] = None,
    ) -> None:
        got = self._fast.sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)
        if got is None:
            return
        sarr, rarr = got
        sreq = None
        if self._eager_ok(dest, sendtag) and self._eager_ok(source, recvtag, True):
            engine = self._engine
            if sarr.nbytes <= engine.eager_max:
                got = engine.sendrecv_eager(self._world[dest], sarr, sendtag, self._world[source], rarr, recvtag, self._ctx)
                if got is not False:  # the send left whole, so receiving after it cannot deadlock
                    if got is True:  # not there yet: a peer's ring is waited on in C (yielding where cores are shared)
                        if self._fast.recv(rarr, source, recvtag, status) is not None:
                            self._p2p_wait(self._irecv_array(rarr, source, recvtag, "Sendrecv"), status)
                    elif status is not None:
                        status.source, status.tag, status.nbytes = source, got[1], got[0]
                    return
            elif dest == source and sendtag == recvtag and engine.swaps_with(self._world[dest]):  # over a socket
                owner = self._p2p_ready("Sendrecv").call("Sendrecv", "dest", dest, sendtag)
                got = engine.sendrecv_frames(self._world[dest], sarr, rarr, self._ctx, sendtag, owner, self.timeout)
                if status is not None:
                    status.source, status.tag, status.nbytes = source, recvtag, got
                return
            else:  # announce (or queue) the send, take the peer's message straight from its ring, then the ack
                sreq = self._isend_array(sarr, dest, sendtag, "Sendrecv")
                got = engine.recv_eager(self._world[source], rarr, self._ctx, recvtag)
                if got is not None:
                    if status is not None:
                        status.source, status.tag, status.nbytes = source, got[1], got[0]
                    self._p2p_wait(sreq)
                    return
        rreq = self._irecv_array(rarr, source, recvtag, "Sendrecv")
        if sreq is None:
            sreq = self._isend_array(sarr, dest, sendtag, "Sendrecv")
        pending = [r for r in (rreq, sreq) if r is not None and not r.done]
        if pending:
            self._engine.wait_requests(pending, self.timeout, pending[0].owner)
        try:
            self._p2p_wait(rreq, status)
        finally:
            self._p2p_wait(sreq)

    def Sendrecv_replace(  # noqa: N802
        self, buf: Any, dest: int, sendtag: int = 0, source: int = ANY_SOURCE, recvtag: int = ANY_TAG, status: Optional[Status] = None
    ) -> None:
        """Send ``buf``'s contents to ``dest`` and replace them with the message from ``source``."""
        arr = self._p2p_buf(buf, "Sendrecv_replace", writable=True)
        self.Sendrecv(arr.copy(), dest, sendtag, arr, source, recvtag, status)

    def _pair(self, rreq: Any, sreq: Any) -> Request:
        """One request for a receive and a send (either None for PROC_NULL); its status is the receive's."""
        if rreq is None:
            req = self._p2p_request(sreq)
            req._status = Status._of(PROC_NULL, ANY_TAG, 0)
            return req
        req = Request(self._engine, self, p2p=rreq)
        if sreq is not None:
            req._more = (sreq,)
        return req

    def Isendrecv(  # noqa: N802
        self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None, source: int = ANY_SOURCE, recvtag: int = ANY_TAG
    ) -> Request:
        """Nonblocking Sendrecv: one request for both transfers."""
        rarr = self._p2p_buf(recvbuf, "Isendrecv", writable=True)
        sarr = self._p2p_buf(sendbuf, "Isendrecv")
        rreq = self._irecv_array(rarr, source, recvtag, "Isendrecv")
        return self._pair(rreq, self._isend_array(sarr, dest, sendtag, "Isendrecv"))

    def Isendrecv_replace(  # noqa: N802
        self, buf: Any, dest: int, sendtag: int = 0, source: int = ANY_SOURCE, recvtag: int = ANY_TAG
    ) -> Request:
        """Nonblocking Sendrecv_replace."""
        arr = self._p2p_buf(buf, "Isendrecv_replace", writable=True)
        sarr = arr.copy()  # before the receive is posted: a buffered message may land at once
        rreq = self._irecv_array(arr, source, recvtag, "Isendrecv_replace")
        return self._pair(rreq, self._isend_array(sarr, dest, sendtag, "Isendrecv_replace"))

    # ---- probes and matched receives --------------------------------------------------------------
    def _probe(self, opname: str, source: int, tag: int, status: Optional[Status], block: bool, take: bool) -> Any:
        """The engine's message a receive of (source, tag) would take (None: none yet; MESSAGE_NO_PROC for
        PROC_NULL), its status filled; ``take`` (matched probes) reserves it for a Message's receive."""
        base = self._p2p_ready(opname)
        peer = self._peer(source, opname, True)
        tag = self._tag(tag, opname, True)
        if peer == PROC_NULL:
            if status is not None:
                status._fill(Status._of(PROC_NULL, ANY_TAG, 0))
            return MESSAGE_NO_PROC
        engine = self._engine
        if block:
            found = engine.probe(peer, self._ctx, tag, base.call(opname, "source", source, tag), self.timeout, take)
        else:
            found = engine.iprobe(peer, self._ctx, tag, take)
        if found is not None and status is not None:
            status._fill(Status._of(self._to_comm[found.src], found.tag, found.nbytes))
        return found

    def Probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> bool:  # noqa: N802
        """Block until a message that a receive of (source, tag) would take has arrived; it stays there. True."""
        self._probe("Probe", source, tag, status, True, False)
        return True

    def Iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> bool:  # noqa: N802
        """Whether a message that a receive of (source, tag) would take has arrived (status filled if so)."""
        return self._probe("Iprobe", source, tag, status, False, False) is not None

    def _message(self, found: Any) -> Message:
        return Message(MESSAGE_NO_PROC) if found is MESSAGE_NO_PROC else Message._of(self, found)

    def Mprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> Message:  # noqa: N802
        """Block until a message of (source, tag) has arrived, and take it: only the returned Message receives it."""
        return self._message(self._probe("Mprobe", source, tag, status, True, True))

    def Improbe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> Optional[Message]:  # noqa: N802
        """Mprobe without blocking: the Message, or None if no such message has arrived."""
        found = self._probe("Improbe", source, tag, status, False, True)
        return None if found is None else self._message(found)

    probe = Probe
    iprobe = Iprobe
    mprobe = Mprobe
    improbe = Improbe

    def _mrecv(self, found: Any, buf: Any, status: Optional[Status], opname: str) -> None:
        """Receive a matched message into ``buf``."""
        arr = self._p2p_buf(buf, opname, writable=True)
        owner = self._p2p_ready(opname).call(opname, "source", self._to_comm[found.src], found.tag)
        self._p2p_wait(self._engine.mrecv(found, arr, owner), status)

    def _imrecv(self, found: Any, buf: Any, opname: str, obj: bool = False) -> Request:
        """A request receiving a matched message: into ``buf``, or (``obj``) as a lowercase receive's object."""
        arr = None if obj else self._p2p_buf(buf, opname, writable=True)
        owner = self._p2p_ready(opname).call(opname, "source", self._to_comm[found.src], found.tag)
        return Request(self._engine, self, p2p=self._engine.mrecv(found, arr, owner), finish=self._loads if obj else None)

    # ---- persistent requests --------------------------------------------------------------------
    def _persistent(self, opname: str, buf: Any, peer: int, tag: int, start: Callable[..., Any], recv: bool = False) -> Prequest:
        """An inactive persistent request; each Start runs ``start(flat bytes, peer, tag, opname)``. The arguments
        are checked now, as MPI does."""
        arr = self._p2p_buf(buf, opname, writable=recv)
        self._peer(peer, opname, recv)
        self._tag(tag, opname, recv)
        return Prequest._persistent(lambda: self._p2p_request(start(arr, peer, tag, opname), recv))

    def Send_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:  # noqa: N802
        """A persistent send: each Start sends ``buf``'s contents at that time."""
        return self._persistent("Send_init", buf, dest, tag, self._isend_array)

    def Ssend_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:  # noqa: N802
        return self._persistent("Ssend_init", buf, dest, tag, self._issend_array)

    def Bsend_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:  # noqa: N802
        return self._persistent("Bsend_init", buf, dest, tag, self._bsend_array)

    def Rsend_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:  # noqa: N802
        return self._persistent("Rsend_init", buf, dest, tag, self._isend_array)

    def Recv_init(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Prequest:  # noqa: N802
        """A persistent receive into ``buf``."""
        return self._persistent("Recv_init", buf, source, tag, self._irecv_array, recv=True)


class _BufferAutomatic:
    """``MPI.BUFFER_AUTOMATIC``: attach it (or None) to ask for automatic buffering; Detach_buffer returns it."""

    def __repr__(self) -> str:
        return "<pycoll.MPI.BUFFER_AUTOMATIC>"

    def __bool__(self) -> bool:
        return False

    def __int__(self) -> int:
        return 0

    def __reduce__(self) -> str:
        return "BUFFER_AUTOMATIC"


BUFFER_AUTOMATIC = _BufferAutomatic()
_BSENDING: "weakref.WeakSet[Comm]" = weakref.WeakSet()  # communicators with buffered sends maybe under way


def attach_buffer(current: Any, buf: Any, opname: str, rank: Optional[int] = None) -> Any:
    """What an Attach_buffer call keeps: ``buf`` checked (writable memory, None or BUFFER_AUTOMATIC, which
    None becomes), when nothing (``current`` None) is attached yet."""
    if current is not None:
        raise InvalidArgumentError("a buffer is attached already; Detach_buffer it first", op=opname, rank=rank)
    if buf is None or buf is BUFFER_AUTOMATIC:
        return BUFFER_AUTOMATIC
    try:
        readonly = memoryview(buf).readonly
    except TypeError:  # not the buffer protocol: an array exporter (NumPy, DLPack, CUDA) also serves
        if not any(hasattr(buf, a) for a in ("__array_interface__", "__cuda_array_interface__", "__dlpack__")):
            raise InvalidArgumentError(f"expected writable memory (e.g. MPI.Alloc_mem), None or MPI.BUFFER_AUTOMATIC, "
                                       f"got {type(buf).__name__}", op=opname, rank=rank) from None
        readonly = False
    if readonly:
        raise InvalidArgumentError(f"the {type(buf).__name__} to attach is read-only", op=opname, rank=rank)
    return buf


def flush_all_bsends() -> None:
    """Wait for the buffered sends of every communicator (MPI.Flush_buffer, MPI.Detach_buffer)."""
    for comm in list(_BSENDING):
        comm._flush_bsends()


