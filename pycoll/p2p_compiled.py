"""The engine's compiled lanes: loading the eager kernels, each shared-memory peer's lane words, and the frames
the kernels take, pull and acknowledge in place of the Python parser."""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Union

import numpy as np

from . import p2p_lane
from .p2p_protocol import (
    ACK,
    ACK_META,
    NO_DST,
    P2P_META,
    RTS_META,
    ANY_SOURCE,
    HEADER_SIZE,
    P2P_SPLIT,
    RDV_PULL_S_PER_BYTE,
    SPIN_US,
    RecvRequest,
    SendRequest,
)


# (sched_yield, kill) by machine: the system calls the kernels make through libc's syscall()
_SYSCALL_NUMBERS = {"x86_64": (24, 62), "amd64": (24, 62), "aarch64": (124, 129), "arm64": (124, 129)}


class CompiledLanes:
    """The engine's use of the compiled eager kernels on shared-memory lanes (mixed into ``p2p.Engine``)."""

    def _next_frame(self, peer: int, lane: tuple, dst: np.ndarray, ctx: int, tag: int, polls: int) -> tuple[int, int, int]:
        """One compiled step on ``peer``'s ring, its stream at a frame boundary, waiting up to ``polls`` polls for a
        frame: an acknowledgement of this rank's rendezvous is handled (ACKED); a plain message for a receive of
        (``ctx``, ``tag``; ``tag`` < -1: none) into ``dst`` is taken, or a rendezvous announcement for it pulled
        and acknowledged: (TAKEN, nbytes, tag). Otherwise (EMPTY or OTHER, 0, 0) with the frame left for the
        engine's path, or (-1, 0, 0) for a buffer the kernel does not take."""
        ch = lane[6]
        try:
            status, nbytes, got_tag, head, tail, rid = self._kernels.take_next(
                lane[3], lane[4], lane[5], ch.head, dst, ctx, tag, P2P_META, RTS_META, ACK_META,
                lane[0], lane[1], lane[2], -1 if self._sendq[peer] else ch.tail, self._readv, self._bounce, lane[7],
                polls)
        except TypeError:  # a buffer of a kind the kernel was not built for
            return -1, 0, 0
        if status == 0:  # TAKEN
            ch.consumed(head)
        elif status == 4:  # ACKED
            ch.consumed(head)
            self._acked(peer, rid)
            return 4, 0, 0
        elif status == 5:  # PULLED: copied from the sender, the announcement consumed
            ch.consumed(head)
            self.rdv_pulls += 1
            self.rdv_eager_pulls += 1
            if tail > 0:
                ch.published(tail)
            else:  # behind queued frames (or a full ring): in order, through the queue
                self._send_ctl(peer, ACK, ctx, got_tag, rid)
        elif status == 3:  # ANNOUNCED, not pulled here: the Python copy (which finds out why), or the engine's path
            if self._pull_announced(peer, lane, dst, ctx, nbytes, got_tag, head) is None:
                return 2, 0, 0
            return 0, nbytes, got_tag
        else:
            return status, 0, 0
        self._seen[peer] = (ctx, got_tag)
        return 0, nbytes, got_tag

    def take_now(self, peer: int, dst: np.ndarray, ctx: int, tag: int) -> Optional[tuple[int, int]]:
        """An Irecv's eager step, without waiting: first the frames already in the rings complete the receives posted
        before (compiled, in order), then, once none is left posted, the message for this receive is taken if it is
        at the head of ``peer``'s ring: ``(nbytes, tag)``, or None and the caller posts the receive."""
        lane = self._lanes.get(peer) if self._kernels is not None else self._kernels_due()
        if lane is None:  # the kernels are not in yet (or no ring to that peer): the Python step
            return None if self._posted else self.recv_eager(peer, dst, ctx, tag, spin=False)
        if self._unexpected or self._schedules or self._abort_requests or peer in self._dead:
            return None
        st = self._inbound[peer]
        if st.have or st.target is not None or not self.lock.acquire(False):
            return None
        try:
            if self._posted:
                if not lane[6].has_input():
                    return None
                self._drain()
                if self._posted or peer in self._dead:
                    return None
            try:
                status, nbytes, got_tag, head = self._kernels.take_plain(lane[3], lane[5], dst, ctx, tag, P2P_META, RTS_META)
            except TypeError:  # a buffer of a kind the kernel was not built for
                return None
            if status == 0:
                lane[6].consumed(head)
                self._seen[peer] = (ctx, got_tag)
                return nbytes, got_tag
            if status == 1:
                return None
            status = 4  # an announcement, or an acknowledgement ahead: the full step
            while status == 4:
                status, nbytes, got_tag = self._next_frame(peer, lane, dst, ctx, tag, 0)
            return (nbytes, got_tag) if status == 0 else None
        finally:
            self.lock.release()

    def _pull_announced(self, peer: int, lane: tuple, dst: np.ndarray, ctx: int, nbytes: int, tag: int,
                        head: int) -> Optional[tuple[int, int]]:
        """The rendezvous announced at ``head`` of ``peer``'s ring, for an eager receive into ``dst``: copy the bytes
        straight out of the sender (cross-memory attach), consume the announcement, acknowledge it. None, with the
        announcement left in the ring for the engine's path (which retries, or falls back to streaming), when the
        copy fails. The engine's lock is held."""
        ch = lane[6]
        w = (head % lane[3].size) // 8
        addr, rid = int(lane[4][w + 4]), int(lane[4][w + 5])
        if self._cma is None:
            from .transport.cma import CrossMemory

            self._cma = CrossMemory()
        if not self._cma.loaded:
            return None
        try:
            if nbytes:
                self._cma.read_addr(ch.peer_pid, dst.ctypes.data, addr, nbytes)
        except OSError:
            return None
        ch.consume(HEADER_SIZE)
        self._seen[peer] = (ctx, tag)
        self.rdv_pulls += 1
        self.rdv_eager_pulls += 1
        out = self._lanes.get(peer)
        tail = -1
        if out is not None and not self._sendq[peer] and peer not in self._dead:
            tail = self._kernels.put_header(out[0], out[1], out[2], out[6].tail, ctx, tag, 0, ACK_META, 0, rid)
        if tail > 0:
            out[6].published(tail)  # type: ignore[index]
        else:  # behind queued frames (or a full ring): in order, through the queue
            self._send_ctl(peer, ACK, ctx, tag, rid)
        return nbytes, tag

    def pull_polls(self, nbytes: int) -> int:
        """Polls a rendezvous send of ``nbytes`` spins for its acknowledgement on top of the usual spin: the
        receiver's pull of its bytes (none where ranks outnumber cores: the receiver needs the core)."""
        return 0 if self.oversubscribed else int(nbytes * self.kernel_polls_per_byte)

    def _await_ack(self, req: SendRequest) -> bool:
        """A blocking rendezvous send whose announcement has left: spin (compiled) for its acknowledgement as the
        next frame from the receiver; True once taken (the send is done), False to wait the engine's way."""
        peer = req.peer
        lane = self._lanes.get(peer)
        if lane is None or self._sendq[peer] or not self._can_take(peer) or not self.lock.acquire(blocking=False):
            return False
        try:
            ch = lane[6]
            data = self._rdv_data.get((peer, req.rdv))
            polls = self._kernel_spin_polls + self.pull_polls(data.nbytes if data is not None else 0)
            head = self._kernels.take_header(lane[3], lane[4], lane[5], ch.head, req.ctx, req.tag, ACK_META, req.rdv,
                                             polls)
            if head < 0:
                return False
            ch.consumed(head)
            self._rdv_sends.pop((peer, req.rdv), None)
            self._rdv_data.pop((peer, req.rdv), None)
            req.done = True
            return True
        finally:
            self.lock.release()

    @property
    def _kernel_spin_polls(self) -> int:
        """Polls an eager kernel spins for its frame: about the engine's spin, a few where ranks share cores."""
        return self._eager_kernel_polls if not self.oversubscribed else 4

    def _candidate(self, peer: int) -> tuple[int, Optional[RecvRequest]]:
        """The first posted receive that a message from ``peer`` could match (its index), if it is a plain
        point-to-point receive into a buffer; (-1, None) when there is none or it is not plain."""
        for i, req in enumerate(self._posted):
            if req.peer == peer or req.peer == ANY_SOURCE:
                if req.sig is None and req.ufunc is None and req.dst is not None:
                    return i, req
                return -1, None
        return -1, None

    def _drain(self) -> bool:
        """The compiled part of ``progress`` while only point-to-point traffic is pending: from each shared-memory
        ring at a frame boundary, take the frames that the first posted receive able to match them takes (a plain
        message, or a rendezvous announcement pulled at once) and the acknowledgements of this rank's rendezvous
        sends, in stream order, without spinning. The first frame it cannot place (another tag, a truncation, a
        collective's message) stops it: the generic path reads that one, so MPI's matching holds."""
        moved = False
        posted = self._posted
        dead = self._dead
        for peer, lane in self._lanes.items():
            if peer in dead or peer in self._pulling:
                continue
            st = self._inbound[peer]
            if st.have or st.target is not None:
                continue
            take_plain = self._kernels.take_plain
            while peer not in dead:
                i, req = self._candidate(peer) if posted else (-1, None)
                if req is not None and req.addr and self.lane_of is not None and self.lane_of[peer]:
                    status, nbytes, got_tag = self._take_into(peer, req)
                elif req is not None:
                    try:  # a plain message first: the cheapest call
                        status, nbytes, got_tag, head = take_plain(lane[3], lane[5], req.dst, req.ctx, req.tag, P2P_META, RTS_META)
                    except TypeError:  # a buffer of a kind the kernel was not built for
                        break
                    if status == 0:
                        lane[6].consumed(head)
                        self._seen[peer] = (req.ctx, got_tag)
                    elif status == 1:
                        break
                    else:  # an acknowledgement, an announcement, or the engine's path
                        status, nbytes, got_tag = self._next_frame(peer, lane, req.dst, req.ctx, req.tag, 0)  # type: ignore[arg-type]
                elif self._rdv_sends and self.lane_of is not None and self.lane_of[peer]:  # acknowledgements only
                    status, nbytes, got_tag = self._ack_into(peer), 0, 0
                elif self._rdv_sends:
                    status, nbytes, got_tag = self._next_frame(peer, lane, NO_DST, 0, -2, 0)
                else:
                    break
                if status == 4:
                    moved = True
                    continue
                if status != 0 or req is None:
                    break
                del posted[i]
                req.source, req.recv_tag, req.nbytes = peer, got_tag, nbytes
                req.done = True
                moved = True
        return moved

    def _ack_into(self, peer: int) -> int:
        """The address kernel's step for an acknowledgement of this rank's rendezvous at the head of ``peer``'s
        ring: ACKED (handled), or the status with the frame left (no receive can take anything here)."""
        status = self._kernels.take(self.lane_of[peer], 0, -1, 0, -1, 0, 0)  # type: ignore[index]
        if status == 4:
            self._acked(peer, self.lane_views[peer][18])
        return status

    def _take_into(self, peer: int, req: RecvRequest) -> tuple[int, int, int]:
        """The address kernel's step for posted receive ``req`` on ``peer``'s lane (no spin), in ``_next_frame``'s
        terms: (TAKEN, nbytes, tag) with the message in, (ACKED, 0, 0) after an acknowledgement, else (status, 0, 0)
        with the frame left for the generic path."""
        words = self.lane_views[peer]
        status = self._kernels.take(self.lane_of[peer], req.addr, req.dst.nbytes, req.ctx, req.tag, 0,  # type: ignore[union-attr]
                                    0 if self._sendq[peer] else 1)
        if status == 4:
            self._acked(peer, words[18])
            return 4, 0, 0
        if status >= 5:  # pulled from the sender
            self.rdv_pulls += 1
            self.rdv_eager_pulls += 1
            if status == 6:  # its acknowledgement queues behind this rank's sends
                self._send_ctl(peer, ACK, req.ctx, words[16], words[18])
            status = 0
        if status != 0:
            return status, 0, 0
        self._seen[peer] = (req.ctx, words[16])
        return 0, words[17], words[16]

    def sendrecv_eager(self, dest: int, payload: np.ndarray, send_tag: int, source: int, dst: np.ndarray,
                       recv_tag: int, ctx: int) -> Union[bool, tuple[int, int]]:
        """A Sendrecv's eager half-steps: False if the send did not leave whole (nothing done), True if it did but
        the receive was not taken (the caller posts it), ``(nbytes, tag)`` when both were done. Compiled, the two
        are one kernel call."""
        lanes = self._lanes
        out, inp = lanes.get(dest), lanes.get(source)
        if (out is not None and inp is not None and payload.nbytes <= self.eager_max and not self._sendq[dest]
                and dest not in self._dead and self._can_take(source) and self.lock.acquire(False)):
            try:
                try:
                    tail, status, nbytes, got_tag, head = self._kernels.exchange_plain(
                        out[0], out[2], payload, send_tag, ctx, inp[3], inp[5], dst, recv_tag, P2P_META, RTS_META,
                        self._kernel_spin_polls)
                except TypeError:  # a buffer of a kind the kernel was not built for: the separate steps below
                    tail = 0
                if tail < 0:
                    return False
                if tail > 0:
                    out[6].published(tail)
                    if status == 3:
                        return self._pull_announced(source, inp, dst, ctx, nbytes, got_tag, head) or True
                    if status != 0:
                        return True
                    inp[6].consumed(head)
                    self._seen[source] = (ctx, got_tag)
                    return nbytes, got_tag
            finally:
                self.lock.release()
        if not self.send_eager(dest, payload, ctx, send_tag):
            return False
        return self.recv_eager(source, dst, ctx, recv_tag) or True

    def _kernels_due(self) -> None:
        """On the first eager call and every 64th after it, until the compiled kernels are in, ask whether they are
        (from the 64th on, the asking starts their load: a job that sends a few messages never loads them); once
        they are, eager calls use them. Always None: the caller runs this call in Python."""
        self._eager_calls += 1
        if self._eager_calls & 63 != 1 or self.kernel_source is None:
            return None
        k = self.kernel_source(self._eager_calls > 1)
        if k is False:
            self.kernel_source = None
        elif k is not None:
            self._lanes = {p: ch.kernel_lane() + (ch, ch.peer_pid) for p, ch in self.channels.items()
                           if hasattr(ch, "kernel_lane") and p in self._has_input and p not in self._closed}
            self._readv = self._cma_address("read")
            self._bounce = bool(self._readv) and self._cma.bounces
            self._kernels = k
            poll_s = self._poll_seconds(k)
            self._eager_kernel_polls = max(int(SPIN_US.get() * 1e-6 / poll_s), 1)
            # a rendezvous send also spins out the receiver's pull before it sleeps
            self.kernel_polls_per_byte = RDV_PULL_S_PER_BYTE / poll_s
            self._build_lanes(k)
        return None

    def _build_lanes(self, k: Any) -> None:
        """The lane words of every shared-memory peer for the address-based kernels (``p2p_lane.L_*``)."""
        import ctypes

        from .transport.futex import _SYS_FUTEX

        try:
            syscall = int(ctypes.cast(ctypes.CDLL(None).syscall, ctypes.c_void_p).value or 0)
        except (OSError, AttributeError):
            syscall = 0
        yield_nr, kill_nr = _SYSCALL_NUMBERS.get(os.uname().machine.lower(), (-1, -1)) if syscall else (-1, -1)
        writev = self._cma_address("write") if P2P_SPLIT.get() and not self.oversubscribed and self._readv else 0
        lane_of = [0] * (max(self.channels) + 1)
        for p, ch in self.channels.items():
            if not hasattr(ch, "lane_addresses") or p not in self._has_input or p in self._closed or p in self._dead:
                continue
            words = np.zeros(p2p_lane.LANE_WORDS, np.int64)
            words[: p2p_lane.L_BELL + 1] = ch.lane_addresses()
            words[p2p_lane.L_SYSCALL] = syscall if _SYS_FUTEX is not None else 0
            words[p2p_lane.L_FUTEX] = _SYS_FUTEX or 0
            words[p2p_lane.L_PID] = ch.peer_pid
            words[p2p_lane.L_READV] = self._readv
            words[p2p_lane.L_META], words[p2p_lane.L_RTS], words[p2p_lane.L_ACK] = P2P_META, RTS_META, ACK_META
            words[p2p_lane.L_YIELD] = yield_nr if self.oversubscribed else -1
            words[p2p_lane.L_WRITEV] = writev
            words[p2p_lane.L_KILL] = kill_nr
            words[p2p_lane.L_BOUNCE] = self._bounce
            self._lane_words[p] = words
            self.lane_views[p] = memoryview(words).cast("B").cast("q")
            lane_of[p] = words.ctypes.data
        self.lane_of = lane_of

    def _drop_lane(self, peer: int) -> None:
        """No compiled call touches ``peer``'s rings any more (its channel failed or closes)."""
        if self.lane_of is not None and 0 <= peer < len(self.lane_of):
            self.lane_of[peer] = 0

    def _cma_address(self, kind: str) -> int:
        """The address of libc's process_vm_readv (``read``: the compiled rendezvous pull) or _writev (``write``: a
        sender's share of the copy); 0 where cross-memory attach is off or unavailable (announcements then go
        through the Python copy, which says why)."""
        if self._cma is None:
            from .transport.cma import CrossMemory

            self._cma = CrossMemory()
        return self._cma.function_address(kind)

    @staticmethod
    def _poll_seconds(k: Any) -> float:
        """How long one poll of ``eager_take``'s spin takes here, timed on a private empty ring."""
        data, words, dst = np.zeros(64, np.uint8), np.zeros(32, np.uint64), np.zeros(0, np.uint8)
        k.eager_take(data, data.view(np.uint64), words, 0, dst, 0, 0, 0, 0, 10)
        polls = 20_000
        t0 = time.perf_counter()
        k.eager_take(data, data.view(np.uint64), words, 0, dst, 0, 0, 0, 0, polls)
        return max((time.perf_counter() - t0) / polls, 1e-10)
