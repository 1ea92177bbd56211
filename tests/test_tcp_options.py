"""The TCP connections' congestion control as PYCOLL_TCP_CONGESTION says: the host's by default (``system``), with
``auto`` cubic (else reno) in place of BBR and the host's choice otherwise, else the first of its names the kernel
lets the socket use; on loopback sockets and on a job's own connections."""

from __future__ import annotations

import json
import socket
import textwrap
from pathlib import Path

import pytest

from harness import run_script
from pycoll.transport import tcp_options

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="this platform has no TCP_CONGESTION")


def _algorithm(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()


def _usable(name: str) -> bool:
    """Whether a fresh socket of this process may use ``name`` (asked of the kernel, not of the code under test)."""
    with socket.socket() as s:
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
        except OSError:
            return False
        return _algorithm(s) == name


def _system() -> str:
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        return f.read().strip()


@pytest.fixture
def connected():
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        yield client, accepted
        client.close()
        accepted.close()


@pytest.fixture(autouse=True)
def _fresh_knowledge(monkeypatch):
    monkeypatch.setattr(tcp_options, "_congestion_ok", {})


def test_auto_has_bbr_give_way_to_cubic_or_reno(connected, monkeypatch) -> None:
    monkeypatch.setenv("PYCOLL_TCP_CONGESTION", "auto")
    if not _usable("bbr"):
        pytest.skip("this kernel lets this process use no BBR")
    want = next((n for n in ("cubic", "reno") if _usable(n)), None)
    if want is None:
        pytest.skip("this kernel lets this process use neither cubic nor reno")
    for sock in connected:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"bbr")
        assert tcp_options.set_congestion(sock) == want
        assert _algorithm(sock) == want


def test_under_auto_another_choice_of_the_host_stays(connected, monkeypatch) -> None:
    monkeypatch.setenv("PYCOLL_TCP_CONGESTION", "auto")
    if not _usable("reno"):
        pytest.skip("reno is not usable here")
    client, _ = connected
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"reno")
    assert tcp_options.set_congestion(client) is None
    assert _algorithm(client) == "reno"


@pytest.mark.parametrize("setting", ["system", None])  # None: the default
def test_system_leaves_the_systems_choice(connected, monkeypatch, setting) -> None:
    if setting is None:
        monkeypatch.delenv("PYCOLL_TCP_CONGESTION", raising=False)
    else:
        monkeypatch.setenv("PYCOLL_TCP_CONGESTION", setting)
    client, _ = connected
    before = _algorithm(client)
    assert before == _system()
    assert tcp_options.set_congestion(client) is None
    assert _algorithm(client) == before


def test_an_algorithm_the_kernel_lacks_is_passed_over_and_remembered(connected, monkeypatch) -> None:
    if not _usable("reno"):
        pytest.skip("reno is not usable here")
    monkeypatch.setenv("PYCOLL_TCP_CONGESTION", "no-such-algorithm,reno")
    client, accepted = connected
    assert tcp_options.set_congestion(client) == "reno" and _algorithm(client) == "reno"
    assert tcp_options._congestion_ok == {"no-such-algorithm": False, "reno": True}
    assert tcp_options.set_congestion(accepted) == "reno" and _algorithm(accepted) == "reno"


_RANK = textwrap.dedent("""
    import json, socket, sys
    from pycoll import MPI
    comm = MPI.COMM_WORLD
    socks = {p: ch.sock for p, ch in comm._engine.channels.items() if getattr(ch, "sock", None) is not None}
    got = {p: s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\\0").decode() for p, s in socks.items()}
    with open(f"{sys.argv[1]}/cc{comm.Get_rank()}.json", "w") as f:
        json.dump(got, f)
""")


@pytest.mark.parametrize("setting", ["reno", "system", "auto"])
def test_a_jobs_connections_take_the_setting(tmp_path: Path, setting: str) -> None:
    if setting == "reno" and not _usable("reno"):
        pytest.skip("reno is not usable here")
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    proc = run_script(3, script, [str(tmp_path)], env={"PYCOLL_SHM_DISABLE": "1", "PYCOLL_TCP_CONGESTION": setting},
                      timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    system = _system()
    if setting == "auto" and system.startswith("bbr"):
        want = next((n for n in ("cubic", "reno") if _usable(n)), system)
    else:
        want = "reno" if setting == "reno" else system
    for rank in range(3):
        got = json.loads((tmp_path / f"cc{rank}.json").read_text())
        assert sorted(map(int, got)) == [p for p in range(3) if p != rank], got  # a TCP connection to each peer
        assert set(got.values()) == {want}, (rank, got)
