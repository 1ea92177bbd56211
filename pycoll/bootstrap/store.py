"""Key-value stores used once at start-up to exchange addresses: a small TCP store and a torch wrapper."""

from __future__ import annotations

import abc
import json
import math
import os
import selectors
import socket
import socketserver
import struct
import threading
import time
from typing import Any, Optional, Union

from pycoll.config import str_param
from pycoll.errors import InvalidArgumentError, PeerFailureError, ProtocolError, TimeoutError

JOB_TOKEN = str_param(
    "PYCOLL_JOB_TOKEN",
    "",
    "Secret shared by the ranks of one job; store and TCP connections must prove they know it. "
    "`pycoll run` generates one; under srun (and env:// without torch) export one yourself.",
)

# Wire format (all integers big-endian):
#   request: op (u8), key length (u32), value length (u32), key (utf-8), value
#   reply:   status (u8), payload length (u32), payload
# GET and WAIT carry their timeout as a float64 value; ADD carries its delta as an int64
# and gets the new counter back as an int64. Counters are stored as decimal ASCII, as torch does.
#
# A connection starts with a challenge-response on the job token (nothing else is served before):
#   client -> HELLO, value = magic + client nonce
#   server -> OK, payload = magic + server nonce + HMAC(token, "store-server" + client nonce + server nonce)
#   client -> AUTH, value = HMAC(token, "store-client" + server nonce + client nonce)
#   server -> OK (or DENIED, then it closes)
_REQ = struct.Struct("!BII")
_REP = struct.Struct("!BI")
_F64 = struct.Struct("!d")
_I64 = struct.Struct("!q")

_OP_HELLO, _OP_SET, _OP_GET, _OP_ADD, _OP_WAIT, _OP_CHECK, _OP_AUTH = range(7)
_OP_NAMES = {
    _OP_HELLO: "hello", _OP_SET: "set", _OP_GET: "get", _OP_ADD: "add", _OP_WAIT: "wait", _OP_CHECK: "check",
    _OP_AUTH: "auth",
}
_ST_OK, _ST_TIMEOUT, _ST_BAD_ARG, _ST_PROTOCOL, _ST_CLOSING, _ST_DENIED, _ST_FAILED = range(7)
# Set by a launcher that saw a rank fail (JSON: rank, cause): blocked GET/WAITs end at once with _ST_FAILED,
# so ranks still starting up raise an error naming that rank instead of waiting out their timeout.
FAILED_KEY = "pycoll/failed"

_MAGIC = b"pycoll-store/2"
NONCE_BYTES = 16
PROOF_BYTES = 32  # HMAC-SHA256
MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 64 << 20
# Before a connection has authenticated, no frame may carry more than this.
_MAX_HANDSHAKE_BYTES = 64
# Seconds a new connection gets to complete the handshake, and how many may be half-open at once.
HANDSHAKE_TIMEOUT = 10.0
MAX_UNAUTHENTICATED = 128
# Bodies above this are read in pieces of this size: memory grows with the bytes that really arrive.
_READ_PIECE = 1 << 20
# Longest blocking GET/WAIT the server accepts (seconds).
_MAX_WAIT_S = 1e7
# Extra seconds a client waits for a reply beyond the server-side timeout of a blocking op.
_REPLY_MARGIN = 10.0


def ascii_host(host: str) -> Union[str, bytes]:
    """``host`` as getaddrinfo takes it without the IDNA codec (whose import costs a starting rank 3-5 ms): an ASCII
    name or address as bytes, anything else unchanged."""
    return host.encode() if host.isascii() else host


def token_bytes(token: Union[str, bytes], what: str = "job token") -> bytes:
    """The job token as HMAC key bytes; an empty token is refused."""
    raw = token.encode("utf-8") if isinstance(token, str) else bytes(token)
    if not raw:
        raise InvalidArgumentError(f"the {what} is empty", op="store")
    return raw


def new_token() -> str:
    """A fresh random job token (256 bits, hex)."""
    return os.urandom(32).hex()  # what secrets.token_hex(32) returns


def auth_proof(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``label`` and ``parts`` under ``key``: what a side sends to show it knows the token."""
    import hashlib
    import hmac

    mac = hmac.new(key, label, hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


class Store(abc.ABC):
    """A key-value store shared by all ranks of a job; values are bytes, every wait is bounded."""

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``, replacing any older value."""

    @abc.abstractmethod
    def get(self, key: str, timeout: float) -> bytes:
        """Return the value of ``key``, blocking until it exists; raise TimeoutError after ``timeout`` s."""

    @abc.abstractmethod
    def add(self, key: str, delta: int) -> int:
        """Atomically add ``delta`` to the counter ``key`` (missing counts as 0); return the new value."""

    @abc.abstractmethod
    def wait(self, keys: list[str], timeout: float) -> None:
        """Block until every key exists; raise TimeoutError naming the missing keys after ``timeout`` s."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the connection; the store's data lives on in its server."""

    def check(self, keys: list[str]) -> bool:
        """True if every key exists now (never blocks)."""
        for key in keys:
            try:
                self.get(key, 0.0)
            except TimeoutError:
                return False
        return True

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def barrier(store: Store, name: str, size: int, timeout: float) -> None:
    """Block until ``size`` callers have entered the barrier ``name``; each name may be used once."""
    count_key, done_key = f"barrier/{name}/count", f"barrier/{name}/done"
    arrived = store.add(count_key, 1)
    if arrived == size:
        store.set(done_key, b"1")
    try:
        store.wait([done_key], timeout)
    except TimeoutError:
        try:
            arrived = store.add(count_key, 0)
        except Exception:  # the store itself may be gone; report what we knew
            pass
        raise TimeoutError(
            f"waited {timeout:.1f} s in barrier {name!r}: {arrived} of {size} ranks arrived", op="store barrier"
        ) from None


def _check_key(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"store keys must be non-empty str, got {key!r}", op="store")
    raw = key.encode("utf-8")
    if len(raw) > MAX_KEY_BYTES:
        raise InvalidArgumentError(f"store key of {len(raw)} bytes exceeds {MAX_KEY_BYTES}", op="store")
    return raw


def _recv_exact(sock: socket.socket, n: int) -> Optional[bytearray]:
    """Read exactly n bytes; None on a clean EOF before the first byte, ConnectionError mid-frame.

    Callers check ``n`` against a limit first; above _READ_PIECE the buffer grows only as bytes arrive.
    """
    if n > _READ_PIECE:
        buf = bytearray()
        while len(buf) < n:
            piece = sock.recv(min(n - len(buf), _READ_PIECE))
            if not piece:
                if not buf:
                    return None
                raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
            buf += piece
        return buf
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


# hmac, hashlib, logging and datetime are imported where used: `pycoll run` starts ranks sooner without them.


def _log() -> Any:
    import logging

    return logging.getLogger("pycoll")


def _compare_digest(a: bytes, b: bytes) -> bool:
    import hmac

    return hmac.compare_digest(a, b)


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


# ----------------------------------------------------------------------------- server


class _State:
    """The data of one server, guarded by one condition variable that wakes blocked GET/WAITs."""

    def __init__(self, token: bytes) -> None:
        self.token = token
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.closing = False
        self.conns: set[socket.socket] = set()
        self.unauthenticated = 0  # connections still in their handshake
        self.refused = 0  # connections closed for a bad handshake or a bad frame


class _Refuse(Exception):
    """Close this connection: the peer broke the protocol or failed authentication."""

    def __init__(self, reason: str, status: int = _ST_PROTOCOL) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


class _Handler(socketserver.BaseRequestHandler):
    """Serves one client connection: a handshake, then a loop of request frames, each answered by one reply."""

    server: "_Server"

    def setup(self) -> None:
        self.authenticated = False
        self.counted = False  # whether this connection counts against MAX_UNAUTHENTICATED
        self.server_nonce: Optional[bytes] = None
        self.client_nonce = b""
        state = self.server.state
        with state.cond:
            state.conns.add(self.request)
            if state.unauthenticated < MAX_UNAUTHENTICATED:
                state.unauthenticated += 1
                self.counted = True
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A stranger that connects and sends nothing holds this thread only this long.
        self.request.settimeout(HANDSHAKE_TIMEOUT)

    def finish(self) -> None:
        state = self.server.state
        with state.cond:
            state.conns.discard(self.request)
            self._uncount()
            state.cond.notify_all()

    def _uncount(self) -> None:
        if self.counted:
            self.counted = False
            self.server.state.unauthenticated -= 1

    def _peer(self) -> str:
        addr = self.client_address
        return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)

    def _reply(self, status: int, payload: bytes = b"") -> None:
        self.request.sendall(_REP.pack(status, len(payload)) + payload)

    def handle(self) -> None:
        try:
            if not self.counted:  # closed unanswered: a pycoll client retries
                self._refuse(_Refuse(f"more than {MAX_UNAUTHENTICATED} connections are in their handshake"), reply=False)
                return
            while self._serve_one():
                pass
        except _Refuse as refusal:
            self._refuse(refusal)
        except socket.timeout:
            if not self.authenticated:
                self._refuse(_Refuse(f"no complete handshake within {HANDSHAKE_TIMEOUT:g} s"), reply=False)
        except OSError as exc:  # the client went away or the server is stopping
            if not self.authenticated and not self.server.state.closing:
                self._refuse(_Refuse(f"connection lost during the handshake ({exc})"), reply=False)
        except Exception as exc:  # never let one connection take more than itself down
            self._refuse(_Refuse(f"internal error on this connection: {type(exc).__name__}: {exc}"), reply=False)

    def _refuse(self, refusal: _Refuse, reply: bool = True) -> None:
        state = self.server.state
        if state.closing:
            return  # connections cut by stop() are not the peer's fault
        who = "client" if self.authenticated else "unauthenticated connection"
        _log().warning("store: closed %s from %s: %s", who, self._peer(), refusal.reason)
        with state.cond:
            state.refused += 1
        if reply:
            try:  # best effort: tell a misconfigured pycoll client why
                self._reply(refusal.status, refusal.reason.encode()[:256])
            except OSError:
                pass

    def _read_frame(self) -> Optional[tuple[int, bytes, bytearray]]:
        """One request: (op, key bytes, value); None on a clean EOF between frames."""
        try:
            head = _recv_exact(self.request, _REQ.size)
        except ConnectionError as exc:
            if self.authenticated and not isinstance(exc, ConnectionResetError):
                raise _Refuse(f"truncated frame header ({exc})") from None
            raise
        if head is None:
            if not self.authenticated:
                raise _Refuse("closed during the handshake")
            return None
        op, klen, vlen = _REQ.unpack(head)
        if self.authenticated:
            ok = op in _OP_NAMES and op not in (_OP_HELLO, _OP_AUTH) and klen <= MAX_KEY_BYTES and vlen <= MAX_VALUE_BYTES
        else:
            expected = _OP_HELLO if self.server_nonce is None else _OP_AUTH
            ok = op == expected and klen == 0 and vlen <= _MAX_HANDSHAKE_BYTES
        if not ok:
            stage = "" if self.authenticated else " before authenticating"
            raise _Refuse(f"malformed frame{stage} (op {op}, key {klen} B, value {vlen} B)")
        try:
            body = _recv_exact(self.request, klen + vlen) if klen + vlen else bytearray()
        except ConnectionError as exc:
            raise _Refuse(f"truncated frame ({exc})") from None
        if body is None:
            raise _Refuse(f"closed after a frame header announcing {klen + vlen} B")
        return op, bytes(body[:klen]), body[klen:]

    def _handshake(self, op: int, value: bytes) -> None:
        token = self.server.state.token
        if op == _OP_HELLO:
            if len(value) != len(_MAGIC) + NONCE_BYTES or not value.startswith(_MAGIC):
                raise _Refuse("the hello is not a pycoll-store/2 client's")
            self.client_nonce = value[len(_MAGIC) :]
            self.server_nonce = os.urandom(NONCE_BYTES)
            proof = auth_proof(token, b"store-server", self.client_nonce, self.server_nonce)
            self._reply(_ST_OK, _MAGIC + self.server_nonce + proof)
            return
        assert self.server_nonce is not None
        expected = auth_proof(token, b"store-client", self.server_nonce, self.client_nonce)
        if not _compare_digest(value, expected):
            raise _Refuse("failed authentication (wrong job token)", _ST_DENIED)
        self.authenticated = True
        self.request.settimeout(None)  # authenticated clients may idle between requests
        with self.server.state.cond:
            self._uncount()
        self._reply(_ST_OK)

    def _serve_one(self) -> bool:
        frame = self._read_frame()
        if frame is None:
            return False
        op, raw_key, body = frame
        if not self.authenticated:
            self._handshake(op, bytes(body))
            return True
        try:
            key = raw_key.decode("utf-8")
        except UnicodeDecodeError:
            raise _Refuse("key is not utf-8") from None
        state = self.server.state
        if op == _OP_SET:
            value = bytes(body)
            with state.cond:
                state.data[key] = value
                state.cond.notify_all()
            self._reply(_ST_OK)
        elif op == _OP_CHECK:
            with state.cond:
                present = key in state.data
            self._reply(_ST_OK, b"\x01" if present else b"\x00")
        elif op == _OP_ADD:
            if len(body) != _I64.size:
                raise _Refuse("add needs an int64 delta")
            (delta,) = _I64.unpack(body)
            with state.cond:
                try:
                    new = int(state.data.get(key, b"0")) + delta
                except ValueError:
                    new = None
                else:
                    state.data[key] = str(new).encode()
                    state.cond.notify_all()
            if new is None:
                self._reply(_ST_BAD_ARG, f"value of key {key!r} is not an integer counter".encode())
            else:
                self._reply(_ST_OK, _I64.pack(new))
        else:  # GET or WAIT: block on the condition variable until the key exists
            if len(body) != _F64.size:
                raise _Refuse("get/wait needs a float64 timeout")
            (timeout,) = _F64.unpack(body)
            if math.isnan(timeout):
                raise _Refuse("get/wait timeout is NaN")
            timeout = min(max(timeout, 0.0), _MAX_WAIT_S)
            with state.cond:
                found = state.cond.wait_for(lambda: key in state.data or state.closing or FAILED_KEY in state.data, timeout)
                result = state.data.get(key) if found and not state.closing else None
                failed = state.data.get(FAILED_KEY) if result is None else None
                closing = state.closing
            if closing:
                self._reply(_ST_CLOSING, b"store server is stopping")
                return False
            if failed is not None:
                self._reply(_ST_FAILED, failed)
            elif result is None:
                self._reply(_ST_TIMEOUT)
            else:
                self._reply(_ST_OK, result if op == _OP_GET else b"")
        return True


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024  # many ranks connect at once at start-up
    block_on_close = False

    def __init__(self, addr: tuple[str, int], family: int, state: _State) -> None:
        self.address_family = family
        self.state = state
        super().__init__(addr, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Reached only if a handler thread could not start: log it, keep serving.
        _log().warning("store: dropped a connection from %s", client_address, exc_info=True)


class TCPStoreServer:
    """The server side of TCPStore: serves any number of clients from a daemon thread.

    Clients must prove they know ``token`` (default: $PYCOLL_JOB_TOKEN, else a fresh random one, see
    ``.token``). ``with TCPStoreServer() as srv: host, port = srv.address`` or ``host, port = srv.start()``.
    It binds to ``host`` only; ``""`` or ``"0.0.0.0"`` (all addresses) only when asked for.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: Union[str, bytes, None] = None) -> None:
        self.host = host
        self.port = port
        if token is None:
            token = JOB_TOKEN.get() or new_token()
        self.token = token  # give it to the clients (pycoll run puts it in PYCOLL_JOB_TOKEN)
        self._state = _State(token_bytes(token))
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None
        self._wake: Optional[tuple[socket.socket, socket.socket]] = None  # stop() writes to [1] to end the loop

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) actually bound; only valid after start()."""
        if self._server is None:
            raise InvalidArgumentError("the store server is not started", op="store server")
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def refused(self) -> int:
        """How many connections were closed for a failed handshake or a malformed frame."""
        with self._state.cond:
            return self._state.refused

    def is_serving(self) -> bool:
        """True while the accept thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> tuple[str, int]:
        """Bind, listen and serve in a daemon thread; return the bound (host, port)."""
        if self._server is not None:
            return self.address
        try:
            family = socket.getaddrinfo(ascii_host(self.host) if self.host else None, self.port, type=socket.SOCK_STREAM)[0][0]
            self._server = _Server((self.host, self.port), family, self._state)
        except OSError as exc:
            raise PeerFailureError(
                f"cannot listen on {self.host}:{self.port}: {exc}", op="store server"
            ) from exc
        self._server.socket.setblocking(False)  # a connection gone before accept() must not block the loop
        self._wake = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, args=(self._server, self._wake[0]), name="pycoll-store", daemon=True)
        self._thread.start()
        return self.address

    @staticmethod
    def _serve(server: _Server, wake: socket.socket) -> None:
        """Accept connections until stop(): blocks in select() on the listener and the wake-up socket, no polling."""
        with selectors.DefaultSelector() as sel:
            sel.register(server.socket, selectors.EVENT_READ)
            sel.register(wake, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    if key.fileobj is wake:
                        return
                server.handle_request()  # the listener is readable: accept, and serve in a new thread

    def stop(self) -> None:
        """Stop serving: blocked clients get a 'stopping' reply, open connections are closed."""
        if self._server is None:
            return
        state = self._state
        with state.cond:
            state.closing = True
            state.cond.notify_all()
            conns = list(state.conns)
        if self._wake is not None:
            self._wake[1].send(b"x")  # ends the accept loop at once
        if self._thread is not None:
            self._thread.join()
        self._server.server_close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._wake is not None:
            for sock in self._wake:
                sock.close()
            self._wake = None
        self._server = None

    def forget_in_child(self) -> None:
        """In a process forked from this one: close its copies of the server's sockets (the parent serves on). Takes
        no lock: a thread that held one at the fork does not exist here."""
        if self._server is not None:
            self._server.socket.close()
        for sock in [*(self._wake or ()), *list(self._state.conns)]:
            sock.close()
        self._server = self._wake = self._thread = None
        self._state = _State(b"")

    def wait_idle(self, timeout: float) -> bool:
        """Block until no client is connected (or ``timeout`` s); True if idle."""
        with self._state.cond:
            return self._state.cond.wait_for(lambda: not self._state.conns, max(timeout, 0.0))

    def set_local(self, key: str, value: bytes) -> None:
        """Set ``key`` from the hosting process (a launcher), waking every blocked GET/WAIT."""
        with self._state.cond:
            self._state.data[key] = bytes(value)
            self._state.cond.notify_all()

    def get_local(self, key: str) -> Optional[bytes]:
        """Read a key straight from this server's data (no network); None if absent."""
        with self._state.cond:
            return self._state.data.get(key)

    def keys(self) -> list[str]:
        """Every key currently stored."""
        with self._state.cond:
            return list(self._state.data)

    def __enter__(self) -> "TCPStoreServer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# ----------------------------------------------------------------------------- client


class _Retry(Exception):
    """The server closed a fresh connection before answering: it may be busy or not up yet."""


class TCPStore(Store):
    """Client of a TCPStoreServer. One request at a time per client (a lock serialises threads);
    use one client per thread for concurrent blocking gets.

    ``token`` (default: $PYCOLL_JOB_TOKEN) must be the server's; the server must prove it knows it too.
    """

    def __init__(
        self, host: str, port: int, connect_timeout: float = 30.0, token: Union[str, bytes, None] = None
    ) -> None:
        self.host = host
        self.port = int(port)
        if token is None:
            token = JOB_TOKEN.get()
            if not token:
                raise InvalidArgumentError(
                    f"no job token to connect to the store at {self._where()}: set PYCOLL_JOB_TOKEN "
                    "(`pycoll run` sets it) or pass token=",
                    op="store connect",
                )
        self._token = token_bytes(token)
        # Bound on replies to non-blocking requests (set, add, check).
        self.reply_timeout = max(float(connect_timeout), _REPLY_MARGIN)
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = self._connect(float(connect_timeout))

    @property
    def local_address(self) -> str:
        """The local IP this client used to reach the server (a hint for how peers reach us)."""
        if self._sock is None:
            return ""
        return str(self._sock.getsockname()[0])

    def _where(self) -> str:
        return f"{self.host}:{self.port}"

    def _connect(self, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        delay = 0.01
        last: Optional[BaseException] = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                sock = socket.create_connection((ascii_host(self.host), self.port), timeout=remaining)
            except OSError as exc:  # refused, unreachable, name not yet resolvable: retry
                last = exc
            else:
                # A retry loop to a free local port can connect a socket to itself: drop that.
                if sock.getsockname() == sock.getpeername():
                    sock.close()
                    last = ConnectionRefusedError("self-connection (no server yet)")
                else:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    try:
                        self._handshake(sock, max(deadline - time.monotonic(), 1.0))
                        return sock
                    except _Retry as exc:
                        last = exc
            time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
            delay = min(delay * 2, 0.5)
        raise TimeoutError(
            f"could not connect to the store at {self._where()} within {timeout:.1f} s (last error: {last})",
            op="store connect",
        )

    def _read_reply(self, sock: socket.socket, limit: int) -> tuple[int, bytes]:
        head = _recv_exact(sock, _REP.size)
        if head is None:
            raise ConnectionError("the server closed the connection")
        status, n = _REP.unpack(head)
        if status > _ST_DENIED or n > limit:
            raise ConnectionError(f"malformed reply (status {status}, {n} B)")
        body = _recv_exact(sock, n) if n else bytearray()
        if body is None:
            raise ConnectionError("the server closed the connection")
        return status, bytes(body)

    def _handshake(self, sock: socket.socket, timeout: float) -> None:
        """Challenge-response on the job token, both ways; closes ``sock`` on failure."""
        where = self._where()
        try:
            sock.settimeout(timeout)
            client_nonce = os.urandom(NONCE_BYTES)
            hello = _MAGIC + client_nonce
            try:
                sock.sendall(_REQ.pack(_OP_HELLO, 0, len(hello)) + hello)
                head = _recv_exact(sock, _REP.size)
            except ConnectionError as exc:  # reset before any answer: as below
                raise _Retry(f"the server dropped the connection before answering the hello ({exc})") from None
            if head is None:  # closed before any answer: a busy server, or one not serving yet
                raise _Retry("the server closed the connection before answering the hello")
            status, n = _REP.unpack(head)
            body = _recv_exact(sock, n) if n <= 1024 else None
            if status == _ST_PROTOCOL and body is not None:
                raise PeerFailureError(
                    f"the store at {where} refused the handshake: {bytes(body).decode(errors='replace')}",
                    op="store connect",
                )
            size = len(_MAGIC) + NONCE_BYTES + PROOF_BYTES
            if status != _ST_OK or body is None or len(body) != size or not body.startswith(_MAGIC):
                raise PeerFailureError(f"{where} is not a working pycoll store (its reply is not a pycoll-store/2 hello)",
                                       op="store connect")
            server_nonce = bytes(body[len(_MAGIC) : len(_MAGIC) + NONCE_BYTES])
            expected = auth_proof(self._token, b"store-server", client_nonce, server_nonce)
            if not _compare_digest(bytes(body[-PROOF_BYTES:]), expected):
                raise PeerFailureError(
                    f"the store at {where} does not know this job's token: PYCOLL_JOB_TOKEN differs from the job's",
                    op="store connect",
                )
            proof = auth_proof(self._token, b"store-client", server_nonce, client_nonce)
            sock.sendall(_REQ.pack(_OP_AUTH, 0, len(proof)) + proof)
            status, body = self._read_reply(sock, 1024)
            if status == _ST_DENIED:
                raise PeerFailureError(
                    f"the store at {where} refused this process's job token: PYCOLL_JOB_TOKEN differs from the job's",
                    op="store connect",
                )
            if status != _ST_OK:
                raise PeerFailureError(
                    f"the store at {where} refused the handshake: {body.decode(errors='replace')}", op="store connect"
                )
        except (PeerFailureError, _Retry):
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            raise PeerFailureError(f"{where} is not a working pycoll store ({exc})", op="store connect") from exc

    def _request(self, op: int, key: str, payload: bytes, reply_timeout: float) -> tuple[int, bytes]:
        raw_key = _check_key(key)
        if len(payload) > MAX_VALUE_BYTES:
            raise InvalidArgumentError(f"value of {len(payload)} bytes exceeds {MAX_VALUE_BYTES}", op="store set")
        what = f"store {_OP_NAMES[op]}"
        with self._lock:
            sock = self._sock
            if sock is None:
                raise PeerFailureError(f"the connection to the store at {self._where()} is closed", op=what)
            try:
                sock.settimeout(reply_timeout)
                sock.sendall(_REQ.pack(op, len(raw_key), len(payload)) + raw_key + payload)
                head = _recv_exact(sock, _REP.size)
                if head is None:
                    raise ConnectionError("the server closed the connection")
                status, n = _REP.unpack(head)
                if status > _ST_FAILED or n > MAX_VALUE_BYTES:
                    raise ProtocolError(
                        f"malformed reply from the store at {self._where()} (status {status}, {n} B)", op=what
                    )
                body = _recv_exact(sock, n) if n else bytearray()
                if body is None:
                    raise ConnectionError("the server closed the connection")
            except socket.timeout:
                self._drop()
                raise TimeoutError(
                    f"no reply from the store at {self._where()} within {reply_timeout:.1f} s for key {key!r}",
                    op=what,
                ) from None
            except ProtocolError:
                self._drop()
                raise
            except OSError as exc:
                self._drop()
                raise PeerFailureError(
                    f"lost the store at {self._where()} while waiting for key {key!r}: {exc}", op=what
                ) from exc
            if status in (_ST_PROTOCOL, _ST_CLOSING, _ST_DENIED):
                self._drop()
                cls = PeerFailureError if status == _ST_CLOSING else ProtocolError
                raise cls(f"the store at {self._where()} answered: {bytes(body).decode(errors='replace')}", op=what)
            return status, bytes(body)

    def _drop(self) -> None:
        # A failed exchange leaves the stream out of step: never reuse it.
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def set(self, key: str, value: bytes) -> None:
        self._request(_OP_SET, key, bytes(value), self.reply_timeout)

    def get(self, key: str, timeout: float) -> bytes:
        status, body = self._request(_OP_GET, key, _F64.pack(timeout), max(timeout, 0.0) + _REPLY_MARGIN)
        if status == _ST_FAILED:
            raise _failed_rank(body, f"waiting for key {key!r}")
        if status == _ST_TIMEOUT:
            raise TimeoutError(f"waited {timeout:.1f} s for key {key!r}", op="store get")
        return body

    def add(self, key: str, delta: int) -> int:
        status, body = self._request(_OP_ADD, key, _I64.pack(int(delta)), self.reply_timeout)
        if status == _ST_BAD_ARG:
            raise InvalidArgumentError(body.decode(errors="replace"), op="store add")
        if len(body) != _I64.size:
            self._drop()
            raise ProtocolError(f"malformed add reply from the store at {self._where()}", op="store add")
        return _I64.unpack(body)[0]

    def check(self, keys: list[str]) -> bool:
        for key in keys:
            _, body = self._request(_OP_CHECK, key, b"", self.reply_timeout)
            if body != b"\x01":
                return False
        return True

    def wait(self, keys: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for i, key in enumerate(keys):
            remaining = max(deadline - time.monotonic(), 0.0)
            status, body = self._request(_OP_WAIT, key, _F64.pack(remaining), remaining + _REPLY_MARGIN)
            if status == _ST_FAILED:
                raise _failed_rank(body, f"waiting for key {key!r}")
            if status == _ST_TIMEOUT:
                missing = [k for k in keys[i:] if not self.check([k])]
                raise TimeoutError(f"waited {timeout:.1f} s for keys {missing}", op="store wait")

    def close(self) -> None:
        with self._lock:
            self._drop()


# ----------------------------------------------------------------------------- torch


def _failed_rank(body: bytes, what: str) -> PeerFailureError:
    """The launcher's notice that a rank failed, as the error of a rank still starting up."""
    try:
        info = json.loads(body.decode())
        rank, cause = int(info["rank"]), str(info.get("cause", "failed"))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return PeerFailureError(f"a rank failed during start-up ({what})", op="start-up")
    return PeerFailureError(f"rank {rank} {cause} during start-up ({what})", op="start-up", peers=[rank])


def _torch_error(exc: BaseException, what: str, cause: str) -> Exception:
    """Map a torch store error to pycoll's: timeouts to TimeoutError, the rest to PeerFailureError."""
    if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
        return TimeoutError(cause, op=what)
    return PeerFailureError(f"{cause}: {exc}", op=what)


class TorchStore(Store):
    """Wraps a ``torch.distributed`` store (e.g. the torchrun agent's TCPStore); keys get a prefix."""

    def __init__(self, store: Any, prefix: str = "pycoll/") -> None:
        self._store = store
        self.prefix = prefix

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        *,
        world_size: int,
        is_master: bool,
        timeout: float,
        prefix: str = "pycoll/",
    ) -> "TorchStore":
        """Create a ``torch.distributed.TCPStore`` the way torch's env:// rendezvous does.

        The master uses ``multi_tenant=True``, so a later ``init_process_group`` in this process on
        the same port shares the server.
        """
        from torch.distributed import TCPStore as _TorchTCPStore  # lazy: torch is optional

        kwargs: dict[str, Any] = {}
        if is_master:
            kwargs["multi_tenant"] = True
        try:
            store = _TorchTCPStore(
                host, int(port), world_size, is_master, timeout=_timedelta(timeout), **kwargs
            )
        except RuntimeError as exc:
            raise _torch_error(
                exc, "store connect", f"could not reach the torch store at {host}:{port} within {timeout:.1f} s"
            ) from exc
        return cls(store, prefix)

    def _live(self, what: str) -> Any:
        if self._store is None:
            raise PeerFailureError("the torch store wrapper is closed", op=what)
        return self._store

    def set(self, key: str, value: bytes) -> None:
        _check_key(key)
        try:
            self._live("store set").set(self.prefix + key, bytes(value))
        except RuntimeError as exc:
            raise _torch_error(exc, "store set", f"could not set key {key!r}") from exc

    def get(self, key: str, timeout: float) -> bytes:
        _check_key(key)
        store = self._live("store get")
        full = self.prefix + key
        try:
            # torch reads a zero timeout as "forever": poll instead.
            if timeout <= 0:
                if not store.check([full]):
                    raise TimeoutError(f"waited {timeout:.1f} s for key {key!r}", op="store get")
            else:
                store.wait([full], _timedelta(timeout))
            return bytes(store.get(full))
        except RuntimeError as exc:
            raise _torch_error(exc, "store get", f"waited {timeout:.1f} s for key {key!r}") from exc

    def add(self, key: str, delta: int) -> int:
        _check_key(key)
        try:
            return int(self._live("store add").add(self.prefix + key, int(delta)))
        except RuntimeError as exc:
            raise _torch_error(exc, "store add", f"could not add to key {key!r}") from exc

    def check(self, keys: list[str]) -> bool:
        try:
            return bool(self._live("store check").check([self.prefix + k for k in keys]))
        except RuntimeError as exc:
            raise _torch_error(exc, "store check", f"could not check keys {keys}") from exc

    def wait(self, keys: list[str], timeout: float) -> None:
        for key in keys:
            _check_key(key)
        store = self._live("store wait")
        try:
            if timeout <= 0:
                ok = store.check([self.prefix + k for k in keys])
            else:
                store.wait([self.prefix + k for k in keys], _timedelta(timeout))
                ok = True
        except RuntimeError as exc:
            ok = False
            if not isinstance(_torch_error(exc, "", ""), TimeoutError):
                raise _torch_error(exc, "store wait", f"could not wait for keys {keys}") from exc
        if not ok:
            missing = [k for k in keys if not self._safe_check(k)]
            raise TimeoutError(f"waited {timeout:.1f} s for keys {missing}", op="store wait")

    def _safe_check(self, key: str) -> bool:
        try:
            return self.check([key])
        except Exception:
            return False

    def close(self) -> None:
        # torch stores have no close(); dropping the reference closes the connection.
        self._store = None
