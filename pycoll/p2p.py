"""The point-to-point layer: message framing, tag matching and the progress engine over per-peer channels."""

from __future__ import annotations

import json
import logging
import os
import select
import struct
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterable, NamedTuple, Optional, Sequence, Union

import numpy as np

from .config import float_param
from .errors import (
    MismatchError,
    PeerFailureError,
    ProtocolError,
    PycollError,
    RemoteError,
    TimeoutError,
)
from .transport.base import Channel

log = logging.getLogger("pycoll")

SPIN_US = float_param("PYCOLL_SPIN_US", 50.0, "Microseconds a wait busy-polls before it starts yielding the core.")
YIELD_US = float_param("PYCOLL_YIELD_US", 2000.0, "Microseconds a wait then spends in sched_yield before it sleeps.")

ANY_SOURCE = -1
ANY_TAG = -1
PROC_NULL = -2

# Frame: 64-byte header, payload, zero padding to 64 bytes (keeps every header and payload aligned in rings).
_HEADER = struct.Struct("<QqQIiQQ")  # ctx, tag, nbytes, meta (kind|dtype<<8|op<<16), root, count, vhash
HEADER_SIZE = 64
ALIGN = 64
_MAGIC = 0x70  # high byte of meta: catches a stream that lost its framing
_ZEROS = bytes(ALIGN)
_SMALL = 16 << 10
_PAD_SINK = memoryview(bytearray(ALIGN))  # payloads up to this size travel in one buffer with their header

CONTROL_CTX = (1 << 64) - 1
_ABORT_TAG = 1  # a rank failed inside an operation: the communicator is broken
_SKIP_TAG = 2  # a rank rejected its arguments before taking part: only that call fails


class Sig(NamedTuple):
    """What a collective message says about the call that sent it; both ends must agree."""

    kind: int = 0
    dtype: int = 0
    op: int = 0
    root: int = 0
    count: int = 0
    vhash: int = 0


P2P_SIG = Sig()


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

    def error(self, cls: type, cause: str, world_peers: Iterable[int] = ()) -> PycollError:
        return cls(cause, op=self.op, rank=self.rank, peers=sorted({self.to_comm(p) for p in world_peers}))


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
    __slots__ = ("segments", "index", "offset")

    def __init__(self, owner: Owner, peer: int, ctx: int, tag: int, segments: list[memoryview]) -> None:
        super().__init__(owner, peer, ctx, tag)
        self.segments = segments
        self.index = 0
        self.offset = 0


class RecvRequest(Request):
    """Receives into ``dst`` (or into a new array if None), or reduces: ``out = op(local, incoming)``."""

    __slots__ = ("sig", "dst", "local", "out", "ufunc", "nbytes", "source", "recv_tag", "seq")

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
        super().__init__(owner, peer, ctx, tag)
        self.sig = sig
        self.dst = dst  # flat typed array (copy target, or reduce output)
        self.local = local
        self.ufunc = ufunc
        self.nbytes = 0
        self.source = -1
        self.recv_tag = -1
        self.seq = 0

    @property
    def reduces(self) -> bool:
        return self.ufunc is not None


class _Unexpected:
    """A message that arrived before its receive was posted, buffered whole."""

    __slots__ = ("src", "ctx", "tag", "sig", "data", "got", "waiter")

    def __init__(self, src: int, ctx: int, tag: int, sig: Sig, nbytes: int) -> None:
        self.src, self.ctx, self.tag, self.sig = src, ctx, tag, sig
        self.data = np.empty(nbytes, np.uint8)
        self.got = 0
        self.waiter: Optional[RecvRequest] = None


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
        self.closed = False

    # ---- posting ---------------------------------------------------------------------------
    def isend(self, peer: int, data: np.ndarray, ctx: int, tag: int, sig: Sig, owner: Owner) -> SendRequest:
        payload = memoryview(data.view(np.uint8)) if data.dtype != np.uint8 else memoryview(data)
        nbytes = payload.nbytes
        meta = sig.kind | (sig.dtype << 8) | (sig.op << 16) | (_MAGIC << 24)
        header = _HEADER.pack(ctx, tag, nbytes, meta, sig.root, sig.count, sig.vhash).ljust(HEADER_SIZE, b"\0")
        pad = _pad(nbytes)
        if nbytes <= _SMALL:
            segments = [memoryview(b"".join((header, payload, _ZEROS[:pad])))]
        else:
            segments = [memoryview(header), payload.cast("B")] + ([memoryview(_ZEROS[:pad])] if pad else [])
        req = SendRequest(owner, peer, ctx, tag, segments)
        if peer in self._dead:
            req.fail(owner.error(PeerFailureError, self._dead[peer], [peer]))
            return req
        q = self._sendq[peer]
        q.append(req)
        if len(q) == 1:  # start at once: small messages usually leave right here
            try:
                self._push(peer, q)
            except PeerFailureError as err:
                self._channel_failed(peer, err.cause)
        return req

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
        if self._is_broken_for(owner):
            req.fail(self._with_rank(self._broken[ctx & ~1][0], owner))
            return req
        # An unexpected message that matches takes precedence, in arrival order.
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
        for peer in self._order:
            if peer in self._dead:
                continue
            try:
                q = self._sendq[peer]
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
            req.done = True
            q.popleft()
        return moved

    def _pull(self, peer: int) -> bool:
        ch = self.channels[peer]
        st = self._inbound[peer]
        moved = False
        while True:
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

    def _on_header(self, src: int, st: _Inbound) -> None:
        ctx, tag, nbytes, meta, root, count, vhash = _HEADER.unpack_from(st.hdr)
        if meta >> 24 != _MAGIC:
            raise ProtocolError(f"malformed message header from rank {src} (bad magic {meta >> 24:#x})", peers=[src])
        sig = Sig(meta & 0xFF, (meta >> 8) & 0xFF, (meta >> 16) & 0xFF, root, count, vhash)
        st.ctx, st.tag, st.nbytes, st.sig, st.got, st.pad = ctx, tag, nbytes, sig, 0, _pad(nbytes)
        if ctx == CONTROL_CTX:
            st.target = _Unexpected(src, ctx, tag, sig, nbytes)
            return
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

    # ---- failures --------------------------------------------------------------------------
    def _channel_failed(self, peer: int, cause: str) -> None:
        if peer in self._dead:
            return
        self._dead[peer] = cause
        log.info("channel to rank %d failed: %s", peer, cause)
        for req in self._sendq[peer]:
            req.fail(req.owner.error(PeerFailureError, cause, [peer]))
        self._sendq[peer].clear()
        for req in [r for r in self._posted if r.peer == peer]:
            self._posted.remove(req)
            req.fail(req.owner.error(PeerFailureError, cause, [peer]))
        st = self._inbound[peer]
        if isinstance(st.target, RecvRequest):
            st.target.fail(st.target.owner.error(PeerFailureError, cause, [peer]))
        try:
            self.channels[peer].close()
        except Exception:  # closing a broken channel is best effort
            pass

    def _on_control(self, src: int, msg: _Unexpected) -> None:
        try:
            info = json.loads(bytes(msg.data).decode())
            base = int(info["ctx"])
        except (ValueError, KeyError, UnicodeDecodeError):
            raise ProtocolError(f"malformed control message from rank {src}", peers=[src]) from None
        peers = [info["rank"]] if info.get("rank") is not None else []
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
        err = RemoteError(
            f"rank {info.get('rank')} failed in {info.get('op', '?')} ({info.get('error', 'error')}: {info.get('cause', '?')})",
            peers=peers,
        )
        if info.get("error") == "TimeoutError":
            err.timed_out = True  # type: ignore[attr-defined]  # stalled ranks here name whom they still wait for
        self.break_ctx(base & ~1, err, int(info.get("seq", -1)))

    def _is_broken_for(self, owner: Owner) -> bool:
        """Calls numbered before the failed one finish normally; that one, later ones and p2p fail."""
        entry = self._broken.get(owner.ctx & ~1)
        return entry is not None and (owner.tag < 0 or entry[1] < 0 or owner.tag >= entry[1])

    def break_ctx(self, base: int, err: PycollError, seq: int) -> None:
        """Fail what is pending on a communicator from collective ``seq`` on (all of it if seq < 0)."""
        if base in self._broken:
            return
        self._broken[base] = (err, seq)
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
        if isinstance(err, RemoteError) and err.rank is None:
            out = RemoteError(err.cause, op=owner.op, rank=owner.rank, peers=err.peers)
            out.contained = getattr(err, "contained", False)  # type: ignore[attr-defined]
            return out
        return err

    def dead_peers(self) -> dict[int, str]:
        """World ranks whose channel failed, with the reason."""
        return self._dead

    def unexpected_in(self, ctx: int, lo: int, hi: int) -> Optional[tuple[int, Sig]]:
        """(source, signature) of the first buffered unmatched message on ``ctx`` with lo <= tag < hi."""
        for u in self._unexpected:
            if u.ctx == ctx and lo <= u.tag < hi:
                return u.src, u.sig
        return None

    def broken(self, ctx: int) -> Optional[PycollError]:
        entry = self._broken.get(ctx & ~1)
        return entry[0] if entry is not None else None

    def _tell_members(self, owner: Owner, err: PycollError, tag: int, ctx: int) -> list[SendRequest]:
        body = json.dumps(
            {"ctx": ctx, "seq": owner.tag, "op": owner.op, "rank": owner.rank, "error": type(err).__name__, "cause": err.cause}
        ).encode()
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
        if base in self._broken or getattr(err, "contained", False):
            return
        reqs = self._tell_members(owner, err, _ABORT_TAG, base)
        self._broken[base] = (err, owner.tag)
        deadline = time.monotonic() + 1.0  # best effort: a peer that does not drain is probably dead
        while not all(r.done for r in reqs) and time.monotonic() < deadline:
            if not self.progress():
                time.sleep(0.0005)
        for sched in self._schedules:
            if self._is_broken_for(sched.owner):
                sched.fail(err)

    # ---- waiting ---------------------------------------------------------------------------
    def start(self, sched: Schedule) -> Schedule:
        """Begin a schedule; it runs in the background of every later wait."""
        self.progress()  # a notice that a peer skipped this call may be waiting
        skipped = self._skipped.pop((sched.owner.ctx, sched.owner.tag), None)
        if skipped is not None:
            sched.fail(self._with_rank(skipped, sched.owner))
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
        self._wait(lambda: all(r.done for r in reqs), lambda: sum(r.done for r in reqs), timeout, owner, lambda: reqs)

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
        spin_s = SPIN_US.get() * 1e-6 if spin else 0.0
        yield_s = spin_s + YIELD_US.get() * 1e-6 if spin else 0.0
        start = idle_since = time.monotonic()
        deadline = start + timeout
        last_mark = marker()
        nap = 20e-6
        while not finished():
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
            if idle < yield_s and (bell is None or not self.oversubscribed):
                os.sched_yield()
                continue
            if now - self._last_liveness > 0.25:
                self._last_liveness = now
                self._check_liveness()
            if bell is not None:  # every wait is on one arena's flags: block on its doorbell, a peer's ring wakes us
                waits = pending()
                bell.sleep(min(0.001, max(deadline - now, 0)), lambda: all(w.done for w in waits))
                continue
            nap = min(nap * 2, 0.001 if not (self._only_sockets and spin) else 0.05, max(deadline - now, 0))
            self._sleep(nap)

    def _sleep(self, seconds: float) -> None:
        if self._only_sockets and self._tcp_fds:
            live = [fd for fd, ch in self._tcp_fds.items() if ch.peer not in self._dead]
            writers = [fd for fd in live if self._sendq[self._tcp_fds[fd].peer]]
            if live:
                select.select(live, writers, [], seconds)
                return
        time.sleep(seconds)

    def _check_liveness(self) -> None:
        for peer, ch in self.channels.items():
            if peer in self._dead:
                continue
            reason = ch.check_alive()
            if reason is not None:
                # Drain what it sent before it went away, then fail it.
                try:
                    self._pull(peer)
                except PeerFailureError:
                    pass
                self._channel_failed(peer, reason)

    def _timed_out(self, owner: Owner, timeout: float, pending: Iterable[Request]) -> None:
        pending = [x for r in pending for x in getattr(r, "requests", (r,))]  # waits on any of several groups
        waiting_on = self._pending_peers(pending)
        sends = sorted({r.peer for r in pending if isinstance(r, SendRequest) and not r.done})
        what = f"waiting for ranks {', '.join(str(owner.to_comm(p)) for p in waiting_on)}" if waiting_on else "waiting"
        extra = f" (sends to ranks {', '.join(str(owner.to_comm(p)) for p in sends)} not drained)" if sends else ""
        err = owner.error(TimeoutError, f"timed out after {timeout:g} s {what}{extra}", waiting_on)
        self.abort(owner, err)
        raise err

    # ---- shutdown --------------------------------------------------------------------------
    def flush(self, timeout: float) -> None:
        """Push out queued sends (e.g. before exit), for at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while any(self._sendq[p] for p in self._sendq if p not in self._dead) and time.monotonic() < deadline:
            if not self.progress():
                time.sleep(0.0005)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for ch in self.channels.values():
            try:
                ch.close()
            except Exception:  # best effort at exit
                pass
