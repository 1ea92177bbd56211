"""Fault suite: garbage, truncated, oversized and unauthenticated frames sent to the TCP store and the TCP
transport on loopback only; each bad connection is closed and logged, and the legitimate job goes on."""

from __future__ import annotations

import logging
import random
import resource
import socket
import struct
import threading
import time
from typing import Callable, Optional

import pytest

import pycoll.bootstrap as bs
from pycoll.bootstrap import rendezvous
from pycoll import p2p, p2p_protocol
from pycoll.bootstrap import store as store_mod
from pycoll.bootstrap import store_server
from pycoll.bootstrap.store_client import TCPStore
from pycoll.bootstrap.store_server import TCPStoreServer
from pycoll.errors import InvalidArgumentError, PeerFailureError, TimeoutError
from pycoll.transport import tcp
from pycoll.transport.base import PeerInfo
from pycoll.transport.tcp import TcpChannel, TcpTransport

from harness import eventually  # noqa: E402  (tests/ is on the path: conftest)

pytestmark = pytest.mark.timeout(60)

TOKEN = "wire-test-token"
SEED = 20261123
LOOPBACK = "127.0.0.1"
_REQ = struct.Struct("!BII")
# Bad frames that were sent, per target, while the legitimate side kept working.
SURVIVED = {"store": 0, "transport": 0, "channel": 0}


@pytest.fixture(scope="module", autouse=True)
def report_total():
    yield
    total = sum(SURVIVED.values())
    parts = ", ".join(f"{k} {v}" for k, v in SURVIVED.items())
    print(f"\ngarbage frames survived: {total} ({parts})")


@pytest.fixture(autouse=True)
def clean_knobs(monkeypatch):
    for name in ("PYCOLL_JOB_TOKEN", "PYCOLL_SOCKET_IFNAME", "PYCOLL_SOCKET_ADDR", "PYCOLL_MAX_MESSAGE",
                 "PYCOLL_STORE_HOST"):
        monkeypatch.delenv(name, raising=False)


def drain(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the other side sends until it closes (bounded)."""
    sock.settimeout(timeout)
    got = b""
    try:
        while True:
            part = sock.recv(65536)
            if not part:
                return got
            got += part
    except OSError:
        return got


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ----------------------------------------------------------------------------- store


def store_frame(op: int, key: bytes = b"", value: bytes = b"") -> bytes:
    return _REQ.pack(op, len(key), len(value)) + key + value


def authenticated_raw(port: int, token: str = TOKEN) -> socket.socket:
    """A raw socket that did the store handshake by hand (to send garbage as an authenticated client)."""
    sock = socket.create_connection((LOOPBACK, port), timeout=5)
    nonce = b"c" * store_mod.NONCE_BYTES
    sock.sendall(store_frame(store_mod.OP_HELLO, value=store_mod.MAGIC + nonce))
    reply = recv_n(sock, 5 + len(store_mod.MAGIC) + store_mod.NONCE_BYTES + store_mod.PROOF_BYTES)
    server_nonce = reply[5 + len(store_mod.MAGIC) : 5 + len(store_mod.MAGIC) + store_mod.NONCE_BYTES]
    proof = store_mod.auth_proof(token.encode(), b"store-client", server_nonce, nonce)
    sock.sendall(store_frame(store_mod.OP_AUTH, value=proof))
    assert recv_n(sock, 5)[0] == 0
    return sock


def recv_n(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            break
        data += part
    return data


def garbage_store_frames(rng: random.Random, count: int) -> list[tuple[str, bytes, bool]]:
    """(kind, bytes, whether to close right after sending without waiting for the server) per frame."""
    ops = store_mod
    kinds: list[Callable[[], tuple[str, bytes, bool]]] = [
        lambda: ("random bytes", rng.randbytes(rng.randint(_REQ.size, 4096)), False),
        lambda: ("random header", _REQ.pack(rng.randrange(256), rng.randrange(1 << 32), rng.randrange(1 << 32)), False),
        lambda: ("oversized value length", _REQ.pack(ops.OP_SET, 1, 1 << 31) + b"k", False),
        lambda: ("oversized key length", _REQ.pack(ops.OP_GET, 0xFFFFFFFF, 8), False),
        lambda: ("oversized hello", _REQ.pack(ops.OP_HELLO, 0, 1 << 31), False),
        lambda: ("hello too long", store_frame(ops.OP_HELLO, value=rng.randbytes(65)), False),
        lambda: ("truncated frame", store_frame(ops.OP_SET, b"key", b"value")[: rng.randint(1, 12)], True),
        lambda: ("truncated hello", store_frame(ops.OP_HELLO, value=ops.MAGIC + b"n" * 16)[: rng.randint(1, 30)], True),
        lambda: ("set before authenticating", store_frame(ops.OP_SET, b"job_id", b"evil"), False),
        lambda: ("get before authenticating", store_frame(ops.OP_GET, b"job_id", struct.pack("!d", 1.0)), False),
        lambda: ("auth before hello", store_frame(ops.OP_AUTH, value=rng.randbytes(32)), False),
        lambda: ("old protocol hello", store_frame(ops.OP_HELLO, value=b"pycoll-store/1"), False),
        lambda: ("hello with a bad magic", store_frame(ops.OP_HELLO, value=rng.randbytes(len(ops.MAGIC) + 16)), False),
        lambda: ("http request", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", False),
        lambda: ("nothing, then close", b"", True),
    ]
    return [rng.choice(kinds)() for _ in range(count)]


def send_and_close(port: int, data: bytes, close_at_once: bool) -> bytes:
    with socket.create_connection((LOOPBACK, port), timeout=5) as sock:
        try:
            sock.sendall(data)
        except OSError:
            pass  # the server may already have closed on the first bytes
        return b"" if close_at_once else drain(sock)


def wrong_token_handshake(port: int, token: str) -> bytes:
    """A well-formed hello and auth under the wrong token; returns the server's last reply."""
    with socket.create_connection((LOOPBACK, port), timeout=5) as sock:
        nonce = b"x" * 16
        sock.sendall(store_frame(store_mod.OP_HELLO, value=store_mod.MAGIC + nonce))
        reply = recv_n(sock, 5 + len(store_mod.MAGIC) + 16 + 32)
        server_nonce = reply[5 + len(store_mod.MAGIC) : 5 + len(store_mod.MAGIC) + 16]
        proof = store_mod.auth_proof(token.encode(), b"store-client", server_nonce, nonce)
        sock.sendall(store_frame(store_mod.OP_AUTH, value=proof))
        return drain(sock)


def test_store_survives_garbage(caplog):
    rng = random.Random(SEED)
    frames = garbage_store_frames(rng, 240)
    rss_before = max_rss_bytes()
    with TCPStoreServer(LOOPBACK, 0, token=TOKEN) as srv, caplog.at_level(logging.WARNING, logger="pycoll"):
        port = srv.address[1]
        legit = TCPStore(LOOPBACK, port, connect_timeout=10, token=TOKEN)
        sent = 0
        for i, (kind, data, close_at_once) in enumerate(frames):
            send_and_close(port, data, close_at_once)
            sent += 1
            legit.set(f"k{i}", kind.encode())  # the job's own client is unaffected
            assert legit.get(f"k{i}", 5.0) == kind.encode(), kind
            if i % 40 == 0:  # and new clients still get in
                with TCPStore(LOOPBACK, port, connect_timeout=10, token=TOKEN) as fresh:
                    assert fresh.add("fresh", 1) >= 1
            assert srv.is_serving(), f"the server thread died after {kind}"
        for i in range(30):  # replies to a wrong token: refused, say so, then close
            assert b"authentication" in wrong_token_handshake(port, f"guess-{i}")
            sent += 1
        for i in range(30):  # authenticated, then garbage: that connection only is closed
            sock = authenticated_raw(port)
            sock.sendall(rng.choice([_REQ.pack(250, 1, 1), _REQ.pack(1, 1, 1 << 31), rng.randbytes(9),
                                     store_frame(store_mod.OP_HELLO, value=b"again")]))
            reply = drain(sock)
            assert reply[:1] == bytes([store_mod.ST_PROTOCOL]), reply
            sock.close()
            sent += 1
        # every bad connection was closed and counted, from its own thread
        assert eventually(lambda: srv.refused == sent), (srv.refused, sent)
        assert srv.is_serving()
        assert legit.get("k0", 1.0) == frames[0][0].encode()
        assert "job_id" not in srv.keys()  # nothing written before authenticating
        legit.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "pycoll"]
    assert len(warnings) >= sent and all("127.0.0.1:" in w for w in warnings[:sent])
    assert any("wrong job token" in w for w in warnings)
    assert max_rss_bytes() - rss_before < 256 << 20  # no frame made the server allocate its announced size
    SURVIVED["store"] += sent
    print(f"garbage frames survived: {sent} (store)")


def test_store_many_concurrent_strangers():
    rng = random.Random(SEED + 1)
    with TCPStoreServer(LOOPBACK, 0, token=TOKEN) as srv:
        port = srv.address[1]
        frames = garbage_store_frames(rng, 96)
        errors: list[BaseException] = []

        def stranger(chunk: list[tuple[str, bytes, bool]]) -> None:
            try:
                for _, data, close_at_once in chunk:
                    send_and_close(port, data, close_at_once)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=stranger, args=(frames[i::8],)) for i in range(8)]
        for t in threads:
            t.start()
        with TCPStore(LOOPBACK, port, connect_timeout=10, token=TOKEN) as st:  # while they hammer it
            for i in range(50):
                st.set(f"k{i}", b"v")
                assert st.get(f"k{i}", 5.0) == b"v"
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert eventually(lambda: srv.refused == len(frames)), (srv.refused, len(frames))
        assert srv.is_serving()
    SURVIVED["store"] += len(frames)
    print(f"garbage frames survived: {len(frames)} (store, 8 threads)")


def test_idle_strangers_do_not_block_the_store(monkeypatch):
    monkeypatch.setattr(store_server, "HANDSHAKE_TIMEOUT", 1.0)
    monkeypatch.setattr(store_server, "MAX_UNAUTHENTICATED", 4)
    with TCPStoreServer(LOOPBACK, 0, token=TOKEN) as srv:
        port = srv.address[1]
        idle = [socket.create_connection((LOOPBACK, port), timeout=5) for _ in range(3)]
        t0 = time.monotonic()
        with TCPStore(LOOPBACK, port, connect_timeout=10, token=TOKEN) as st:  # a slot is still free
            st.set("a", b"1")
        assert time.monotonic() - t0 < 0.9  # did not wait for the idle ones
        # More half-open connections than allowed: the extra ones are closed at once ...
        idle += [socket.create_connection((LOOPBACK, port), timeout=5) for _ in range(3)]
        # ... the rest after the handshake timeout, and a client that found no slot retries until one frees.
        with TCPStore(LOOPBACK, port, connect_timeout=15, token=TOKEN) as st:
            assert st.get("a", 1.0) == b"1"
        for sock in idle:
            assert drain(sock, 5.0) == b""  # closed without a word
            sock.close()
        assert eventually(lambda: srv.refused >= 6)
        assert srv.is_serving()
    SURVIVED["store"] += 6
    print("garbage frames survived: 6 (store, idle strangers)")


# ----------------------------------------------------------------------------- transport set-up


def peer(rank: int, addr: Optional[list] = None) -> PeerInfo:
    return PeerInfo(rank=rank, host_id=f"h{rank}", hostname="test", pid=rank, transports=["tcp"],
                    addresses={"tcp": addr} if addr else {})


def exchange(ch_a: TcpChannel, ch_b: TcpChannel, payload: bytes) -> bytes:
    """Send payload from a to b over the non-blocking channels; return what b received."""
    view, got = memoryview(payload), bytearray()
    out = bytearray(len(payload))
    deadline = time.monotonic() + 10
    while len(got) < len(payload):
        if view:
            view = view[ch_a.send_some(view) :]
        n = ch_b.recv_some(memoryview(out)[: len(payload) - len(got)])
        got += out[:n]
        assert time.monotonic() < deadline, "no progress"
    return bytes(got)


def transport_garbage(rng: random.Random, port: int, key: bytes, count: int) -> int:
    """Send ``count`` bad handshakes to rank 0's listener; return how many were sent."""
    challenge_size = tcp._CHALLENGE.size

    def dial_with(proof_key: bytes, claimed: int, to_rank: int = 0) -> bytes:
        with socket.create_connection((LOOPBACK, port), timeout=5) as sock:
            _, _, their_nonce = tcp._CHALLENGE.unpack(recv_n(sock, challenge_size))
            nonce = rng.randbytes(16)
            proof = store_mod.auth_proof(proof_key, b"tcp-dial", their_nonce, nonce, tcp._RANKS.pack(claimed, to_rank))
            sock.sendall(tcp._DIAL.pack(tcp._MAGIC, claimed, to_rank, nonce, proof))
            return drain(sock)

    def replay() -> bytes:  # a proof made for another connection's nonce
        proof = store_mod.auth_proof(key, b"tcp-dial", b"n" * 16, b"d" * 16, tcp._RANKS.pack(1, 0))
        with socket.create_connection((LOOPBACK, port), timeout=5) as sock:
            recv_n(sock, challenge_size)
            sock.sendall(tcp._DIAL.pack(tcp._MAGIC, 1, 0, b"d" * 16, proof))
            return drain(sock)

    def raw(data: bytes, close_at_once: bool) -> bytes:
        with socket.create_connection((LOOPBACK, port), timeout=5) as sock:
            if not close_at_once:
                assert recv_n(sock, challenge_size).startswith(tcp._MAGIC)
            try:
                sock.sendall(data)
            except OSError:
                pass
            return b"" if close_at_once else drain(sock)

    kinds: list[Callable[[], bytes]] = [
        lambda: raw(rng.randbytes(rng.randint(len(tcp._MAGIC), 2048)), False),
        lambda: raw(b"\0" * 60, False),
        lambda: raw(rng.randbytes(1 << 20), False),  # oversized: refused at the first bytes
        lambda: raw(tcp._MAGIC + rng.randbytes(rng.randint(0, 40)), True),  # truncated dial, then close
        lambda: raw(b"", True),
        lambda: dial_with(b"wrong-token\0job", 1),
        lambda: dial_with(key, 1, to_rank=5),  # meant for another rank
        lambda: dial_with(key, 7),  # a rank that is not expected
        lambda: replay(),
    ]
    for _ in range(count):
        assert rng.choice(kinds)() == b""  # closed without an answer
    return count


def test_transport_setup_survives_strangers(caplog):
    rng = random.Random(SEED + 2)
    key = tcp._job_key("job-wire", TOKEN)
    t0, t1 = TcpTransport(token=TOKEN), TcpTransport(token=TOKEN)
    addr0 = t0.listen(peer(0), LOOPBACK)
    assert addr0[0] == LOOPBACK
    me0, me1 = peer(0, addr0), peer(1, t1.listen(peer(1), LOOPBACK))
    result: dict = {}

    def rank0() -> None:
        try:
            result["channels"] = t0.connect(me0, [me1], "job-wire", lambda name: None, 30)
        except BaseException as exc:
            result["error"] = exc

    with caplog.at_level(logging.WARNING, logger="pycoll"):
        acceptor = threading.Thread(target=rank0)
        acceptor.start()
        idle = [socket.create_connection((LOOPBACK, addr0[1]), timeout=5) for _ in range(4)]  # never say a word
        sent = transport_garbage(rng, addr0[1], key, 60)
        assert eventually(lambda: t0.refused == sent), (t0.refused, sent)
        started = time.monotonic()
        ch1 = t1.connect(me1, [me0], "job-wire", lambda name: None, 30)[0]
        assert time.monotonic() - started < tcp.HANDSHAKE_TIMEOUT / 2  # the idle strangers held no one up
        acceptor.join(30)
        for sock in idle:
            sock.close()
    assert "error" not in result, result.get("error")
    ch0 = result["channels"][1]
    try:
        assert exchange(ch1, ch0, b"hello rank 0" * 1000) == b"hello rank 0" * 1000
        assert exchange(ch0, ch1, b"and back") == b"and back"
    finally:
        ch0.close()
        ch1.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "pycoll" and r.levelno == logging.WARNING]
    assert len(warnings) >= sent and all("127.0.0.1:" in w for w in warnings)
    assert any("wrong job token" in w for w in warnings)
    SURVIVED["transport"] += sent
    print(f"garbage frames survived: {sent} (transport)")


def test_transport_refuses_a_rank_with_another_token(caplog):
    t0, t1 = TcpTransport(token=TOKEN), TcpTransport(token="another job")
    me0 = peer(0, t0.listen(peer(0), LOOPBACK))
    me1 = peer(1, t1.listen(peer(1), LOOPBACK))
    result: dict = {}

    def rank0() -> None:
        try:
            t0.connect(me0, [me1], "job", lambda name: None, 2.0)
        except BaseException as exc:
            result["error"] = exc

    with caplog.at_level(logging.WARNING, logger="pycoll"):
        acceptor = threading.Thread(target=rank0)
        acceptor.start()
        with pytest.raises(PeerFailureError, match="job token") as info:
            t1.connect(me1, [me0], "job", lambda name: None, 10)
        assert info.value.peers == (0,)
        acceptor.join(10)
    assert isinstance(result.get("error"), TimeoutError) and result["error"].peers == (1,)  # rank 1 never got in
    assert any("wrong job token" in r.getMessage() for r in caplog.records)


def test_lower_ranks_are_dialled_in_parallel(monkeypatch):
    """Rank 2 dials ranks 0 and 1 at once: while rank 0 is late to its accept loop, the dial to rank 1 completes, and
    rank 1 accepts rank 2 while its own dial to rank 0 waits."""
    spans: dict = {}
    real = TcpTransport._dial_and_prove

    def timed(self, my_rank, peer_info, key, deadline):
        start = time.monotonic()
        try:
            return real(self, my_rank, peer_info, key, deadline)
        finally:
            spans[(my_rank, peer_info.rank)] = (start, time.monotonic())

    monkeypatch.setattr(TcpTransport, "_dial_and_prove", timed)
    ts = [TcpTransport(token=TOKEN) for _ in range(3)]
    mes = [peer(r, ts[r].listen(peer(r), LOOPBACK)) for r in range(3)]
    result: dict = {}

    def rank(r: int, delay: float) -> None:
        time.sleep(delay)
        try:
            result[r] = ts[r].connect(mes[r], [m for m in mes if m.rank != r], "job-par", lambda name: None, 30)
        except BaseException as exc:
            result[r] = exc

    threads = [threading.Thread(target=rank, args=(r, 1.0 if r == 0 else 0.0)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(result[r], dict) and sorted(result[r]) == [q for q in range(3) if q != r] for r in range(3)), result
    assert spans[(2, 1)][1] < spans[(2, 0)][1] - 0.5  # rank 1 answered rank 2 long before late rank 0 did
    for chans in result.values():
        for ch in chans.values():
            ch.close()


# ----------------------------------------------------------------------------- established channels


def header(nbytes: int, ctx: int = 5, magic: int = p2p_protocol.MAGIC) -> bytes:
    return p2p_protocol.HEADER.pack(ctx, 0, nbytes, magic << 24, 0, 0, 0).ljust(p2p_protocol.HEADER_SIZE, b"\0")


@pytest.mark.parametrize(
    "frame, cause",
    [
        (header(1 << 62), "PYCOLL_MAX_MESSAGE"),
        (header(2**64 - 1), "PYCOLL_MAX_MESSAGE"),
        (header(1 << 30, ctx=p2p_protocol.CONTROL_CTX), "control message"),
        (header(16, magic=0x13), "bad magic"),
        (bytes(range(64)), "bad magic"),
    ],
    ids=["huge", "max-u64", "huge-control", "bad-magic", "garbage"],
)
def test_bad_header_closes_only_that_channel(frame, cause, caplog):
    a1, b1 = socket.socketpair()
    a2, b2 = socket.socketpair()
    engine = p2p.Engine(0, {1: TcpChannel(1, a1), 2: TcpChannel(2, a2)})
    rss_before = max_rss_bytes()
    with caplog.at_level(logging.WARNING, logger="pycoll"):
        b1.sendall(frame)
        deadline = time.monotonic() + 5
        while 1 not in engine.dead_peers() and time.monotonic() < deadline:
            engine.progress()  # never raises: the engine marks the peer dead
    assert cause in engine.dead_peers()[1] and "rank 1" in engine.dead_peers()[1]
    assert 2 not in engine.dead_peers()  # the other channel is untouched
    assert any("rank 1" in r.getMessage() and cause in r.getMessage() for r in caplog.records)
    assert max_rss_bytes() - rss_before < 64 << 20
    engine.close()
    for s in (b1, b2):
        s.close()
    SURVIVED["channel"] += 1


def test_frame_limit_knob(monkeypatch):
    monkeypatch.setenv("PYCOLL_MAX_MESSAGE", "1M")
    assert tcp.frame_limit() == 1 << 20
    monkeypatch.delenv("PYCOLL_MAX_MESSAGE")
    assert tcp.frame_limit() > 1 << 20  # this host's memory


# ----------------------------------------------------------------------------- interfaces


def test_listeners_bind_loopback_not_all_addresses():
    t = TcpTransport(token=TOKEN)
    try:
        host, _ = t.listen(peer(0), "")
        assert host == LOOPBACK and t._listener.getsockname()[0] == LOOPBACK
    finally:
        t.close()
    with TCPStoreServer() as srv:
        assert srv.address[0] == LOOPBACK


@pytest.mark.parametrize("spec", ["lo", "=lo", "lo,eth", "nosuchif,lo"])
def test_socket_ifname_picks_the_interface(monkeypatch, spec):
    monkeypatch.setenv("PYCOLL_SOCKET_IFNAME", spec)
    assert bs.interface_address() == ("lo", LOOPBACK)
    t = TcpTransport(token=TOKEN)
    try:
        host, _ = t.listen(peer(0), "192.0.2.1")  # a store address it must not use
        assert host == LOOPBACK and t._listener.getsockname()[0] == LOOPBACK
    finally:
        t.close()
    assert rendezvous._mpi_store_host(["host-a", "host-b"]) == LOOPBACK  # rank 0's store under mpiexec too


def test_socket_ifname_exclusion():
    names = {n for n, _ in [bs.interface_address("^nosuchif")]}
    assert names  # something is left when nothing is excluded
    try:
        name, addr = bs.interface_address("^lo")
    except InvalidArgumentError as exc:  # a host with loopback only
        assert "PYCOLL_SOCKET_IFNAME" in str(exc)
    else:
        assert name != "lo" and addr != LOOPBACK


@pytest.mark.parametrize("spec", ["nosuchif0", "=l", " , "])
def test_unknown_interface_is_invalid_argument(monkeypatch, spec):
    monkeypatch.setenv("PYCOLL_SOCKET_IFNAME", spec)
    with pytest.raises(InvalidArgumentError, match="PYCOLL_SOCKET_IFNAME"):
        TcpTransport(token=TOKEN).listen(peer(0), LOOPBACK)
