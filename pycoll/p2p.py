"""The point-to-point layer: message framing, tag matching and the progress engine over per-peer channels."""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterable, NamedTuple, Optional, Sequence, Union

import numpy as np

from . import p2p_lane
from .config import bool_param, float_param, size_param
from .errors import (
    AbortedError,
    MismatchError,
    PeerFailureError,
    PeerLostError,
    PeerMismatchError,
    ProtocolError,
    PycollError,
    RemoteError,
    TimeoutError,
)
from .transport.base import Channel

log = logging.getLogger("pycoll")

SPIN_US = float_param("PYCOLL_SPIN_US", 50.0, "Microseconds a wait busy-polls before it starts yielding the core (default 50, or 2 with more ranks than cores).")
_OVERSUBSCRIBED_SPIN_US = 2.0
YIELD_US = float_param("PYCOLL_YIELD_US", 2000.0, "Microseconds a wait then spends in sched_yield before it sleeps.")
PROBE_AFTER_S = 1.0  # a collective idle this long asks the ranks it waits for which call they are in (deadlocks)
STALL_WARN = float_param(
    "PYCOLL_STALL_WARN",
    60.0,
    "Seconds a collective may wait before pycoll logs which ranks have not joined and what they were last seen doing "
    "(then again at every further multiple); 0 turns the report off.",
)

ANY_SOURCE = -1
ANY_TAG = -1
PROC_NULL = -2

# Frame: 64-byte header, payload, zero padding to 64 bytes (keeps every header and payload aligned in rings).
_HEADER = struct.Struct("<QqQIiQQ")  # ctx, tag, nbytes, meta (kind|dtype<<8|op<<16), root, count, vhash
_CTX_TAG = struct.Struct("<Qq")
HEADER_SIZE = 64
ALIGN = 64
_MAGIC = 0x70  # high byte of meta: catches a stream that lost its framing
_ZEROS = bytes(ALIGN)
_SMALL = 16 << 10
_PAD_SINK = memoryview(bytearray(ALIGN))  # payloads up to this size travel in one buffer with their header

P2P_CMA = bool_param(
    "PYCOLL_P2P_CMA", True,
    "Set to 0 to stream every point-to-point message through the shared-memory ring; by default messages from "
    "PYCOLL_P2P_CMA_BYTES go by rendezvous: the receiver copies them straight from the sender's buffer (one "
    "process_vm_readv).",
)
RDV_PULL_S_PER_BYTE = 0.25e-9  # a rendezvous send spins out its receiver's pull down to 4 GB/s (this VM's moves ~8)
P2P_CMA_BYTES = size_param(
    "PYCOLL_P2P_CMA_BYTES", 128 << 10,
    "Smallest point-to-point message sent by rendezvous and cross-memory attach (see PYCOLL_P2P_CMA; default 128K: "
    "below it the eager ring's two copies, pipelined between the ranks, beat the rendezvous' handshake).",
)
TCP_EAGER = bool_param(
    "PYCOLL_TCP_EAGER", True,
    "Set to 0 to send every point-to-point message to a peer on another host through the progress engine; by "
    "default a blocking or nonblocking send of up to the eager size leaves in one system call, and a receive "
    "takes its message straight from the socket while nothing else is pending.",
)
TCP_EAGER_WAIT_MS = float_param(
    "PYCOLL_TCP_EAGER_WAIT_MS", 2.0,
    "Milliseconds a receive from a peer on another host waits in the kernel on that one socket (after its spin "
    "and PYCOLL_YIELD_US of yielding) before it waits through the progress engine, which serves every peer.",
)
# Rendezvous frames: header only, told apart by their meta word (kind byte 0xF0.. with no dtype/op).
_RTS = 0xF1  # sender -> receiver: count = the payload's address in the sender, vhash = rendezvous id
_ACK = 0xF2  # receiver -> sender: the bytes of rendezvous vhash were pulled (or the receive failed): done
_NAK = 0xF3  # receiver -> sender: cross-memory attach failed here; send rendezvous vhash through the stream
_RDATA = 0xF4  # sender -> receiver: the payload of rendezvous vhash, streamed after a NAK
_SSEND = 0xF5  # a synchronous send's frame: a plain message whose receiver sends _ACK (vhash = its id) once it matched it
_U8 = np.dtype(np.uint8)
_P2P_META = _MAGIC << 24  # a plain point-to-point frame: no kind, dtype or op
_RTS_META, _ACK_META = _RTS | _P2P_META, _ACK | _P2P_META
_NO_SEGMENTS: list = []
_NO_DST = np.zeros(0, np.uint8)  # take_next's receive buffer when only acknowledgements are taken

CONTROL_CTX = (1 << 64) - 1
_ABORT_TAG = 1  # a rank failed inside an operation: the communicator is broken
_SKIP_TAG = 2  # a rank rejected its arguments before taking part: only that call fails
_STATUS_ASK = 3  # a stalled rank asks a peer what it is doing
_STATUS_TELL = 4  # the answer: the operations the peer is in and whom they wait for
_CHECK_KIND = 15  # signature kind of PYCOLL_CHECK_CALLS's own messages (algorithms/check.py)
_GOODBYE_TAG = 5  # a rank shuts down normally: its streams ending after this is no failure


class Sig(NamedTuple):
    """What a collective message says about the call that sent it; both ends must agree."""

    kind: int = 0
    dtype: int = 0
    op: int = 0
    root: int = 0
    count: int = 0
    vhash: int = 0


P2P_SIG = Sig()


def _meta(sig: Sig) -> int:
    """A frame header's meta word for a message of the call ``sig`` describes."""
    return sig.kind | (sig.dtype << 8) | (sig.op << 16) | (_MAGIC << 24)


def frame_head(ctx: int, tag: int, nbytes: int, sig: Sig) -> bytes:
    """The packed header of a collective's frame (its first ``_HEADER.size`` bytes; zeros pad it to HEADER_SIZE):
    both what a sender writes and, byte for byte, what its receiver expects."""
    return _HEADER.pack(ctx, tag, nbytes, _meta(sig), sig.root, sig.count, sig.vhash)


def head_ctx(head: bytes) -> int:
    return _CTX_TAG.unpack_from(head)[0]


def head_tag(head: bytes) -> int:
    return _CTX_TAG.unpack_from(head)[1]


@dataclass
class Owner:
    """The operation a request belongs to, for error messages and aborts."""

    op: str
    ctx: int
    rank: int  # this process's rank in the communicator
    to_comm: Callable[[int], int]  # world rank -> communicator rank
    members: Sequence[int] = ()  # world ranks of the communicator
    describe: Callable[[Sig], str] = lambda s: str(s)
    tag: int = -1  # the collective's sequence number (-1 for point-to-point)
    sig: Optional["Sig"] = None  # the collective's signature, for spotting peers that called something else

    def error(self, cls: type, cause: str, world_peers: Iterable[int] = ()) -> PycollError:
        return cls(cause, op=self.op, rank=self.rank, peers=sorted({self.to_comm(p) for p in world_peers}))

    def call(self, name: str, word: str, a: Any, b: Any) -> "P2POwner":
        """The owner of one point-to-point call on this communicator, e.g. ``Send(dest=1, tag=5)``."""
        return P2POwner(self, name, word, a, b)


class P2POwner:
    """A point-to-point call's owner: the communicator's base owner plus the call's words, formatted only on demand."""

    __slots__ = ("base", "name", "word", "a", "b")
    tag = -1
    sig: Optional[Sig] = None

    def __init__(self, base: Owner, name: str, word: str, a: Any, b: Any) -> None:
        self.base, self.name, self.word, self.a, self.b = base, name, word, a, b

    @property
    def op(self) -> str:
        return f"{self.name}({self.word}={self.a}, tag={self.b})"

    ctx = property(lambda self: self.base.ctx)
    rank = property(lambda self: self.base.rank)
    to_comm = property(lambda self: self.base.to_comm)
    members = property(lambda self: self.base.members)
    describe = property(lambda self: self.base.describe)

    def error(self, cls: type, cause: str, world_peers: Iterable[int] = ()) -> PycollError:
        return cls(cause, op=self.op, rank=self.base.rank, peers=sorted({self.base.to_comm(p) for p in world_peers}))


class Request:
    """A pending send or receive; ``done`` once complete, ``error`` if it failed."""

    __slots__ = ("owner", "peer", "ctx", "tag", "done", "error")

    def __init__(self, owner: Owner, peer: int, ctx: int, tag: int) -> None:
        self.owner = owner
        self.peer = peer
        self.ctx = ctx
        self.tag = tag
        self.done = False
        self.error: Optional[PycollError] = None

    def fail(self, err: PycollError) -> None:
        if not self.done:
            self.error = err
            self.done = True


class SendRequest(Request):
    __slots__ = ("segments", "index", "offset", "rdv")

    def __init__(self, owner: Any, peer: int, ctx: int, tag: int, segments: list[memoryview]) -> None:
        self.owner = owner
        self.peer = peer
        self.ctx = ctx
        self.tag = tag
        self.done = False
        self.error: Optional[PycollError] = None
        self.segments = segments
        self.index = 0
        self.offset = 0
        self.rdv = 0  # rendezvous id while the peer has not pulled the payload yet


class RecvRequest(Request):
    """Receives into ``dst`` (or into a new array if None), or reduces: ``out = op(local, incoming)``."""

    __slots__ = ("sig", "dst", "local", "out", "ufunc", "nbytes", "source", "recv_tag", "seq", "addr")

    def __init__(
        self,
        owner: Owner,
        peer: int,
        ctx: int,
        tag: int,
        sig: Optional[Sig],
        dst: Optional[np.ndarray],
        local: Optional[np.ndarray] = None,
        ufunc: Any = None,
    ) -> None:
        self.owner = owner
        self.peer = peer
        self.ctx = ctx
        self.tag = tag
        self.done = False
        self.error: Optional[PycollError] = None
        self.sig = sig
        self.dst = dst  # flat typed array (copy target, or reduce output)
        self.local = local
        self.ufunc = ufunc
        self.nbytes = 0
        self.source = -1
        self.recv_tag = -1
        self.seq = 0
        self.addr = 0  # dst's address, where the poster knew it: the compiled drain then takes it by address

    @property
    def reduces(self) -> bool:
        return self.ufunc is not None


class _Unexpected:
    """A message that arrived before its receive was posted, buffered whole."""

    __slots__ = ("src", "ctx", "tag", "sig", "data", "got", "waiter", "rdv", "sync")

    def __init__(self, src: int, ctx: int, tag: int, sig: Sig, nbytes: int) -> None:
        self.src, self.ctx, self.tag, self.sig = src, ctx, tag, sig
        self.data = np.empty(nbytes, np.uint8)
        self.got = 0
        self.waiter: Optional[RecvRequest] = None
        self.rdv: Optional[tuple[int, int, int]] = None  # a rendezvous announcement: (id, address, length)
        self.sync = 0  # a synchronous send's id: its sender waits for an _ACK once a receive takes this

    @property
    def nbytes(self) -> int:
        """The message's size (a rendezvous announcement's buffers nothing yet)."""
        return self.rdv[2] if self.rdv is not None else self.data.nbytes


class _Inbound:
    """Per-channel parser state: header, then payload into a target, then padding."""

    __slots__ = ("hdr", "have", "target", "nbytes", "got", "pad", "ctx", "tag", "sig")

    def __init__(self) -> None:
        self.hdr = bytearray(HEADER_SIZE)
        self.have = 0
        self.target: Union[RecvRequest, _Unexpected, None] = None
        self.nbytes = self.got = self.pad = 0
        self.ctx = self.tag = 0
        self.sig = P2P_SIG


def _pad(n: int) -> int:
    return -n % ALIGN


def _fits(req: RecvRequest, src: int, ctx: int, tag: int) -> bool:
    return req.ctx == ctx and req.peer in (src, ANY_SOURCE) and req.tag in (tag, ANY_TAG)


class Schedule:
    """A running collective: a generator of algorithm steps, each yielding the requests it waits on."""

    __slots__ = ("gen", "owner", "waiting", "done", "error", "steps")

    def __init__(self, gen: Generator, owner: Owner) -> None:
        self.gen = gen
        self.owner = owner
        self.waiting: tuple = ()
        self.done = False
        self.error: Optional[PycollError] = None
        self.steps = 0

    def fail(self, err: PycollError) -> None:
        if not self.done:
            self.error = err
            self.done = True
            if not self.gen.gi_running:  # failed from inside its own step: advance closes it after the step
                self.gen.close()

    def advance(self) -> bool:
        """Run the generator as far as it can go without blocking; True if it moved."""
        moved = False
        while not self.done:
            for r in self.waiting:
                if not r.done:
                    return moved
                if r.error is not None:
                    self.fail(r.error)
                    return True
            try:
                nxt = self.gen.send(None)
            except StopIteration:
                self.done = True
                return True
            except PycollError as err:
                self.fail(err)
                return True
            if self.done:  # failed during that step
                self.gen.close()
                return True
            self.waiting = nxt if isinstance(nxt, tuple) else tuple(nxt) if isinstance(nxt, list) else (nxt,)
            self.steps += 1
            moved = True
        return moved


def _common_bell(waits: Iterable[Any]) -> Any:
    """The doorbell shared by every pending wait (arena flag waits carry one), else None."""
    bell = None
    for w in waits:
        b = getattr(w, "bell", None)
        if b is None or (bell is not None and b is not bell):
            return None
        bell = b
    return bell


class Engine:
    """Owns the channels of one process and moves every pending message forward."""

    def __init__(self, rank: int, channels: dict[int, Channel]) -> None:
        self.rank = rank
        self.channels = channels
        self._inbound = {peer: _Inbound() for peer in channels}
        self._sendq: dict[int, deque[SendRequest]] = {peer: deque() for peer in channels}
        self._posted: list[RecvRequest] = []
        self._unexpected: list[_Unexpected] = []
        self._dead: dict[int, str] = {}  # world rank -> why its channel failed
        self._broken: dict[int, tuple[PycollError, int]] = {}  # ctx base -> (the abort, first failed call)
        self.broken_ctxs = self._broken  # read-only to callers: empty while no communicator failed
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
        self._last_liveness = 0.0
        self._seen: dict[int, tuple[int, int]] = {}  # world rank -> (ctx, tag) of the last message it sent here
        self._waits: list[Owner] = []
        self._asked: set[int] = set()  # world ranks asked for their status that have not answered yet
        self.tags_per_call = 1  # collective tags per call number (set by the layer above), for stall reports  # owners of the waits in progress (the stall report's answer)
        self._abort_requests: deque[tuple[int, PycollError, list[int]]] = deque()  # from Comm.Abort, any thread
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
        # where a small frame to a socket is put together (header, payload, padding) for its one send
        self._frame = memoryview(bytearray(HEADER_SIZE + _SMALL + ALIGN))
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
        self._eager_calls = 0
        self._eager_kernel_polls = 20000
        self.kernel_polls_per_byte = 0.0  # polls a rendezvous send's wait adds per byte (set with the kernels)
        # The per-call fast path (p2p_fast): world rank -> address of its lane's words (0: none), once the kernels
        # are in; a lane is zeroed when its channel fails or closes.
        self.lane_of: Optional[list[int]] = None
        self.lane_views: dict[int, memoryview] = {}  # world rank -> its lane's words, as Python reads them
        self._lane_words: dict[int, np.ndarray] = {}

    # ---- posting ---------------------------------------------------------------------------
    def isend(self, peer: int, data: np.ndarray, ctx: int, tag: int, sig: Sig, owner: Any) -> SendRequest:
        payload = memoryview(data if data.dtype is _U8 else data.view(np.uint8))
        if payload.ndim != 1:
            payload = payload.cast("B")
        nbytes = payload.nbytes
        req = SendRequest(owner, peer, ctx, tag, _NO_SEGMENTS)
        if peer in self._dead:
            req.fail(owner.error(PeerFailureError, self._dead[peer], [peer]))
            return req
        meta = _meta(sig)
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
                        tail = self._kernels.announce(lane[0], lane[1], lane[2], lane[6].tail, data, ctx, tag, _RTS_META, rid)
                    except TypeError:  # not flat bytes: the header below
                        tail = -1
                    if tail > 0:
                        lane[6].published(tail)
                        return req
                addr = data.ctypes.data
                req.segments = [memoryview(_HEADER.pack(ctx, tag, nbytes, _RTS | (_MAGIC << 24), 0, addr, rid).ljust(HEADER_SIZE, b"\0"))]
                self._enqueue(peer, req)
                return req
        pad = -nbytes % ALIGN
        total = HEADER_SIZE + nbytes + pad
        if not q and nbytes <= _SMALL:
            reserve = self._reserve[peer]
            slot = reserve(total) if reserve is not None else None
            if slot is not None:  # straight into the ring: no staging copy, no queue
                _HEADER.pack_into(slot, 0, ctx, tag, nbytes, meta, sig.root, sig.count, sig.vhash)
                if nbytes:
                    slot[HEADER_SIZE : HEADER_SIZE + nbytes] = payload
                self._commit[peer](total)
                req.done = True
                return req
        header = _HEADER.pack(ctx, tag, nbytes, meta, sig.root, sig.count, sig.vhash).ljust(HEADER_SIZE, b"\0")
        if nbytes <= _SMALL:
            req.segments = [memoryview(b"".join((header, payload, _ZEROS[:pad])))]
        else:
            req.segments = [memoryview(header), payload] + ([memoryview(_ZEROS[:pad])] if pad else [])
        self._enqueue(peer, req)
        return req

    def send_now(self, peer: int, payload: np.ndarray, ctx: int, tag: int, sig: Sig) -> bool:
        """A collective's small message to a peer on another host in one system call, now (``send_eager`` with the
        call's signature); False, nothing sent, where it cannot go so (the caller sends through the engine)."""
        return self.send_frame_now(peer, frame_head(ctx, tag, payload.nbytes, sig), payload)

    def recv_now(self, peer: int, dst: np.ndarray, ctx: int, tag: int, sig: Sig) -> bool:
        """A collective's message of exactly ``dst.nbytes`` (flat bytes) from a peer on another host, taken straight
        from the socket (waiting as ``recv_eager`` does) while no receive is posted; False where the caller must
        post a receive instead (nothing consumed)."""
        return self.recv_frame_now(peer, frame_head(ctx, tag, dst.nbytes, sig), dst)

    def send_frame_now(self, peer: int, head: bytes, payload: np.ndarray, limit: int = _SMALL) -> bool:
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

    def recv_frame_now(self, peer: int, head: bytes, dst: np.ndarray) -> bool:
        """``recv_now`` for the frame whose header is exactly ``head`` (``frame_head``)."""
        # Only this call's own receives could match its frames (its exact context and tag): none may be posted
        # or buffered, else the next frame could be theirs. Other calls' schedules may run.
        if peer not in self._tcp_socks or not self._can_take(peer, True) or not self.lock.acquire(blocking=False):
            return False
        try:
            got = self._recv_eager_tcp(peer, dst, 0, 0, True, head)
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
                tail = self._kernels.put_plain(lane[0], lane[2], payload, ctx, tag, _P2P_META)
            except TypeError:  # a buffer of a kind the kernel was not built for (strided, another dtype)
                tail = 0
            if tail > 0:
                lane[6].published(tail)
                return True
            if tail < 0:
                return False
        return put(_HEADER.pack_into, (ctx, tag, nbytes, _P2P_META, 0, 0, 0), payload, HEADER_SIZE,
                   HEADER_SIZE + nbytes + (-nbytes % ALIGN))

    def _send_eager_tcp(self, peer: int, sock: Any, payload: np.ndarray, head: bytes) -> bool:
        """A message to a peer on another host in one system call, header (``head``, packed) and payload together:
        small ones copied behind the header in the engine's frame buffer, larger ones by sendmsg's iovec. What the
        socket does not take at once queues behind, as the engine's own sends do (the user's buffer is free either
        way: the rest is a copy)."""
        nbytes = payload.nbytes
        pad = -nbytes % ALIGN
        total = HEADER_SIZE + nbytes + pad
        frame = self._frame
        if not self.lock.acquire(blocking=False):  # another thread is in the engine (and may use the frame buffer)
            return False
        try:
            if nbytes <= _SMALL:
                frame[: len(head)] = head  # the header's tail, up to HEADER_SIZE, stays zero
                if nbytes:
                    self._frame_bytes[HEADER_SIZE : HEADER_SIZE + nbytes] = (
                        payload if payload.dtype is _U8 else payload.reshape(-1).view(np.uint8))
                    if pad:
                        frame[HEADER_SIZE + nbytes : total] = _ZEROS[:pad]
                sent = sock.send(frame[:total])
            else:
                data = memoryview(payload if payload.dtype is _U8 else payload.view(np.uint8)).cast("B")
                sent = sock.sendmsg([head, _ZEROS[: HEADER_SIZE - len(head)], data, _ZEROS[:pad]])
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return False  # nothing left: the engine's path finds the failure and reports it
        finally:
            self.lock.release()
        if sent < total:  # the socket is full: the rest (copied) queues, and progress sends it
            if nbytes <= _SMALL:
                rest = memoryview(bytes(frame[sent:total]))
            else:
                whole = b"".join((head.ljust(HEADER_SIZE, b"\0"), memoryview(payload).cast("B"), _ZEROS[:pad]))
                rest = memoryview(whole)[sent:]
            req = SendRequest(self._ctl_owner, peer, head_ctx(head), head_tag(head), [rest])
            self._sendq[peer].append(req)
            self.tcp_eager_queued += 1
        self.tcp_eager_sends += 1
        return True

    def _recv_eager_tcp(self, peer: int, dst: np.ndarray, ctx: int, tag: int, spin: bool, head: Optional[bytes] = None
                        ) -> Optional[tuple[int, int]]:
        """``recv_eager`` from a peer on another host: its next frame, read from the socket into the channel's
        staging area and copied out, when it is this receive's message: a point-to-point frame of ``ctx`` and
        ``tag`` (or any tag) of up to ``dst.nbytes``, or, given ``head``, the collective frame with exactly that
        header. Waits as the engine does (polling the socket for PYCOLL_SPIN_US, then yielding the core for
        PYCOLL_YIELD_US), then in the kernel (poll) for up to PYCOLL_TCP_EAGER_WAIT_MS, while nothing else
        needs this rank; the engine's wait takes over after that."""
        ch = self.channels[peer]
        spin_until = deadline = 0.0
        if head is not None:
            nbytes = dst.nbytes
            want = HEADER_SIZE + nbytes + (-nbytes % ALIGN)
            if want > ch.staging_bytes:
                return None  # it cannot be shown whole: the engine's path
            got_tag = head_tag(head)
            hlen = len(head)
        else:
            want = HEADER_SIZE
        while True:
            try:
                view = ch.peek(want)
            except PeerFailureError:
                return None  # the engine's path reports it
            if len(view) >= HEADER_SIZE:
                if head is not None:
                    if view[:hlen] != head:
                        return None  # another call's message or a control frame: the engine's path
                else:
                    got_ctx, got_tag, nbytes, meta, root, count, vhash = _HEADER.unpack_from(view)
                    want = HEADER_SIZE + nbytes + (-nbytes % ALIGN)
                    if (got_ctx != ctx or (got_tag != tag and tag != ANY_TAG) or meta != _P2P_META or root or count
                            or vhash or nbytes > dst.nbytes or want > ch.staging_bytes):
                        return None
                if len(view) >= want:
                    if nbytes:
                        memoryview(dst)[:nbytes] = view[HEADER_SIZE : HEADER_SIZE + nbytes]
                    ch.consume(want)
                    self._seen[peer] = (head_ctx(head) if head is not None else ctx, got_tag)
                    self.tcp_eager_recvs += 1
                    return nbytes, got_tag
            if not spin:
                return None
            if not deadline:  # the engine's wait in small: spin, then yield the core, then sleep in the kernel
                now = time.monotonic()
                spin_us = SPIN_US.get() if not self.oversubscribed or SPIN_US.is_set() else _OVERSUBSCRIBED_SPIN_US
                spin_until = now + spin_us * 1e-6
                yield_until = spin_until + YIELD_US.get() * 1e-6
                deadline = yield_until + TCP_EAGER_WAIT_MS.get() * 1e-3
                ready = self._readable.get(peer) or self._poller(peer, ch)
            # until more bytes are in: a poll of the socket costs a third of a failed read
            while not ready(0):
                now = time.monotonic()
                if now < spin_until:
                    continue
                if now >= deadline or self._abort_requests or any(self._sendq.values()):
                    return None
                if now < yield_until:  # a sleeper's wake-up costs tens of µs: the peer's answer is usually sooner
                    os.sched_yield()
                    continue
                ready(max(1, int((deadline - now) * 1e3)))
                break

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
            got_ctx, got_tag, nbytes, meta, root, count, vhash = _HEADER.unpack_from(view)
            total = HEADER_SIZE + nbytes + (-nbytes % ALIGN)
            if (got_ctx != ctx or (got_tag != tag and tag != ANY_TAG) or meta != _P2P_META or root or count or vhash
                    or nbytes > dst.nbytes or len(view) < total):
                return None  # another call's message, a rendezvous, a bad fit or a split frame: the engine's path
            if nbytes:
                memoryview(dst)[:nbytes] = view[HEADER_SIZE : HEADER_SIZE + nbytes]
            ch.consume(total)
            self._seen[peer] = (ctx, got_tag)
            return nbytes, got_tag
        finally:
            self.lock.release()

    def _next_frame(self, peer: int, lane: tuple, dst: np.ndarray, ctx: int, tag: int, polls: int) -> tuple[int, int, int]:
        """One compiled step on ``peer``'s ring, its stream at a frame boundary, waiting up to ``polls`` polls for a
        frame: an acknowledgement of this rank's rendezvous is handled (ACKED); a plain message for a receive of
        (``ctx``, ``tag``; ``tag`` < -1: none) into ``dst`` is taken, or a rendezvous announcement for it pulled
        and acknowledged: (TAKEN, nbytes, tag). Otherwise (EMPTY or OTHER, 0, 0) with the frame left for the
        engine's path, or (-1, 0, 0) for a buffer the kernel does not take."""
        ch = lane[6]
        try:
            status, nbytes, got_tag, head, tail, rid = self._kernels.take_next(
                lane[3], lane[4], lane[5], ch.head, dst, ctx, tag, _P2P_META, _RTS_META, _ACK_META,
                lane[0], lane[1], lane[2], -1 if self._sendq[peer] else ch.tail, self._readv, lane[7], polls)
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
                self._send_ctl(peer, _ACK, ctx, got_tag, rid)
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
                status, nbytes, got_tag, head = self._kernels.take_plain(lane[3], lane[5], dst, ctx, tag, _P2P_META, _RTS_META)
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
            tail = self._kernels.put_header(out[0], out[1], out[2], out[6].tail, ctx, tag, 0, _ACK_META, 0, rid)
        if tail > 0:
            out[6].published(tail)  # type: ignore[index]
        else:  # behind queued frames (or a full ring): in order, through the queue
            self._send_ctl(peer, _ACK, ctx, tag, rid)
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
            head = self._kernels.take_header(lane[3], lane[4], lane[5], ch.head, req.ctx, req.tag, _ACK_META, req.rdv,
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

    def _can_take(self, peer: int, schedules_may_run: bool = False) -> bool:
        """Whether an eager receive from ``peer`` keeps MPI's matching order: no receive posted, nothing unexpected
        buffered, no schedule running (unless ``schedules_may_run``: a collective's frames, which only its own
        receives match), its stream at a frame boundary of a shared-memory ring or a socket."""
        if self._posted or self._unexpected or (self._schedules and not schedules_may_run) or self._abort_requests:
            return False
        st = self._inbound.get(peer)
        return ((peer in self._has_input or peer in self._tcp_socks) and peer not in self._dead and not st.have  # type: ignore[union-attr]
                and st.target is None)  # type: ignore[union-attr]

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
                        status, nbytes, got_tag, head = take_plain(lane[3], lane[5], req.dst, req.ctx, req.tag, _P2P_META, _RTS_META)
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
                    status, nbytes, got_tag = self._next_frame(peer, lane, _NO_DST, 0, -2, 0)
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
                self._send_ctl(peer, _ACK, req.ctx, words[16], words[18])
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
                        out[0], out[2], payload, send_tag, ctx, inp[3], inp[5], dst, recv_tag, _P2P_META, _RTS_META,
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
            self._readv = self._readv_address()
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
        yield_nr = {"x86_64": 24, "amd64": 24, "aarch64": 124, "arm64": 124}.get(os.uname().machine.lower(), -1)
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
            words[p2p_lane.L_META], words[p2p_lane.L_RTS], words[p2p_lane.L_ACK] = _P2P_META, _RTS_META, _ACK_META
            words[p2p_lane.L_YIELD] = yield_nr if self.oversubscribed and syscall else -1
            self._lane_words[p] = words
            self.lane_views[p] = memoryview(words).cast("B").cast("q")
            lane_of[p] = words.ctypes.data
        self.lane_of = lane_of

    def _drop_lane(self, peer: int) -> None:
        """No compiled call touches ``peer``'s rings any more (its channel failed or closes)."""
        if self.lane_of is not None and 0 <= peer < len(self.lane_of):
            self.lane_of[peer] = 0

    def _rdv_ok(self, peer: int, nbytes: int) -> bool:
        """Whether a point-to-point message of ``nbytes`` to ``peer`` goes by rendezvous (pulled by the peer)."""
        return nbytes >= self._rdv_bytes and self._cma_to(peer)

    def _readv_address(self) -> int:
        """The address of libc's process_vm_readv for the compiled rendezvous pull; 0 where cross-memory attach is
        off or unavailable (announcements then go through the Python copy, which says why)."""
        if self._cma is None:
            from .transport.cma import CrossMemory

            self._cma = CrossMemory()
        if not self._cma.loaded:
            return 0
        import ctypes

        try:
            return int(ctypes.cast(ctypes.CDLL(None).process_vm_readv, ctypes.c_void_p).value or 0)
        except (OSError, AttributeError):
            return 0

    @staticmethod
    def _poll_seconds(k: Any) -> float:
        """How long one poll of ``eager_take``'s spin takes here, timed on a private empty ring."""
        data, words, dst = np.zeros(64, np.uint8), np.zeros(32, np.uint64), np.zeros(0, np.uint8)
        k.eager_take(data, data.view(np.uint64), words, 0, dst, 0, 0, 0, 0, 10)
        polls = 20_000
        t0 = time.perf_counter()
        k.eager_take(data, data.view(np.uint64), words, 0, dst, 0, 0, 0, 0, polls)
        return max((time.perf_counter() - t0) / polls, 1e-10)

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
                if _fits(req, u.src, u.ctx, u.tag):
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

    # ---- progress --------------------------------------------------------------------------
    def progress(self) -> bool:
        """Move every channel and every running schedule as far as possible, without blocking."""
        moved = False
        if self._lanes and (self._posted or self._rdv_sends) and not self._schedules:
            moved = self._drain()
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

    def _push(self, peer: int, q: deque) -> bool:
        ch = self.channels[peer]
        moved = False
        while q:
            req = q[0]
            segs = req.segments
            while req.index < len(segs):
                seg = segs[req.index]
                n = ch.send_some(seg[req.offset :]) if req.offset else ch.send_some(seg)
                if n == 0:
                    return moved
                moved = True
                req.offset += n
                if req.offset == len(seg):
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
                        elif type(target) is _Unexpected:
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
                n = ch.recv_some(_PAD_SINK[: st.pad])
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

    def _pull_payload(self, ch: Channel, st: _Inbound) -> int:
        target = st.target
        left = st.nbytes - st.got
        if isinstance(target, RecvRequest) and target.reduces and target.error is None:
            view = ch.peek()
            isz = target.dst.itemsize  # type: ignore[union-attr]
            n = min(len(view), left) // isz * isz
            if n == 0:
                return 0
            i, j = st.got // isz, (st.got + n) // isz
            incoming = np.frombuffer(view[:n], dtype=target.dst.dtype)  # type: ignore[union-attr]
            target.ufunc(target.local[i:j], incoming, out=target.dst[i:j])  # type: ignore[index]
            del incoming
            ch.consume(n)
        elif isinstance(target, RecvRequest) and target.error is None:
            out = memoryview(target.dst.view(np.uint8))[st.got : st.nbytes]  # type: ignore[union-attr]
            n = ch.recv_some(out)
        elif isinstance(target, _Unexpected):
            n = ch.recv_some(memoryview(target.data)[st.got :])
            target.got += n
        else:  # discarding the payload of a failed or mismatched receive
            n = ch.recv_some(memoryview(bytearray(min(left, 1 << 20))))
        st.got += n
        return n

    def _on_header(self, src: int, st: _Inbound, hdr: Any = None) -> None:
        ctx, tag, nbytes, meta, root, count, vhash = _HEADER.unpack_from(st.hdr if hdr is None else hdr)
        try:  # the largest message a peer may announce, read once per engine
            limit = self._max_message
        except AttributeError:
            from .transport.tcp import frame_limit

            limit = self._max_message = frame_limit()
        # Integer comparisons only; nothing is allocated from a length before it passed them.
        if meta >> 24 != _MAGIC or nbytes > limit or (ctx == CONTROL_CTX and nbytes > 1 << 20):
            if meta >> 24 != _MAGIC:
                why = f"bad magic {meta >> 24:#x}: the stream lost its framing"
            elif nbytes > limit:
                why = f"it announces {nbytes} bytes, more than the {limit}-byte limit (PYCOLL_MAX_MESSAGE)"
            else:
                why = f"a control message of {nbytes} bytes"
            log.warning("rank %d: closing the channel to rank %d: malformed message header (%s)", self.rank, src, why)
            raise ProtocolError(f"malformed message header from rank {src} ({why})", rank=self.rank, peers=[src])
        kind = meta & 0xFF
        if kind >= _RTS and ctx != CONTROL_CTX:
            if kind == _SSEND:
                self._on_sync(src, st, ctx, tag, nbytes, vhash)
                return
            if kind <= _RDATA and self._on_rendezvous(src, st, kind, ctx, tag, nbytes, count, vhash):
                return
        sig = P2P_SIG if not meta & 0xFFFFFF and not root and not count and not vhash else \
            Sig(kind, (meta >> 8) & 0xFF, (meta >> 16) & 0xFF, root, count, vhash)
        st.ctx, st.tag, st.nbytes, st.sig, st.got, st.pad = ctx, tag, nbytes, sig, 0, -nbytes % ALIGN
        if ctx == CONTROL_CTX:
            st.target = _Unexpected(src, ctx, tag, sig, nbytes)
            return
        self._seen[src] = (ctx, tag)
        req = self._match(src, ctx, tag)
        if req is None:
            u = _Unexpected(src, ctx, tag, sig, nbytes)
            self._unexpected.append(u)
            st.target = u
            return
        st.target = req
        problem = self._check(req, src, sig, nbytes)
        if problem is not None:
            req.fail(problem)
        else:
            req.source, req.recv_tag, req.nbytes = src, tag, nbytes
            if req.dst is None:
                req.dst = np.empty(nbytes, np.uint8)

    def _on_rendezvous(self, src: int, st: _Inbound, kind: int, ctx: int, tag: int, nbytes: int, addr: int, rid: int) -> bool:
        """A rendezvous frame; False for streamed rendezvous data, which the caller reads like any payload."""
        if kind == _RDATA:
            req = self._rdv_recvs.pop((src, rid), None)
            st.ctx, st.tag, st.nbytes, st.sig, st.got, st.pad = ctx, tag, nbytes, P2P_SIG, 0, -nbytes % ALIGN
            st.target = req  # None (its receive failed meanwhile): the bytes are discarded
            return True
        st.nbytes = st.pad = st.got = 0
        st.target = None
        if kind == _RTS:
            self._seen[src] = (ctx, tag)
            req = self._match(src, ctx, tag)
            if req is None:
                u = _Unexpected(src, ctx, tag, P2P_SIG, 0)
                u.rdv = (rid, addr, nbytes)
                self._unexpected.append(u)
            else:
                self._rdv_pull(req, src, tag, rid, addr, nbytes)
            return True
        if kind == _ACK:
            self._acked(src, rid)
            return True
        send = self._rdv_sends.pop((src, rid), None)
        payload = self._rdv_data.pop((src, rid), None)
        if send is not None and payload is not None:  # _NAK: that peer cannot read this process; stream the payload
            self._cma_ok[src] = False
            n = payload.nbytes
            header = _HEADER.pack(ctx, tag, n, _RDATA | (_MAGIC << 24), 0, 0, rid).ljust(HEADER_SIZE, b"\0")
            send.segments = [memoryview(header), payload] + ([memoryview(_ZEROS[: -n % ALIGN])] if n % ALIGN else [])
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
            self._send_ctl(src, _ACK, req.ctx, tag, rid)
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
            self._send_ctl(src, _NAK, req.ctx, tag, rid)
            return
        req.done = True
        self.rdv_pulls += 1
        self._send_ctl(src, _ACK, req.ctx, tag, rid)

    def _send_ctl(self, peer: int, kind: int, ctx: int, tag: int, rid: int) -> None:
        """A header-only rendezvous frame."""
        if peer in self._dead:
            return
        header = memoryview(_HEADER.pack(ctx, tag, 0, kind | (_MAGIC << 24), 0, 0, rid).ljust(HEADER_SIZE, b"\0"))
        self._enqueue(peer, SendRequest(self._ctl_owner, peer, ctx, tag, [header]))

    def _match(self, src: int, ctx: int, tag: int) -> Optional[RecvRequest]:
        for i, req in enumerate(self._posted):
            if _fits(req, src, ctx, tag):
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

    def _on_complete(self, src: int, st: _Inbound) -> None:
        target = st.target
        if isinstance(target, RecvRequest):
            target.done = True
        elif isinstance(target, _Unexpected):
            if target.ctx == CONTROL_CTX:
                self._on_control(src, target)
            elif target.waiter is not None:
                self._deliver(target.waiter, target)

    def _bind_unexpected(self, req: RecvRequest, u: _Unexpected) -> None:
        if u.rdv is not None:
            rid, addr, nbytes = u.rdv
            self._rdv_pull(req, u.src, u.tag, rid, addr, nbytes)
            return
        if u.sync:  # matched: the synchronous sender may complete
            self._send_ctl(u.src, _ACK, u.ctx, u.tag, u.sync)
        problem = self._check(req, u.src, u.sig, u.data.nbytes)
        if problem is not None:
            req.fail(problem)
            return
        req.source, req.recv_tag, req.nbytes = u.src, u.tag, u.data.nbytes
        if u.got == u.data.nbytes:
            self._deliver(req, u)
        else:
            u.waiter = req

    def _deliver(self, req: RecvRequest, u: _Unexpected) -> None:
        if req.dst is None:
            req.dst = u.data
        elif req.reduces:
            incoming = u.data.view(req.dst.dtype) if u.data.nbytes else req.dst[:0]
            req.ufunc(req.local, incoming, out=req.dst)
        elif u.data.nbytes:
            req.dst.view(np.uint8)[: u.data.nbytes] = u.data
        req.done = True

    # ---- synchronous sends, probes, matched receives, cancels --------------------------------
    def issend(self, peer: int, data: np.ndarray, ctx: int, tag: int, owner: Any) -> SendRequest:
        """A synchronous point-to-point send: done once a receive on ``peer`` matched it. A rendezvous already waits
        for the receiver's pull; any other message goes as an _SSEND frame whose receiver acks the match."""
        payload = memoryview(data if data.dtype is _U8 else data.view(np.uint8))
        if payload.ndim != 1:
            payload = payload.cast("B")
        nbytes = payload.nbytes
        if nbytes >= self._rdv_bytes and data.flags.c_contiguous and self._cma_to(peer):
            return self.isend(peer, data, ctx, tag, P2P_SIG, owner)
        req = SendRequest(owner, peer, ctx, tag, _NO_SEGMENTS)
        if peer in self._dead:
            req.fail(owner.error(PeerFailureError, self._dead[peer], [peer]))
            return req
        self._rdv_seq += 1
        req.rdv = sid = self._rdv_seq  # pushed is not done: the _ACK is (_on_rendezvous); a failed peer fails it
        self._rdv_sends[(peer, sid)] = req
        self._rdv_data[(peer, sid)] = payload
        header = _HEADER.pack(ctx, tag, nbytes, _SSEND | (_MAGIC << 24), 0, 0, sid).ljust(HEADER_SIZE, b"\0")
        pad = -nbytes % ALIGN
        if nbytes <= _SMALL:
            req.segments = [memoryview(b"".join((header, payload, _ZEROS[:pad])))]
        else:
            req.segments = [memoryview(header), payload] + ([memoryview(_ZEROS[:pad])] if pad else [])
        self._enqueue(peer, req)
        return req

    def _on_sync(self, src: int, st: _Inbound, ctx: int, tag: int, nbytes: int, sid: int) -> None:
        """The header of a synchronous send: read like a plain message, and acked to its sender once matched."""
        st.ctx, st.tag, st.nbytes, st.sig, st.got, st.pad = ctx, tag, nbytes, P2P_SIG, 0, -nbytes % ALIGN
        self._seen[src] = (ctx, tag)
        req = self._match(src, ctx, tag)
        if req is None:
            u = _Unexpected(src, ctx, tag, P2P_SIG, nbytes)
            u.sync = sid  # acked by whichever receive takes it (_bind_unexpected)
            self._unexpected.append(u)
            st.target = u
            return
        st.target = req
        self._send_ctl(src, _ACK, ctx, tag, sid)
        problem = self._check(req, src, P2P_SIG, nbytes)
        if problem is not None:
            req.fail(problem)
        else:
            req.source, req.recv_tag, req.nbytes = src, tag, nbytes
            if req.dst is None:
                req.dst = np.empty(nbytes, np.uint8)

    def find_unexpected(self, peer: int, ctx: int, tag: int) -> Optional[_Unexpected]:
        """The buffered message a receive of (``peer``, ``ctx``, ``tag``) would take now (the earliest to arrive)."""
        for u in self._unexpected:
            if u.ctx == ctx and (peer == ANY_SOURCE or u.src == peer) and (tag == ANY_TAG or u.tag == tag):
                return u
        return None

    def iprobe(self, peer: int, ctx: int, tag: int, take: bool = False) -> Optional[_Unexpected]:
        """Progress once, then the message a receive of (peer, ctx, tag) would take, or None. With ``take`` (a matched
        probe) it leaves the unexpected list: no receive but ``mrecv``'s takes it, and the streams it left are not
        read by an eager receive (which needs the list empty) before it."""
        self.progress()
        u = self.find_unexpected(peer, ctx, tag)
        if u is not None and take:
            self._unexpected.remove(u)
        return u

    def probe(self, peer: int, ctx: int, tag: int, owner: Any, timeout: float, take: bool = False) -> _Unexpected:
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

    def mrecv(self, u: _Unexpected, dst: Optional[np.ndarray], owner: Any) -> RecvRequest:
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

    # ---- failures --------------------------------------------------------------------------
    def _channel_failed(self, peer: int, cause: str) -> None:
        if peer in self._dead:
            return
        if peer in self._pulling:
            # A reply to its stream failed (an ack to a peer that reported another rank's death and exited): the
            # rest of the stream, that report included, is read first, by the pull on the stack, which fails it after.
            self._fail_after_pull.setdefault(peer, cause)
            return
        self._dead[peer] = cause
        self._readable.pop(peer, None)
        clean = getattr(self.channels[peer], "closed_by_peer", False)
        try:  # what it sent before it went (a goodbye, a report of another rank's death) comes first
            self._pull(peer)
        except PeerFailureError:
            pass
        clean = clean or peer in self._left
        log.info("channel to rank %d failed: %s", peer, cause)
        for req in self._sendq[peer]:
            req.fail(req.owner.error(PeerFailureError, cause, [peer]))
        self._sendq[peer].clear()
        for key in [k for k in self._rdv_sends if k[0] == peer]:  # the peer never pulled them: the buffers are untouched
            self._rdv_data.pop(key, None)
            req = self._rdv_sends.pop(key)
            req.fail(req.owner.error(PeerFailureError, cause, [peer]))
        for key in [k for k in self._rdv_recvs if k[0] == peer]:
            req = self._rdv_recvs.pop(key)
            req.fail(req.owner.error(PeerFailureError, cause, [peer]))
        for req in [r for r in self._posted if r.peer == peer]:
            self._posted.remove(req)
            req.fail(req.owner.error(PeerFailureError, cause, [peer]))
        st = self._inbound[peer]
        if isinstance(st.target, RecvRequest):
            st.target.fail(st.target.owner.error(PeerFailureError, cause, [peer]))
        self._closed.add(peer)
        self._drop_lane(peer)
        # The fast paths never look at a closed channel again (its rings may be unmapped once it is closed).
        self._peers = [e for e in self._peers if e[0] != peer]
        self._inputs.pop(peer, None)
        try:
            self.channels[peer].close()
        except Exception:  # closing a broken channel is best effort
            pass
        if clean:
            self._left.add(peer)
            return  # a normal shutdown: it finished its part; only what still needed it (failed above) fails
        # It died: collectives of every communicator that has it cannot finish. Fail them now, naming it
        # (a collective that only waited for flags it already set finishes first).
        for sched in list(self._schedules):
            if not sched.done and peer in sched.owner.members:
                if not sched.gen.gi_running:
                    sched.advance()
                if not sched.done:
                    self.break_ctx(sched.owner.ctx & ~1, sched.owner.error(PeerFailureError, cause, [peer]), sched.owner.tag)

    def _on_control(self, src: int, msg: _Unexpected) -> None:
        try:
            info = json.loads(bytes(msg.data).decode())
            base = int(info["ctx"])
        except (ValueError, KeyError, UnicodeDecodeError):
            raise ProtocolError(f"malformed control message from rank {src}", peers=[src]) from None
        peers = [info["rank"]] if info.get("rank") is not None else []
        if msg.tag == _GOODBYE_TAG:
            self._left.add(src)
            return
        if msg.tag == _STATUS_ASK:
            self._tell_status(src, info)
            return
        if msg.tag == _STATUS_TELL:
            self._compare_calls(src, info.get("calls") or ())
            if info.get("quiet"):
                return
            self._asked.discard(src)
            log.warning("stall report: world rank %d answers: %s", src, info.get("doing") or "no pycoll operation in progress")
            return
        if msg.tag == _SKIP_TAG:
            err = RemoteError(
                f"rank {info.get('rank')} rejected its arguments and skipped this call ({info.get('cause', '?')})",
                op=info.get("op"),
                peers=peers,
            )
            err.contained = True  # type: ignore[attr-defined]  # only this call fails; nothing to abort
            key = (base, int(info.get("seq", -1)))
            for sched in self._schedules:
                if (sched.owner.ctx, sched.owner.tag) == key:
                    sched.fail(self._with_rank(err, sched.owner))
                    return
            self._skipped[key] = err
            return
        lost = [int(q) for q in info.get("lost") or ()]
        if lost:  # a peer died: say which, so every survivor names the same dead rank
            dead = ", ".join(map(str, lost))
            err = PeerLostError(
                f"rank {dead} failed: rank {info.get('rank')} saw it in {info.get('op', '?')} ({info.get('cause', '?')})",
                peers=lost,
            )
        elif info.get("error") in ("MismatchError", "PeerMismatchError"):  # a mismatch: every rank raises one
            cause = str(info.get("cause", "?")).replace("this rank called", f"rank {info.get('rank')} called")
            err = PeerMismatchError(f"{cause} (found by rank {info.get('rank')})", peers=sorted(set(peers + list(info.get("ranks") or ()))))
        else:
            err = RemoteError(
                f"rank {info.get('rank')} failed in {info.get('op', '?')} ({info.get('error', 'error')}: {info.get('cause', '?')})",
                peers=peers,
            )
        if info.get("error") == "TimeoutError":
            err.timed_out = True  # type: ignore[attr-defined]  # stalled ranks here name whom they still wait for
        members = [int(m) for m in info.get("members") or ()]
        if lost:  # src only passes the news on: if its own stream ends next, it was no death (``witnessed``)
            self._messengers.setdefault(src, set()).update(members[q] for q in lost if 0 <= q < len(members))
        for q in lost:  # a witness saw it die: stop waiting on it everywhere, naming it
            w = members[q] if 0 <= q < len(members) else -1
            if w != self.rank and w in self.channels and w not in self._dead:
                self._channel_failed(w, f"rank {q} failed (rank {info.get('rank')} saw it: {info.get('cause', '?')})")
        self.break_ctx(base & ~1, err, int(info.get("seq", -1)))
        if lost and base & ~1 not in self._told and self.rank in members:
            # Pass a death on before this rank can raise (and perhaps exit): whoever sees this rank's
            # stream end has then heard which rank really died.
            self._told.add(base & ~1)
            fwd = Owner(info.get("op", "?"), base | 1, members.index(self.rank), lambda w: w, members, tag=int(info.get("seq", -1)))
            self._tell_members(fwd, err, _ABORT_TAG, base & ~1)

    def _is_broken_for(self, owner: Owner) -> bool:
        """Calls numbered before the failed one finish normally; that one, later ones and p2p fail."""
        entry = self._broken.get(owner.ctx & ~1)
        return entry is not None and (owner.tag < 0 or entry[1] < 0 or owner.tag >= entry[1])

    def break_ctx(self, base: int, err: PycollError, seq: int) -> None:
        """Fail what is pending on a communicator from collective ``seq`` on (all of it if seq < 0)."""
        entry = self._broken.get(base)
        if entry is not None and (entry[1] < 0 or 0 <= entry[1] <= seq):
            return  # already broken from this call on
        self._broken[base] = (err, seq)  # a failure in an earlier call than the one known: from there on
        broken = [s for s in self._schedules if self._is_broken_for(s.owner)]
        stalled = [self._stalled(err, s) for s in broken]  # before their receives fail below
        for req in [r for r in self._posted if self._is_broken_for(r.owner)]:
            self._posted.remove(req)
            req.fail(self._with_rank(err, req.owner))
        for sched, own in zip(broken, stalled):
            sched.fail(own or self._with_rank(err, sched.owner))

    @staticmethod
    def _pending_peers(waits: Iterable[Any]) -> list[int]:
        """World ranks that the given waits still need something from."""
        flat = [x for w in waits for x in getattr(w, "requests", (w,))]
        return sorted({r.peer for r in flat if not r.done and r.peer >= 0})

    def _stalled(self, err: PycollError, sched: Schedule) -> Optional[PycollError]:
        """After another rank timed out: this rank's own TimeoutError if it still waits for someone else."""
        if not getattr(err, "timed_out", False):
            return None
        waiting = [p for p in self._pending_peers(sched.waiting) if p not in {sched.owner.members[q] for q in err.peers}]
        if not waiting:
            return None
        owner = sched.owner
        ranks = ", ".join(str(owner.to_comm(p)) for p in waiting)
        return owner.error(TimeoutError, f"stalled waiting for ranks {ranks} ({err.cause})", waiting)

    @staticmethod
    def _with_rank(err: PycollError, owner: Owner) -> PycollError:
        """A peer's report as this rank's error in ``owner``'s operation (its op and sequence number)."""
        if isinstance(err, RemoteError) and err.rank is None:
            out = type(err)(err.cause, op=owner.op, rank=owner.rank, peers=err.peers)
            out.contained = getattr(err, "contained", False)  # type: ignore[attr-defined]
            return out
        if isinstance(err, AbortedError) and err.op != owner.op:  # name the call that was waiting
            return AbortedError(err.cause, op=owner.op, rank=owner.rank)
        return err

    def poll_reports(self) -> None:
        """Read what peers sent (reports of failures among them) without advancing any schedule."""
        for peer in self._order:
            if peer not in self._dead:
                try:
                    self._pull(peer)
                except PeerFailureError as err:
                    self._channel_failed(peer, err.cause)

    def dead_peers(self) -> dict[int, str]:
        """World ranks whose channel failed, with the reason."""
        return self._dead

    def unexpected_in(self, ctx: int, lo: int, hi: int) -> Optional[tuple[int, Sig]]:
        """(source, signature) of the first buffered unmatched message on ``ctx`` with lo <= tag < hi."""
        for u in self._unexpected:
            if u.ctx == ctx and lo <= u.tag < hi:
                return u.src, u.sig
        return None

    def broken_since(self, ctx: int) -> int:
        """The call number from which the communicator is broken (-1: all of it, 0: not broken)."""
        entry = self._broken.get(ctx & ~1)
        return 0 if entry is None else entry[1]

    def broken(self, ctx: int) -> Optional[PycollError]:
        entry = self._broken.get(ctx & ~1)
        return entry[0] if entry is not None else None

    def witnessed(self, err: PycollError, owner: Owner) -> PycollError:
        """``err``, a lost connection in ``owner``'s operation; or, where the peers it names had reported that
        another rank died before their streams ended (they exited after passing the news on, on this or another
        communicator), an error naming the rank that really died, as this operation's."""
        if type(err) is not PeerFailureError or not err.peers:
            return err
        known = self.broken(owner.ctx)
        if isinstance(known, PeerLostError) and not set(known.peers) & set(err.peers):
            return self._with_rank(known, owner)
        members = list(owner.members)
        named = [members[q] for q in err.peers if 0 <= q < len(members)]
        if not named or not all(w in self._messengers for w in named):
            return err
        dead = sorted({members.index(w) for m in named for w in self._messengers[m] if w in members} - set(err.peers))
        if not dead:
            return err
        who = ", ".join(map(str, dead))
        return PeerLostError(f"rank {who} failed: rank {err.peers[0]} reported it before its own connection ended "
                             f"({err.cause})", op=owner.op, rank=owner.rank, peers=dead)

    def _tell_members(self, owner: Owner, err: PycollError, tag: int, ctx: int) -> list[SendRequest]:
        info = {"ctx": ctx, "seq": owner.tag, "op": owner.op, "rank": owner.rank, "error": type(err).__name__, "cause": err.cause,
                "members": list(owner.members)}
        if isinstance(err, PeerFailureError) and err.peers:  # the ranks that died (a lost peer's report passes them on)
            info["lost"] = list(err.peers)
        elif isinstance(err, MismatchError):
            info["ranks"] = list(err.peers)
        body = json.dumps(info).encode()
        payload = np.frombuffer(body, np.uint8)
        return [
            self.isend(p, payload, CONTROL_CTX, tag, P2P_SIG, owner)
            for p in owner.members
            if p != self.rank and p not in self._dead
        ]

    def notify_skip(self, owner: Owner, err: PycollError) -> None:
        """Tell the other members that this rank will not take part in collective ``owner.tag``."""
        self._tell_members(owner, err, _SKIP_TAG, owner.ctx)

    def abort(self, owner: Owner, err: PycollError) -> None:
        """Tell the communicator's other members that this operation failed here, then break it locally."""
        base = owner.ctx & ~1
        if getattr(err, "contained", False):
            return
        if base not in self._told:
            # Tell the others even if a peer's report broke the communicator here: a rank's report then always
            # precedes its exit on every stream, so no survivor mistakes a survivor's exit for the failure.
            self._told.add(base)
            self._tell_members(owner, err, _ABORT_TAG, base)
            self._broken.setdefault(base, (err, owner.tag))
        self.flush(1.0, delivered=True)  # best effort: a peer that does not drain is probably dead
        for sched in self._schedules:
            if self._is_broken_for(sched.owner):
                sched.fail(err)

    # ---- waiting ---------------------------------------------------------------------------
    def start(self, sched: Schedule, direct: bool = False) -> Schedule:
        """Begin a schedule; it runs in the background of every later wait. A ``direct`` one (its first messages
        straight through the sockets) skips the first progress pass: a peer's notice that it skipped the call
        is a frame its receives do not take, so the schedule then waits, and the wait's progress reads it."""
        if not direct:
            self.progress()  # a notice that a peer skipped this call may be waiting
        skipped = self._skipped.pop((sched.owner.ctx, sched.owner.tag), None)
        if skipped is not None:
            sched.fail(self._with_rank(skipped, sched.owner))
            return sched
        if self._dead:  # a member already died: this collective cannot finish
            dead = [m for m in sched.owner.members if m in self._dead and m not in self._left]
            if dead:
                err = sched.owner.error(PeerFailureError, self._dead[dead[0]], dead)
                sched.fail(err)
                self.break_ctx(sched.owner.ctx & ~1, err, sched.owner.tag)
                return sched
        sched.advance()
        if not sched.done:
            self._schedules.append(sched)
        return sched

    def wait_schedule(self, sched: Schedule, timeout: float) -> None:
        self._wait(lambda: sched.done, lambda: sched.steps, timeout, sched.owner, lambda: sched.waiting)
        if sched in self._schedules:
            self._schedules.remove(sched)

    def wait_requests(self, reqs: Sequence[Request], timeout: float, owner: Owner) -> None:
        """Wait for all of ``reqs``; each one that completes earns a fresh timeout. Their completions are counted from
        a pointer past the done prefix (requests mostly complete in order), the rest looked at only when the prefix
        did not move, so a long window costs no pass over all of it per message."""
        n = len(reqs)
        front = 0  # reqs[:front] are done
        beyond: set[int] = set()  # indices past the front seen done
        last_front = 0
        observed = 0  # changes whenever a completion was seen

        def finished() -> bool:
            nonlocal front
            while front < n and reqs[front].done:
                front += 1
            return front == n

        def completed() -> int:
            nonlocal last_front, observed
            finished()
            if front != last_front:  # the request at the last front completed: that alone tells a change
                last_front = front
                observed += 1
            else:
                new = [i for i in range(front + 1, n) if reqs[i].done and i not in beyond]
                if new:
                    beyond.update(new)
                    observed += 1
            return observed

        self._wait(finished, completed, timeout, owner, lambda: reqs)

    def wait_one(self, req: Request, timeout: float) -> None:
        """Wait for one point-to-point request: a short tight poll of the channels, then the general wait."""
        if self._kernels is not None and type(req) is SendRequest and req.rdv and not req.done and self._await_ack(req):
            return
        if not self._abort_requests and self.lock.acquire(blocking=False):
            try:
                progress = self.progress
                for _ in range(self._tight_polls if not self.oversubscribed else 4):
                    progress()
                    if req.done:
                        return
            finally:
                self.lock.release()
        if not req.done:
            self._wait(lambda: req.done, lambda: req.done, timeout, req.owner, lambda: (req,))

    def _input_ready(self) -> bool:
        return any(f() for f in self._inputs.values())

    def run_until(self, ready: Callable[[], bool], seconds: float) -> None:
        """Make progress until ``ready()`` or ``seconds`` pass, sleeping (never spinning) when idle; no timeout error.

        For a progress thread beside the user's: it must not hold the GIL or a core while idle.
        """
        self._wait(ready, lambda: 0, seconds, None, lambda: (), spin=False)

    def _wait(
        self,
        finished: Callable[[], bool],
        marker: Callable[[], int],
        timeout: float,
        owner: Optional[Owner],
        pending: Callable[[], Iterable[Request]],
        spin: bool = True,
    ) -> None:
        with self.lock:
            if owner is not None:
                self._waits.append(owner)
            try:
                self._wait_locked(finished, marker, timeout, owner, pending, spin)
            finally:
                if owner is not None:
                    self._waits.remove(owner)

    def _wait_locked(
        self,
        finished: Callable[[], bool],
        marker: Callable[[], int],
        timeout: float,
        owner: Optional[Owner],
        pending: Callable[[], Iterable[Request]],
        spin: bool,
    ) -> None:
        # ranks sharing cores spin only briefly (unless PYCOLL_SPIN_US says otherwise): the core may be needed
        spin_us = SPIN_US.get() if not self.oversubscribed or SPIN_US.is_set() else _OVERSUBSCRIBED_SPIN_US
        spin_s = spin_us * 1e-6 if spin else 0.0
        yield_s = spin_s + YIELD_US.get() * 1e-6 if spin else 0.0
        start = idle_since = time.monotonic()
        deadline = start + timeout
        stall_s = STALL_WARN.get() if owner is not None else 0.0
        stall_at = start + stall_s if stall_s > 0 else float("inf")
        probed = False
        last_mark = marker()
        nap = 20e-6
        while not finished():
            if self._abort_requests:
                self.take_aborts()
                continue
            if self.progress():
                idle_since = time.monotonic()
                nap = 20e-6
                mark = marker()
                if mark != last_mark:  # each completed step earns a fresh timeout
                    last_mark, deadline = mark, idle_since + timeout
                continue
            now = time.monotonic()
            if now > deadline:
                if owner is None:  # run_until: the time is up, nothing failed
                    return
                self._timed_out(owner, timeout, pending())
            idle = now - idle_since
            if idle < spin_s:
                continue
            bell = _common_bell(pending())
            if bell is None and self._stream_bell is not None and not self._schedules:
                bell = self._stream_bell  # point-to-point only: a peer's write into our rings wakes us
            if idle < yield_s and (bell is None or not self.oversubscribed):
                os.sched_yield()
                continue
            if now - self._last_liveness > 0.25:
                self._last_liveness = now
                self._check_liveness()
                self._check_strays()
                if owner is not None and not probed and now - start > PROBE_AFTER_S and owner.sig is not None and owner.tag >= 0:
                    probed = True
                    self._ask(owner, pending(), quiet=True)
                if now > stall_at:
                    assert owner is not None
                    self._report_stall(owner, pending(), now - start)
                    stall_at = now + stall_s
            if bell is not None and bell is self._stream_bell:
                bell.sleep(min(0.002, max(deadline - now, 0)), self._input_ready)
                continue
            if bell is not None:  # every wait is on one arena's flags: block on its doorbell, a peer's ring wakes us
                waits = pending()
                bell.sleep(min(0.001, max(deadline - now, 0)), lambda: all(w.done for w in waits))
                continue
            peers = self._pending_peers(pending()) if not self._only_sockets else ()
            if peers and self._shm_bell is not None and self._shm_peers.issuperset(peers):
                # waits on this host's peers only: their writes into our rings (or space freed in theirs) ring our bell
                self._shm_bell.sleep(min(0.002, max(deadline - now, 0)), self._input_ready)
                continue
            remote = self._only_sockets or (bool(peers) and self._tcp_peers.issuperset(peers))
            nap = min(nap * 2, 0.05 if (remote and spin) else 0.001, max(deadline - now, 0))
            self._sleep(nap)

    # ---- aborts from other threads, stall reports ----------------------------------------------
    def request_abort(self, base: int, err: PycollError, members: Sequence[int]) -> bool:
        """Break communicator ``base`` (world ranks ``members``) from any thread: at once if no thread is waiting
        in this engine (True), else the waiting thread does it within one sleep (at most 50 ms)."""
        self._abort_requests.append((base, err, list(members)))
        if self.lock.acquire(blocking=False):
            try:
                self.take_aborts()
            finally:
                self.lock.release()
            return True
        return False

    def take_aborts(self) -> None:
        """Carry out the aborts other threads asked for: tell the peers, fail everything pending on the communicator."""
        while self._abort_requests:
            base, err, members = self._abort_requests.popleft()
            rank = err.rank if err.rank is not None else -1
            owner = Owner(err.op or "Abort", base | 1, rank, lambda w: w, members, tag=-1)
            self._told.add(base)
            reqs = self._tell_members(owner, err, _ABORT_TAG, base)
            self.break_ctx(base, err, -1)  # earlier calls too: nothing on this communicator completes any more
            deadline = time.monotonic() + 1.0  # best effort, as in abort()
            told = {r.peer for r in reqs}
            while time.monotonic() < deadline and not (
                all(r.done for r in reqs) and not any(self.channels[p].unsafe_to_exit() for p in told if p not in self._dead)
            ):
                if not self.progress():
                    time.sleep(0.0005)

    def _report_stall(self, owner: Owner, pending: Iterable[Request], waited: float) -> None:
        """Log who has not joined ``owner``'s operation and what they were last seen in; ask them what they do."""
        waiting = [p for p in self._pending_peers(pending) if p != self.rank]
        parts = []
        for p in waiting:
            seen = self._seen.get(p)
            if seen is None:
                where = "no message from it yet"
            elif seen[0] & ~1 == owner.ctx & ~1 and seen[1] >= 0:
                where = f"last seen in call #{seen[1] // self.tags_per_call} of this communicator"
            else:
                where = "last seen in another communicator" + (f" (call #{seen[1] // self.tags_per_call})" if seen[1] >= 0 else " (point-to-point)")
            if p in self._asked:
                where += "; it has not answered the last status question (busy outside pycoll?)"
            parts.append(f"rank {owner.to_comm(p)} (world {p}): {where}")
        log.warning(
            "stall: %s on world rank %d (rank %d of its communicator) has waited %.0f s; not joined: %s",
            owner.op, self.rank, owner.rank, waited, "; ".join(parts) or "no rank (waiting on local work)",
        )
        self._ask(owner, pending, quiet=False)

    def _ask(self, owner: Owner, pending: Iterable[Request], quiet: bool) -> None:
        """Ask the ranks ``owner``'s operation waits for what they are doing (``quiet``: only to spot a mismatch)."""
        body = np.frombuffer(json.dumps({"ctx": owner.ctx & ~1, "op": owner.op, "rank": owner.rank, "quiet": quiet}).encode(), np.uint8)
        for p in self._pending_peers(pending):
            if p != self.rank and p not in self._dead and p in self.channels:
                if not quiet:
                    self._asked.add(p)
                self.isend(p, body, CONTROL_CTX, _STATUS_ASK, P2P_SIG, owner)

    def _compare_calls(self, src: int, calls: Iterable) -> None:
        """A peer said which calls it is in: one of ours with the same number but another signature is a mismatch
        (both sides wait, so no message would ever show it: rooted calls whose roots disagree, say)."""
        theirs = {(int(c[0]), int(c[1])): Sig(*(int(v) for v in c[2])) for c in calls if len(c) == 3 and len(c[2]) == 6}
        for sched in list(self._schedules):
            own = sched.owner
            sig = theirs.get((own.ctx, own.tag))
            if not sched.done and own.sig is not None and sig is not None and sig != own.sig and src in own.members:
                sched.fail(own.error(
                    MismatchError, f"rank {own.to_comm(src)} called {own.describe(sig)}, this rank called {own.describe(own.sig)}", [src]
                ))

    def _tell_status(self, src: int, info: dict) -> None:
        """Answer a stalled peer: the operations this rank waits in, and for whom."""
        doing = []
        for w in self._waits:
            scheds = [s for s in self._schedules if s.owner is w]
            pending = [x for s in scheds for x in s.waiting]
            who = [p for p in self._pending_peers(pending) if p != self.rank]
            doing.append(f"in {w.op} (rank {w.rank} of its communicator)" + (f", waiting for world ranks {who}" if who else ""))
        running = [s.owner.op for s in self._schedules if s.owner not in self._waits]
        if running:
            doing.append("started without waiting: " + ", ".join(running))
        calls = [[s.owner.ctx, s.owner.tag, list(s.owner.sig)] for s in self._schedules if s.owner.sig is not None and s.owner.tag >= 0]
        body = json.dumps({"ctx": int(info.get("ctx", 0)), "rank": self.rank, "doing": "; ".join(doing), "calls": calls,
                           "quiet": bool(info.get("quiet"))}).encode()
        owner = Owner("stall report", CONTROL_CTX, self.rank, lambda w: w, (), tag=-1)
        self.isend(src, np.frombuffer(body, np.uint8), CONTROL_CTX, _STATUS_TELL, P2P_SIG, owner)

    def _sleep(self, seconds: float) -> None:
        """Sleep up to ``seconds``, woken at once by input on a socket (or room to send on one) where there are any;
        a peer on this host writing to us does not end it early (``seconds`` stays short while one may)."""
        if self._tcp_fds:
            live = [fd for fd, ch in self._tcp_fds.items() if ch.peer not in self._dead]
            writers = [fd for fd in live if self._sendq[self._tcp_fds[fd].peer]]
            if live:
                select.select(live, writers, [], seconds)
                return
        time.sleep(seconds)

    def _check_strays(self) -> None:
        """Fail a waiting collective when a peer sent a message for the same call number with another signature:
        it called something else (a message nobody will ever receive), whatever the algorithms' meeting points."""
        for sched in self._schedules:
            own = sched.owner
            if sched.done or own.sig is None or own.tag < 0:
                continue
            lo, hi = own.tag * self.tags_per_call, (own.tag + 1) * self.tags_per_call
            for u in self._unexpected:
                if u.ctx == own.ctx and lo <= u.tag < hi and u.sig != own.sig and u.sig.kind != _CHECK_KIND:
                    sched.fail(own.error(
                        MismatchError, f"rank {own.to_comm(u.src)} called {own.describe(u.sig)}, this rank called {own.describe(own.sig)}",
                        [u.src],
                    ))
                    break

    def _check_liveness(self) -> None:
        for peer, ch in self.channels.items():
            if peer in self._dead:
                continue
            reason = ch.check_alive()
            if reason is not None:
                self._channel_failed(peer, reason)  # drains what it sent before it went away

    def _timed_out(self, owner: Owner, timeout: float, pending: Iterable[Request]) -> None:
        pending = [x for r in pending for x in getattr(r, "requests", (r,))]  # waits on any of several groups
        waiting_on = self._pending_peers(pending)
        sends = sorted({r.peer for r in pending if isinstance(r, SendRequest) and not r.done})
        what = f"waiting for ranks {', '.join(str(owner.to_comm(p)) for p in waiting_on)}" if waiting_on else "waiting"
        extra = f" (sends to ranks {', '.join(str(owner.to_comm(p)) for p in sends)} not drained)" if sends else ""
        err = owner.error(TimeoutError, f"Timed out after {timeout:g} s {what}{extra}", waiting_on)
        self.abort(owner, err)
        raise err

    # ---- shutdown --------------------------------------------------------------------------
    def flush(self, timeout: float, delivered: bool = False) -> None:
        """Push out queued sends (e.g. before exit), for at most ``timeout`` seconds; with ``delivered``, also
        until every live peer holds them (a report sent just before an exit must not die in a socket buffer)."""
        deadline = time.monotonic() + timeout

        def pending() -> bool:
            live = [p for p in self._sendq if p not in self._dead]
            return any(self._sendq[p] for p in live) or (delivered and any(self.channels[p].unsafe_to_exit() for p in live))

        while pending() and time.monotonic() < deadline:
            if not self.progress():
                time.sleep(0.0005)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        owner = Owner("shutdown", CONTROL_CTX, self.rank, lambda w: w, (), tag=-1)
        bye = np.frombuffer(json.dumps({"ctx": 0, "rank": self.rank}).encode(), np.uint8)
        for peer in self._order:  # before the streams end, so that peers do not take this for a death
            if peer not in self._dead and peer != self.rank and self.channels[peer].kind != "self":
                self.isend(peer, bye, CONTROL_CTX, _GOODBYE_TAG, P2P_SIG, owner)
        self.flush(0.5)
        for peer in self.channels:
            self._drop_lane(peer)
        for ch in self.channels.values():
            try:
                ch.close()
            except Exception:  # best effort at exit
                pass
