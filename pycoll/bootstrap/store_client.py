"""The client of pycoll's TCP store: connects (and reconnects) with the job token's handshake; every call
honours its timeout and raises an error naming the store and the cause."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Optional, Union

from pycoll.errors import InvalidArgumentError, PeerFailureError, ProtocolError, TimeoutError
from .store import (
    F64,
    I64,
    JOB_TOKEN,
    MAGIC,
    MAX_VALUE_BYTES,
    NONCE_BYTES,
    OP_ADD,
    OP_AUTH,
    OP_CHECK,
    OP_GET,
    OP_HELLO,
    OP_NAMES,
    OP_SET,
    OP_WAIT,
    PROOF_BYTES,
    REPLY,
    REQUEST,
    ST_BAD_ARG,
    ST_CLOSING,
    ST_DENIED,
    ST_FAILED,
    ST_OK,
    ST_PROTOCOL,
    ST_TIMEOUT,
    Store,
    ascii_host,
    auth_proof,
    check_key,
    compare_digest,
    failed_rank_error,
    recv_exact,
    token_bytes,
)


# Extra seconds a client waits for a reply beyond the server-side timeout of a blocking op.
_REPLY_MARGIN = 10.0


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
        head = recv_exact(sock, REPLY.size)
        if head is None:
            raise ConnectionError("the server closed the connection")
        status, n = REPLY.unpack(head)
        if status > ST_DENIED or n > limit:
            raise ConnectionError(f"malformed reply (status {status}, {n} B)")
        body = recv_exact(sock, n) if n else bytearray()
        if body is None:
            raise ConnectionError("the server closed the connection")
        return status, bytes(body)

    def _handshake(self, sock: socket.socket, timeout: float) -> None:
        """Challenge-response on the job token, both ways; closes ``sock`` on failure."""
        where = self._where()
        try:
            sock.settimeout(timeout)
            client_nonce = os.urandom(NONCE_BYTES)
            hello = MAGIC + client_nonce
            try:
                sock.sendall(REQUEST.pack(OP_HELLO, 0, len(hello)) + hello)
                head = recv_exact(sock, REPLY.size)
            except ConnectionError as exc:  # reset before any answer: as below
                raise _Retry(f"the server dropped the connection before answering the hello ({exc})") from None
            if head is None:  # closed before any answer: a busy server, or one not serving yet
                raise _Retry("the server closed the connection before answering the hello")
            status, n = REPLY.unpack(head)
            body = recv_exact(sock, n) if n <= 1024 else None
            if status == ST_PROTOCOL and body is not None:
                raise PeerFailureError(
                    f"the store at {where} refused the handshake: {bytes(body).decode(errors='replace')}",
                    op="store connect",
                )
            size = len(MAGIC) + NONCE_BYTES + PROOF_BYTES
            if status != ST_OK or body is None or len(body) != size or not body.startswith(MAGIC):
                raise PeerFailureError(f"{where} is not a working pycoll store (its reply is not a pycoll-store/2 hello)",
                                       op="store connect")
            server_nonce = bytes(body[len(MAGIC) : len(MAGIC) + NONCE_BYTES])
            expected = auth_proof(self._token, b"store-server", client_nonce, server_nonce)
            if not compare_digest(bytes(body[-PROOF_BYTES:]), expected):
                raise PeerFailureError(
                    f"the store at {where} does not know this job's token: PYCOLL_JOB_TOKEN differs from the job's",
                    op="store connect",
                )
            proof = auth_proof(self._token, b"store-client", server_nonce, client_nonce)
            sock.sendall(REQUEST.pack(OP_AUTH, 0, len(proof)) + proof)
            status, body = self._read_reply(sock, 1024)
            if status == ST_DENIED:
                raise PeerFailureError(
                    f"the store at {where} refused this process's job token: PYCOLL_JOB_TOKEN differs from the job's",
                    op="store connect",
                )
            if status != ST_OK:
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
        raw_key = check_key(key)
        if len(payload) > MAX_VALUE_BYTES:
            raise InvalidArgumentError(f"value of {len(payload)} bytes exceeds {MAX_VALUE_BYTES}", op="store set")
        what = f"store {OP_NAMES[op]}"
        with self._lock:
            sock = self._sock
            if sock is None:
                raise PeerFailureError(f"the connection to the store at {self._where()} is closed", op=what)
            try:
                sock.settimeout(reply_timeout)
                sock.sendall(REQUEST.pack(op, len(raw_key), len(payload)) + raw_key + payload)
                head = recv_exact(sock, REPLY.size)
                if head is None:
                    raise ConnectionError("the server closed the connection")
                status, n = REPLY.unpack(head)
                if status > ST_FAILED or n > MAX_VALUE_BYTES:
                    raise ProtocolError(
                        f"malformed reply from the store at {self._where()} (status {status}, {n} B)", op=what
                    )
                body = recv_exact(sock, n) if n else bytearray()
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
            if status in (ST_PROTOCOL, ST_CLOSING, ST_DENIED):
                self._drop()
                cls = PeerFailureError if status == ST_CLOSING else ProtocolError
                raise cls(f"the store at {self._where()} answered: {bytes(body).decode(errors='replace')}", op=what)
            return status, bytes(body)

    def _drop(self) -> None:
        # A failed exchange leaves the stream out of step: never reuse it.
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def set(self, key: str, value: bytes) -> None:
        self._request(OP_SET, key, bytes(value), self.reply_timeout)

    def get(self, key: str, timeout: float) -> bytes:
        status, body = self._request(OP_GET, key, F64.pack(timeout), max(timeout, 0.0) + _REPLY_MARGIN)
        if status == ST_FAILED:
            raise failed_rank_error(body, f"waiting for key {key!r}")
        if status == ST_TIMEOUT:
            raise TimeoutError(f"waited {timeout:.1f} s for key {key!r}", op="store get")
        return body

    def add(self, key: str, delta: int) -> int:
        status, body = self._request(OP_ADD, key, I64.pack(int(delta)), self.reply_timeout)
        if status == ST_BAD_ARG:
            raise InvalidArgumentError(body.decode(errors="replace"), op="store add")
        if len(body) != I64.size:
            self._drop()
            raise ProtocolError(f"malformed add reply from the store at {self._where()}", op="store add")
        return I64.unpack(body)[0]

    def check(self, keys: list[str]) -> bool:
        for key in keys:
            _, body = self._request(OP_CHECK, key, b"", self.reply_timeout)
            if body != b"\x01":
                return False
        return True

    def wait(self, keys: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for i, key in enumerate(keys):
            remaining = max(deadline - time.monotonic(), 0.0)
            status, body = self._request(OP_WAIT, key, F64.pack(remaining), remaining + _REPLY_MARGIN)
            if status == ST_FAILED:
                raise failed_rank_error(body, f"waiting for key {key!r}")
            if status == ST_TIMEOUT:
                missing = [k for k in keys[i:] if not self.check([k])]
                raise TimeoutError(f"waited {timeout:.1f} s for keys {missing}", op="store wait")

    def close(self) -> None:
        with self._lock:
            self._drop()
