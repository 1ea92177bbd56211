"""Key-value stores used once at start-up to exchange addresses: a small TCP store and a torch wrapper."""

from __future__ import annotations

import abc
import datetime
import socket
import socketserver
import struct
import threading
import time
from typing import Any, Optional

from pycoll.errors import InvalidArgumentError, PeerFailureError, ProtocolError, TimeoutError

# Wire format (all integers big-endian):
#   request: op (u8), key length (u32), value length (u32), key (utf-8), value
#   reply:   status (u8), payload length (u32), payload
# GET and WAIT carry their timeout as a float64 value; ADD carries its delta as an int64
# and gets the new counter back as an int64. Counters are stored as decimal ASCII, as torch does.
_REQ = struct.Struct("!BII")
_REP = struct.Struct("!BI")
_F64 = struct.Struct("!d")
_I64 = struct.Struct("!q")

_OP_HELLO, _OP_SET, _OP_GET, _OP_ADD, _OP_WAIT, _OP_CHECK = range(6)
_OP_NAMES = {_OP_HELLO: "hello", _OP_SET: "set", _OP_GET: "get", _OP_ADD: "add", _OP_WAIT: "wait", _OP_CHECK: "check"}
_ST_OK, _ST_TIMEOUT, _ST_BAD_ARG, _ST_PROTOCOL, _ST_CLOSING = range(5)

_MAGIC = b"pycoll-store/1"
MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 64 << 20
# Extra seconds a client waits for a reply beyond the server-side timeout of a blocking op.
_REPLY_MARGIN = 10.0


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
    """Read exactly n bytes; None on a clean EOF before the first byte, ConnectionError mid-frame."""
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


# ----------------------------------------------------------------------------- server


class _State:
    """The data of one server, guarded by one condition variable that wakes blocked GET/WAITs."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.closing = False
        self.conns: set[socket.socket] = set()


class _Handler(socketserver.BaseRequestHandler):
    """Serves one client connection: a loop of request frames, each answered by one reply frame."""

    server: "_Server"

    def setup(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.state.cond:
            self.server.state.conns.add(self.request)

    def finish(self) -> None:
        with self.server.state.cond:
            self.server.state.conns.discard(self.request)
            self.server.state.cond.notify_all()

    def _reply(self, status: int, payload: bytes = b"") -> None:
        self.request.sendall(_REP.pack(status, len(payload)) + payload)

    def handle(self) -> None:
        try:
            while self._serve_one():
                pass
        except OSError:
            pass  # the client went away or the server is stopping

    def _serve_one(self) -> bool:
        head = _recv_exact(self.request, _REQ.size)
        if head is None:
            return False
        op, klen, vlen = _REQ.unpack(head)
        if op not in _OP_NAMES or klen > MAX_KEY_BYTES or vlen > MAX_VALUE_BYTES:
            self._reply(_ST_PROTOCOL, f"malformed frame (op {op}, key {klen} B, value {vlen} B)".encode())
            return False
        body = _recv_exact(self.request, klen + vlen) if klen + vlen else bytearray()
        if body is None:
            return False
        try:
            key = bytes(body[:klen]).decode("utf-8")
        except UnicodeDecodeError:
            self._reply(_ST_PROTOCOL, b"key is not utf-8")
            return False
        value = bytes(body[klen:])
        state = self.server.state
        if op == _OP_HELLO:
            self._reply(_ST_OK if value == _MAGIC else _ST_PROTOCOL, _MAGIC)
            return value == _MAGIC
        if op == _OP_SET:
            with state.cond:
                state.data[key] = value
                state.cond.notify_all()
            self._reply(_ST_OK)
        elif op == _OP_CHECK:
            with state.cond:
                present = key in state.data
            self._reply(_ST_OK, b"\x01" if present else b"\x00")
        elif op == _OP_ADD:
            if len(value) != _I64.size:
                self._reply(_ST_PROTOCOL, b"add needs an int64 delta")
                return False
            (delta,) = _I64.unpack(value)
            with state.cond:
                try:
                    new = int(state.data.get(key, b"0")) + delta
                except ValueError:
                    self._reply(_ST_BAD_ARG, f"value of key {key!r} is not an integer counter".encode())
                    return True
                state.data[key] = str(new).encode()
                state.cond.notify_all()
            self._reply(_ST_OK, _I64.pack(new))
        else:  # GET or WAIT: block on the condition variable until the key exists
            if len(value) != _F64.size:
                self._reply(_ST_PROTOCOL, b"get/wait needs a float64 timeout")
                return False
            (timeout,) = _F64.unpack(value)
            with state.cond:
                found = state.cond.wait_for(lambda: key in state.data or state.closing, max(timeout, 0.0))
                result = state.data.get(key) if found and not state.closing else None
                closing = state.closing
            if closing:
                self._reply(_ST_CLOSING, b"store server is stopping")
                return False
            if result is None:
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


class TCPStoreServer:
    """The server side of TCPStore: serves any number of clients from a daemon thread.

    ``with TCPStoreServer() as srv: host, port = srv.address`` or ``host, port = srv.start()``.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self._state = _State()
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) actually bound; only valid after start()."""
        if self._server is None:
            raise InvalidArgumentError("the store server is not started", op="store server")
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> tuple[str, int]:
        """Bind, listen and serve in a daemon thread; return the bound (host, port)."""
        if self._server is not None:
            return self.address
        try:
            family = socket.getaddrinfo(self.host or None, self.port, type=socket.SOCK_STREAM)[0][0]
            self._server = _Server((self.host, self.port), family, self._state)
        except OSError as exc:
            raise PeerFailureError(
                f"cannot listen on {self.host}:{self.port}: {exc}", op="store server"
            ) from exc
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, name="pycoll-store", daemon=True
        )
        self._thread.start()
        return self.address

    def stop(self) -> None:
        """Stop serving: blocked clients get a 'stopping' reply, open connections are closed."""
        if self._server is None:
            return
        state = self._state
        with state.cond:
            state.closing = True
            state.cond.notify_all()
            conns = list(state.conns)
        self._server.shutdown()
        self._server.server_close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join()
        self._server = None

    def wait_idle(self, timeout: float) -> bool:
        """Block until no client is connected (or ``timeout`` s); True if idle."""
        with self._state.cond:
            return self._state.cond.wait_for(lambda: not self._state.conns, max(timeout, 0.0))

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


class TCPStore(Store):
    """Client of a TCPStoreServer. One request at a time per client (a lock serialises threads);
    use one client per thread for concurrent blocking gets."""

    def __init__(self, host: str, port: int, connect_timeout: float = 30.0) -> None:
        self.host = host
        self.port = int(port)
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
                sock = socket.create_connection((self.host, self.port), timeout=remaining)
            except OSError as exc:  # refused, unreachable, name not yet resolvable: retry
                last = exc
            else:
                # A retry loop to a free local port can connect a socket to itself: drop that.
                if sock.getsockname() == sock.getpeername():
                    sock.close()
                    last = ConnectionRefusedError("self-connection (no server yet)")
                else:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self._handshake(sock, max(deadline - time.monotonic(), 1.0))
                    return sock
            time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
            delay = min(delay * 2, 0.5)
        raise TimeoutError(
            f"could not connect to the store at {self._where()} within {timeout:.1f} s (last error: {last})",
            op="store connect",
        )

    def _handshake(self, sock: socket.socket, timeout: float) -> None:
        try:
            sock.settimeout(timeout)
            sock.sendall(_REQ.pack(_OP_HELLO, 0, len(_MAGIC)) + _MAGIC)
            head = _recv_exact(sock, _REP.size)
            if head is None:
                raise ConnectionError("closed during the handshake")
            status, n = _REP.unpack(head)
            body = _recv_exact(sock, n) if n <= 1024 else None
            if status != _ST_OK or body != _MAGIC:
                raise ConnectionError("the reply is not a pycoll store's")
        except OSError as exc:
            sock.close()
            raise PeerFailureError(
                f"{self._where()} is not a working pycoll store ({exc})", op="store connect"
            ) from exc

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
                if status > _ST_CLOSING or n > MAX_VALUE_BYTES:
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
            if status in (_ST_PROTOCOL, _ST_CLOSING):
                self._drop()
                cls = ProtocolError if status == _ST_PROTOCOL else PeerFailureError
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
            status, _ = self._request(_OP_WAIT, key, _F64.pack(remaining), remaining + _REPLY_MARGIN)
            if status == _ST_TIMEOUT:
                missing = [k for k in keys[i:] if not self.check([k])]
                raise TimeoutError(f"waited {timeout:.1f} s for keys {missing}", op="store wait")

    def close(self) -> None:
        with self._lock:
            self._drop()


# ----------------------------------------------------------------------------- torch


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
                host, int(port), world_size, is_master, timeout=datetime.timedelta(seconds=timeout), **kwargs
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
                store.wait([full], datetime.timedelta(seconds=timeout))
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
                store.wait([self.prefix + k for k in keys], datetime.timedelta(seconds=timeout))
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
