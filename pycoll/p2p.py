"""The point-to-point layer's engine: the channels of one process, posting sends and receives (eager,
rendezvous and synchronous), probes and matched receives; progress, failures and waits are its mixins."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Optional

import numpy as np

from .errors import PeerFailureError, PycollError, RemoteError
from .p2p_compiled import CompiledLanes
from .p2p_eager import EagerPaths
from .p2p_frames import FramePaths
from .p2p_failures import FailureHandling
from .p2p_progress import Progress
from .p2p_protocol import (
    HEADER,
    MAGIC,
    NO_SEGMENTS,
    RTS,
    RTS_META,
    SMALL_BYTES,
    SSEND,
    U8,
    ZEROS,
    ALIGN,
    ANY_SOURCE,
    ANY_TAG,
    CONTROL_CTX,
    HEADER_SIZE,
    P2P_CMA,
    P2P_CMA_BYTES,
    P2P_SIG,
    TCP_EAGER,
    EXCHANGE_RINGS,
    TCP_FRAME_C,
    Inbound,
    Unexpected,
    Owner,
    RecvRequest,
    Request,
    Schedule,
    SendRequest,
    Sig,
    fits,
    meta_of,
)
from .p2p_waiting import Waiting
from .transport.base import Channel


class Engine(EagerPaths, FramePaths, CompiledLanes, Progress, FailureHandling, Waiting):
    """Owns the channels of one process and moves every pending message forward."""

    def __init__(self, rank: int, channels: dict[int, Channel]) -> None:
        self.rank = rank
        self.channels = channels
        self._inbound = {peer: Inbound() for peer in channels}
        self._sendq: dict[int, deque[SendRequest]] = {peer: deque() for peer in channels}
        self._posted: list[RecvRequest] = []
        self._unexpected: list[Unexpected] = []
        self._dead: dict[int, str] = {}  # world rank -> why its channel failed
        self._broken: dict[int, tuple[PycollError, int]] = {}  # ctx base -> (the abort, first failed call)
        # read-only to callers: empty while no communicator failed; a fast path asks for its own communicator's key
        # (its even context: ``broken_here``), so that one communicator's failure leaves the others' calls alone
        self.broken_ctxs = self._broken
        self._left: set[int] = set()  # world ranks that said goodbye (a normal shutdown)
        self._told: set[int] = set()  # ctx bases whose failure this rank reported to the other members
        self._pulling: set[int] = set()  # peers whose stream a _pull on the stack is reading
        self._fail_after_pull: dict[int, str] = {}  # peer -> why its channel failed while its stream was being read
        self._closed: set[int] = set()  # peers whose channel _channel_failed closed
        self._skipped: dict[tuple[int, int], RemoteError] = {}  # (ctx, seq) -> why a peer skipped that call
        self._schedules: list[Schedule] = []
        self._post_seq = 0
        self._order = sorted(channels)
        self._tcp_fds = {ch.fileno(): ch for ch in channels.values() if ch.fileno() is not None}
        self._only_sockets = all(ch.fileno() is not None or ch.kind == "self" for ch in channels.values())
        # More ranks on this host than cores: a waiter then sleeps on the arena doorbell right after its
        # spin, leaving the core to a rank with work; otherwise it yields first (a futex wake costs both sides).
        self.oversubscribed = True
        # what the waits' first yields showed of the peers on other hosts (``seen_cpu``): where they share this CPU
        # without the rank knowing (placed so by the scheduler), the waits on sockets spin as oversubscribed ones do
        self.cpu_shared = False
        self._cpu_votes = 0
        self._last_liveness = 0.0
        self._seen: dict[int, tuple[int, int]] = {}  # world rank -> (ctx, tag) of the last message it sent here
        self._waits: list[Owner] = []
        self._asked: set[int] = set()  # world ranks asked for their status that have not answered yet
        self.tags_per_call = 1  # collective tags per call number (set by the layer above), for stall reports  # owners of the waits in progress (the stall report's answer)
        self._abort_requests: deque[tuple[int, PycollError, list[int], int]] = deque()  # Comm.Abort's, a composed call's
        self.lock = threading.RLock()  # held by the thread inside a wait; Comm.Abort acts directly when it is free
        self.closed = False
        # Fast paths: channels that let a small frame be written in place, or say cheaply whether input waits.
        self._reserve = {p: getattr(ch, "reserve", None) for p, ch in channels.items()}
        self._commit = {p: getattr(ch, "commit", None) for p, ch in channels.items()}
        self._peers = [(p, channels[p], self._sendq[p], self._inbound[p], getattr(channels[p], "has_input", None)) for p in self._order]
        # Rendezvous (large point-to-point messages pulled by cross-memory attach).
        self._rdv_bytes = max(P2P_CMA_BYTES.get(), HEADER_SIZE)
        self._rdv_seq = 0
        self._rdv_sends: dict[tuple[int, int], SendRequest] = {}  # (peer, id) -> send waiting for its ack
        self._rdv_data: dict[tuple[int, int], memoryview] = {}  # (peer, id) -> its payload (kept alive until the ack)
        self._rdv_recvs: dict[tuple[int, int], RecvRequest] = {}  # (peer, id) -> receive waiting for a streamed payload
        self._cma_ok: dict[int, bool] = {}
        self.rdv_pulls = 0  # messages this rank copied straight from a sender's buffer
        self.rdv_eager_pulls = 0  # of which an eager receive's compiled path took the announcement
        # (peer, id) -> (lane, address, bytes) of rendezvous sends whose receiver may take this rank's help
        self.split_sends: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.split_chunks = 0  # chunks this rank wrote into its receivers' buffers while it waited
        self._cma: Any = None
        # One doorbell for every inbound stream (all shared-memory, besides the loopback): idle waits block on it.
        bells = {id(b): b for b in (getattr(ch, "bell", None) for ch in channels.values() if ch.kind != "self")}
        self._stream_bell = next(iter(bells.values())) if len(bells) == 1 and None not in bells.values() else None
        # Where peers on this host (shared memory) and on others (sockets) mix: whom a wait is for says how to sleep
        self._tcp_peers = {ch.peer for ch in self._tcp_fds.values()}
        shm = {p: getattr(ch, "bell", None) for p, ch in channels.items() if ch.kind == "shm"}
        self._shm_peers = set(shm)
        shm_bells = {id(b): b for b in shm.values()}
        self._shm_bell = next(iter(shm_bells.values())) if len(shm_bells) == 1 and None not in shm_bells.values() else None
        self._inputs = {p: getattr(ch, "has_input", None) or (lambda ch=ch: len(ch.peek()) > 0) for p, ch in channels.items()}
        self._tight_polls = 200  # polls before a wait starts counting time (about 20-60 us of spinning)
        self._ctl_owner = Owner("rendezvous", CONTROL_CTX, rank, lambda w: w, ())
        # Eager receives poll one shared-memory ring directly, for about the engine's spin before they post.
        self._has_input = {p: getattr(ch, "has_input", None) for p, ch in channels.items() if ch.kind == "shm"}
        # Peers on other hosts: small point-to-point messages go straight through their sockets (one call each way)
        self._tcp_socks = {p: ch.sock for p, ch in channels.items() if ch.kind == "tcp" and TCP_EAGER.get()}
        self.tcp_eager_sends = self.tcp_eager_recvs = self.tcp_eager_queued = 0  # counts, for tests and tuning
        self.posted_socket_takes = 0  # posted receives whose wait took their message in C (take_posted_from_socket)
        # exchange_frames' frames (counts): moved whole in C, and moved in part there and finished by the engine
        self.frames_exchanged = self.frames_handed_on = 0
        self.ring_frames_exchanged = self.ring_frames_handed_on = 0  # of each, those of this host's peers (rings)
        self.exchanges_unwaited = 0  # exchanges that moved only what was ready: this rank owed its peers bytes
        self.block_exchanges = 0  # exchanges of a plan's blocks made once (``frame_exchanger``)
        self.copies_in_exchanges = 0  # of those, the ones that also made a local copy while the sockets waited
        # of those, the peers whose frames move in C (TcpChannel.swap_frame): one call into C per small call
        self._swap_peers = {p for p in self._tcp_socks if getattr(channels[p], "can_swap", False) and TCP_FRAME_C.get()}
        # peers on this host whose frames join such a call through their rings (``exchange_frames``)
        self._ring_peers = set(self._shm_peers) if self._swap_peers and EXCHANGE_RINGS.get() else set()
        # where a small frame to a socket is put together (header, payload, padding) for its one send
        self._frame = memoryview(bytearray(HEADER_SIZE + SMALL_BYTES + ALIGN))
        self._frame_bytes = np.frombuffer(self._frame, np.uint8)
        self._readable: dict[int, Callable[[int], list]] = {}  # peer -> poll(ms) of its socket (``_poller``)
        self._messengers: dict[int, set[int]] = {}  # world rank -> the world ranks it reported dead
        self.direct_peers = bool(self._tcp_socks)  # send_now / recv_now can move a collective's messages
        self._put_frame = {p: ch.put_frame for p, ch in channels.items() if hasattr(ch, "put_frame")}
        # The largest eager message (callers read it): below the rendezvous threshold, a quarter of a ring at most.
        rings = [ch.capacity for ch in channels.values() if hasattr(ch, "put_frame")]
        self.eager_max = min([self._rdv_bytes - 1] + [c // 4 - HEADER_SIZE - ALIGN for c in rings])
        self._eager_polls = 600
        # The compiled eager path: ``kernel_source(start)`` (set by the runtime) gives the kernel module once loaded,
        # None while loading (or not started: ``start`` starts it), False where it cannot run.
        self.kernel_source: Optional[Callable[[bool], Any]] = None
        self._kernels: Any = None
        self._lanes: dict[int, tuple] = {}  # peer -> its rings as the kernels take them, its channel, its pid
        self._readv = 0  # libc's process_vm_readv for the kernels (0: none)
        self._bounce = False  # whether the kernels bounce cross-memory copies at the short distance
        self._eager_calls = 0
        self._eager_kernel_polls = 20000
        self.kernel_polls_per_byte = 0.0  # polls a rendezvous send's wait adds per byte (set with the kernels)
        # The per-call fast path (p2p_fast): world rank -> address of its lane's words (0: none), once the kernels
        # are in; a lane is zeroed when its channel fails or closes.
        self.lane_of: Optional[list[int]] = None
        self.lane_views: dict[int, memoryview] = {}  # world rank -> its lane's words, as Python reads them
        self._lane_words: dict[int, np.ndarray] = {}

    def isend(self, peer: int, data: np.ndarray, ctx: int, tag: int, sig: Sig, owner: Any) -> SendRequest:
        payload = memoryview(data if data.dtype is U8 else data.view(np.uint8))
        if payload.ndim != 1:
            payload = payload.cast("B")
        nbytes = payload.nbytes
        req = SendRequest(owner, peer, ctx, tag, NO_SEGMENTS)
        if peer in self._dead:
            req.fail(owner.error(PeerFailureError, self._dead[peer], [peer]))
            return req
        meta = meta_of(sig)
        q = self._sendq[peer]
        if nbytes >= self._rdv_bytes and not ctx & 1 and ctx != CONTROL_CTX and self._cma_to(peer):
            # rendezvous: announce (address, length); the peer pulls the bytes itself and acks
            self._rdv_seq += 1
            if data.flags.c_contiguous:
                req.rdv = rid = self._rdv_seq
                self._rdv_sends[(peer, rid)] = req
                self._rdv_data[(peer, rid)] = payload  # kept for a fallback through the stream
                lane = self._lanes.get(peer)
                if lane is not None and not q:  # compiled: the announcement goes straight into the ring
                    try:
                        tail = self._kernels.announce(lane[0], lane[1], lane[2], lane[6].tail, data, ctx, tag, RTS_META, rid)
                    except TypeError:  # not flat bytes: the header below
                        tail = -1
                    if tail > 0:
                        lane[6].published(tail)
                        return req
                addr = data.ctypes.data
                req.segments = [memoryview(HEADER.pack(ctx, tag, nbytes, RTS | (MAGIC << 24), 0, addr, rid).ljust(HEADER_SIZE, b"\0"))]
                self._enqueue(peer, req)
                return req
        pad = -nbytes % ALIGN
        total = HEADER_SIZE + nbytes + pad
        if not q and nbytes <= SMALL_BYTES:
            reserve = self._reserve[peer]
            slot = reserve(total) if reserve is not None else None
            if slot is not None:  # straight into the ring: no staging copy, no queue
                HEADER.pack_into(slot, 0, ctx, tag, nbytes, meta, sig.root, sig.count, sig.vhash)
                if nbytes:
                    slot[HEADER_SIZE : HEADER_SIZE + nbytes] = payload
                self._commit[peer](total)
                req.done = True
                return req
        header = HEADER.pack(ctx, tag, nbytes, meta, sig.root, sig.count, sig.vhash).ljust(HEADER_SIZE, b"\0")
        if nbytes <= SMALL_BYTES:
            req.segments = [memoryview(b"".join((header, payload, ZEROS[:pad])))]
        else:
            req.segments = [memoryview(header), payload] + ([memoryview(ZEROS[:pad])] if pad else [])
        self._enqueue(peer, req)
        return req

    def _rdv_ok(self, peer: int, nbytes: int) -> bool:
        """Whether a point-to-point message of ``nbytes`` to ``peer`` goes by rendezvous (pulled by the peer)."""
        return nbytes >= self._rdv_bytes and self._cma_to(peer)

    def _enqueue(self, peer: int, req: SendRequest) -> None:
        """Queue a send behind ``peer``'s others; alone in the queue, it starts at once (small ones leave here)."""
        q = self._sendq[peer]
        q.append(req)
        if len(q) == 1:
            self._push_now(peer, q)

    def _push_now(self, peer: int, q: deque) -> None:
        try:
            self._push(peer, q)
        except PeerFailureError as err:
            self._channel_failed(peer, err.cause)

    def _cma_to(self, peer: int) -> bool:
        """Whether ``peer`` can pull this rank's memory by cross-memory attach (its channel says; PYCOLL_P2P_CMA)."""
        ok = self._cma_ok.get(peer)
        if ok is None:
            probe = getattr(self.channels[peer], "peer_can_pull", None)
            answer = probe() if probe is not None and P2P_CMA.get() else False
            if answer is None:  # the peer has not probed yet: stream this one, ask again next time
                return False
            ok = self._cma_ok[peer] = bool(answer)
        return ok

    def irecv(
        self,
        peer: int,
        dst: Optional[np.ndarray],
        ctx: int,
        tag: int,
        sig: Optional[Sig],
        owner: Owner,
        local: Optional[np.ndarray] = None,
        ufunc: Any = None,
    ) -> RecvRequest:
        req = RecvRequest(owner, peer, ctx, tag, sig, dst, local, ufunc)
        if self._broken and self._is_broken_for(owner):
            req.fail(self._with_rank(self._broken[ctx & ~1][0], owner))
            return req
        # An unexpected message that matches takes precedence, in arrival order.
        if self._unexpected:
            for i, u in enumerate(self._unexpected):
                if fits(req, u.src, u.ctx, u.tag):
                    del self._unexpected[i]
                    self._bind_unexpected(req, u)
                    return req
        if peer >= 0 and peer in self._dead:
            req.fail(owner.error(PeerFailureError, self._dead[peer], [peer]))
            return req
        self._post_seq += 1
        req.seq = self._post_seq
        self._posted.append(req)
        return req

    def issend(self, peer: int, data: np.ndarray, ctx: int, tag: int, owner: Any) -> SendRequest:
        """A synchronous point-to-point send: done once a receive on ``peer`` matched it. A rendezvous already waits
        for the receiver's pull; any other message goes as an SSEND frame whose receiver acks the match."""
        payload = memoryview(data if data.dtype is U8 else data.view(np.uint8))
        if payload.ndim != 1:
            payload = payload.cast("B")
        nbytes = payload.nbytes
        if nbytes >= self._rdv_bytes and data.flags.c_contiguous and self._cma_to(peer):
            return self.isend(peer, data, ctx, tag, P2P_SIG, owner)
        req = SendRequest(owner, peer, ctx, tag, NO_SEGMENTS)
        if peer in self._dead:
            req.fail(owner.error(PeerFailureError, self._dead[peer], [peer]))
            return req
        self._rdv_seq += 1
        req.rdv = sid = self._rdv_seq  # pushed is not done: the ACK is (_on_rendezvous); a failed peer fails it
        self._rdv_sends[(peer, sid)] = req
        self._rdv_data[(peer, sid)] = payload
        header = HEADER.pack(ctx, tag, nbytes, SSEND | (MAGIC << 24), 0, 0, sid).ljust(HEADER_SIZE, b"\0")
        pad = -nbytes % ALIGN
        if nbytes <= SMALL_BYTES:
            req.segments = [memoryview(b"".join((header, payload, ZEROS[:pad])))]
        else:
            req.segments = [memoryview(header), payload] + ([memoryview(ZEROS[:pad])] if pad else [])
        self._enqueue(peer, req)
        return req

    def find_unexpected(self, peer: int, ctx: int, tag: int) -> Optional[Unexpected]:
        """The buffered message a receive of (``peer``, ``ctx``, ``tag``) would take now (the earliest to arrive)."""
        for u in self._unexpected:
            if u.ctx == ctx and (peer == ANY_SOURCE or u.src == peer) and (tag == ANY_TAG or u.tag == tag):
                return u
        return None

    def iprobe(self, peer: int, ctx: int, tag: int, take: bool = False) -> Optional[Unexpected]:
        """Progress once, then the message a receive of (peer, ctx, tag) would take, or None. With ``take`` (a matched
        probe) it leaves the unexpected list: no receive but ``mrecv``'s takes it, and the streams it left are not
        read by an eager receive (which needs the list empty) before it."""
        self.progress()
        u = self.find_unexpected(peer, ctx, tag)
        if u is not None and take:
            self._unexpected.remove(u)
        return u

    def probe(self, peer: int, ctx: int, tag: int, owner: Any, timeout: float, take: bool = False) -> Unexpected:
        """Wait for a message a receive of (peer, ctx, tag) would take (see ``iprobe``); fails if ``peer`` dies or the
        communicator breaks first, and times out after ``timeout`` seconds without progress."""
        u = self.iprobe(peer, ctx, tag, take)
        if u is not None:
            return u
        marker = Request(owner, peer, ctx, tag)  # what the wait is for: a timeout names the rank

        def arrived() -> bool:
            if self.find_unexpected(peer, ctx, tag) is not None:
                return True
            if peer >= 0 and peer in self._dead:
                marker.fail(owner.error(PeerFailureError, self._dead[peer], [peer]))
            elif self._broken and self._is_broken_for(owner):
                marker.fail(self._with_rank(self._broken[ctx & ~1][0], owner))
            return marker.done

        self._wait(arrived, lambda: 0, timeout, owner, lambda: (marker,))
        if marker.error is not None:
            raise marker.error
        u = self.find_unexpected(peer, ctx, tag)
        assert u is not None
        if take:
            self._unexpected.remove(u)
        return u

    def mrecv(self, u: Unexpected, dst: Optional[np.ndarray], owner: Any) -> RecvRequest:
        """Receive the message a matched probe took into ``dst`` (None: into a new array)."""
        req = RecvRequest(owner, u.src, u.ctx, u.tag, None, dst)
        self._bind_unexpected(req, u)
        return req

    def cancel_recv(self, req: RecvRequest) -> bool:
        """Withdraw a posted receive no message matched yet: True if it was (it is then done, with nothing received)."""
        try:
            self._posted.remove(req)
        except ValueError:
            return False
        req.done = True
        return True
