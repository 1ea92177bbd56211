"""The engine's progress: pushing queued sends, parsing each inbound stream into frames, matching them to
posted receives, rendezvous pulls and the unexpected-message queue."""

from __future__ import annotations

import logging
import errno
from collections import deque
from typing import Any, Optional

import numpy as np

from .errors import MismatchError, PeerFailureError, ProtocolError, PycollError
from .p2p_protocol import (
    ACK,
    HEADER,
    MAGIC,
    NAK,
    PAD_SINK,
    RDATA,
    RTS,
    SSEND,
    ZEROS,
    ALIGN,
    CONTROL_CTX,
    HEADER_SIZE,
    P2P_SIG,
    Inbound,
    Unexpected,
    RecvRequest,
    SendRequest,
    Sig,
    fits,
    unreachable,
)
from .transport.base import Channel

log = logging.getLogger("pycoll")


def _sliced(segments: list, limit: int) -> list:
    """The leading ``limit`` (> 0) bytes of ``segments`` (byte memoryviews), as segments."""
    out, left = [], limit
    for seg in segments:
        if len(seg) >= left:
            out.append(seg[:left])
            return out
        out.append(seg)
        left -= len(seg)
    return out


class Progress:
    """The engine's non-blocking progress over every channel and schedule (mixed into ``p2p.Engine``)."""

    def progress(self) -> bool:
        """Move every channel and every running schedule as far as possible, without blocking."""
        moved = False
        if self._lanes and (self._posted or self._rdv_sends) and not self._schedules:
            moved = self._drain()
        if self.split_sends and self._help_splits():
            moved = True
        dead = self._dead
        for peer, ch, q, st, has_input in self._peers:
            if peer in dead:  # its channel is closed (a peer failed while this loop ran): nothing to read or ask
                continue
            if q or st.have or st.target is not None or has_input is None or has_input():
                try:
                    if q and self._push(peer, q):
                        moved = True
                    if self._pull(peer):
                        moved = True
                except PeerFailureError as err:
                    self._channel_failed(peer, err.cause)
                    moved = True
        if self._schedules:
            for sched in list(self._schedules):
                if sched.advance():
                    moved = True
                if sched.done:
                    self._schedules.remove(sched)
        return moved

    def _help_splits(self) -> bool:
        """Write chunks of the oldest rendezvous sends still waiting into their receivers' buffers, where they have
        begun reading (``p2p_kernels.help_split``); forget the sends that are done. True if a chunk was written."""
        k, lane_of, pending = self._kernels, self.lane_of, self._rdv_sends
        live = 0
        wrote = 0
        for key, (d, src, n) in list(self.split_sends.items()):
            if key not in pending or k is None or lane_of is None or not lane_of[key[0]]:
                del self.split_sends[key]
                continue
            wrote += k.help_split(d, key[1], src, n)
            live += 1
            if live == 2:  # the receiver reads in order: the oldest are the ones it may be on
                break
        self.split_chunks += wrote
        return wrote > 0

    def _push(self, peer: int, q: deque) -> bool:
        ch = self.channels[peer]
        gather = getattr(ch, "send_gathered", None)  # a socket: a message's segments in one system call
        budget = (ch.push_slice or 1 << 62) if gather is not None else 0  # a socket's bytes per push, then a pull
        moved = False
        while q:
            req = q[0]
            segs = req.segments
            while req.index < len(segs):
                seg = segs[req.index]
                if gather is not None:
                    if budget <= 0:
                        return moved  # the rest after this peer's incoming bytes are read: both directions flow
                    n = gather(_sliced([seg[req.offset :] if req.offset else seg, *segs[req.index + 1 :]], budget))
                    budget -= n
                else:
                    n = ch.send_some(seg[req.offset :]) if req.offset else ch.send_some(seg)
                if n == 0:
                    return moved
                moved = True
                while n and req.index < len(segs):  # past the segments the socket took whole
                    left = len(segs[req.index]) - req.offset
                    if n < left:
                        req.offset += n
                        break
                    n -= left
                    req.index += 1
                    req.offset = 0
            if not req.rdv:
                req.done = True
            q.popleft()
        return moved

    def _pull(self, peer: int) -> bool:
        # Completing a message can run code that reads channels again (a failed cross-memory copy polls for
        # reports): a stream already being read higher up is left to that reader, and one closed meanwhile
        # (its peer failed) is not read again.
        if peer in self._pulling or peer in self._closed:
            return False
        self._pulling.add(peer)
        try:
            return self._pull_stream(peer)
        finally:
            self._pulling.discard(peer)
            cause = self._fail_after_pull.pop(peer, None)
            if cause is not None:  # the stream is read to its end now: what it said came first
                self._channel_failed(peer, cause)

    def _pull_stream(self, peer: int) -> bool:
        ch = self.channels[peer]
        st = self._inbound[peer]
        moved = False
        while peer not in self._closed:
            if st.target is None and st.have == 0:
                view = ch.peek()
                if len(view) >= HEADER_SIZE:  # a whole header in place: parse it there, and a whole frame at once
                    moved = True
                    self._on_header(peer, st, view)
                    if peer in self._closed:  # a rendezvous found the peer gone
                        return True
                    total = HEADER_SIZE + st.nbytes + st.pad
                    target = st.target
                    if st.nbytes and len(view) >= total:
                        if type(target) is RecvRequest and target.ufunc is None and target.error is None:
                            memoryview(target.dst.view(np.uint8))[: st.nbytes] = view[HEADER_SIZE : HEADER_SIZE + st.nbytes]  # type: ignore[union-attr]
                        elif type(target) is Unexpected:
                            memoryview(target.data)[:] = view[HEADER_SIZE:total - st.pad]
                            target.got = st.nbytes
                        else:
                            total = HEADER_SIZE
                        if total > HEADER_SIZE:
                            ch.consume(total)
                            st.got, st.pad = st.nbytes, 0
                            self._on_complete(peer, st)
                            st.target = None
                            continue
                    ch.consume(HEADER_SIZE)
                    if not st.nbytes and not st.pad:
                        self._on_complete(peer, st)
                        st.target = None
                        continue
                    st.have = HEADER_SIZE
            if st.target is None and st.have < HEADER_SIZE:  # reading a header
                n = ch.recv_some(memoryview(st.hdr)[st.have :])
                if n == 0:
                    return moved
                moved = True
                st.have += n
                if st.have < HEADER_SIZE:
                    continue
                self._on_header(peer, st)
            if st.got < st.nbytes:  # payload
                n = self._pull_payload(ch, st)
                if n == 0:
                    return moved
                moved = True
                continue
            if st.pad:
                n = ch.recv_some(PAD_SINK[: st.pad])
                if n == 0:
                    return moved
                st.pad -= n
                moved = True
                if st.pad:
                    continue
            self._on_complete(peer, st)
            st.have = 0
            st.target = None
            moved = True
        return moved

    def _pull_payload(self, ch: Channel, st: Inbound) -> int:
        target = st.target
        left = st.nbytes - st.got
        if isinstance(target, RecvRequest) and target.reduces and target.error is None:
            view = ch.peek(left)  # a socket reads up to the rest
            isz = target.dst.itemsize  # type: ignore[union-attr]
            n = min(len(view), left) // isz * isz
            if n == 0:
                if view and ch.ended:  # the stream ended inside an element: drop the fragment, and peek reports the end
                    ch.consume(len(view))
                    ch.peek()
                return 0
            i, j = st.got // isz, (st.got + n) // isz
            incoming = np.frombuffer(view[:n], dtype=target.dst.dtype)  # type: ignore[union-attr]
            target.ufunc(target.local[i:j], incoming, out=target.dst[i:j])  # type: ignore[index]
            del incoming
            ch.consume(n)
        elif isinstance(target, RecvRequest) and target.error is None:
            out = memoryview(target.dst.view(np.uint8))[st.got : st.nbytes]  # type: ignore[union-attr]
            n = ch.recv_some(out)
        elif isinstance(target, Unexpected):
            n = ch.recv_some(memoryview(target.data)[st.got :])
            target.got += n
        else:  # discarding the payload of a failed or mismatched receive
            n = ch.recv_some(memoryview(bytearray(min(left, 1 << 20))))
        st.got += n
        return n

    def _on_header(self, src: int, st: Inbound, hdr: Any = None) -> None:
        ctx, tag, nbytes, meta, root, count, vhash = HEADER.unpack_from(st.hdr if hdr is None else hdr)
        try:  # the largest message a peer may announce, read once per engine
            limit = self._max_message
        except AttributeError:
            from .transport.tcp import frame_limit

            limit = self._max_message = frame_limit()
        # Integer comparisons only; nothing is allocated from a length before it passed them.
        if meta >> 24 != MAGIC or nbytes > limit or (ctx == CONTROL_CTX and nbytes > 1 << 20):
            if meta >> 24 != MAGIC:
                why = f"bad magic {meta >> 24:#x}: the stream lost its framing"
            elif nbytes > limit:
                why = f"it announces {nbytes} bytes, more than the {limit}-byte limit (PYCOLL_MAX_MESSAGE)"
            else:
                why = f"a control message of {nbytes} bytes"
            log.warning("rank %d: closing the channel to rank %d: malformed message header (%s)", self.rank, src, why)
            raise ProtocolError(f"malformed message header from rank {src} ({why})", rank=self.rank, peers=[src])
        kind = meta & 0xFF
        if kind >= RTS and ctx != CONTROL_CTX:
            if kind == SSEND:
                self._on_sync(src, st, ctx, tag, nbytes, vhash)
                return
            if kind <= RDATA and self._on_rendezvous(src, st, kind, ctx, tag, nbytes, count, vhash):
                return
        sig = P2P_SIG if not meta & 0xFFFFFF and not root and not count and not vhash else \
            Sig(kind, (meta >> 8) & 0xFF, (meta >> 16) & 0xFF, root, count, vhash)
        st.ctx, st.tag, st.nbytes, st.sig, st.got, st.pad = ctx, tag, nbytes, sig, 0, -nbytes % ALIGN
        if ctx == CONTROL_CTX:
            st.target = Unexpected(src, ctx, tag, sig, nbytes)
            return
        self._seen[src] = (ctx, tag)
        req = self._match(src, ctx, tag)
        if req is None:
            if self._broken and unreachable(self._broken, self.tags_per_call, ctx, tag):  # a broken communicator's: its bytes are read and dropped
                st.target = None
                return
            u = Unexpected(src, ctx, tag, sig, nbytes)
            self._unexpected.append(u)
            st.target = u
            return
        st.target = req
        self._start_receive(req, src, sig, tag, nbytes)

    def _start_receive(self, req: RecvRequest, src: int, sig: Sig, tag: int, nbytes: int) -> None:
        """A message's header matched ``req``: fail it if the message does not fit the receive, else record where the
        message came from and have a buffer ready for its payload."""
        problem = self._check(req, src, sig, nbytes)
        if problem is not None:
            req.fail(problem)
        else:
            req.source, req.recv_tag, req.nbytes = src, tag, nbytes
            if req.dst is None:
                req.dst = np.empty(nbytes, np.uint8)

    def _on_rendezvous(self, src: int, st: Inbound, kind: int, ctx: int, tag: int, nbytes: int, addr: int, rid: int) -> bool:
        """A rendezvous frame; False for streamed rendezvous data, which the caller reads like any payload."""
        if kind == RDATA:
            req = self._rdv_recvs.pop((src, rid), None)
            st.ctx, st.tag, st.nbytes, st.sig, st.got, st.pad = ctx, tag, nbytes, P2P_SIG, 0, -nbytes % ALIGN
            st.target = req  # None (its receive failed meanwhile): the bytes are discarded
            return True
        st.nbytes = st.pad = st.got = 0
        st.target = None
        if kind == RTS:
            self._seen[src] = (ctx, tag)
            req = self._match(src, ctx, tag)
            if req is None:
                u = Unexpected(src, ctx, tag, P2P_SIG, 0)
                u.rdv = (rid, addr, nbytes)
                self._unexpected.append(u)
            else:
                self._rdv_pull(req, src, tag, rid, addr, nbytes)
            return True
        if kind == ACK:
            self._acked(src, rid)
            return True
        send = self._rdv_sends.pop((src, rid), None)
        payload = self._rdv_data.pop((src, rid), None)
        if send is not None and payload is not None:  # NAK: that peer cannot read this process; stream the payload
            self._cma_ok[src] = False
            n = payload.nbytes
            header = HEADER.pack(ctx, tag, n, RDATA | (MAGIC << 24), 0, 0, rid).ljust(HEADER_SIZE, b"\0")
            send.segments = [memoryview(header), payload] + ([memoryview(ZEROS[: -n % ALIGN])] if n % ALIGN else [])
            send.index = send.offset = send.rdv = 0
            self._enqueue(src, send)
        return True

    def _acked(self, src: int, rid: int) -> None:
        """``src`` acknowledged this rank's rendezvous (or synchronous send) ``rid``: the send is done."""
        send = self._rdv_sends.pop((src, rid), None)
        if self._rdv_data.pop((src, rid), None) is None or send is None:
            return
        if send.index < len(send.segments):  # a synchronous send still streaming its payload: its push completes it
            send.rdv = 0
        else:
            send.done = True

    def _rdv_pull(self, req: RecvRequest, src: int, tag: int, rid: int, addr: int, nbytes: int) -> None:
        """Copy an announced message straight out of the sender's buffer into the receive, then ack it."""
        problem = self._check(req, src, P2P_SIG, nbytes)
        if problem is not None:  # the receive fails here; the sender completes (its buffer is not read)
            req.fail(problem)
            self._send_ctl(src, ACK, req.ctx, tag, rid)
            return
        req.source, req.recv_tag, req.nbytes = src, tag, nbytes
        if req.dst is None:
            req.dst = np.empty(nbytes, np.uint8)
        if self._cma is None:
            from .transport.cma import CrossMemory

            self._cma = CrossMemory()
        try:
            if not self._cma.loaded:
                raise OSError(errno.ENOSYS, self._cma.reason or "cross-memory attach is unavailable")
            self._cma.read_addr(self.channels[src].peer_pid, req.dst.ctypes.data, addr, nbytes)  # type: ignore[attr-defined]
        except OSError as exc:
            if exc.errno == errno.ESRCH:  # the sender is gone; the receive fails with its channel (after its last words)
                self._rdv_recvs[(src, rid)] = req
                self._channel_failed(src, f"rank {src} exited while this rank copied its message (process_vm_readv: {exc.strerror})")
                return
            log.info("rank %d: cross-memory copy from rank %d failed (%s); it streams instead", self.rank, src, exc)
            self._rdv_recvs[(src, rid)] = req
            self._send_ctl(src, NAK, req.ctx, tag, rid)
            return
        req.done = True
        self.rdv_pulls += 1
        self._send_ctl(src, ACK, req.ctx, tag, rid)

    def _send_ctl(self, peer: int, kind: int, ctx: int, tag: int, rid: int) -> None:
        """A header-only rendezvous frame."""
        if peer in self._dead:
            return
        header = memoryview(HEADER.pack(ctx, tag, 0, kind | (MAGIC << 24), 0, 0, rid).ljust(HEADER_SIZE, b"\0"))
        self._enqueue(peer, SendRequest(self._ctl_owner, peer, ctx, tag, [header]))

    def _match(self, src: int, ctx: int, tag: int) -> Optional[RecvRequest]:
        for i, req in enumerate(self._posted):
            if fits(req, src, ctx, tag):
                del self._posted[i]
                return req
        return None

    def _check(self, req: RecvRequest, src: int, sig: Sig, nbytes: int) -> Optional[PycollError]:
        if req.sig is not None and sig != req.sig:
            return req.owner.error(
                MismatchError,
                f"rank {req.owner.to_comm(src)} called {req.owner.describe(sig)}, this rank called {req.owner.describe(req.sig)}",
                [src],
            )
        if req.dst is None:
            return None
        capacity = req.dst.nbytes
        if (req.reduces and nbytes != capacity) or nbytes > capacity:
            return req.owner.error(
                MismatchError,
                f"message of {nbytes} bytes from rank {req.owner.to_comm(src)} does not fit the {capacity}-byte receive buffer",
                [src],
            )
        return None

    def _on_complete(self, src: int, st: Inbound) -> None:
        target = st.target
        if isinstance(target, RecvRequest):
            target.done = True
        elif isinstance(target, Unexpected):
            if target.ctx == CONTROL_CTX:
                self._on_control(src, target)
            elif target.waiter is not None:
                self._deliver(target.waiter, target)

    def _bind_unexpected(self, req: RecvRequest, u: Unexpected) -> None:
        if u.rdv is not None:
            rid, addr, nbytes = u.rdv
            self._rdv_pull(req, u.src, u.tag, rid, addr, nbytes)
            return
        if u.sync:  # matched: the synchronous sender may complete
            self._send_ctl(u.src, ACK, u.ctx, u.tag, u.sync)
        problem = self._check(req, u.src, u.sig, u.data.nbytes)
        if problem is not None:
            req.fail(problem)
            return
        req.source, req.recv_tag, req.nbytes = u.src, u.tag, u.data.nbytes
        if u.got == u.data.nbytes:
            self._deliver(req, u)
        else:
            u.waiter = req

    def _deliver(self, req: RecvRequest, u: Unexpected) -> None:
        if req.dst is None:
            req.dst = u.data
        elif req.reduces:
            incoming = u.data.view(req.dst.dtype) if u.data.nbytes else req.dst[:0]
            req.ufunc(req.local, incoming, out=req.dst)
        elif u.data.nbytes:
            req.dst.view(np.uint8)[: u.data.nbytes] = u.data
        req.done = True

    def _on_sync(self, src: int, st: Inbound, ctx: int, tag: int, nbytes: int, sid: int) -> None:
        """The header of a synchronous send: read like a plain message, and acked to its sender once matched."""
        st.ctx, st.tag, st.nbytes, st.sig, st.got, st.pad = ctx, tag, nbytes, P2P_SIG, 0, -nbytes % ALIGN
        self._seen[src] = (ctx, tag)
        req = self._match(src, ctx, tag)
        if req is None:
            u = Unexpected(src, ctx, tag, P2P_SIG, nbytes)
            u.sync = sid  # acked by whichever receive takes it (_bind_unexpected)
            self._unexpected.append(u)
            st.target = u
            return
        st.target = req
        self._send_ctl(src, ACK, ctx, tag, sid)
        self._start_receive(req, src, P2P_SIG, tag, nbytes)
