"""Compiled point-to-point calls of one communicator: buffer specs resolved once, then each call between two ranks of one host one Numba call while the engine has nothing else pending."""

from __future__ import annotations

import ctypes
import os
import time
import weakref
from typing import Any, Optional

import numpy as np

from .config import float_param, int_param
from .memory import DATA_FIELD, host_address
from .p2p import _ACK, Engine, P2POwner, RecvRequest, SendRequest
from .p2p_lane import EMPTY

_TAG_MAX = (1 << 63) - 1
P2P_YIELDS = int_param(
    "PYCOLL_P2P_YIELDS", 4096,
    "Where a host runs more ranks than cores: how many times a compiled point-to-point call waiting for its peer "
    "gives up the core (sched_yield) before it sleeps on the doorbell (default 4096, a few ms when the core is idle).",
)
P2P_SPIN_US = float_param(
    "PYCOLL_P2P_SPIN_US", 2000.0,
    "Where every rank of the host has a core: microseconds a compiled blocking Recv or Sendrecv keeps polling for its "
    "peer's message, giving up the core (sched_yield) between short spins, before the engine's wait takes over "
    "(where ranks share cores, PYCOLL_P2P_YIELDS counts its yields instead).",
)
_NO_SEGMENTS: list = []
_word_at = ctypes.c_size_t.from_address
_memmove = ctypes.memmove

# Resolved buffer specs by id(arr): (arr, count or None, datatype or None, arr's dtype then, flat bytes over it, their
# address, their length). An entry holds its array (so its id names nobody else while it is there); the entries and
# the bytes of the arrays they keep alive (their bases, each counted once) are bounded: past a bound, all are dropped.
_SPECS: dict = {}
_SPECS_MAX = 256
_PINNED_MAX = 256 << 20
_pinned: dict = {}  # id(base array) -> its bytes
_last_root: Any = lambda: None  # the array of the last view found by its shape (a weak reference)
_seen: dict = {}  # id(array) -> a weak reference to it, for arrays found by their shape once
_SEEN_MAX = 64


def _spec_parts(buf: Any) -> Optional[tuple]:
    """(spec type, array, count or None, datatype or None) of ``[arr, count, datatype]`` (an int count),
    ``[arr, datatype]`` or a bare array; None for any other argument (resolved in full on every call)."""
    t = type(buf)
    if t is list or t is tuple:
        n = len(buf)
        if n == 3:
            obj, count, datatype = buf
            return (t, obj, count, datatype) if type(count) is int else None
        if n == 2:
            return t, buf[0], None, buf[1]
        return None
    if t is np.ndarray:
        return t, buf, None, None
    return None


def _cached(buf: Any, writable: bool) -> Optional[tuple]:
    """The cached resolution of a buffer spec: by the array's identity if it is still right for it (same object,
    count, datatype and dtype; writable for a receive), else by its shape (a fresh array or view per call, as
    programs pass them); None if neither knows it. The entry's flat bytes (``flat``) are made only if asked for.
    Written out in one body: each spec of a small call spends its time here (about 1 µs)."""
    t = type(buf)
    if t is list or t is tuple:
        n = len(buf)
        if n == 3:
            obj, count, datatype = buf
            if type(count) is not int:
                return None
        elif n == 2:
            obj, datatype = buf
            count = None
        else:
            return None
    elif t is np.ndarray:
        obj, count, datatype = buf, None, None
    else:
        return None
    e = _SPECS.get(id(obj))
    if (e is not None and e[0] is obj and e[1] == count and e[2] is datatype and obj.dtype is e[3]
            and (not writable or obj.flags.writeable)):
        return e
    if type(obj) is not np.ndarray:
        return None
    f = obj.flags
    if not f.c_contiguous:
        return None
    try:
        nbytes = _SHAPES.get((t, obj.shape, obj.dtype, f.writeable, count, datatype, writable))
    except TypeError:  # an unhashable datatype argument
        return None
    if nbytes is None:
        return None
    addr = (_word_at(id(obj) + DATA_FIELD).value if DATA_FIELD >= 0 else host_address(obj)) if nbytes else 0
    e = (obj, count, datatype, obj.dtype, None, addr, nbytes)
    root = obj.base
    if root is None:
        _keep_returning(obj, e)
    elif type(root) is np.ndarray and root.base is None:
        _keep_view(obj, root, e)
    return e


def _keep_returning(obj: np.ndarray, e: tuple) -> None:
    """Cache an array found by its shape under its identity when it comes a second time (a program's own buffers,
    several of one shape); a fresh array per call is only ever referenced weakly here."""
    ref = _seen.get(id(obj))
    if ref is not None and ref() is obj:
        _keep(obj, e)
        return
    if len(_seen) >= _SEEN_MAX:
        _seen.clear()
    _seen[id(obj)] = weakref.ref(obj)


def _keep_view(obj: np.ndarray, root: np.ndarray, e: tuple) -> None:
    """Cache a view found by its shape under its identity where that holds no memory that would be freed otherwise:
    its array's bytes are held already, or a view of the same array came just before (a program's receive slots of
    one buffer); a view of a fresh array per call is not kept."""
    global _last_root
    if id(root) in _pinned:
        if len(_SPECS) < _SPECS_MAX:
            _SPECS[id(obj)] = e
    elif _last_root() is root:
        _keep(obj, e)
    else:
        _last_root = weakref.ref(root)


def flat(e: tuple) -> np.ndarray:
    """An entry's flat bytes: kept where the full parse made them, else viewed over its array now."""
    got = e[4]
    if got is None:
        got = e[0].reshape(-1).view(_UINT8)[:e[6]]
    return got


# What a spec resolves to by its shape, for arrays seen before in other objects (a fresh array or view per call):
# (spec type, array shape, dtype, writable flag, count, datatype, a receive's) -> the length of the flat bytes, which
# start at the array's first byte. A spec whose bytes are not a prefix of its C-ordered array is never kept here.
_SHAPES: dict = {}
_SHAPES_MAX = 1024
_UINT8 = np.dtype(np.uint8)


def _shape_key(t: type, obj: Any, count: Any, datatype: Any, writable: bool) -> Optional[tuple]:
    """The shape key of a spec over a C-ordered array; None for other kinds."""
    if type(obj) is not np.ndarray:
        return None
    f = obj.flags
    if not f.c_contiguous:
        return None
    return (t, obj.shape, obj.dtype, f.writeable, count, datatype, writable)


def _remember_shape(key: Optional[tuple], obj: np.ndarray, arr: np.ndarray, addr: int) -> None:
    """Keep the length of a spec's flat bytes ``arr`` under its shape ``key`` where they are a prefix of its array
    ``obj``'s own memory."""
    if key is None or arr.dtype != _UINT8 or not arr.flags.c_contiguous:
        return
    if arr.nbytes and (not obj.nbytes or host_address(obj) != addr):
        return
    if len(_SHAPES) >= _SHAPES_MAX:
        _SHAPES.clear()
    try:
        _SHAPES[key] = arr.nbytes
    except TypeError:
        pass


def _resolve(comm: Any, buf: Any, opname: str, writable: bool) -> tuple:
    """Resolve ``buf`` by the communicator's full parse (its errors are the call's) and cache the result when it
    views the array's own memory."""
    arr = comm._p2p_buf(buf, opname, writable)
    parts = _spec_parts(buf)
    t, obj, count, datatype = parts if parts is not None else (None, None, None, None)
    addr = host_address(arr) if arr.nbytes else 0
    if type(obj) is not np.ndarray or not np.may_share_memory(obj, arr):
        return (None, None, None, None, arr, addr, arr.nbytes)  # a packed copy, another kind of buffer: used once
    _remember_shape(_shape_key(t, obj, count, datatype, writable), obj, arr, addr)
    entry = (obj, count, datatype, obj.dtype, arr, addr, arr.nbytes)
    _keep(obj, entry)
    return entry


def _keep(obj: np.ndarray, entry: tuple) -> None:
    """Cache ``entry`` under ``id(obj)``, within the bounds on entries and on the bytes they keep alive."""
    root = obj
    while type(root.base) is np.ndarray:
        root = root.base
    if id(root) not in _pinned:
        if len(_SPECS) >= _SPECS_MAX or sum(_pinned.values()) + root.nbytes > _PINNED_MAX:
            _SPECS.clear()
            _pinned.clear()
        _pinned[id(root)] = root.nbytes
    elif len(_SPECS) >= _SPECS_MAX:
        _SPECS.clear()
        _pinned.clear()
        _pinned[id(root)] = root.nbytes
    _SPECS[id(obj)] = entry


class FastP2P:
    """One communicator's compiled point-to-point calls. Each method does the whole call and returns None, or
    returns the buffer as flat bytes for the engine's general path when the call cannot go this way (a peer off
    this host, the kernels not loaded yet, receives already posted, unexpected messages buffered, a failure...).
    It goes this way only where MPI's matching order is kept: a receive takes the next frame of its source's ring
    only while nothing else could match it first."""

    __slots__ = ("comm", "engine", "ctx", "size", "world", "lanes", "words", "k", "posted", "unexpected",
                 "schedules", "aborts", "sendq", "inbound", "lock", "broken", "eager_max", "polls", "owners", "linger_s",
                 "linger_polls")

    def __init__(self, comm: Any) -> None:
        engine: Engine = comm._engine
        self.comm = comm
        self.engine = engine
        self.ctx = comm._ctx
        self.size = comm._size
        self.world = comm._world
        self.lanes: Optional[list[int]] = None  # world rank -> lane address (0: none), once the kernels are in
        self.words: dict = {}
        self.k: Any = None
        self.posted, self.unexpected, self.schedules = engine._posted, engine._unexpected, engine._schedules
        self.aborts, self.sendq, self.inbound = engine._abort_requests, engine._sendq, engine._inbound
        self.broken = engine.broken_ctxs
        self.lock = engine.lock
        self.eager_max = engine.eager_max
        self.polls = 0
        self.linger_s = 0.0
        self.linger_polls = 1
        self.owners: dict = {}  # (call, rank, tag) -> its owner, for the requests this path posts

    def _lanes(self) -> Optional[list[int]]:
        """The engine's lanes once its kernels are in (asking the engine counts towards starting their load)."""
        engine = self.engine
        if engine.lane_of is None:
            engine._kernels_due()
            if engine.lane_of is None:
                return None
        self.k = engine._kernels
        self.words = engine.lane_views
        # the kernels' wait for a frame: about the engine's spin, or where ranks outnumber cores that many
        # sched_yields (the core goes to a rank with work; the peer's answer comes sooner than a futex wake); then,
        # where each rank has a core, ``_linger`` for PYCOLL_P2P_SPIN_US
        self.polls = engine._kernel_spin_polls if not engine.oversubscribed else max(P2P_YIELDS.get(), 0)
        self.linger_s = P2P_SPIN_US.get() * 1e-6 if not engine.oversubscribed else 0.0
        self.linger_polls = max(engine._kernel_spin_polls // 10, 1)  # about 5 µs between yields
        self.lanes = engine.lane_of
        return self.lanes

    def _dead(self) -> bool:
        """Whether the communicator was freed, torn down or broken (the general path raises the error)."""
        comm = self.comm
        return comm._freed or comm._aborted is not None or bool(self.broken)

    def _quiet(self, peer: int) -> bool:
        """Whether the next frame from ``peer`` is a receive's to take: nothing posted, buffered or running that
        could match first, its stream at a frame boundary."""
        if self.posted or self.unexpected or self.schedules or self.aborts:
            return False
        st = self.inbound[peer]
        return not st.have and st.target is None

    # ---- sends ---------------------------------------------------------------------------------
    def send(self, buf: Any, dest: Any, tag: Any) -> Optional[np.ndarray]:
        """A blocking send: an eager message written into the peer's ring, or a rendezvous announced and its
        acknowledgement awaited."""
        e = _cached(buf, False) or _resolve(self.comm, buf, "Send", False)
        lanes = self.lanes or self._lanes()
        if lanes is not None and type(dest) is int and type(tag) is int and 0 <= dest < self.size and 0 <= tag <= _TAG_MAX:
            peer = self.world[dest]
            d = lanes[peer]
            if d and not self.sendq[peer] and not self._dead():
                n = e[6]
                if n <= self.eager_max:
                    if self.k.put(d, e[5], n, self.ctx, tag):
                        return None
                elif self.engine._rdv_ok(peer, n):
                    return self._rendezvous(peer, d, e, dest, tag)
        return flat(e)

    def _rendezvous(self, peer: int, d: int, e: tuple, dest: int, tag: int) -> Optional[np.ndarray]:
        """A blocking send by rendezvous: announce, then wait for the acknowledgement (spinning first)."""
        if not self.lock.acquire(False):
            return flat(e)
        try:
            engine = self.engine
            rid = engine._rdv_seq = engine._rdv_seq + 1
            if not self.k.announce_at(d, e[5], e[6], self.ctx, tag, rid):
                return flat(e)
            if self.k.await_ack(d, self.ctx, tag, rid, self.polls + self.engine.pull_polls(e[6])):
                return None
            req = self._pending_send(peer, rid, flat(e), "Send", dest, tag)
        finally:
            self.lock.release()
        self.comm._p2p_wait(req)
        return None

    def _pending_send(self, peer: int, rid: int, arr: np.ndarray, opname: str, dest: int, tag: int) -> SendRequest:
        """The engine's request for rendezvous ``rid``, announced here, whose acknowledgement is still to come."""
        req = SendRequest(self._owner(opname, "dest", dest, tag), peer, self.ctx, tag, _NO_SEGMENTS)
        req.rdv = rid
        self.engine._rdv_sends[(peer, rid)] = req
        self.engine._rdv_data[(peer, rid)] = memoryview(arr)  # streamed from, should the receiver fail to pull
        return req

    def isend(self, buf: Any, dest: Any, tag: Any) -> Any:
        """A nonblocking send: True for an eager message written now, the engine's request for a rendezvous
        announced (done at its acknowledgement); else the flat bytes for the engine's path."""
        e = _cached(buf, False) or _resolve(self.comm, buf, "Isend", False)
        lanes = self.lanes or self._lanes()
        if lanes is not None and type(dest) is int and type(tag) is int and 0 <= dest < self.size and 0 <= tag <= _TAG_MAX:
            peer = self.world[dest]
            d = lanes[peer]
            if d and not self.sendq[peer] and not self._dead():
                n = e[6]
                if n <= self.eager_max:
                    if self.k.put(d, e[5], n, self.ctx, tag):
                        return True
                elif self.engine._rdv_ok(peer, n) and self.lock.acquire(False):
                    try:
                        engine = self.engine
                        rid = engine._rdv_seq = engine._rdv_seq + 1
                        if self.k.announce_at(d, e[5], n, self.ctx, tag, rid):
                            return self._pending_send(peer, rid, flat(e), "Isend", dest, tag)
                    finally:
                        self.lock.release()
        return flat(e)

    # ---- receives ------------------------------------------------------------------------------
    def _take(self, peer: int, d: int, e: tuple, tag: int, polls: int, status: int = -1) -> int:
        """The receive of ``e`` from ``peer`` on lane ``d``, acknowledgements ahead handled: 0 when taken, else
        the take's status. ``status``: what a take the caller made returned (-1: none made). The engine's lock
        is held."""
        k = self.k
        engine = self.engine
        while True:
            if status < 0:
                status = k.take(d, e[5], e[6], self.ctx, tag, polls, 0 if self.sendq[peer] else 1)
            if status == 0:
                return 0
            if status == 4:  # ACKED: one of this rank's rendezvous sends is done
                engine._acked(peer, self.words[peer][18])
                status = -1
                continue
            if status >= 5:  # PULLED straight from the sender
                engine.rdv_pulls += 1
                engine.rdv_eager_pulls += 1
                if status == 6:  # its acknowledgement queues behind this rank's sends to the peer
                    w = self.words[peer]
                    engine._send_ctl(peer, _ACK, self.ctx, w[16], w[18])
                return 0
            return status

    def _linger(self, peer: int, d: int, e: tuple, tag: int) -> int:
        """After the spin found no frame from ``peer``: take again between ``sched_yield``s (the core goes to any
        thread that is ready; on an idle core the call returns at once) for PYCOLL_P2P_SPIN_US, where each rank has
        a core. The engine's wait would do the same after posting a receive, at several µs of Python a poll, and
        complete it through its queues: a peer late by more than the spin (ranks drift apart after uneven work)
        cost a halo step 20-40 µs. The take's status; the engine's lock is held."""
        until = time.monotonic() + self.linger_s
        polls = self.linger_polls
        while True:
            os.sched_yield()
            status = self._take(peer, d, e, tag, polls)
            if status != EMPTY or self.aborts or time.monotonic() >= until:
                return status

    def recv(self, buf: Any, source: Any, tag: Any, status: Any) -> Optional[np.ndarray]:
        """A blocking receive of the next frame from ``source``'s ring, spinning briefly for it."""
        e = _cached(buf, True) or _resolve(self.comm, buf, "Recv", True)
        lanes = self.lanes or self._lanes()
        if lanes is not None and type(source) is int and type(tag) is int and 0 <= source < self.size and -1 <= tag <= _TAG_MAX:
            peer = self.world[source]
            d = lanes[peer]
            if d and self.unexpected and not self._dead() and self.lock.acquire(False):
                try:
                    got = self._take_unexpected(peer, e, tag)
                finally:
                    self.lock.release()
                if got is not None:
                    if status is not None:
                        status.source, status.tag, status.nbytes = source, got[0], got[1]
                    return None
            elif d and self._quiet(peer) and not self._dead() and self.lock.acquire(False):
                try:
                    got = self._take(peer, d, e, tag, self.polls)
                    if got == EMPTY and self.linger_s:
                        got = self._linger(peer, d, e, tag)
                finally:
                    self.lock.release()
                if not got:
                    if status is not None:
                        w = self.words[peer]
                        status.source, status.tag, status.nbytes = source, w[16], w[17]
                    return None
        return flat(e)

    def irecv(self, buf: Any, source: Any, tag: Any) -> Any:
        """A nonblocking receive: the message taken now if it is next in ``source``'s ring ((tag, nbytes)), or the
        engine's receive posted here (the engine's compiled drain completes it); else the flat bytes for the
        engine's path."""
        e = _cached(buf, True) or _resolve(self.comm, buf, "Irecv", True)
        lanes = self.lanes or self._lanes()
        if lanes is not None and type(source) is int and type(tag) is int and 0 <= source < self.size and -1 <= tag <= _TAG_MAX:
            peer = self.world[source]
            d = lanes[peer]
            comm = self.comm
            if (d and self.unexpected and not self.aborts and not comm._freed and comm._aborted is None
                    and not self.broken and self.lock.acquire(False)):
                try:
                    got = self._take_unexpected(peer, e, tag)
                finally:
                    self.lock.release()
                if got is not None:
                    return got
            elif (d and not self.schedules and not self.aborts and not comm._freed
                    and comm._aborted is None and not self.broken and self.lock.acquire(False)):
                try:
                    st = self.inbound[peer]
                    if st.have or st.target is not None:
                        return flat(e)
                    if self.posted:  # messages already in for the receives posted before: completed first
                        self._complete_posted(peer, d)
                    if not self.posted:
                        status = self.k.take(d, e[5], e[6], self.ctx, tag, 0, 0 if self.sendq[peer] else 1)
                        if not status or not self._take(peer, d, e, tag, 0, status):
                            w = self.words[peer]
                            return w[16], w[17]
                    req = RecvRequest(self._owner("Irecv", "source", source, tag), peer, self.ctx, tag, None, flat(e))
                    req.addr = e[5]
                    self.posted.append(req)
                    return req
                finally:
                    self.lock.release()
        return flat(e)

    def _take_unexpected(self, peer: int, e: tuple, tag: int) -> Optional[tuple[int, int]]:
        """The first buffered message (one that came while this rank was in another call) that a receive of ``tag``
        from ``peer`` matches, copied into ``e`` and dropped from the buffer: (its tag, its length). None where
        there is none or where it needs the engine: a rendezvous, a synchronous send, one still arriving, one larger
        than the buffer (the engine's path then raises). The engine's lock is held."""
        ctx = self.ctx
        unexpected = self.unexpected
        for i, u in enumerate(unexpected):
            if u.ctx == ctx and u.src == peer and (tag < 0 or u.tag == tag):
                data = u.data
                n = data.nbytes
                if u.rdv is not None or u.sync or u.got != n or u.waiter is not None or n > e[6]:
                    return None
                if n:
                    _memmove(e[5], host_address(data), n)
                del unexpected[i]
                return u.tag, n
        return None

    def wait_posted(self, reqs: list) -> None:
        """Complete, in posting order, the receives among ``reqs`` that this path posted, each waiting (compiled)
        for its message as the next frame of its source's ring; stop at the first that cannot go this way (the
        engine's wait does the rest)."""
        lanes = self.lanes
        if lanes is None or not self.lock.acquire(False):
            return
        try:
            posted = self.posted
            for req in reqs:
                if req.done:
                    continue
                if (type(req) is not RecvRequest or not req.addr or not posted or posted[0] is not req
                        or self.unexpected or self.schedules or self.aborts or self._dead()):
                    return
                peer = req.peer
                d = lanes[peer]
                st = self.inbound[peer]
                if not d or st.have or st.target is not None:
                    return
                self._complete_posted(peer, d, self.polls)
                if not req.done:
                    return
        finally:
            self.lock.release()

    def _complete_posted(self, peer: int, d: int, polls: int = 0) -> None:
        """Complete, from ``peer``'s ring and in order, the receives at the head of the posted list that this path
        posted for ``peer``, while their messages come (each waited for up to ``polls`` polls). The engine's lock
        is held."""
        posted = self.posted
        k = self.k
        engine = self.engine
        w = self.words[peer]
        while posted:
            req = posted[0]
            if req.peer != peer or not req.addr or req.ctx != self.ctx:
                return
            status = k.take(d, req.addr, req.dst.nbytes, req.ctx, req.tag, polls, 0 if self.sendq[peer] else 1)
            if status == 4:  # ACKED: one of this rank's rendezvous sends is done
                engine._acked(peer, w[18])
                continue
            if status >= 5:
                engine.rdv_pulls += 1
                engine.rdv_eager_pulls += 1
                if status == 6:
                    engine._send_ctl(peer, _ACK, req.ctx, w[16], w[18])
            elif status != 0:
                return
            del posted[0]
            req.source, req.recv_tag, req.nbytes = peer, w[16], w[17]
            req.done = True

    def _owner(self, opname: str, word: str, rank: int, tag: int) -> P2POwner:
        """The owner of a request of this path (one per call, rank and tag, made once)."""
        key = (opname, rank, tag)
        owner = self.owners.get(key)
        if owner is None:
            if len(self.owners) >= 1024:
                self.owners.clear()
            owner = self.owners[key] = self.comm._p2p_ready(opname).call(opname, word, rank, tag)
        return owner

    # ---- both ----------------------------------------------------------------------------------
    def sendrecv(self, sendbuf: Any, dest: Any, sendtag: Any, recvbuf: Any, source: Any, recvtag: Any,
                 status: Any) -> Optional[tuple]:
        """A Sendrecv: both messages eager in one kernel call, or the send by rendezvous with the peer's message
        taken (pulled) and the acknowledgement awaited in one kernel call; what is left over goes to the engine
        here. None when done, else (send bytes, receive bytes) for the engine's path (nothing done)."""
        r = _cached(recvbuf, True) or _resolve(self.comm, recvbuf, "Sendrecv", True)
        s = _cached(sendbuf, False) or _resolve(self.comm, sendbuf, "Sendrecv", False)
        lanes = self.lanes or self._lanes()
        if (lanes is None or type(dest) is not int or type(sendtag) is not int or type(source) is not int
                or type(recvtag) is not int or not 0 <= dest < self.size or not 0 <= source < self.size
                or not 0 <= sendtag <= _TAG_MAX or not -1 <= recvtag <= _TAG_MAX):
            return flat(s), flat(r)
        speer, rpeer = self.world[dest], self.world[source]
        dd, ds = lanes[speer], lanes[rpeer]
        if (not dd or not ds or self.sendq[speer] or not self._quiet(rpeer) or self._dead()
                or not self.lock.acquire(False)):
            return flat(s), flat(r)
        engine = self.engine
        ctx = self.ctx
        try:
            n = s[6]
            if n <= self.eager_max:
                got = self.k.exchange(dd, ds, s[5], n, sendtag, r[5], r[6], recvtag, ctx, self.polls,
                                      0 if self.sendq[rpeer] else 1)
                if got == 7:  # NOT_SENT: no room for it
                    return flat(s), flat(r)
                if got == 4:  # an acknowledgement was ahead: go on taking
                    engine._acked(rpeer, self.words[rpeer][18])
                    got = self._take(rpeer, ds, r, recvtag, self.polls)
                elif got >= 5:  # pulled from the sender
                    engine.rdv_pulls += 1
                    engine.rdv_eager_pulls += 1
                    if got == 6:
                        w = self.words[rpeer]
                        engine._send_ctl(rpeer, _ACK, ctx, w[16], w[18])
                    got = 0
                if got == EMPTY and self.linger_s:  # sent: wait on for the peer's message
                    got = self._linger(rpeer, ds, r, recvtag)
                sreq = None
                received = got == 0
            elif engine._rdv_ok(speer, n):
                sreq, received = self._exchange_rdv(speer, rpeer, dd, ds, s, r, dest, sendtag, recvtag)
                if sreq is False:
                    return flat(s), flat(r)
            else:
                return flat(s), flat(r)
        finally:
            self.lock.release()
        comm = self.comm
        if not received:
            rreq = comm._irecv_array(flat(r), source, recvtag, "Sendrecv")
            pending = [x for x in (rreq, sreq) if x is not None and not x.done]
            if pending:
                engine.wait_requests(pending, comm.timeout, pending[0].owner)
            try:
                comm._p2p_wait(rreq, status)
            finally:
                if sreq is not None:
                    comm._p2p_wait(sreq)
            return None
        if sreq is not None:
            comm._p2p_wait(sreq)
        if status is not None:
            w = self.words[rpeer]
            status.source, status.tag, status.nbytes = source, w[16], w[17]
        return None

    def _exchange_rdv(self, speer: int, rpeer: int, dd: int, ds: int, s: tuple, r: tuple, dest: int, sendtag: int,
                      recvtag: int) -> tuple[Any, bool]:
        """A Sendrecv's send by rendezvous and its receive, as far as one kernel call takes them: (the engine's
        request for the send if its acknowledgement is still to come, whether the receive is done); (False,
        False) when nothing was done. The engine's lock is held."""
        engine = self.engine
        ctx = self.ctx
        rid = engine._rdv_seq = engine._rdv_seq + 1
        state = 0
        polls = self.polls + engine.pull_polls(s[6])  # the usual spin and the receiver's pull
        while True:
            state = self.k.exchange_rdv(dd, ds, s[5], s[6], sendtag, r[5], r[6], recvtag, ctx, rid, polls,
                                        0 if self.sendq[rpeer] else 1, state)
            if not state & 1:  # not announced: nothing done
                return False, False
            if state & 32:  # PULLED_IN
                engine.rdv_pulls += 1
                state &= ~32
            if state & 8:  # ACK_DUE: the receive's acknowledgement queues behind this rank's sends
                w = self.words[rpeer]
                engine._send_ctl(rpeer, _ACK, ctx, w[16], w[18])
            if not state & 16:
                break
            engine._acked(rpeer, self.words[rpeer][18])  # ACKED_OTHER: another send of this rank is done; go on
        sreq = None if state & 2 else self._pending_send(speer, rid, flat(s), "Sendrecv", dest, sendtag)
        return sreq, bool(state & 4)
