"""Eager point-to-point paths that skip the engine's queues: small messages written straight into a peer's
ring or socket, and taken straight out of them while nothing else could match."""

from __future__ import annotations

import os
import select
import time
from typing import Any, Callable, Optional

import numpy as np

from .errors import PeerFailureError
from .p2p_protocol import (
    HEADER,
    OVERSUBSCRIBED_SPIN_US,
    P2P_META,
    SMALL_BYTES,
    U8,
    ZEROS,
    ALIGN,
    ANY_TAG,
    HEADER_SIZE,
    P2P_SIG,
    SPIN_US,
    TCP_EAGER_WAIT_MS,
    YIELD_US,
    SendRequest,
    Sig,
    frame_bytes,
    frame_head,
    head_ctx,
    head_tag,
    payload_bytes,
)
from .transport.base import Channel


# a first yield that took this long ran another task; one back this soon ran none (as ``_tcpframe.c``'s take, but
# timed from Python: on this VM a yield that runs nothing takes 0.73-1.03 us there (10th-99th percentile), so C's
# 1 us missed most of the votes back whenever the machine ran slower, and ranks apart again kept the short spin)
_HANDED_S = 4e-6
_KEPT_S = 2e-6


class EagerPaths:
    """The engine's eager calls, which move one small message without a request (mixed into ``p2p.Engine``)."""

    def send_now(self, peer: int, payload: np.ndarray, ctx: int, tag: int, sig: Sig) -> bool:
        """A collective's small message to a peer on another host in one system call, now (``send_eager`` with the
        call's signature); False, nothing sent, where it cannot go so (the caller sends through the engine)."""
        return self.send_frame_now(peer, frame_head(ctx, tag, payload.nbytes, sig), payload)

    def recv_now(self, peer: int, dst: np.ndarray, ctx: int, tag: int, sig: Sig) -> bool:
        """A collective's message of exactly ``dst.nbytes`` (flat bytes) from a peer on another host, taken straight
        from the socket (waiting as ``recv_eager`` does) while no receive is posted; False where the caller must
        post a receive instead (nothing consumed)."""
        return self.recv_frame_now(peer, frame_head(ctx, tag, dst.nbytes, sig), dst)

    def send_frame_now(self, peer: int, head: bytes, payload: np.ndarray, limit: int = SMALL_BYTES) -> bool:
        """``send_now`` with the frame's header already packed (``frame_head``): a caller that sends the same
        header it expects back packs it once. Payloads up to ``limit`` bytes go so (a receiver takes a frame
        straight from the socket only if it fits its staging area whole: ``frame_room``)."""
        sock = self._tcp_socks.get(peer)
        if sock is None or payload.nbytes > limit or self._sendq[peer] or peer in self._dead:
            return False
        return self._send_eager_tcp(peer, sock, payload, head)

    def frame_room(self, peer: int) -> int:
        """The largest payload of a frame from ``peer`` that ``recv_frame_now`` can take whole (0: none)."""
        ch = self.channels.get(peer)
        return max(0, getattr(ch, "staging_bytes", 0) - HEADER_SIZE - ALIGN) if peer in self._tcp_socks else 0

    def recv_frame_now(self, peer: int, head: bytes, dst: np.ndarray, spun: bool = False, yielded: bool = False) -> bool:
        """``recv_now`` for the frame whose header is exactly ``head`` (``frame_head``); ``spun``: the caller has
        spun its share already, and the wait goes on from yielding the core; ``yielded``: it has yielded too, and
        the wait goes on in the kernel."""
        # Only this call's own receives could match its frames (its exact context and tag): none may be posted
        # or buffered, else the next frame could be theirs. Other calls' schedules may run.
        if peer not in self._tcp_socks or not self._can_take(peer, True) or not self.lock.acquire(blocking=False):
            return False
        try:
            got = self._recv_eager_tcp(peer, dst, 0, 0, True, head, spun, yielded)
        finally:
            self.lock.release()
        return got is not None

    def send_eager(self, peer: int, payload: np.ndarray, ctx: int, tag: int) -> bool:
        """Write a small point-to-point message of flat bytes straight into ``peer``'s ring; False (nothing sent)
        unless it left whole: nothing queued before it, room in the ring, a channel that writes frames in place."""
        nbytes = payload.nbytes
        put = self._put_frame.get(peer)
        if put is None:
            sock = self._tcp_socks.get(peer)
            if sock is None or nbytes > self.eager_max or self._sendq[peer] or peer in self._dead:
                return False
            return self._send_eager_tcp(peer, sock, payload, frame_head(ctx, tag, nbytes, P2P_SIG))
        if nbytes > self.eager_max or self._sendq[peer] or peer in self._dead:
            return False
        lane = self._lanes.get(peer) if self._kernels is not None else self._kernels_due()
        if lane is not None:
            try:
                tail = self._kernels.put_plain(lane[0], lane[2], payload, ctx, tag, P2P_META)
            except TypeError:  # a buffer of a kind the kernel was not built for (strided, another dtype)
                tail = 0
            if tail > 0:
                lane[6].published(tail)
                return True
            if tail < 0:
                return False
        return put(HEADER.pack_into, (ctx, tag, nbytes, P2P_META, 0, 0, 0), payload, HEADER_SIZE,
                   frame_bytes(nbytes))

    def _send_eager_tcp(self, peer: int, sock: Any, payload: np.ndarray, head: bytes) -> bool:
        """A message to a peer on another host in one system call, header (``head``, packed) and payload together:
        small ones copied behind the header in the engine's frame buffer, larger ones by sendmsg's iovec. What the
        socket does not take at once queues behind, as the engine's own sends do (the user's buffer is free either
        way: the rest is a copy)."""
        if peer in self._swap_peers:  # in C: one sendmsg, nothing copied first
            if not self.lock.acquire(blocking=False):
                return False
            try:
                sent, _ = self.channels[peer].swap_frame(head, payload, None, None, 0)  # type: ignore
            finally:
                self.lock.release()
            return sent >= 0 and self._sent_eager_tcp(peer, head, payload, sent)
        nbytes = payload.nbytes
        pad = -nbytes % ALIGN
        total = HEADER_SIZE + nbytes + pad
        frame = self._frame
        if not self.lock.acquire(blocking=False):  # another thread is in the engine (and may use the frame buffer)
            return False
        try:
            if nbytes <= SMALL_BYTES:
                frame[: len(head)] = head  # the header's tail, up to HEADER_SIZE, stays zero
                if nbytes:
                    self._frame_bytes[HEADER_SIZE : HEADER_SIZE + nbytes] = payload_bytes(payload)
                    if pad:
                        frame[HEADER_SIZE + nbytes : total] = ZEROS[:pad]
                sent = sock.send(frame[:total])
            else:
                data = memoryview(payload if payload.dtype is U8 else payload.view(np.uint8)).cast("B")
                sent = sock.sendmsg([head, ZEROS[: HEADER_SIZE - len(head)], data, ZEROS[:pad]])
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return False  # nothing left: the engine's path finds the failure and reports it
        finally:
            self.lock.release()
        return self._sent_eager_tcp(peer, head, payload, sent)

    def _sent_eager_tcp(self, peer: int, head: bytes, payload: np.ndarray, sent: int) -> bool:
        """A frame of which the socket took ``sent`` bytes: the rest (copied) queues, and progress sends it (the
        user's buffer is free either way)."""
        nbytes = payload.nbytes
        pad = -nbytes % ALIGN
        if sent < HEADER_SIZE + nbytes + pad:
            whole = b"".join((head.ljust(HEADER_SIZE, b"\0"), memoryview(payload).cast("B"), ZEROS[:pad]))
            req = SendRequest(self._ctl_owner, peer, head_ctx(head), head_tag(head), [memoryview(whole)[sent:]])
            self._sendq[peer].append(req)
            self.tcp_eager_queued += 1
        self.tcp_eager_sends += 1
        return True

    def _recv_eager_tcp(self, peer: int, dst: np.ndarray, ctx: int, tag: int, spin: bool,
                        head: Optional[bytes] = None, spun: bool = False, yielded: bool = False
                        ) -> Optional[tuple[int, int]]:
        """``recv_eager`` from a peer on another host: its next frame, read from the socket into the channel's
        staging area and copied out, when it is this receive's message: a point-to-point frame of ``ctx`` and
        ``tag`` (or any tag) of up to ``dst.nbytes``, or, given ``head``, the collective frame with exactly that
        header. Waits as the engine does (polling the socket for PYCOLL_SPIN_US, then yielding the core for
        PYCOLL_YIELD_US), then in the kernel (poll) for up to PYCOLL_TCP_EAGER_WAIT_MS, while nothing else
        needs this rank; the engine's wait takes over after that. ``spun``: the spin was made already; ``yielded``: the
        yields too."""
        ch: Any = self.channels[peer]
        in_c = peer in self._swap_peers
        spin_until = deadline = 0.0
        if head is not None:
            nbytes = dst.nbytes
            want = frame_bytes(nbytes)
            if want > ch.staging_bytes:
                return None  # it cannot be shown whole: the engine's path
            got_tag = head_tag(head)
            hlen = len(head)
        else:
            want = HEADER_SIZE
        while True:
            if in_c and not ch.ended:  # the look and the spin in C (TcpChannel.swap_frame, take_message)
                spin_ns = int(self._spin_us() * 1e3) if spin and not spun else 0
                if head is not None:
                    status = ch.swap_frame(None, None, head, dst, spin_ns)[1]
                else:
                    status, nbytes, got_tag = ch.take_message(ctx, tag, tag == ANY_TAG, P2P_META, dst, spin_ns)
                if status == ch.TAKEN:
                    self._took_from_socket(peer, head_ctx(head) if head is not None else ctx, got_tag)
                    return nbytes, got_tag
                if status != ch.NOT_YET:
                    return None  # another frame is next, or the stream ended: the engine's path
                spun = spun or spin
            else:
                try:
                    view = ch.peek(want)
                except PeerFailureError:
                    return None  # the engine's path reports it
                if len(view) >= HEADER_SIZE:
                    if head is not None:
                        if view[:hlen] != head:
                            return None  # another call's message or a control frame: the engine's path
                    else:
                        got_ctx, got_tag, nbytes, meta, root, count, vhash = HEADER.unpack_from(view)
                        want = frame_bytes(nbytes)
                        if (got_ctx != ctx or (got_tag != tag and tag != ANY_TAG) or meta != P2P_META or root
                                or count or vhash or nbytes > dst.nbytes or want > ch.staging_bytes):
                            return None
                    if len(view) >= want:
                        if nbytes:
                            memoryview(dst)[:nbytes] = view[HEADER_SIZE : HEADER_SIZE + nbytes]
                        ch.consume(want)
                        self._took_from_socket(peer, head_ctx(head) if head is not None else ctx, got_tag)
                        return nbytes, got_tag
            if not spin or ch.ended:  # a frame cut short by the end of the stream: the engine's path reports it
                return None
            if not deadline:  # the engine's wait in small: spin, then yield the core, then sleep in the kernel
                now = time.monotonic()
                spin_until = now + (0.0 if spun else self._spin_us() * 1e-6)
                yield_until = spin_until + (0.0 if yielded else YIELD_US.get() * 1e-6)
                deadline = yield_until + TCP_EAGER_WAIT_MS.get() * 1e-3
                ready = self._readable.get(peer) or self._poller(peer, ch)
                voting = not yielded  # the first yield tells where the peer runs (``seen_cpu``)
            # until more bytes are in: a poll of the socket costs a third of a failed read
            while not ready(0):
                now = time.monotonic()
                if now < spin_until:
                    continue
                if now >= deadline or self._abort_requests or any(self._sendq.values()):
                    return None
                if now < yield_until:  # a sleeper's wake-up costs tens of µs: the peer's answer is usually sooner
                    if not voting:
                        os.sched_yield()
                        continue
                    voting = False
                    began = time.monotonic()  # the yield alone: the checks above cost half its time in Python
                    os.sched_yield()
                    took = time.monotonic() - began
                    came = bool(ready(0))
                    if took >= _HANDED_S and came:
                        self.seen_cpu(1)
                    elif took < _KEPT_S and not came:
                        self.seen_cpu(-1)
                    continue
                ready(max(1, int((deadline - now) * 1e3)))
                break

    def _took_from_socket(self, peer: int, ctx: int, tag: int) -> None:
        """What an eager receive from a socket records of the message it took: its context and tag (for the
        matching order), and the count."""
        self._seen[peer] = (ctx, tag)
        self.tcp_eager_recvs += 1

    def _spin_us(self) -> float:
        """How long a wait on a socket polls it before it yields the core (PYCOLL_SPIN_US; 2 µs where the ranks
        outnumber the cores, or where waits found the peer sharing this CPU, unless set)."""
        if SPIN_US.is_set() or not (self.oversubscribed or self.cpu_shared):
            return SPIN_US.get()
        return OVERSUBSCRIBED_SPIN_US

    def seen_cpu(self, vote: int) -> None:
        """What a wait's first yield showed (``TcpChannel.swap_frame``'s ``cpu_seen``, or a receive's own in
        ``_recv_eager_tcp``): 1, another task ran on this CPU and the awaited frame came in meanwhile (the peer may
        share the CPU, and a spin only keeps it from sending); -1, the yield came back at once with the frame still
        out (the peer runs elsewhere). Two votes more one way than the other switch the socket waits to the short
        spin, or back."""
        votes = self._cpu_votes = max(-2, min(2, self._cpu_votes + vote))
        if votes == 2:
            self.cpu_shared = True
        elif votes == -2:
            self.cpu_shared = False

    def _poller(self, peer: int, ch: Channel) -> Callable[[int], list]:
        """``poll(ms)`` on the socket of ``peer`` alone, for input (and its end), kept per peer."""
        poller = select.poll()
        poller.register(ch.fileno(), select.POLLIN | select.POLLPRI)
        self._readable[peer] = poller.poll
        return poller.poll

    def recv_eager(self, peer: int, dst: np.ndarray, ctx: int, tag: int, spin: bool = True) -> Optional[tuple[int, int]]:
        """Receive one small point-to-point message from ``peer`` straight out of its ring into ``dst`` (flat bytes),
        polling only that ring for a short spin (none unless ``spin``: a frame already there or nothing):
        ``(nbytes, tag)``, or None with nothing consumed, and the caller posts a receive. Taken only while no receive
        is posted, nothing unexpected is buffered, no schedule runs and the stream sits at a frame boundary, so MPI's
        matching order holds."""
        if not self._can_take(peer) or not self.lock.acquire(blocking=False):
            return None
        try:
            if peer in self._tcp_socks:
                return self._recv_eager_tcp(peer, dst, ctx, tag, spin)
            lane = self._lanes.get(peer) if self._kernels is not None else self._kernels_due()
            if lane is not None:
                polls = self._kernel_spin_polls if spin else 0
                status = 4
                while status == 4:  # acknowledgements ahead of the message are handled on the way
                    status, nbytes, got_tag = self._next_frame(peer, lane, dst, ctx, tag, polls)
                if status == 0:
                    return nbytes, got_tag
                if status > 0:
                    return None
            has_input = self._has_input[peer]
            if not has_input():
                polls = (self._eager_polls if not self.oversubscribed else 4) if spin else 0
                while polls and not has_input():
                    polls -= 1
                if not polls:
                    return None
            ch = self.channels[peer]
            view = ch.peek()
            if len(view) < HEADER_SIZE:
                return None
            got_ctx, got_tag, nbytes, meta, root, count, vhash = HEADER.unpack_from(view)
            total = frame_bytes(nbytes)
            if (got_ctx != ctx or (got_tag != tag and tag != ANY_TAG) or meta != P2P_META or root or count or vhash
                    or nbytes > dst.nbytes or len(view) < total):
                return None  # another call's message, a rendezvous, a bad fit or a split frame: the engine's path
            if nbytes:
                memoryview(dst)[:nbytes] = view[HEADER_SIZE : HEADER_SIZE + nbytes]
            ch.consume(total)
            self._seen[peer] = (ctx, got_tag)
            return nbytes, got_tag
        finally:
            self.lock.release()

    def take_posted_from_socket(self, req: Any) -> bool:
        """A posted point-to-point receive ``req``, first in the posted list, from a peer on another host: its message
        of up to ``frame_room`` taken in C from the socket as a fresh receive takes it (``recv_eager``: the spin,
        the yields, then the kernel's wait for up to PYCOLL_TCP_EAGER_WAIT_MS), where nothing else could match it
        first (nothing unexpected buffered, no schedule running, the stream at a frame boundary) and nothing this
        rank owes a peer is queued (the peer may wait for it before it sends). Posted again, first, where the
        message did not come or another frame is next. Whether it completed; the engine's lock is held."""
        posted, peer = self._posted, req.peer
        if (not posted or posted[0] is not req or peer not in self._tcp_socks or type(req.dst) is not np.ndarray
                or req.dst.nbytes > self.frame_room(peer) or req.local is not None or req.sig is not None
                or self._unexpected or self._schedules or self._abort_requests or any(self._sendq.values())):
            return False  # a frame past the staging area is read straight into place by the engine
        st = self._inbound.get(peer)
        if st is None or st.have or st.target is not None:
            return False
        del posted[0]
        got = self._recv_eager_tcp(peer, req.dst, req.ctx, req.tag, True)
        if got is None:
            posted.insert(0, req)
            return False
        req.source, req.recv_tag, req.nbytes = peer, got[1], got[0]
        req.done = True
        self.posted_socket_takes += 1
        return True

    def _can_take(self, peer: int, schedules_may_run: bool = False) -> bool:
        """Whether an eager receive from ``peer`` keeps MPI's matching order: no receive posted, nothing unexpected
        buffered, no schedule running (unless ``schedules_may_run``: a collective's frames, which only its own
        receives match), its stream at a frame boundary of a shared-memory ring or a socket."""
        if self._posted or self._unexpected or (self._schedules and not schedules_may_run) or self._abort_requests:
            return False
        st = self._inbound.get(peer)
        return ((peer in self._has_input or peer in self._tcp_socks) and peer not in self._dead and not st.have  # type: ignore[union-attr]
                and st.target is None)  # type: ignore[union-attr]

