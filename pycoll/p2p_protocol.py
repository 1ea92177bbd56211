"""The point-to-point layer's vocabulary: the frame format and its control words, call signatures, the owners
of operations, send and receive requests, schedules, and the knobs the engine's parts share."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterable, NamedTuple, Optional, Sequence, Union

import numpy as np

from .config import bool_param, float_param, size_param
from .errors import PycollError


SPIN_US = float_param("PYCOLL_SPIN_US", 50.0, "Microseconds a wait busy-polls before it starts yielding the core (default 50, or 2 with more ranks than cores).")
OVERSUBSCRIBED_SPIN_US = 2.0
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
TAG_MAX = (1 << 63) - 1  # the largest tag: a tag travels as a signed 64-bit header word

# Frame: 64-byte header, payload, zero padding to 64 bytes (keeps every header and payload aligned in rings).
HEADER = struct.Struct("<QqQIiQQ")  # ctx, tag, nbytes, meta (kind|dtype<<8|op<<16), root, count, vhash
CTX_TAG = struct.Struct("<Qq")
HEADER_SIZE = 64
ALIGN = 64
MAGIC = 0x70  # high byte of meta: catches a stream that lost its framing
ZEROS = bytes(ALIGN)
SMALL_BYTES = 16 << 10
PAD_SINK = memoryview(bytearray(ALIGN))  # payloads up to this size travel in one buffer with their header

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
SENDRECV_CMA_BYTES = size_param(
    "PYCOLL_SENDRECV_CMA_BYTES", 128 << 10,
    "Smallest message a compiled Sendrecv sends by rendezvous where every rank of the host has a core (default "
    "128K, as PYCOLL_P2P_CMA_BYTES): below it the eager ring's two copies, each rank's on its own core, beat each "
    "rank pulling its peer's message (AMD EPYC VM, 2026-12-02: 64 KiB 4.8-6.4 us against 10.6-13.1, 96 KiB 6.7-7.8 "
    "against 14.0-16.6); from 256 KiB the pull wins (34 against 48 us). Where ranks share cores "
    "PYCOLL_P2P_CMA_BYTES holds.",
)
P2P_SPLIT = bool_param(
    "PYCOLL_P2P_SPLIT", True,
    "Set to 0 to leave a rendezvous' copy to its receiver alone; by default, where every rank of the host has a core, "
    "a sender waiting for its acknowledgement writes chunks from the back of the message (process_vm_writev) while "
    "the receiver reads them from the front, so both cores copy.",
)
TCP_EAGER = bool_param(
    "PYCOLL_TCP_EAGER", True,
    "Set to 0 to send every point-to-point message to a peer on another host through the progress engine; by "
    "default a blocking or nonblocking send of up to the eager size leaves in one system call, and a receive "
    "takes its message straight from the socket while nothing else is pending.",
)
TCP_FRAME_C = bool_param(
    "PYCOLL_TCP_FRAME_C", True,
    "Set to 0 to move those frames in the engine's Python calls; by default, where pycoll/transport/_tcpframe.c was "
    "compiled at install, a small call's frame out and frame in move in one call into C (one sendmsg each way, the "
    "wait polling the socket), and a blocking Alltoall's larger blocks to and from every peer on another host "
    "move together in one such call.",
)
EXCHANGE_RINGS = bool_param(
    "PYCOLL_EXCHANGE_RINGS", True,
    "Set to 0 to leave a blocking Alltoall's blocks to and from the peers on this host to the progress engine; by "
    "default, where the blocks to other hosts move in one call into C (PYCOLL_TCP_FRAME_C), those of this host "
    "join that call through the shared-memory rings, so that one loop in C serves every peer.",
)
TCP_EAGER_WAIT_MS = float_param(
    "PYCOLL_TCP_EAGER_WAIT_MS", 2.0,
    "Milliseconds a receive from a peer on another host waits in the kernel on that one socket (after its spin "
    "and PYCOLL_YIELD_US of yielding) before it waits through the progress engine, which serves every peer.",
)
# Rendezvous frames: header only, told apart by their meta word (kind byte 0xF0.. with no dtype/op).
RTS = 0xF1  # sender -> receiver: count = the payload's address in the sender, vhash = rendezvous id
ACK = 0xF2  # receiver -> sender: the bytes of rendezvous vhash were pulled (or the receive failed): done
NAK = 0xF3  # receiver -> sender: cross-memory attach failed here; send rendezvous vhash through the stream
RDATA = 0xF4  # sender -> receiver: the payload of rendezvous vhash, streamed after a NAK
SSEND = 0xF5  # a synchronous send's frame: a plain message whose receiver sends ACK (vhash = its id) once it matched it
U8 = np.dtype(np.uint8)
P2P_META = MAGIC << 24  # a plain point-to-point frame: no kind, dtype or op
RTS_META, ACK_META = RTS | P2P_META, ACK | P2P_META
NO_SEGMENTS: list = []
NO_DST = np.zeros(0, np.uint8)  # take_next's receive buffer when only acknowledgements are taken

CONTROL_CTX = (1 << 64) - 1
ABORT_TAG = 1  # a rank failed inside an operation: the communicator is broken
SKIP_TAG = 2  # a rank rejected its arguments before taking part: only that call fails
STATUS_ASK = 3  # a stalled rank asks a peer what it is doing
STATUS_TELL = 4  # the answer: the operations the peer is in and whom they wait for
CHECK_KIND = 15  # signature kind of PYCOLL_CHECK_CALLS's own messages (algorithms/check.py)
GOODBYE_TAG = 5  # a rank shuts down normally: its streams ending after this is no failure


class Sig(NamedTuple):
    """What a collective message says about the call that sent it; both ends must agree."""

    kind: int = 0
    dtype: int = 0
    op: int = 0
    root: int = 0
    count: int = 0
    vhash: int = 0


P2P_SIG = Sig()


def counts_hash(values: Sequence[int]) -> int:
    """A vector call's per-rank counts as the one word its signature carries (``Sig.vhash``; never 0)."""
    digest = hashlib.blake2b(struct.pack(f"<{len(values)}q", *values), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def meta_of(sig: Sig) -> int:
    """A frame header's meta word for a message of the call ``sig`` describes."""
    return sig.kind | (sig.dtype << 8) | (sig.op << 16) | (MAGIC << 24)


def frame_bytes(nbytes: int) -> int:
    """A frame's size on the wire for a payload of ``nbytes``: its header, the payload, zeros to ALIGN."""
    return HEADER_SIZE + nbytes + (-nbytes % ALIGN)


def payload_bytes(a: np.ndarray) -> np.ndarray:
    """A contiguous array's bytes, as the flat uint8 view a frame's payload is read from or written to."""
    return a if a.dtype is U8 and a.ndim == 1 else a.reshape(-1).view(U8)


def frame_head(ctx: int, tag: int, nbytes: int, sig: Sig) -> bytes:
    """The packed header of a collective's frame (its first ``HEADER.size`` bytes; zeros pad it to HEADER_SIZE):
    both what a sender writes and, byte for byte, what its receiver expects."""
    return HEADER.pack(ctx, tag, nbytes, meta_of(sig), sig.root, sig.count, sig.vhash)


def head_ctx(head: bytes) -> int:
    return CTX_TAG.unpack_from(head)[0]


def head_tag(head: bytes) -> int:
    return CTX_TAG.unpack_from(head)[1]


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


class Unexpected:
    """A message that arrived before its receive was posted, buffered whole."""

    __slots__ = ("src", "ctx", "tag", "sig", "data", "got", "waiter", "rdv", "sync")

    def __init__(self, src: int, ctx: int, tag: int, sig: Sig, nbytes: int) -> None:
        self.src, self.ctx, self.tag, self.sig = src, ctx, tag, sig
        self.data = np.empty(nbytes, np.uint8)
        self.got = 0
        self.waiter: Optional[RecvRequest] = None
        self.rdv: Optional[tuple[int, int, int]] = None  # a rendezvous announcement: (id, address, length)
        self.sync = 0  # a synchronous send's id: its sender waits for an ACK once a receive takes this

    @property
    def nbytes(self) -> int:
        """The message's size (a rendezvous announcement's buffers nothing yet)."""
        return self.rdv[2] if self.rdv is not None else self.data.nbytes


class Inbound:
    """Per-channel parser state: header, then payload into a target, then padding."""

    __slots__ = ("hdr", "have", "target", "nbytes", "got", "pad", "ctx", "tag", "sig")

    def __init__(self) -> None:
        self.hdr = bytearray(HEADER_SIZE)
        self.have = 0
        self.target: Union[RecvRequest, Unexpected, None] = None
        self.nbytes = self.got = self.pad = 0
        self.ctx = self.tag = 0
        self.sig = P2P_SIG


def broken_from(broken: dict, ctx: int, call: int) -> bool:
    """Whether ``broken`` (the engine's, by even context: (error, first failed call, -1 for all)) breaks call number
    ``call`` on context ``ctx`` (-1: point-to-point, which fails on a broken communicator whatever its calls): calls
    numbered before the failed one finish normally; that one and later ones fail."""
    entry = broken.get(ctx & ~1)
    return entry is not None and (call < 0 or entry[1] < 0 or call >= entry[1])


def unreachable(broken: dict, tags_per_call: int, ctx: int, tag: int) -> bool:
    """Whether no receive can take a message of ``ctx`` and ``tag`` any more (``broken_from``): a collective's
    message (an odd context) of a broken call, or a broken communicator's point-to-point message."""
    return broken_from(broken, ctx, tag // tags_per_call if ctx & 1 else -1)


def drop_unreachable(unexpected: list, broken: dict, tags_per_call: int) -> None:
    """Forget the buffered messages that no receive can take (``unreachable``): while any is buffered, the fast paths
    of every communicator leave their receives to the engine, for MPI's matching order. A rendezvous announcement or a
    synchronous send stays: its sender waits for an answer."""
    keep = [u for u in unexpected if u.rdv is not None or u.sync or u.waiter is not None
            or not unreachable(broken, tags_per_call, u.ctx, u.tag)]
    if len(keep) != len(unexpected):
        unexpected[:] = keep


def fits(req: RecvRequest, src: int, ctx: int, tag: int) -> bool:
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

