"""The rendezvous store's interface and wire: ``Store`` (what a rendezvous needs of a key-value store), a
barrier on it, the job token and its proofs, and the frames that pycoll's TCP store and its clients exchange."""

from __future__ import annotations

import abc
import json
import os
import socket
import struct
from typing import Any, Optional, Union

from pycoll.config import str_param
from pycoll.errors import InvalidArgumentError, PeerFailureError, TimeoutError


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
REQUEST = struct.Struct("!BII")
REPLY = struct.Struct("!BI")
F64 = struct.Struct("!d")
I64 = struct.Struct("!q")
OP_HELLO, OP_SET, OP_GET, OP_ADD, OP_WAIT, OP_CHECK, OP_AUTH = range(7)
OP_NAMES = {
    OP_HELLO: "hello", OP_SET: "set", OP_GET: "get", OP_ADD: "add", OP_WAIT: "wait", OP_CHECK: "check",
    OP_AUTH: "auth",
}
ST_OK, ST_TIMEOUT, ST_BAD_ARG, ST_PROTOCOL, ST_CLOSING, ST_DENIED, ST_FAILED = range(7)
# Set by a launcher that saw a rank fail (JSON: rank, cause): blocked GET/WAITs end at once with ST_FAILED,
# so ranks still starting up raise an error naming that rank instead of waiting out their timeout.
FAILED_KEY = "pycoll/failed"
MAGIC = b"pycoll-store/2"
NONCE_BYTES = 16
PROOF_BYTES = 32  # HMAC-SHA256
MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 64 << 20
# Bodies above this are read in pieces of this size: memory grows with the bytes that really arrive.
READ_PIECE = 1 << 20


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


def check_key(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"store keys must be non-empty str, got {key!r}", op="store")
    raw = key.encode("utf-8")
    if len(raw) > MAX_KEY_BYTES:
        raise InvalidArgumentError(f"store key of {len(raw)} bytes exceeds {MAX_KEY_BYTES}", op="store")
    return raw


def recv_exact(sock: socket.socket, n: int) -> Optional[bytearray]:
    """Read exactly n bytes; None on a clean EOF before the first byte, ConnectionError mid-frame.

    Callers check ``n`` against a limit first; above READ_PIECE the buffer grows only as bytes arrive.
    """
    if n > READ_PIECE:
        buf = bytearray()
        while len(buf) < n:
            piece = sock.recv(min(n - len(buf), READ_PIECE))
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


def compare_digest(a: bytes, b: bytes) -> bool:
    import hmac

    return hmac.compare_digest(a, b)


def failed_rank_error(body: bytes, what: str) -> PeerFailureError:
    """The launcher's notice that a rank failed, as the error of a rank still starting up."""
    try:
        info = json.loads(body.decode())
        rank, cause = int(info["rank"]), str(info.get("cause", "failed"))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return PeerFailureError(f"a rank failed during start-up ({what})", op="start-up")
    return PeerFailureError(f"rank {rank} {cause} during start-up ({what})", op="start-up", peers=[rank])
