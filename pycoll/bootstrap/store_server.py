"""pycoll's TCP store server: one thread per connection, each authenticated by the job token before it is
served; blocking gets and waits end early, naming the rank, once a launcher marks a rank failed."""

from __future__ import annotations

import math
import os
import selectors
import socket
import socketserver
import threading
from typing import Any, Optional, Union

from pycoll.errors import InvalidArgumentError, PeerFailureError
from .store import (
    F64,
    FAILED_KEY,
    I64,
    JOB_TOKEN,
    MAGIC,
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    NONCE_BYTES,
    OP_ADD,
    OP_AUTH,
    OP_CHECK,
    OP_GET,
    OP_HELLO,
    OP_NAMES,
    OP_SET,
    REPLY,
    REQUEST,
    ST_BAD_ARG,
    ST_CLOSING,
    ST_DENIED,
    ST_FAILED,
    ST_OK,
    ST_PROTOCOL,
    ST_TIMEOUT,
    ascii_host,
    auth_proof,
    compare_digest,
    new_token,
    recv_exact,
    token_bytes,
)


# Before a connection has authenticated, no frame may carry more than this.
_MAX_HANDSHAKE_BYTES = 64
# Seconds a new connection gets to complete the handshake, and how many may be half-open at once.
HANDSHAKE_TIMEOUT = 10.0
MAX_UNAUTHENTICATED = 128
# Longest blocking GET/WAIT the server accepts (seconds).
_MAX_WAIT_S = 1e7


def _log() -> Any:
    import logging

    return logging.getLogger("pycoll")


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

    def __init__(self, reason: str, status: int = ST_PROTOCOL) -> None:
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
        self.request.sendall(REPLY.pack(status, len(payload)) + payload)

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
            head = recv_exact(self.request, REQUEST.size)
        except ConnectionError as exc:
            if self.authenticated and not isinstance(exc, ConnectionResetError):
                raise _Refuse(f"truncated frame header ({exc})") from None
            raise
        if head is None:
            if not self.authenticated:
                raise _Refuse("closed during the handshake")
            return None
        op, klen, vlen = REQUEST.unpack(head)
        if self.authenticated:
            ok = op in OP_NAMES and op not in (OP_HELLO, OP_AUTH) and klen <= MAX_KEY_BYTES and vlen <= MAX_VALUE_BYTES
        else:
            expected = OP_HELLO if self.server_nonce is None else OP_AUTH
            ok = op == expected and klen == 0 and vlen <= _MAX_HANDSHAKE_BYTES
        if not ok:
            stage = "" if self.authenticated else " before authenticating"
            raise _Refuse(f"malformed frame{stage} (op {op}, key {klen} B, value {vlen} B)")
        try:
            body = recv_exact(self.request, klen + vlen) if klen + vlen else bytearray()
        except ConnectionError as exc:
            raise _Refuse(f"truncated frame ({exc})") from None
        if body is None:
            raise _Refuse(f"closed after a frame header announcing {klen + vlen} B")
        return op, bytes(body[:klen]), body[klen:]

    def _handshake(self, op: int, value: bytes) -> None:
        token = self.server.state.token
        if op == OP_HELLO:
            if len(value) != len(MAGIC) + NONCE_BYTES or not value.startswith(MAGIC):
                raise _Refuse("the hello is not a pycoll-store/2 client's")
            self.client_nonce = value[len(MAGIC) :]
            self.server_nonce = os.urandom(NONCE_BYTES)
            proof = auth_proof(token, b"store-server", self.client_nonce, self.server_nonce)
            self._reply(ST_OK, MAGIC + self.server_nonce + proof)
            return
        assert self.server_nonce is not None
        expected = auth_proof(token, b"store-client", self.server_nonce, self.client_nonce)
        if not compare_digest(value, expected):
            raise _Refuse("failed authentication (wrong job token)", ST_DENIED)
        self.authenticated = True
        self.request.settimeout(None)  # authenticated clients may idle between requests
        with self.server.state.cond:
            self._uncount()
        self._reply(ST_OK)

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
        if op == OP_SET:
            value = bytes(body)
            with state.cond:
                state.data[key] = value
                state.cond.notify_all()
            self._reply(ST_OK)
        elif op == OP_CHECK:
            with state.cond:
                present = key in state.data
            self._reply(ST_OK, b"\x01" if present else b"\x00")
        elif op == OP_ADD:
            if len(body) != I64.size:
                raise _Refuse("add needs an int64 delta")
            (delta,) = I64.unpack(body)
            with state.cond:
                try:
                    new = int(state.data.get(key, b"0")) + delta
                except ValueError:
                    new = None
                else:
                    state.data[key] = str(new).encode()
                    state.cond.notify_all()
            if new is None:
                self._reply(ST_BAD_ARG, f"value of key {key!r} is not an integer counter".encode())
            else:
                self._reply(ST_OK, I64.pack(new))
        else:  # GET or WAIT: block on the condition variable until the key exists
            if len(body) != F64.size:
                raise _Refuse("get/wait needs a float64 timeout")
            (timeout,) = F64.unpack(body)
            if math.isnan(timeout):
                raise _Refuse("get/wait timeout is NaN")
            timeout = min(max(timeout, 0.0), _MAX_WAIT_S)
            with state.cond:
                found = state.cond.wait_for(lambda: key in state.data or state.closing or FAILED_KEY in state.data, timeout)
                result = state.data.get(key) if found and not state.closing else None
                failed = state.data.get(FAILED_KEY) if result is None else None
                closing = state.closing
            if closing:
                self._reply(ST_CLOSING, b"store server is stopping")
                return False
            if failed is not None:
                self._reply(ST_FAILED, failed)
            elif result is None:
                self._reply(ST_TIMEOUT)
            else:
                self._reply(ST_OK, result if op == OP_GET else b"")
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
