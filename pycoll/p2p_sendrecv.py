"""The compiled point-to-point Sendrecv of one communicator: the send and the receive in one kernel call, or by
rendezvous both ways, falling back to the engine as the separate calls do."""

from __future__ import annotations

import ctypes
from typing import Any, Optional

from .p2p_protocol import ACK, SENDRECV_CMA_BYTES, TAG_MAX
from .p2p_lane import EMPTY
from .p2p_specs import cached_spec, flat_bytes_of, resolve_spec

_memmove = ctypes.memmove


class SendRecv:
    """The compiled Sendrecv: both halves in one kernel call where they can be (mixed into ``p2p_fast.FastP2P``)."""

    __slots__ = ()

    def sendrecv(self, sendbuf: Any, dest: Any, sendtag: Any, recvbuf: Any, source: Any, recvtag: Any,
                 status: Any) -> Optional[tuple]:
        """A Sendrecv: both messages eager in one kernel call, or the send by rendezvous with the peer's message
        taken (pulled) and the acknowledgement awaited in one kernel call; what is left over goes to the engine
        here. None when done, else (send bytes, receive bytes) for the engine's path (nothing done)."""
        r = cached_spec(recvbuf, True) or resolve_spec(self.comm, recvbuf, "Sendrecv", True)
        s = cached_spec(sendbuf, False) or resolve_spec(self.comm, sendbuf, "Sendrecv", False)
        if dest == source and type(dest) is int and dest == self.comm._rank and self._to_self(s, r, sendtag, recvtag,
                                                                                               status):
            return None
        lanes = self.lanes or self._lanes()
        if (lanes is None or type(dest) is not int or type(sendtag) is not int or type(source) is not int
                or type(recvtag) is not int or not 0 <= dest < self.size or not 0 <= source < self.size
                or not 0 <= sendtag <= TAG_MAX or not -1 <= recvtag <= TAG_MAX):
            return flat_bytes_of(s), flat_bytes_of(r)
        speer, rpeer = self.world[dest], self.world[source]
        dd, ds = lanes[speer], lanes[rpeer]
        if self.unexpected and dd and ds:
            return self._buffered(s, r, speer, dd, dest, sendtag, source, rpeer, recvtag, status)
        if (not dd or not ds or self.sendq[speer] or not self._quiet(rpeer) or self._dead()
                or not self.lock.acquire(False)):
            return flat_bytes_of(s), flat_bytes_of(r)
        engine = self.engine
        ctx = self.ctx
        try:
            n = s[6]
            # each rank pulls its peer's message at once: one copy each (where each has a core to pull with)
            by_rdv = n >= SENDRECV_CMA_BYTES.get() and not engine.oversubscribed and engine._cma_to(speer)
            if n <= self.eager_max and not by_rdv:
                got = self.k.exchange(dd, ds, s[5], n, sendtag, r[5], r[6], recvtag, ctx, self.polls,
                                      0 if self.sendq[rpeer] else 1)
                if got == 7:  # NOT_SENT: no room for it
                    return flat_bytes_of(s), flat_bytes_of(r)
                if got == 4:  # an acknowledgement was ahead: go on taking
                    engine._acked(rpeer, self.words[rpeer][18])
                    got = self._take(rpeer, ds, r, recvtag, self.polls)
                elif got >= 5:  # pulled from the sender
                    engine.rdv_pulls += 1
                    engine.rdv_eager_pulls += 1
                    if got == 6:
                        w = self.words[rpeer]
                        engine._send_ctl(rpeer, ACK, ctx, w[16], w[18])
                    got = 0
                if got == EMPTY and self.linger_s:  # sent: wait on for the peer's message
                    got = self._linger(rpeer, ds, r, recvtag)
                sreq = None
                received = got == 0
            elif by_rdv or engine._rdv_ok(speer, n):
                sreq, received = self._exchange_rdv(speer, rpeer, dd, ds, s, r, dest, sendtag, recvtag)
                if sreq is False:
                    return flat_bytes_of(s), flat_bytes_of(r)
            else:
                return flat_bytes_of(s), flat_bytes_of(r)
        finally:
            self.lock.release()
        comm = self.comm
        if not received:
            rreq = comm._irecv_array(flat_bytes_of(r), source, recvtag, "Sendrecv")
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

    def _buffered(self, s: tuple, r: tuple, speer: int, dd: int, dest: int, sendtag: int, source: int, rpeer: int,
                  recvtag: int, status: Any) -> Optional[tuple]:
        """A Sendrecv whose message may have come while this rank was in another call (after a receive the
        engine completed, which reads on past its frame): taken from the buffer, then the send written into the
        peer's ring on lane ``dd`` (or sent by the engine where it does not fit). The flat bytes for the engine's
        path, nothing done, where no buffered message matches or it needs the engine."""
        got = None if self.schedules or self.aborts or self._dead() else self._take_buffered(rpeer, r, recvtag)
        if got is None:
            return flat_bytes_of(s), flat_bytes_of(r)
        if self.sendq[speer] or s[6] > self.eager_max or not self.k.put(dd, s[5], s[6], self.ctx, sendtag):
            comm = self.comm
            comm._p2p_wait(comm._isend_array(flat_bytes_of(s), dest, sendtag, "Sendrecv"))
        if status is not None:
            status.source, status.tag, status.nbytes = source, got[0], got[1]
        return None

    def _to_self(self, s: tuple, r: tuple, sendtag: Any, recvtag: Any, status: Any) -> bool:
        """A Sendrecv with this rank itself (a ring of one, a periodic dimension of one): where nothing else pending
        could match first (nothing posted, buffered or in flight to itself), the receive takes the send's bytes
        straight away, as MPI's order has it. False, having done nothing, otherwise (and where the tags do not
        match or the message is too long: the engine's path waits or names the error)."""
        me = self.world[self.comm._rank]
        if (type(sendtag) is not int or type(recvtag) is not int or not 0 <= sendtag <= TAG_MAX
                or recvtag not in (-1, sendtag) or s[6] > r[6] or self.sendq.get(me) or self._dead()):
            return False
        ch = self.engine.channels.get(me)
        if ch is None or ch.has_input() or not self._quiet(me) or not self.lock.acquire(False):
            return False
        try:
            if self.posted or self.unexpected or ch.has_input():  # rechecked under the lock
                return False
            if s[6]:
                _memmove(r[5], s[5], s[6])
        finally:
            self.lock.release()
        if status is not None:
            status.source, status.tag, status.nbytes = self.comm._rank, sendtag, s[6]
        return True

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
                engine._send_ctl(rpeer, ACK, ctx, w[16], w[18])
            if not state & 16:
                break
            engine._acked(rpeer, self.words[rpeer][18])  # ACKED_OTHER: another send of this rank is done; go on
        # exchange_rdv offers no split (this rank pulls its own receive meanwhile): nothing for the wait to help
        sreq = None if state & 2 else self._pending_send(speer, rid, dd, s, "Sendrecv", dest, sendtag, offered=False)
        return sreq, bool(state & 4)
