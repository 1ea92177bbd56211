"""Compiled point-to-point calls of one communicator: buffer specs resolved once (``p2p_specs``), then each call
between two ranks of one host one C call (an eager Send, Isend or Irecv: ``eager_calls``) or one Numba call while
the engine has nothing else pending."""

from __future__ import annotations

import ctypes
import functools
import os
import time
from typing import Any, Optional

import numpy as np

from .config import float_param, int_param
from .memory import host_address
from .p2p import Engine
from .p2p_protocol import ACK, NO_SEGMENTS, TAG_MAX, P2POwner, RecvRequest, SendRequest
from .p2p_lane import EMPTY, SPLIT_MIN_BYTES
from .p2p_sendrecv import SendRecv
from .p2p_specs import cached_spec, call_key_module, flat_bytes_of, resolve_spec, spec_caches


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
_memmove = ctypes.memmove


def _not_in_c(*args: Any) -> None:
    """Where the C eager calls were not built: every call takes the Python path."""
    return None


def eager_gate(fast: "FastP2P") -> tuple:
    """What ``pycoll._callkey.eager_send`` and ``eager_take`` read of a communicator, in their order: the spec caches,
    the engine (its lanes), the communicator (freed? aborted?), comm rank -> world rank, the engine's send queues
    and broken contexts, the context id, the eager limit, then what a receive must find empty (posted receives,
    buffered messages, running schedules, abort requests), the inbound streams, and the engine's lock."""
    engine = fast.engine
    return (*spec_caches(), engine, fast.comm, tuple(fast.world), engine._sendq, engine.broken_ctxs, fast.ctx,
            fast.eager_max, engine._posted, engine._unexpected, engine._schedules, engine._abort_requests,
            engine._inbound, engine.lock)


def eager_calls(fast: "FastP2P") -> tuple[Any, Any, Any]:
    """(send_now, take_now, take_object_now): a communicator's eager send and receive in C (``pycoll/_callkey.c``),
    called with (buf, rank, tag), and its receive of a message of any length into a new bytes object (a pickle),
    called with (rank, tag, polls to wait); each returns a false value where the call needs the Python path, always
    so where the C module was not built or PYCOLL_CALL_KEY=python."""
    module = call_key_module()
    if module is None or not hasattr(module, "eager_take_object"):  # none, or an older build
        return _not_in_c, _not_in_c, _not_in_c
    gate = eager_gate(fast)
    return (functools.partial(module.eager_send, gate), functools.partial(module.eager_take, gate),
            functools.partial(module.eager_take_object, gate))


class FastP2P(SendRecv):
    """One communicator's compiled point-to-point calls. Each method does the whole call and returns None, or
    returns the buffer as flat bytes for the engine's general path when the call cannot go this way (a peer off
    this host, the kernels not loaded yet, receives already posted, unexpected messages buffered, a failure...).
    It goes this way only where MPI's matching order is kept: a receive takes the next frame of its source's ring
    only while nothing else could match it first."""

    __slots__ = ("comm", "engine", "ctx", "size", "world", "lanes", "words", "k", "posted", "unexpected",
                 "schedules", "aborts", "sendq", "inbound", "lock", "broken", "base", "eager_max", "polls", "owners", "linger_s",
                 "linger_polls", "send_now", "take_now", "take_object_now")

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
        self.base = comm._ctx & ~1  # the key of this communicator's entry in ``broken``
        self.lock = engine.lock
        self.eager_max = engine.eager_max
        self.polls = 0
        self.linger_s = 0.0
        self.linger_polls = 1
        self.owners: dict = {}  # (call, rank, tag) -> its owner, for the requests this path posts
        # the eager send and receive in C, tried first: (buf, rank, tag) -> True / (tag, nbytes), else false; the
        # object receive's: (rank, tag, polls) -> (tag, nbytes, its bytes), False (none came) or None
        self.send_now, self.take_now, self.take_object_now = eager_calls(self)

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
        broken = self.broken
        return comm._freed or comm._aborted is not None or bool(broken) and self.base in broken

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
        e = cached_spec(buf, False) or resolve_spec(self.comm, buf, "Send", False)
        lanes = self.lanes or self._lanes()
        if lanes is not None and type(dest) is int and type(tag) is int and 0 <= dest < self.size and 0 <= tag <= TAG_MAX:
            peer = self.world[dest]
            d = lanes[peer]
            if d and not self.sendq[peer] and not self._dead():
                n = e[6]
                if n <= self.eager_max:
                    if self.k.put(d, e[5], n, self.ctx, tag):
                        return None
                elif self.engine._rdv_ok(peer, n):
                    return self._rendezvous(peer, d, e, dest, tag)
        return flat_bytes_of(e)

    def _rendezvous(self, peer: int, d: int, e: tuple, dest: int, tag: int) -> Optional[np.ndarray]:
        """A blocking send by rendezvous: announce, then wait for the acknowledgement (spinning first)."""
        if not self.lock.acquire(False):
            return flat_bytes_of(e)
        try:
            engine = self.engine
            rid = engine._rdv_seq = engine._rdv_seq + 1
            if not self.k.announce_at(d, e[5], e[6], self.ctx, tag, rid):
                return flat_bytes_of(e)
            if self.k.await_ack(d, self.ctx, tag, rid, self.polls + self.engine.pull_polls(e[6]), e[5], e[6]):
                return None
            req = self._pending_send(peer, rid, d, e, "Send", dest, tag)
        finally:
            self.lock.release()
        self.comm._p2p_wait(req)
        return None

    def _pending_send(self, peer: int, rid: int, d: int, e: tuple, opname: str, dest: int, tag: int,
                      offered: bool = True) -> SendRequest:
        """The engine's request for rendezvous ``rid`` of spec ``e``, announced here on lane ``d``, whose
        acknowledgement is still to come; one of split size whose announcement ``offered`` the split is also kept
        for the engine's wait to help copy (``Progress._help_splits``)."""
        req = SendRequest(self._owner(opname, "dest", dest, tag), peer, self.ctx, tag, NO_SEGMENTS)
        req.rdv = rid
        self.engine._rdv_sends[(peer, rid)] = req
        # streamed from, should the receiver fail to pull
        self.engine._rdv_data[(peer, rid)] = memoryview(flat_bytes_of(e))
        if offered and e[6] >= SPLIT_MIN_BYTES:
            self.engine.split_sends[(peer, rid)] = (d, e[5], e[6])
        return req

    def isend(self, buf: Any, dest: Any, tag: Any) -> Any:
        """A nonblocking send: True for an eager message written now, the engine's request for a rendezvous
        announced (done at its acknowledgement); else the flat bytes for the engine's path."""
        e = cached_spec(buf, False) or resolve_spec(self.comm, buf, "Isend", False)
        lanes = self.lanes or self._lanes()
        if lanes is not None and type(dest) is int and type(tag) is int and 0 <= dest < self.size and 0 <= tag <= TAG_MAX:
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
                            return self._pending_send(peer, rid, d, e, "Isend", dest, tag)
                    finally:
                        self.lock.release()
        return flat_bytes_of(e)

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
                    engine._send_ctl(peer, ACK, self.ctx, w[16], w[18])
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
        e = cached_spec(buf, True) or resolve_spec(self.comm, buf, "Recv", True)
        lanes = self.lanes or self._lanes()
        if lanes is not None and type(source) is int and type(tag) is int and 0 <= source < self.size and -1 <= tag <= TAG_MAX:
            peer = self.world[source]
            d = lanes[peer]
            if d and self.unexpected and not self._dead():
                got = self._take_buffered(peer, e, tag)
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
        return flat_bytes_of(e)

    def irecv(self, buf: Any, source: Any, tag: Any) -> Any:
        """A nonblocking receive: the message taken now if it is next in ``source``'s ring ((tag, nbytes)), or the
        engine's receive posted here (the engine's compiled drain completes it); else the flat bytes for the
        engine's path."""
        e = cached_spec(buf, True) or resolve_spec(self.comm, buf, "Irecv", True)
        lanes = self.lanes or self._lanes()
        if lanes is not None and type(source) is int and type(tag) is int and 0 <= source < self.size and -1 <= tag <= TAG_MAX:
            peer = self.world[source]
            d = lanes[peer]
            comm = self.comm
            if (d and self.unexpected and not self.aborts and not comm._freed and comm._aborted is None
                    and not (self.broken and self.base in self.broken)):
                got = self._take_buffered(peer, e, tag)
                if got is not None:
                    return got
            elif (d and not self.schedules and not self.aborts and not comm._freed
                    and comm._aborted is None and not (self.broken and self.base in self.broken)
                    and self.lock.acquire(False)):
                try:
                    st = self.inbound[peer]
                    if st.have or st.target is not None:
                        return flat_bytes_of(e)
                    if self.posted:  # messages already in for the receives posted before: completed first
                        self._complete_posted(peer, d)
                    if not self.posted:
                        status = self.k.take(d, e[5], e[6], self.ctx, tag, 0, 0 if self.sendq[peer] else 1)
                        if not status or not self._take(peer, d, e, tag, 0, status):
                            w = self.words[peer]
                            return w[16], w[17]
                    req = RecvRequest(self._owner("Irecv", "source", source, tag), peer, self.ctx, tag, None, flat_bytes_of(e))
                    req.addr = e[5]
                    self.posted.append(req)
                    return req
                finally:
                    self.lock.release()
        return flat_bytes_of(e)

    def _take_buffered(self, peer: int, e: tuple, tag: int) -> Optional[tuple[int, int]]:
        """``_take_unexpected`` under the engine's lock, if it is free (None, nothing taken, if not)."""
        if not self.lock.acquire(False):
            return None
        try:
            return self._take_unexpected(peer, e, tag)
        finally:
            self.lock.release()

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
        """Complete, in posting order, the receives among ``reqs`` at the head of the posted list, each waiting in C
        for its message: as the next frame of its source's ring (receives this path posted), or of its socket (a
        source on another host); stop at the first that cannot go this way (the engine's wait does the rest)."""
        if not self.lock.acquire(False):
            return
        try:
            posted = self.posted
            for req in reqs:
                if req.done:
                    continue
                if (type(req) is not RecvRequest or not posted or posted[0] is not req
                        or self.unexpected or self.schedules or self.aborts or self._dead()):
                    return
                if req.addr:
                    peer = req.peer
                    d = self.lanes[peer] if self.lanes is not None else 0
                    st = self.inbound[peer]
                    if not d or st.have or st.target is not None:
                        return
                    self._complete_posted(peer, d, self.polls)
                else:  # a source on another host: the engine checks the stream and the head of the list itself
                    self.engine.take_posted_from_socket(req)
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
                    engine._send_ctl(peer, ACK, req.ctx, w[16], w[18])
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

