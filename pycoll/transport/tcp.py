"""TCP transport: one non-blocking stream socket per pair of ranks, for ranks on different hosts."""

from __future__ import annotations

import errno
import fcntl
import hmac
import importlib
import logging
import os
import secrets
import selectors
import socket
import struct
import termios
import threading
import time
from typing import Any, Optional, Union

from ..bootstrap.interfaces import SOCKET_IFNAME, interface_address
from ..bootstrap.rendezvous import job_token
from ..bootstrap.store import NONCE_BYTES, PROOF_BYTES, ascii_host, auth_proof
from ..config import size_param, str_param
from ..errors import PeerFailureError, PycollError, TimeoutError
from .base import Barrier, Channel, PeerInfo, Transport
from .tcp_options import tune

try:  # optional (setup.py): without it the engine moves each frame between hosts in Python
    _tcpframe: Any = importlib.import_module(__name__.rpartition(".")[0] + "._tcpframe")
except ImportError:  # pragma: no cover - a build without a C compiler
    _tcpframe = None

log = logging.getLogger("pycoll")

SOCKET_ADDR = str_param(
    "PYCOLL_SOCKET_ADDR",
    "",
    "IP address the TCP transport listens on; default: the address of PYCOLL_SOCKET_IFNAME, else the local "
    "address this rank used to reach the bootstrap store.",
)
MAX_MESSAGE = size_param(
    "PYCOLL_MAX_MESSAGE",
    0,
    "Largest message a rank accepts from a peer; a header announcing more closes that channel with a "
    "ProtocolError. 0: this host's physical memory.",
)

# Set-up handshake, after the dialer (the higher rank) connects to the acceptor's listener:
#   acceptor -> challenge: magic, acceptor rank, acceptor nonce
#   dialer   -> dial: magic, dialer rank, acceptor rank, dialer nonce,
#               HMAC(key, "tcp-dial" + acceptor nonce + dialer nonce + ranks)
#   acceptor -> HMAC(key, "tcp-accept" + dialer nonce + acceptor nonce + ranks)
# key = job token + job id; a connection that fails it is closed and logged, set-up goes on.
_MAGIC = b"pycoll-t"
_CHALLENGE = struct.Struct(f"<8sI{NONCE_BYTES}s")
_DIAL = struct.Struct(f"<8sII{NONCE_BYTES}s{PROOF_BYTES}s")
_RANKS = struct.Struct("<II")
# Seconds a new connection gets to send its whole dial; half-open connections held at once.
HANDSHAKE_TIMEOUT = 10.0
MAX_PENDING = 64
_STAGING = 1 << 18
# A read into the staging area takes at most this much more than the frame it waits for: small frames still come
# many to a read, and a large one's payload is read straight into its receive instead of through the area.
READ_WINDOW = 32 << 10
PUSH_SLICE = size_param(
    "PYCOLL_TCP_PUSH_SLICE", 60 << 10,
    "Bytes one write to a socket carries before the socket is read (0: all it takes): messages both ways at once "
    "flow together, and each write fits one TCP segmentation-offload packet (64 KiB less headers), which is sent as "
    "the write returns. On a veth pair, writes of 64 KiB and more ran large messages 1.5-2.5x slower.")


def frame_limit() -> int:
    """The largest message a peer may announce (PYCOLL_MAX_MESSAGE, default this host's memory)."""
    limit = MAX_MESSAGE.get()
    if limit:
        return limit
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def _job_key(job_id: str, token: Union[str, bytes, None]) -> bytes:
    """The HMAC key of this job's handshakes: its token and its id (a job without a token: the id only)."""
    if token is None:
        token = job_token(job_id)
    raw = token.encode() if isinstance(token, str) else bytes(token)
    return raw + b"\0" + job_id.encode()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError(f"connection closed during the handshake after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def _addr_text(addr: Any) -> str:
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)


class _Pending:
    """An accepted connection that has not completed its handshake yet."""

    __slots__ = ("sock", "addr", "nonce", "buf", "deadline")

    def __init__(self, sock: socket.socket, addr: Any, nonce: bytes, deadline: float) -> None:
        self.sock, self.addr, self.nonce, self.deadline = sock, addr, nonce, deadline
        self.buf = bytearray()


# exchange(flows, spin_ns, yield_ns, wait_ns): several sockets' frames at once (``TcpChannel.flow``); None unbuilt
exchange = _tcpframe.exchange if _tcpframe is not None else None
# exchange_blocks(parts, send, recv, tag, ...): the same for a plan's blocks of two buffers (``block_part``)
exchange_blocks = _tcpframe.exchange_blocks if _tcpframe is not None else None
EXCHANGE_FLOWS = _tcpframe.EXCHANGE_FLOWS if _tcpframe is not None else 0  # the most sockets one exchange takes


class TcpChannel(Channel):
    """A connected non-blocking socket with a small staging area for zero-copy-style peeks."""

    kind = "tcp"

    def __init__(self, peer: int, sock: socket.socket) -> None:
        super().__init__(peer)
        sock.setblocking(False)
        self.sock = sock
        self._stage = bytearray(_STAGING)
        self.staging_bytes = _STAGING  # the largest frame that peek() can show whole
        self._view = memoryview(self._stage)
        self._start = 0
        self._end = 0
        self.cpu_seen = 0  # what the last swap's first yield showed of the peer (``swap_frame``)
        self._fd = sock.fileno()
        self.push_slice = PUSH_SLICE.get()  # read by the engine's push (p2p_progress) and the C exchange (p2p_frames)
        self._ended: Optional[PeerFailureError] = None  # how the stream ended, while staged bytes precede the end

    def _failed(self, exc: BaseException) -> PeerFailureError:
        return PeerFailureError(f"connection to rank {self.peer} failed: {exc}", peers=[self.peer])

    # swap_frame's outcomes for the incoming frame (None where the C module was not built)
    can_swap = _tcpframe is not None
    TAKEN, NOT_YET, OTHER = (_tcpframe.TAKEN, _tcpframe.NOT_YET, _tcpframe.OTHER) if _tcpframe else (0, 1, 2)

    def swap_frame(self, head_out: Optional[bytes], out: Any, head_in: Optional[bytes], into: Any,
                   spin_ns: int, yield_ns: int = 0, tag: Optional[int] = None) -> tuple[int, int]:
        """One frame out (header ``head_out``, payload ``out``: flat bytes) in one ``sendmsg``, and the frame whose
        header is exactly ``head_in`` into ``into`` (flat bytes), polling the socket for up to ``spin_ns``, then,
        where the outgoing frame left whole, for up to ``yield_ns`` between ``sched_yield``s; either frame may be
        None. Returns (bytes the socket took of the outgoing frame, -1 for none, below -1 for a failed send; what
        became of the incoming one: TAKEN, NOT_YET with nothing consumed, OTHER where another frame is next,
        anything else where the stream ended). ``tag``, where given, replaces the tag field of both headers; ``out``
        and ``into`` may be any contiguous arrays, taken as their bytes. The caller holds the engine's lock; in C,
        without the GIL. ``cpu_seen`` then holds what the wait's first yield showed of the peer: 1 where another task
        ran on this CPU meanwhile and the frame came in (the peer may share it), -1 where the yield came back at once
        with the frame still out (the peer runs elsewhere), else 0."""
        sent, status, self._start, self._end, self.cpu_seen = _tcpframe.swap(
            self.sock.fileno(), self._stage, self._start, self._end, head_out, out, head_in, into, spin_ns, yield_ns, tag)
        return sent, status

    def take_message(self, ctx: int, tag: int, any_tag: bool, meta: int, into: Any,
                     spin_ns: int) -> tuple[int, int, int]:
        """The next frame if it is a point-to-point message of ``ctx`` and ``tag`` (any tag if ``any_tag``) with
        ``meta`` of at most ``len(into)`` bytes, its payload into ``into`` (flat bytes), polling the socket for up
        to ``spin_ns``: (status as ``swap_frame``'s, its size, its tag). The caller holds the engine's lock."""
        status, nbytes, got_tag, self._start, self._end = _tcpframe.take_message(
            self.sock.fileno(), self._stage, self._start, self._end, ctx, tag, any_tag, meta, into, spin_ns)
        return status, nbytes, got_tag

    def flow(self, head_out: Optional[bytes], out: Any, head_in: Optional[bytes], into: Any) -> tuple:
        """This socket's part of an ``exchange`` (several sockets' frames moved together, in C): its outgoing frame
        (header ``head_out``, payload ``out``) and the incoming one whose header is exactly ``head_in``, read into
        ``into``; either None. ``settle`` takes back the staging bounds that the exchange left."""
        return (self.sock.fileno(), self._stage, self._start, self._end, head_out, out, head_in, into)

    def settle(self, start: int, end: int) -> None:
        self._start, self._end = start, end

    def block_part(self) -> tuple:
        """This socket's fixed part of an ``exchange_blocks`` flow: (the channel, whose staging bounds ``_start`` and
        ``_end`` C reads and writes back, its descriptor, its staging area)."""
        return (self, self._fd, self._stage)

    def send_some(self, data: memoryview) -> int:
        return self.send_gathered((data,))

    def send_gathered(self, segments: Any) -> int:
        """``send_some`` of several segments in one ``sendmsg`` (a message's header, payload and padding): the
        bytes the socket took, counted across them."""
        try:
            return self.sock.sendmsg(segments)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            raise self._failed(exc) from None

    def _fill(self, out: memoryview) -> int:
        if self._ended is not None:  # the stream ended behind staged bytes, all read now
            raise self._ended
        try:
            n = self.sock.recv_into(out)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            raise self._failed(exc) from None
        if n == 0 and len(out):
            raise PeerFailureError(f"rank {self.peer} closed its TCP connection", peers=[self.peer])
        return n

    def recv_some(self, out: memoryview) -> int:
        staged = self._end - self._start
        if staged:
            n = min(staged, len(out))
            out[:n] = self._view[self._start : self._start + n]
            self.consume(n)
            return n
        return self._fill(out) if len(out) else 0

    def peek(self, want: int = 0) -> memoryview:
        """The bytes staged so far (reading what the socket has, without blocking). A full staging area is
        compacted once half of it is consumed, or when fewer than ``want`` bytes (a frame the caller waits for)
        are staged: compacting on every call would copy the whole area per small frame."""
        if self._end == len(self._stage) and self._start and (
                self._start >= len(self._stage) >> 1 or self._end - self._start < max(want, 64)):
            left = self._end - self._start
            self._stage[:left] = self._view[self._start : self._end]
            self._start, self._end = 0, left
        stop = min(len(self._stage), self._start + max(want, READ_WINDOW))
        if self._end < stop:
            try:
                self._end += self._fill(self._view[self._end : stop])
            except PeerFailureError as exc:
                # The stream ended (or broke) behind bytes already staged: those came first (the peer's last
                # data, its goodbye) and must be read before the end is reported, by the read that finds
                # nothing staged (_fill raises it then).
                if self._end == self._start:
                    raise
                self._ended = exc
        return self._view[self._start : self._end]

    @property
    def ended(self) -> bool:
        """The stream has ended (or broken) behind the bytes still staged: no more will come."""
        return self._ended is not None

    def consume(self, n: int) -> None:
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0

    def fileno(self) -> Optional[int]:
        return self._fd

    def unsafe_to_exit(self) -> bool:
        # Bytes the peer has not acknowledged die with this process if it exits with unread input: the
        # kernel then resets the connection instead of finishing the stream.
        try:
            return struct.unpack("i", fcntl.ioctl(self._fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0] > 0
        except OSError:
            return False

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class TcpTransport(Transport):
    """Rank i connects to every lower rank and accepts from every higher one; both ends prove the job token."""

    name = "tcp"

    def __init__(self, token: Union[str, bytes, None] = None) -> None:
        self._listener: Optional[socket.socket] = None
        self._token = token  # None: the job's (pycoll.bootstrap.job_token)
        self.refused = 0  # connections closed during set-up for a failed handshake
        # The address of the NIC nearest this rank's device, when the runtime found one (topology.live.listen_nic)
        self.near_address: Optional[str] = None

    def listen(self, me: PeerInfo, store_host: str) -> Any:
        host = SOCKET_ADDR.get()
        if not host and SOCKET_IFNAME.get():
            host = interface_address()[1]
        # never all addresses unless PYCOLL_SOCKET_ADDR says so
        host = host or self.near_address or store_host or "127.0.0.1"
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
            sock.listen(256)
        except OSError as exc:
            sock.close()
            raise PeerFailureError(f"TCP transport cannot listen on {host}: {exc}", op="init", rank=me.rank) from None
        self._listener = sock
        return [host, sock.getsockname()[1]]

    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        return me.rank != peer.rank and "tcp" in peer.addresses

    def connect(
        self, me: PeerInfo, peers: list[PeerInfo], job_id: str, barrier: Barrier, timeout: float
    ) -> dict[int, Channel]:
        deadline = time.monotonic() + timeout
        key = _job_key(job_id, self._token)
        channels: dict[int, Channel] = {}
        dials = _Dials(self, me.rank, [p for p in peers if p.rank < me.rank], key, deadline)
        try:
            dials.start()  # lower ranks are dialled in parallel while this thread accepts the higher ones
            higher = {p.rank for p in peers if p.rank > me.rank}
            if higher:
                assert self._listener is not None
                for rank, sock in self._accept_all(me.rank, higher, key, deadline, timeout):
                    tune(sock)
                    channels[rank] = TcpChannel(rank, sock)
            for rank, sock in dials.result():
                tune(sock)
                channels[rank] = TcpChannel(rank, sock)
        except BaseException:
            dials.abandon()
            for ch in channels.values():
                ch.close()
            raise
        finally:
            self.close()
        return channels

    # ---- dialer side -----------------------------------------------------------------------
    DIAL_THREADS = 16  # dials in flight at once
    def _dial_and_prove(self, my_rank: int, peer: PeerInfo, key: bytes, deadline: float) -> socket.socket:
        host, port = peer.addresses["tcp"]
        sock = self._dial(host, port, deadline, peer.rank)
        where = f"rank {peer.rank} at {host}:{port}"
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.1))
            magic, their_rank, their_nonce = _CHALLENGE.unpack(_recv_exact(sock, _CHALLENGE.size))
            if magic != _MAGIC or their_rank != peer.rank:
                raise PeerFailureError(f"{where} is not that rank's pycoll TCP listener", op="init", peers=[peer.rank])
            nonce = secrets.token_bytes(NONCE_BYTES)
            ranks = _RANKS.pack(my_rank, peer.rank)
            proof = auth_proof(key, b"tcp-dial", their_nonce, nonce, ranks)
            sock.sendall(_DIAL.pack(_MAGIC, my_rank, peer.rank, nonce, proof))
            answer = _recv_exact(sock, PROOF_BYTES)
            if not hmac.compare_digest(answer, auth_proof(key, b"tcp-accept", nonce, their_nonce, ranks)):
                raise PeerFailureError(
                    f"{where} answered the handshake without this job's token (PYCOLL_JOB_TOKEN differs?)",
                    op="init",
                    peers=[peer.rank],
                )
        except PycollError:
            sock.close()
            raise
        except socket.timeout:
            sock.close()
            raise TimeoutError(
                f"TCP set-up: {where} did not complete the handshake in time", op="init", rank=my_rank, peers=[peer.rank]
            ) from None
        except OSError as exc:
            sock.close()
            raise PeerFailureError(
                f"{where} refused the TCP handshake ({exc}); do all ranks share the job token?",
                op="init",
                rank=my_rank,
                peers=[peer.rank],
            ) from None
        sock.settimeout(None)
        return sock

    @staticmethod
    def _dial(host: str, port: int, deadline: float, rank: int) -> socket.socket:
        delay = 0.01
        while True:
            try:
                return socket.create_connection((ascii_host(host), port), timeout=max(deadline - time.monotonic(), 0.1))
            except OSError as exc:
                if time.monotonic() + delay > deadline or exc.errno not in (errno.ECONNREFUSED, errno.EAGAIN, None):
                    raise PeerFailureError(f"cannot connect to rank {rank} at {host}:{port}: {exc}", op="init", peers=[rank]) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    # ---- acceptor side ---------------------------------------------------------------------
    def _accept_all(
        self, my_rank: int, higher: set[int], key: bytes, deadline: float, timeout: float
    ) -> list[tuple[int, socket.socket]]:
        """Accept until every rank in ``higher`` has proved itself. Handshakes interleave, so a stranger
        that connects and stalls delays no one; one that fails is closed and logged."""
        listener = self._listener
        assert listener is not None
        listener.setblocking(False)
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ, None)
        pending: dict[int, _Pending] = {}  # fileno -> connection in its handshake
        done: list[tuple[int, socket.socket]] = []
        try:
            while higher:
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(
                        f"TCP set-up: ranks {sorted(higher)} did not connect within {timeout:.0f} s",
                        op="init",
                        rank=my_rank,
                        peers=sorted(higher),
                    )
                for fd, p in list(pending.items()):
                    if p.deadline <= now:
                        self._refuse(sel, pending, fd, my_rank, f"no complete handshake within {HANDSHAKE_TIMEOUT:g} s")
                wake = min([deadline] + [p.deadline for p in pending.values()])
                for sel_key, _ in sel.select(max(wake - now, 0.0)):
                    if sel_key.data is None:
                        self._accept_some(sel, pending, my_rank)
                        continue
                    fd = sel_key.fd
                    if fd in pending:
                        got = self._read_dial(sel, pending, fd, my_rank, higher, key)
                        if got is not None:
                            higher.discard(got[0])
                            done.append(got)
        finally:
            for fd in list(pending):
                pending.pop(fd).sock.close()
            sel.close()
        return done

    def _accept_some(self, sel: selectors.BaseSelector, pending: dict[int, _Pending], my_rank: int) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of descriptors: the listener itself is fine
                log.warning("TCP set-up (rank %d): accept failed: %s", my_rank, exc)
                return
            if len(pending) >= MAX_PENDING:  # make room: the oldest half-open connection goes first
                oldest = min(pending, key=lambda fd: pending[fd].deadline)
                self._refuse(sel, pending, oldest, my_rank, f"more than {MAX_PENDING} connections in their handshake")
            sock.setblocking(False)
            nonce = secrets.token_bytes(NONCE_BYTES)
            try:
                sent = sock.send(_CHALLENGE.pack(_MAGIC, my_rank, nonce))
            except OSError:
                sent = 0
            if sent != _CHALLENGE.size:
                self.refused += 1
                log.warning("TCP set-up (rank %d): closed a connection from %s: it went away at once", my_rank, _addr_text(addr))
                sock.close()
                continue
            p = _Pending(sock, addr, nonce, time.monotonic() + HANDSHAKE_TIMEOUT)
            pending[sock.fileno()] = p
            sel.register(sock, selectors.EVENT_READ, p)

    def _read_dial(
        self,
        sel: selectors.BaseSelector,
        pending: dict[int, _Pending],
        fd: int,
        my_rank: int,
        higher: set[int],
        key: bytes,
    ) -> Optional[tuple[int, socket.socket]]:
        """Read what has arrived of one dial; (rank, socket) once it is complete and proven."""
        p = pending[fd]
        try:
            data = p.sock.recv(_DIAL.size - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            self._refuse(sel, pending, fd, my_rank, f"connection lost during the handshake ({exc})")
            return None
        if not data:
            self._refuse(sel, pending, fd, my_rank, f"closed after {len(p.buf)} of {_DIAL.size} handshake bytes")
            return None
        p.buf += data
        if not _MAGIC.startswith(bytes(p.buf[: len(_MAGIC)])):
            self._refuse(sel, pending, fd, my_rank, "garbage instead of a pycoll TCP handshake")
            return None
        if len(p.buf) < _DIAL.size:
            return None
        _, rank, to_rank, nonce, proof = _DIAL.unpack(p.buf)
        ranks = _RANKS.pack(rank, my_rank)
        if to_rank != my_rank:
            self._refuse(sel, pending, fd, my_rank, f"the handshake is meant for rank {to_rank}")
        elif not hmac.compare_digest(proof, auth_proof(key, b"tcp-dial", p.nonce, nonce, ranks)):
            self._refuse(sel, pending, fd, my_rank, f"failed authentication as rank {rank} (wrong job token)")
        elif rank not in higher:
            self._refuse(sel, pending, fd, my_rank, f"rank {rank} is not expected here (or already connected)")
        else:
            del pending[fd]
            sel.unregister(p.sock)
            try:
                p.sock.settimeout(HANDSHAKE_TIMEOUT)
                p.sock.sendall(auth_proof(key, b"tcp-accept", nonce, p.nonce, ranks))
            except OSError as exc:
                p.sock.close()
                raise PeerFailureError(
                    f"rank {rank} went away during the TCP handshake ({exc})", op="init", rank=my_rank, peers=[rank]
                ) from None
            p.sock.settimeout(None)
            return rank, p.sock
        return None

    def _refuse(self, sel: selectors.BaseSelector, pending: dict[int, _Pending], fd: int, my_rank: int, why: str) -> None:
        p = pending.pop(fd)
        sel.unregister(p.sock)
        p.sock.close()
        self.refused += 1
        log.warning("TCP set-up (rank %d): closed a connection from %s: %s", my_rank, _addr_text(p.addr), why)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None


class _Dials:
    """The dials of one rank to its lower-ranked peers, run by a few threads at once (a dial waits for the peer to
    reach its accept loop; in parallel, one slow peer holds up no other). ``result`` gives the proven sockets by
    rank, or raises the lowest rank's failure."""

    def __init__(self, transport: "TcpTransport", my_rank: int, peers: list[PeerInfo], key: bytes, deadline: float) -> None:
        self._transport, self._rank, self._key, self._deadline = transport, my_rank, key, deadline
        self._todo = sorted(peers, key=lambda p: p.rank)
        self._ranks = [p.rank for p in self._todo]
        self._lock = threading.Lock()
        self._done: dict[int, socket.socket] = {}
        self._failed: dict[int, BaseException] = {}
        self._stop = False
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(min(len(self._todo), TcpTransport.DIAL_THREADS)):
            t = threading.Thread(target=self._work, name=f"pycoll-tcp-dial-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _work(self) -> None:
        while True:
            with self._lock:
                if self._stop or not self._todo:
                    return
                peer = self._todo.pop(0)
            try:
                sock = self._transport._dial_and_prove(self._rank, peer, self._key, self._deadline)
            except BaseException as exc:  # handed to the connecting thread
                with self._lock:
                    self._failed[peer.rank] = exc
                    self._stop = True
                continue
            with self._lock:
                if self._stop:
                    sock.close()
                else:
                    self._done[peer.rank] = sock

    def _join(self) -> None:
        for t in self._threads:
            t.join(max(self._deadline - time.monotonic(), 0.0) + 1.0)

    def result(self) -> list[tuple[int, socket.socket]]:
        self._join()
        with self._lock:
            if self._failed:
                raise self._failed[min(self._failed)]
            missing = sorted(set(self._ranks) - set(self._done))
            if missing:  # a dial outlived its deadline (each one honours it, so this is a stuck thread)
                raise TimeoutError(f"TCP set-up: the dials to ranks {missing} did not finish in time",
                                   op="init", rank=self._rank, peers=missing)
            return sorted(self._done.items())

    def abandon(self) -> None:
        """Stop dialling and close what was proven (set-up failed elsewhere)."""
        with self._lock:
            self._stop = True
        self._join()
        with self._lock:
            for sock in self._done.values():
                sock.close()
            self._done.clear()
