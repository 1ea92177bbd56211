"""Tests of the start-up key-value store: TCPStoreServer, TCPStore, barrier and the torch wrapper."""

from __future__ import annotations

import builtins
import logging
import socket
import struct
import threading

import pytest

from pycoll.bootstrap import store as store_mod
from pycoll.bootstrap.store import barrier
from pycoll.bootstrap.store_client import TCPStore
from pycoll.bootstrap.store_server import TCPStoreServer
from pycoll.bootstrap.torch_store import TorchStore
from pycoll.errors import InvalidArgumentError, PeerFailureError, ProtocolError, TimeoutError

from harness import eventually

TOKEN = "test-token"


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch):
    monkeypatch.delenv("PYCOLL_JOB_TOKEN", raising=False)


@pytest.fixture
def server():
    with TCPStoreServer("127.0.0.1", 0) as srv:
        yield srv


def client(srv: TCPStoreServer, timeout: float = 10.0) -> TCPStore:
    host, port = srv.address
    return TCPStore(host, port, connect_timeout=timeout, token=srv.token)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(30)
def test_set_get_add_wait_check(server):
    with client(server) as st:
        st.set("a", b"hello")
        assert st.get("a", 1.0) == b"hello"
        st.set("a", b"")  # overwrite, empty value
        assert st.get("a", 1.0) == b""
        assert st.add("n", 5) == 5
        assert st.add("n", -2) == 3
        assert st.add("n", 0) == 3
        assert st.get("n", 1.0) == b"3"  # counters read back as decimal text
        st.wait(["a", "n"], 1.0)
        assert st.check(["a", "n"])
        assert not st.check(["a", "missing"])
        big = bytes(range(256)) * 4096
        st.set("big", big)
        assert st.get("big", 1.0) == big
        assert server.get_local("a") == b""
        assert sorted(server.keys()) == ["a", "big", "n"]


@pytest.mark.timeout(30)
def test_add_on_non_counter_is_invalid_argument(server):
    with client(server) as st:
        st.set("text", b"abc")
        with pytest.raises(InvalidArgumentError, match="text"):
            st.add("text", 1)
        assert st.get("text", 1.0) == b"abc"  # the connection is still usable


@pytest.mark.timeout(30)
def test_blocking_get_from_another_thread(server):
    got: list[bytes] = []
    with client(server) as waiter, client(server) as setter:
        t = threading.Thread(target=lambda: got.append(waiter.get("late", 20.0)))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not got  # still blocked: the key does not exist yet
        setter.set("late", b"now")
        t.join(20.0)
        assert got == [b"now"]


@pytest.mark.timeout(30)
def test_get_timeout_names_the_key(server):
    with client(server) as st:
        with pytest.raises(TimeoutError, match="'addr/3'") as info:
            st.get("addr/3", 0.2)
        assert isinstance(info.value, builtins.TimeoutError)
        assert info.value.op == "store get"
        st.set("after", b"1")  # the client survives a timeout
        assert st.get("after", 1.0) == b"1"


@pytest.mark.timeout(30)
def test_wait_timeout_names_missing_keys(server):
    with client(server) as st:
        st.set("k0", b"x")
        with pytest.raises(TimeoutError) as info:
            st.wait(["k0", "k1", "k2"], 0.2)
        assert "k1" in str(info.value) and "k2" in str(info.value) and "'k0'" not in str(info.value)


@pytest.mark.timeout(60)
def test_many_concurrent_clients(server):
    n = 48
    errors: list[BaseException] = []
    results: dict[int, list[bytes]] = {}

    def rank(r: int) -> None:
        try:
            with client(server) as st:
                st.set(f"v/{r}", str(r).encode())
                st.add("count", 1)
                results[r] = [st.get(f"v/{i}", 30.0) for i in range(n)]
                barrier(st, "one", n, 30.0)
                barrier(st, "two", n, 30.0)
        except BaseException as exc:  # collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)
    assert not errors, errors
    expected = [str(i).encode() for i in range(n)]
    assert all(results[r] == expected for r in range(n))
    assert server.get_local("count") == str(n).encode()
    assert server.get_local("barrier/two/count") == str(n).encode()


@pytest.mark.timeout(30)
def test_barrier_timeout_says_how_many_arrived(server):
    with client(server) as st:
        with pytest.raises(TimeoutError, match="1 of 3 ranks arrived"):
            barrier(st, "lonely", 3, 0.2)


@pytest.mark.timeout(30)
def test_malformed_frame_from_client_gets_error_and_server_survives(server):
    host, port = server.address
    with socket.create_connection((host, port), timeout=10) as raw:
        raw.sendall(struct.pack("!BII", 99, 1, 0) + b"k")  # unknown op
        head = raw.recv(5)
        assert head[0] == 3  # protocol error status
        while raw.recv(4096):  # the server then closes the connection
            pass
    with socket.create_connection((host, port), timeout=10) as raw:
        raw.sendall(struct.pack("!BII", 1, 0xFFFFFFFF, 0))  # absurd key length
        assert raw.recv(5)[0] == 3
    with client(server) as st:  # other clients are unaffected
        st.set("ok", b"1")
        assert st.get("ok", 1.0) == b"1"


def _recv_n(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            break
        data += part
    return data


def _fake_server(reply: bytes, after_hello: bool, token: str = TOKEN):
    """A listener that answers the first request (or the one after a valid handshake) with ``reply``."""
    lsock = socket.create_server(("127.0.0.1", 0))
    key = token.encode()

    def serve() -> None:
        conn, _ = lsock.accept()
        with conn:
            if after_hello:  # the real challenge-response, as a TCPStoreServer with ``token`` does it
                magic = store_mod.MAGIC
                hello = _recv_n(conn, 9 + len(magic) + 16)
                client_nonce, server_nonce = hello[-16:], b"s" * 16
                proof = store_mod.auth_proof(key, b"store-server", client_nonce, server_nonce)
                conn.sendall(struct.pack("!BI", 0, len(magic) + 48) + magic + server_nonce + proof)
                _recv_n(conn, 9 + 32)
                conn.sendall(struct.pack("!BI", 0, 0))
            conn.recv(4096)
            conn.sendall(reply)
        lsock.close()

    threading.Thread(target=serve, daemon=True).start()
    return lsock.getsockname()[1]


@pytest.mark.timeout(30)
def test_garbage_handshake_raises_peer_failure():
    port = _fake_server(b"HTTP/1.1 400 Bad Request\r\n\r\n", after_hello=False)
    with pytest.raises(PeerFailureError, match="not a working pycoll store"):
        TCPStore("127.0.0.1", port, connect_timeout=10, token=TOKEN)


@pytest.mark.timeout(30)
def test_malformed_reply_raises_peer_failure():
    port = _fake_server(struct.pack("!BI", 77, 0), after_hello=True)
    st = TCPStore("127.0.0.1", port, connect_timeout=10, token=TOKEN)
    with pytest.raises(ProtocolError, match="malformed"):
        st.get("x", 1.0)
    with pytest.raises(PeerFailureError, match="closed"):  # the broken connection is not reused
        st.set("x", b"1")


@pytest.mark.timeout(30)
def test_reply_cut_short_raises_peer_failure():
    port = _fake_server(struct.pack("!BI", 0, 100) + b"short", after_hello=True)
    st = TCPStore("127.0.0.1", port, connect_timeout=10, token=TOKEN)
    with pytest.raises(PeerFailureError):
        st.get("x", 1.0)


@pytest.mark.timeout(30)
def test_stopped_server_raises_peer_failure_in_blocked_and_later_calls():
    srv = TCPStoreServer()
    srv.start()
    blocked, later = client(srv), client(srv)
    caught: list[BaseException] = []

    def wait_forever() -> None:
        try:
            blocked.get("never", 20.0)
        except BaseException as exc:
            caught.append(exc)

    t = threading.Thread(target=wait_forever)
    t.start()
    t.join(0.2)
    srv.stop()
    t.join(20.0)
    assert len(caught) == 1 and isinstance(caught[0], PeerFailureError), caught
    with pytest.raises(PeerFailureError):
        later.set("x", b"1")


@pytest.mark.timeout(30)
def test_client_retries_until_the_server_starts():
    port = free_port()
    srv = TCPStoreServer("127.0.0.1", port)
    timer = threading.Timer(0.5, srv.start)
    timer.start()
    try:
        with TCPStore("127.0.0.1", port, connect_timeout=20, token=srv.token) as st:
            st.set("k", b"v")
            assert srv.get_local("k") == b"v"
    finally:
        timer.join()
        srv.stop()


@pytest.mark.timeout(30)
def test_connect_timeout_raises_pycoll_timeout():
    port = free_port()
    with pytest.raises(TimeoutError, match=f"127.0.0.1:{port}"):
        TCPStore("127.0.0.1", port, connect_timeout=0.5, token=TOKEN)


@pytest.mark.timeout(30)
def test_bad_keys_are_invalid_arguments(server):
    with client(server) as st:
        with pytest.raises(InvalidArgumentError):
            st.set("", b"x")
        with pytest.raises(InvalidArgumentError):
            st.set("k" * 5000, b"x")


@pytest.mark.timeout(30)
def test_server_port_in_use_raises_peer_failure(server):
    _, port = server.address
    with pytest.raises(PeerFailureError, match=str(port)):
        TCPStoreServer("127.0.0.1", port).start()


@pytest.mark.timeout(30)
def test_stop_is_idempotent_and_wait_idle():
    srv = TCPStoreServer()
    srv.start()
    st = client(srv)
    assert not srv.wait_idle(0.1)
    st.close()
    assert srv.wait_idle(10.0)
    srv.stop()
    srv.stop()


# ----------------------------------------------------------------------------- job token


@pytest.mark.timeout(30)
def test_wrong_token_is_refused_and_logged(caplog):
    with TCPStoreServer("127.0.0.1", 0, token=TOKEN) as srv, caplog.at_level(logging.WARNING, logger="pycoll"):
        host, port = srv.address
        with pytest.raises(PeerFailureError, match="PYCOLL_JOB_TOKEN differs") as info:
            TCPStore(host, port, connect_timeout=10, token="not-the-job-token")
        assert info.value.op == "store connect"
        with TCPStore(host, port, connect_timeout=10, token=TOKEN) as st:  # the job goes on
            st.set("k", b"v")
            assert st.get("k", 1.0) == b"v"
        assert eventually(lambda: srv.refused == 1) and srv.is_serving()
    assert any("127.0.0.1" in r.getMessage() and "handshake" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(30)
def test_client_needs_a_token(monkeypatch):
    with TCPStoreServer("127.0.0.1", 0, token=TOKEN) as srv:
        with pytest.raises(InvalidArgumentError, match="PYCOLL_JOB_TOKEN"):
            TCPStore(*srv.address, connect_timeout=5)
        monkeypatch.setenv("PYCOLL_JOB_TOKEN", TOKEN)  # the environment supplies it
        with TCPStore(*srv.address, connect_timeout=5) as st:
            st.set("k", b"v")


@pytest.mark.timeout(30)
def test_server_token_defaults(monkeypatch):
    a, b = TCPStoreServer(), TCPStoreServer()
    assert a.token and b.token and a.token != b.token and len(a.token) == 64  # fresh, random
    monkeypatch.setenv("PYCOLL_JOB_TOKEN", "from-env")
    assert TCPStoreServer().token == "from-env"
    with pytest.raises(InvalidArgumentError, match="empty"):
        TCPStoreServer(token="")


@pytest.mark.timeout(30)
def test_server_binds_loopback_by_default():
    with TCPStoreServer() as srv:
        assert srv.address[0] == "127.0.0.1"


@pytest.mark.timeout(60)
def test_torch_store_wrapper():
    pytest.importorskip("torch.distributed", reason="torch is not installed")
    port = free_port()
    st = TorchStore.connect("127.0.0.1", port, world_size=1, is_master=True, timeout=20)
    try:
        st.set("a", b"1")
        assert st.get("a", 5.0) == b"1"
        assert st.add("c", 2) == 2 and st.add("c", 3) == 5
        assert st.check(["a"]) and not st.check(["zz"])
        with pytest.raises(TimeoutError, match="'zz'"):
            st.get("zz", 0.0)
        with pytest.raises(TimeoutError, match="zz"):
            st.wait(["a", "zz"], 0.2)
        assert st._store.get("pycoll/a") == b"1"  # keys carry the pycoll/ prefix in torch's store
        barrier(st, "b", 1, 5.0)
    finally:
        st.close()
