"""The engine's frames to peers on other hosts moved in C (``transport/_tcpframe.c``): a two-rank call's frame each
way in one call (``frame_swapper``, for ``pycoll.paired``), a direct collective's large frames to several hosts at
once (``exchange_frames``), and a large point-to-point Sendrecv with one partner (``sendrecv_frames``). What C could
not finish is handed to the engine's queues and parser."""

from __future__ import annotations

import struct
from typing import Any, Callable, Optional

import numpy as np

from .p2p_protocol import (
    ALIGN,
    HEADER_SIZE,
    P2P_SIG,
    SPIN_US,
    TCP_EAGER_WAIT_MS,
    YIELD_US,
    ZEROS,
    Owner,
    RecvRequest,
    SendRequest,
    Sig,
    frame_bytes,
    frame_head,
    head_ctx,
    head_tag,
    payload_bytes,
)
from .config import _ENV_BYTES
from .memory import HOST
from .transport import tcp as _tcp

_TAG = struct.Struct("<q")  # a frame header's tag field, at offset 8
_TAKEN = _tcp.TcpChannel.TAKEN  # an exchanged frame that came in whole (from a socket or a ring alike)


class FramePaths:
    """Collective frames through C over the sockets to other hosts (mixed into ``p2p.Engine``; it uses the eager
    paths of ``p2p_eager.EagerPaths`` where C cannot take a frame)."""

    def frame_swapper(self, peer: int) -> Callable[..., tuple[bool, bool]]:
        """``swap(ctx, tag, head_out, out, head_in, into, limit)``: ``send_frame_now`` of ``out`` and
        ``recv_frame_now`` into ``into`` (contiguous arrays of up to ``limit`` bytes, at most ``frame_room``; either
        None: no frame that way) in one call into C where the socket's channel has it (``TcpChannel.swap_frame``),
        returning whether each moved. The headers are a plan's, made once with the call's context ``ctx`` and tag 0
        (``frame_head``); the call's ``tag`` goes into both in C. A frame that did not move is the caller's to move
        through the engine, as with the two calls. Made once per plan (``pycoll.paired``): a small call's whole
        Python share of its socket is this function, over the parts of the engine's state bound here."""
        in_python = self._swap_in_python
        if peer not in self._swap_peers:
            return lambda ctx, tag, head_out, out, head_in, into, limit: in_python(peer, tag, head_out, out, head_in,
                                                                                  into, limit)
        ch: Any = self.channels[peer]
        sendq, dead, can_take, seen = self._sendq[peer], self._dead, self._can_take, self._seen
        acquire, release = self.lock.acquire, self.lock.release
        swap_frame, spin_us, yield_us, taken, not_yet = ch.swap_frame, self._spin_us, YIELD_US.get, ch.TAKEN, ch.NOT_YET
        engine = self
        # the wait's budgets in ns, worked out again only when PYCOLL_SPIN_US or PYCOLL_YIELD_US changes, or what the
        # waits found of the peer's CPU (``seen_cpu``)
        read = _ENV_BYTES.get if _ENV_BYTES is not None else lambda key: object()
        spin_key, yield_key, budgets = SPIN_US.env_key, YIELD_US.env_key, [(), 0, 0]

        def swap(ctx: int, tag: int, head_out: Optional[bytes], out: Optional[np.ndarray], head_in: Optional[bytes],
                 into: Optional[np.ndarray], limit: int) -> tuple[bool, bool]:
            # a receive taken here keeps MPI's matching order only with nothing else that could match
            if (ch.ended or sendq or peer in dead or (out is not None and out.nbytes > limit)
                    or (into is not None and (into.nbytes > limit or not can_take(peer, True)))
                    or not acquire(False)):
                return in_python(peer, tag, head_out, out, head_in, into, limit)
            try:  # the whole wait short of sleeping, in C: the spin, then the yields
                if into is None:
                    count, status = swap_frame(head_out, out, None, None, 0, 0, tag)
                else:
                    raw = (read(spin_key), read(yield_key), engine.cpu_shared)
                    if raw != budgets[0]:
                        budgets[:] = raw, int(spin_us() * 1e3), int(yield_us() * 1e3)
                    count, status = swap_frame(head_out, out, head_in, into, budgets[1], budgets[2], tag)
                    if ch.cpu_seen:
                        engine.seen_cpu(ch.cpu_seen)
            finally:
                release()
            whole = out is None or count == HEADER_SIZE + out.nbytes + (-out.nbytes % ALIGN)  # ``frame_bytes``
            if whole:
                sent = True
                engine.tcp_eager_sends += out is not None
            else:  # in part (the rest queues), or not at all (the engine's path finds the failure)
                sent = count >= 0 and engine._sent_eager_tcp(peer, _tagged(head_out, tag), payload_bytes(out), count)  # type: ignore[arg-type]
            if into is None:
                return sent, True
            if status == taken:
                seen[peer] = (ctx, tag)
                engine.tcp_eager_recvs += 1
                return sent, True
            if status == not_yet:  # the rest of the wait (sleeping, or yielding where the frame left in part) in Python
                return sent, engine.recv_frame_now(peer, _tagged(head_in, tag), payload_bytes(into), spun=True,
                                                   yielded=whole)
            return sent, False  # another frame is next, or the stream ended: the engine's path takes or names it

        return swap

    def _swap_in_python(self, peer: int, tag: int, head_out: Optional[bytes], out: Optional[np.ndarray],
                        head_in: Optional[bytes], into: Optional[np.ndarray], limit: int) -> tuple[bool, bool]:
        """``frame_swapper``'s swap where C cannot take the frames: the two eager calls."""
        sent = out is None or self.send_frame_now(peer, _tagged(head_out, tag), payload_bytes(out), limit)
        return sent, into is None or self.recv_frame_now(peer, _tagged(head_in, tag), payload_bytes(into))

    def swaps_with(self, peer: int) -> bool:
        """Whether frames to and from ``peer`` (on another host) can move in C (``exchange_frames``)."""
        return peer in self._swap_peers

    def exchanges_blocks_with(self, peer: int) -> bool:
        """Whether a plan's frames to and from ``peer`` (on another host) can move in one call into C straight into
        place, whatever their size (``frame_exchanger``)."""
        return _tcp.exchange_blocks is not None and peer in self._swap_peers

    def exchanges_with(self, peer: int) -> bool:
        """Whether ``peer``'s frames can join an exchange in C that a peer on another host takes part in: that peer's,
        or one of this host's through its rings (PYCOLL_EXCHANGE_RINGS)."""
        return peer in self._swap_peers or peer in self._ring_peers

    def exchange_frames(self, moves: list, ctx: int, tag: int, sig: Sig, owner: Owner) -> list:
        """A collective's frames to and from several peers on other hosts, moved together in one call into C
        (``_tcpframe.exchange``), with those of this host's peers through their rings (PYCOLL_EXCHANGE_RINGS) where
        a socket takes part: ``moves`` holds (peer, out, into), flat bytes or None. For each, (send, receive):
        True where it moved whole, the engine's request where it moved in part (the engine finishes it), None where
        it did not start (the caller sends or receives through the engine). Every socket is polled with the others:
        the spin and yields of a wait, then up to PYCOLL_TCP_EAGER_WAIT_MS in the kernel since the last byte moved."""
        results: list = [(None, None)] * len(moves)
        if _tcp.exchange is None or not self._swap_peers or not self.lock.acquire(blocking=False):
            return results
        try:
            flows, parts = [], []
            left_out = False  # a send that the engine makes after this
            slices = []  # the sockets' push slices
            for i, (peer, out, into) in enumerate(moves):
                ch: Any = self.channels.get(peer)
                socket = peer in self._swap_peers
                if (not socket and peer not in self._ring_peers) or ch.ended or peer in self._dead \
                        or peer in self._closed or len(flows) == _tcp.EXCHANGE_FLOWS:
                    left_out = left_out or out is not None
                    continue
                head_out = frame_head(ctx, tag, out.nbytes, sig) if out is not None and not self._sendq[peer] else None
                head_in = None
                if into is not None and self._can_take(peer, True):
                    head_in = head_out if out is not None and out.nbytes == into.nbytes and head_out else \
                        frame_head(ctx, tag, into.nbytes, sig)
                left_out = left_out or (out is not None and head_out is None)
                if head_out is None and head_in is None:
                    continue
                flows.append(ch.flow(head_out, out if head_out else None, head_in, into if head_in else None))
                parts.append((i, peer, ch, socket, head_out, out, head_in, into))
                if socket:
                    slices.append(ch.push_slice)
            if not slices:  # rings alone: the engine's path, which sleeps on their doorbell
                return results
            # C waits for frames only where nothing this rank owes could be what a peer waits for before it sends
            # them: no bytes of another call queued, no send of this one left out, no other call in progress
            owed = (left_out or self._posted or len(self._schedules) > 1
                    or any(req.ctx != ctx or req.tag != tag for q in self._sendq.values() for req in q))
            self.exchanges_unwaited += bool(owed)
            budgets = (0, 0, 0) if owed else (int(self._spin_us() * 1e3), int(YIELD_US.get() * 1e3),
                                               int(TCP_EAGER_WAIT_MS.get() * 1e6))
            states = _tcp.exchange(flows, *budgets, min(slices))  # as the engine writes
            for part, state in zip(parts, states):
                i, peer, ch, socket, head_out, out, head_in, into = part
                results[i] = self._settle_flow(peer, ch, socket, head_out, out, head_in, into, state, ctx, tag, sig,
                                               owner)
        finally:
            self.lock.release()
        return results

    def sendrecv_frames(self, peer: int, out: np.ndarray, into: np.ndarray, ctx: int, tag: int, owner: Owner,
                        timeout: Optional[float]) -> int:
        """A point-to-point Sendrecv with ``peer`` over a socket, one tag both ways: both frames in one call into C
        (``exchange_frames``), the way a two-rank collective moves its blocks. The peer's message is taken there only
        where its header is the one expected (``tag``, ``into``'s length) and nothing posted or buffered earlier could
        match it; else the engine's receive takes it, as it does whatever C moved in part. Waits for both within
        ``timeout`` and returns the bytes received; raises a request's error."""
        sent, got = self.exchange_frames([(peer, out, into)], ctx, tag, P2P_SIG, owner)[0]
        send = self.isend(peer, out, ctx, tag, P2P_SIG, owner) if sent is None else sent
        recv = self.irecv(peer, into, ctx, tag, None, owner) if got is None else got
        reqs = [r for r in (recv, send) if r is not True]  # the receive's error first
        pending = [r for r in reqs if not r.done]
        if pending:
            self.wait_requests(pending, timeout, owner)
        for req in reqs:
            if req.error is not None:
                raise req.error
        return into.nbytes if recv is True else recv.nbytes

    def _settle_flow(self, peer: int, ch: Any, socket: bool, head_out: Optional[bytes], out: Any,
                     head_in: Optional[bytes], into: Any, state: tuple, ctx: int, tag: int, sig: Sig,
                     owner: Owner) -> tuple:
        """One flow after ``_tcp.exchange`` (its ``state``; the headers as sent, tagged): the channel's staging bounds
        taken back, and for each way True where the frame moved whole, the engine's request where it moved in part,
        None where it did not start (or was not asked)."""
        sent, got, status, start, end, _ = state
        ch.settle(start, end)
        sending = receiving = None
        if head_out is not None:
            sending = True if sent == frame_bytes(out.nbytes) else self._queue_rest(peer, head_out, out, sent, owner)
        if head_in is not None and got:
            receiving = True if status == _TAKEN else self._resume_frame(peer, head_in, into, got, sig, owner)
            if socket:
                self._took_from_socket(peer, ctx, tag)
            else:
                self._seen[peer] = (ctx, tag)
        for moved in (sending, receiving):
            if moved is True:
                self.frames_exchanged += 1
                self.ring_frames_exchanged += not socket
            elif moved is not None:
                self.frames_handed_on += 1
                self.ring_frames_handed_on += not socket
        return sending, receiving

    def frame_exchanger(self, blocks: list, ctx: int, sig: Sig) -> Optional[Callable[..., Optional[list]]]:
        """``exchange(tag, send, recv, make_owner)``: ``exchange_or_post`` of one frame each way with each peer of
        ``blocks``, (peer, out_start, out_stop, in_start, in_stop) in bytes of a plan's send and receive buffers,
        made once for a plan whose calls differ only in their tag and buffers (``pycoll.exchanged``), as
        ``frame_swapper`` is for one peer: the whole exchange is one call into C (``exchange_blocks``), the headers
        made here with tag 0 and the call's tag put in there. ``local`` (source, target): the rank's own block copied
        into its result by the same call, in C while the sockets wait where it is one plain memcpy
        (``HostMemory.plain``), else after the frames; made whenever the call does not return None. It returns the
        requests still to wait on (none where
        every frame moved whole; ``make_owner()`` names them otherwise), or None, having done nothing, where the
        engine's state asks for the general path (a queued send, a posted or unexpected receive, a frame in part, a
        schedule running, a dead or closed peer, the lock held). None where it cannot serve these peers."""
        peers = [block[0] for block in blocks]
        if (_tcp.exchange_blocks is None or not 0 < len(peers) <= _tcp.EXCHANGE_FLOWS
                or not any(p in self._swap_peers for p in peers) or not all(self.exchanges_with(p) for p in peers)):
            return None
        parts, heads, watched = [], [], []
        for peer, out_start, out_stop, in_start, in_stop in blocks:
            ch: Any = self.channels[peer]
            head_out = frame_head(ctx, 0, out_stop - out_start, sig)
            head_in = frame_head(ctx, 0, in_stop - in_start, sig)
            parts.append(ch.block_part() + (head_out, out_start, out_stop, head_in, in_start, in_stop))
            heads.append((head_out, head_in))
            watched.append((peer, ch, peer in self._swap_peers, self._sendq[peer]))
        plan = tuple(parts)
        sockets = [ch for _, ch, socket, _ in watched if socket]
        rings = len(peers) - len(sockets)
        exchange_blocks, acquire, release, dead, closed, seen = _tcp.exchange_blocks, self.lock.acquire, \
            self.lock.release, self._dead, self._closed, self._seen
        spin_us, yield_us, wait_ms, can_take = self._spin_us, YIELD_US.get, TCP_EAGER_WAIT_MS.get, self._can_take
        plain, copy, engine = HOST.plain, HOST.copy, self

        def run(tag: int, send: np.ndarray, recv: np.ndarray, make_owner: Callable[[], Owner],
                local: Optional[tuple[np.ndarray, np.ndarray]] = None) -> Optional[list]:
            if dead or closed:
                return None
            for peer, ch, _, sendq in watched:  # a receive taken here keeps MPI's matching order (no schedule runs)
                if sendq or ch.ended or not can_take(peer):
                    return None
            if not acquire(False):
                return None
            # a plain copy is made in C while the sockets wait; any other after the frames, here
            in_c = (payload_bytes(local[0]), payload_bytes(local[1])) if local and plain(local[1], local[0]) else None
            try:
                states = exchange_blocks(plan, send, recv, tag, int(spin_us() * 1e3), int(yield_us() * 1e3),
                                         int(wait_ms() * 1e6), min(ch.push_slice for ch in sockets),
                                         *(in_c or (None, None)))
                if local is not None and in_c is None:
                    copy(local[1], local[0])
                engine.block_exchanges += 1
                engine.copies_in_exchanges += in_c is not None
                if states is None:  # every frame moved whole both ways: the usual end
                    for peer in peers:
                        seen[peer] = (ctx, tag)
                    engine.frames_exchanged += 2 * len(peers)
                    engine.ring_frames_exchanged += 2 * rings
                    engine.tcp_eager_recvs += len(sockets)
                    return []
                owner, sb, rb = make_owner(), payload_bytes(send), payload_bytes(recv)
                ends = []
                for (peer, a, b, d, e), (_, ch, socket, _), (head_out, head_in), state in zip(blocks, watched, heads,
                                                                                           states):
                    move = (peer, sb[a:b], rb[d:e])
                    ends.append((move, self._settle_flow(peer, ch, socket, _tagged(head_out, tag), move[1],
                                                         _tagged(head_in, tag), move[2], state, ctx, tag, sig, owner)))
            finally:
                release()
            return engine._post_unfinished(ends, ctx, tag, sig, owner)

        return run

    def exchange_or_post(self, moves: list, ctx: int, tag: int, sig: Sig, owner: Owner) -> list:
        """``exchange_frames``, and every frame that did not start there posted to the engine: the requests still to
        wait on (those C moved in part, and those posted)."""
        return self._post_unfinished(zip(moves, self.exchange_frames(moves, ctx, tag, sig, owner)), ctx, tag, sig,
                                     owner)

    def _post_unfinished(self, ends: Any, ctx: int, tag: int, sig: Sig, owner: Owner) -> list:
        """After an exchange, ``ends`` holding ((peer, out, into), (sent, got)) as ``exchange_frames`` gives them:
        every frame that did not start posted to the engine; the requests still to wait on."""
        reqs = []
        for (peer, out, into), (sent, got) in ends:
            if out is not None and sent is not True:
                reqs.append(sent if sent is not None else self.isend(peer, out, ctx, tag, sig, owner))
            if into is not None and got is not True:
                reqs.append(got if got is not None else self.irecv(peer, into, ctx, tag, sig, owner))
        return reqs

    def _queue_rest(self, peer: int, head: bytes, payload: np.ndarray, sent: int, owner: Owner) -> SendRequest:
        """The part of a frame that the socket did not take, queued (not copied) as the engine's send: the caller
        waits on it before its buffer is reused; a failed socket fails it there."""
        nbytes = payload.nbytes
        segs = [memoryview(head.ljust(HEADER_SIZE, b"\0")), memoryview(payload).cast("B")]
        if nbytes % ALIGN:
            segs.append(memoryview(ZEROS[: -nbytes % ALIGN]))
        req = SendRequest(owner, peer, head_ctx(head), head_tag(head), segs)
        while sent >= len(segs[req.index]):  # past the segments that went whole
            sent -= len(segs[req.index])
            req.index += 1
        req.offset = sent
        self._sendq[peer].append(req)
        return req

    def _resume_frame(self, peer: int, head: bytes, into: np.ndarray, got: int, sig: Sig, owner: Owner) -> RecvRequest:
        """A frame of which ``got`` bytes (its whole header, some payload) were read: the engine's parser for that
        stream resumes inside it, into a receive that is already matched."""
        ctx, tag, nbytes = head_ctx(head), head_tag(head), into.nbytes
        req = RecvRequest(owner, peer, ctx, tag, sig, into)
        req.source, req.recv_tag, req.nbytes = peer, tag, nbytes
        st = self._inbound[peer]
        body = got - HEADER_SIZE
        st.ctx, st.tag, st.nbytes, st.sig = ctx, tag, nbytes, sig
        st.got, st.pad = min(body, nbytes), -nbytes % ALIGN - max(0, body - nbytes)
        st.have, st.target = HEADER_SIZE, req
        return req


def _tagged(head: Any, tag: int) -> bytes:
    """A header made with tag 0 (``frame_head``), with ``tag`` in its place."""
    return head[:8] + _TAG.pack(tag) + head[16:]

