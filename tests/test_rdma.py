"""RDMA transport: selection and fallback, the channel over the fake NIC (in one process and between ranks),
pyverbs when installed, and real devices when `ibv_devices` lists one."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import shutil
import subprocess
import sys
import threading
import types
from typing import Iterator

import numpy as np
import pytest

import harness
from pycoll.errors import PeerFailureError
from pycoll.transport import PeerInfo, choose, make_transports, rdma_verbs
from pycoll.transport.rdma import RdmaChannel, RdmaTransport
from pycoll.transport.rdma_fake import FakeProvider
from pycoll.transport.rdma_memory import Region
from pycoll.transport.rdma_proto import NoRdma, PortInfo
from pycoll.transport.rdma_verbs import VerbsProvider, load_pyverbs

_jobs = itertools.count()


def rdma_device() -> str | None:
    """The first device `ibv_devices` lists, or None."""
    tool = shutil.which("ibv_devices")
    if tool is None:
        return None
    try:
        out = subprocess.run([tool], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split()[0] for line in out.splitlines()[2:] if line.strip()]
    return rows[0] if rows else None


NO_DEVICE = "no RDMA device here (`ibv_devices` lists none, or ibverbs-utils is not installed)"


def need_device() -> None:
    """Skip, saying why, unless this host has an RDMA device and pyverbs."""
    if rdma_device() is None:
        pytest.skip(NO_DEVICE)
    try:
        load_pyverbs()
    except NoRdma as exc:
        pytest.skip(f"an RDMA device but no pyverbs: {exc}")


# ---- an in-process pair of channels over the fake NIC ------------------------------------------


class _Store:
    """The two calls of the bootstrap store the transport uses, for two threads of one process."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cv = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._cv:
            self._data[key] = value
            self._cv.notify_all()

    def get(self, key: str, timeout: float) -> bytes:
        with self._cv:
            if not self._cv.wait_for(lambda: key in self._data, timeout):
                raise TimeoutError(key)
            return self._data[key]


@contextlib.contextmanager
def _pair(provider=FakeProvider) -> Iterator[tuple[list[RdmaTransport], RdmaChannel, RdmaChannel]]:
    """Transports for ranks 0 and 1 and the channels 0->1 and 1->0, connected through the fake NIC (or another
    provider: two queue pairs of one process then talk through the device's loopback)."""
    store, job = _Store(), f"t{os.getpid()}x{next(_jobs)}"
    ts = [RdmaTransport(provider()) for _ in range(2)]
    me = [PeerInfo(rank=r, host_id="h", hostname="h", pid=os.getpid(), transports=["rdma"]) for r in range(2)]
    for t, info in zip(ts, me):
        assert t.enabled(), t.reason
        t.store = store
        info.addresses["rdma"] = t.listen(info, "127.0.0.1")
    got: dict[int, object] = {}

    def run(r: int) -> None:
        try:
            got[r] = ts[r].connect(me[r], [me[1 - r]], job, lambda name: None, 20.0)
        except BaseException as exc:  # reported below
            got[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    try:
        for r in range(2):
            assert isinstance(got[r], dict), got[r]
        yield ts, got[0][1], got[1][0]  # type: ignore[index]
    finally:
        for t in ts:
            t.close()


@pytest.fixture
def small(monkeypatch):
    """Small rings and chunks, so that a few hundred KB wrap the ring many times."""
    for k, v in {"PYCOLL_IB_BUFFER": "64K", "PYCOLL_IB_CHUNK": "8K", "PYCOLL_IB_BOUNCE": "4",
                 "PYCOLL_IB_RECV_DEPTH": "6", "PYCOLL_IB_ZCOPY": "0", "PYCOLL_TOPO_DISCOVER": "0"}.items():
        monkeypatch.setenv(k, v)


def _pump(pairs, limit: int = 200000) -> None:
    """Move every (sender, data, receiver, out) until all outs are full; at most ``limit`` rounds."""
    state = [[0, 0] for _ in pairs]
    for _ in range(limit):
        busy = False
        for (tx, data, rx, out), st in zip(pairs, state):
            if st[0] < len(data):
                st[0] += tx.send_some(memoryview(data)[st[0] :])
                busy = True
            if st[1] < len(out):
                st[1] += rx.recv_some(memoryview(out)[st[1] :])
                busy = True
        if not busy:
            return
    raise AssertionError(f"transfer stalled: {state}")


def test_channel_moves_bytes_both_ways_through_small_rings(small):
    with _pair() as (ts, a, b):
        rng = np.random.default_rng(1)
        ab = rng.integers(0, 256, 700_000, dtype=np.uint8).tobytes()
        ba = rng.integers(0, 256, 300_001, dtype=np.uint8).tobytes()
        out_ab, out_ba = bytearray(len(ab)), bytearray(len(ba))
        _pump([(a, ab, b, out_ab), (b, ba, a, out_ba)])
        assert bytes(out_ab) == ab and bytes(out_ba) == ba
        # credit reports are batched: far fewer than the writes they answer
        assert a._credits.msgs > 80 and b.credit_writes < a._credits.msgs
        assert b._return.consumed == len(ab) and a._credits.acked <= len(ab)


def test_large_sends_go_direct_and_reuse_their_registration(small, monkeypatch):
    monkeypatch.setenv("PYCOLL_IB_ZCOPY", "32K")
    with _pair() as (ts, a, b):
        arr = np.arange(50_000, dtype=np.float32)  # 200 KB: direct, in 8 KB writes through a 64 KB ring
        for _ in range(3):  # a static shape, sent again and again
            out = np.zeros_like(arr)
            _pump([(a, memoryview(arr).cast("B"), b, memoryview(out).cast("B"))])
            assert np.array_equal(out, arr)
        nic = ts[0].nic
        assert nic.registered == 1 and ts[0].cache.hits == 2
        del arr
        gc.collect()  # the owner is gone: its registration is dropped (the address may be reused)
        assert len(ts[0].cache) == 0 and nic.deregistered == 1
        small_msg = b"x" * 100  # below the threshold: bounce blocks, no registration
        got = bytearray(100)
        _pump([(a, small_msg, b, got)])
        assert bytes(got) == small_msg and nic.registered == 1


def test_the_fake_nic_catches_a_source_changed_before_completion(small, monkeypatch):
    """Why a direct send counts as accepted only once complete: the device reads the buffer until then."""
    monkeypatch.setenv("PYCOLL_IB_ZCOPY", "32K")
    with _pair() as (ts, a, b):
        arr = np.ones(20_000, np.float32)
        assert a.send_some(memoryview(arr).cast("B")) == 0  # posted straight from the buffer, not complete yet
        arr[0] = 2  # what the engine never does before a send is complete
        with pytest.raises(PeerFailureError, match="source changed before its completion"):
            a.send_some(memoryview(arr).cast("B"))


def test_completion_error_names_the_peer(small):
    with _pair() as (ts, a, b):
        a._ep.fail("transport retry counter exceeded")  # what a vanished peer looks like to the sender
        with pytest.raises(PeerFailureError) as info:  # a queue pair in error still takes posts; they complete in error
            for _ in range(3):
                a.send_some(memoryview(b"hello"))
        assert info.value.peers == (1,) and "rank 1" in str(info.value) and "retry counter" in str(info.value)
        assert "rank 1" in (a.check_alive() or "")


def test_a_dead_peer_process_is_noticed(small):
    with _pair() as (ts, a, b):
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        a._ep._remote["pid"] = gone.pid  # the peer's process has exited
        reason = a.check_alive()
        assert reason is not None and "rank 1" in reason and "gone" in reason
        with pytest.raises(PeerFailureError):
            a.peek()


def test_close_reaches_the_peer_after_its_data(small):
    with _pair() as (ts, a, b):
        assert a.send_some(memoryview(b"last words")) == 10
        a.close()
        got = bytearray(10)
        assert b.recv_some(memoryview(got)) == 10 and bytes(got) == b"last words"
        with pytest.raises(PeerFailureError, match="closed its RDMA channel"):
            b.peek()
        assert b.closed_by_peer and "closed" in (b.check_alive() or "")


# ---- selection and fallback -----------------------------------------------------------------------


def test_rdma_sits_between_shm_and_tcp():
    assert [t.name for t in make_transports()] == ["self", "shm", "rdma", "tcp"]


def _info(rank, host, rdma=None):
    p = PeerInfo(rank=rank, host_id=host, hostname=host, pid=1, transports=["self", "shm", "rdma", "tcp"])
    p.addresses["tcp"] = ["127.0.0.1", 1]
    if rdma is not None:
        p.addresses["rdma"] = {"fabric": rdma}
    return p


def test_rdma_is_chosen_only_when_both_ends_share_a_fabric():
    ts = make_transports()
    a = _info(0, "host-a", "ib:fe80:0000:0000:0000")
    assert choose(ts, a, _info(1, "host-b", "ib:fe80:0000:0000:0000")).name == "rdma"
    assert choose(ts, a, _info(1, "host-a", "ib:fe80:0000:0000:0000")).name == "shm"  # same host: shared memory first
    assert choose(ts, a, _info(1, "host-b", "roce")).name == "tcp"  # another fabric
    assert choose(ts, a, _info(1, "host-b")).name == "tcp"  # the peer has no RDMA


def test_no_device_in_sysfs_is_no_rdma_without_importing_pyverbs(monkeypatch, tmp_path):
    monkeypatch.setattr(rdma_verbs, "SYSFS_IB", str(tmp_path / "missing"))
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # an import would fail loudly
    t = RdmaTransport()
    assert not t.enabled() and t.reason.startswith("no RDMA device (") and "missing" in t.reason


def test_without_pyverbs_the_transport_is_off_with_an_info_line(monkeypatch, caplog, tmp_path):
    (tmp_path / "mlx5_0").mkdir()
    monkeypatch.setattr(rdma_verbs, "SYSFS_IB", str(tmp_path))  # the kernel lists a device
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # `import pyverbs` fails
    monkeypatch.setenv("PYCOLL_IB_PYVERBS_PATH", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="pycoll"):
        t = RdmaTransport()
        assert not t.enabled()
    assert "pyverbs is not installed" in t.reason
    assert any("RDMA transport off: pyverbs is not installed" in r.getMessage() for r in caplog.records)
    assert t.connect(_info(0, "h"), [], "job", lambda name: None, 1.0) == {}  # still takes part in set-up


def test_get_device_list_raising_means_no_rdma(monkeypatch, caplog):
    """pyverbs raises from get_device_list when there is no device; that is "no RDMA here", not an error."""

    def get_device_list():
        raise RuntimeError("Failed to get devices list")

    fake = types.ModuleType("pyverbs")
    fake.__path__ = []  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pyverbs", fake)
    monkeypatch.setitem(sys.modules, "pyverbs.device", types.SimpleNamespace(get_device_list=get_device_list))
    monkeypatch.setitem(sys.modules, "pyverbs.enums", types.SimpleNamespace())
    with caplog.at_level(logging.INFO, logger="pycoll"):
        t = RdmaTransport(VerbsProvider(sysfs_first=False))
        assert not t.enabled()
    assert t.reason.startswith("no RDMA device (get_device_list: Failed to get devices list")
    assert any("RDMA transport off: no RDMA device" in r.getMessage() for r in caplog.records)


def test_hca_filter_that_matches_nothing(monkeypatch):
    monkeypatch.setenv("PYCOLL_IB_FAKE", "1")
    monkeypatch.setenv("PYCOLL_IB_HCA", "mlx5_0:1")
    t = RdmaTransport()
    assert not t.enabled() and "no active RDMA port matches PYCOLL_IB_HCA='mlx5_0:1' (ports: fake0:1 (active))" in t.reason
    monkeypatch.setenv("PYCOLL_IB_HCA", "mlx5_0:one")
    assert not t.enabled() and "is not valid" in t.reason
    monkeypatch.setenv("PYCOLL_IB_HCA", "=fake0")
    assert t.enabled()
    monkeypatch.setenv("PYCOLL_IB_DISABLE", "1")
    assert not t.enabled()


def test_installed_pyverbs_imports_and_reports_devices():
    """With python3-pyverbs installed: the verbs layer loads (also from a virtual environment), and no device
    is a clean NoRdma."""
    try:
        load_pyverbs()
    except NoRdma as exc:
        pytest.skip(f"pyverbs not available: {exc}")
    if rdma_device() is None:
        with pytest.raises(NoRdma, match="no RDMA device"):
            VerbsProvider(sysfs_first=False).ports()  # get_device_list itself raises, or returns nothing
    else:
        assert VerbsProvider().ports()


def test_pycoll_info_reports_rdma(monkeypatch):
    """`pycoll info`'s rdma line: the ports pycoll would use, or why RDMA is off."""
    from pycoll.cli import _rdma_status

    monkeypatch.setenv("PYCOLL_IB_DISABLE", "1")
    assert _rdma_status() == "off (PYCOLL_IB_DISABLE is set)"
    monkeypatch.delenv("PYCOLL_IB_DISABLE")
    monkeypatch.setenv("PYCOLL_IB_FAKE", "1")
    assert _rdma_status().startswith("fake0:1 (fake, lid 1, gid[0] ")


def _pyverbs():
    try:
        load_pyverbs()
    except NoRdma as exc:
        pytest.skip(f"pyverbs not available: {exc}")
    import pyverbs.enums as e

    return e


@pytest.mark.parametrize("layer", ["Ethernet", "InfiniBand"])
def test_queue_pair_attributes_with_real_pyverbs(layer, monkeypatch):
    """The thin layer's RTR/RTS attributes, built from real pyverbs objects (no device needed for these)."""
    _pyverbs()
    monkeypatch.setenv("PYCOLL_IB_TIMEOUT", "18")
    port = PortInfo("mlx5_0", 1, True, layer, lid=4, gid="fe80:0000:0000:0000:0000:0000:0000:0001", gid_index=3, fabric="x")
    remote = {"qpn": 77, "psn": 1234, "lid": 9, "gid": "0000:0000:0000:0000:0000:ffff:0a00:0002", "mtu": 3}
    attr = rdma_verbs.rts_attributes(port, 5, 4321, remote)
    assert (attr.dest_qp_num, attr.rq_psn, attr.sq_psn, attr.path_mtu) == (77, 1234, 4321, 3)  # the smaller MTU
    assert (attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.ah_attr.port_num) == (18, 7, 7, 1)
    if layer == "Ethernet":  # RoCE: a global route to the peer's GID from our chosen GID index
        ah = attr.ah_attr
        assert (ah.is_global, ah.sgid_index, ah.hop_limit, str(ah.dgid)) == (1, 3, 64, remote["gid"])
    else:  # InfiniBand: by LID
        assert (attr.ah_attr.is_global, attr.ah_attr.dlid) == (0, 9)


def test_write_requests_and_completions_with_real_pyverbs():
    e = _pyverbs()
    from pyverbs.cq import WC

    src = Region(0x10000, 4096, lkey=5, rkey=6)
    wr = rdma_verbs.write_request(11, src, 64, 100, 0x20000, 7, imm=100)
    assert (wr.wr_id, wr.opcode, wr.imm_data) == (11, e.IBV_WR_RDMA_WRITE_WITH_IMM, 100)
    assert rdma_verbs.write_request(12, src, 0, 24, 0x30000, 7, imm=None).opcode == e.IBV_WR_RDMA_WRITE
    got = rdma_verbs.completion(WC(wr_id=0, status=e.IBV_WC_SUCCESS, opcode=e.IBV_WC_RECV_RDMA_WITH_IMM, byte_len=100, imm_data=100))
    assert got.ok and got.recv and (got.imm, got.nbytes) == (100, 100)
    bad = rdma_verbs.completion(WC(wr_id=12, status=e.IBV_WC_RETRY_EXC_ERR, opcode=e.IBV_WC_RDMA_WRITE))
    assert not bad.ok and not bad.recv and bad.wr_id == 12 and bad.status == "transport retry counter exceeded"


# ---- ranks over the fake NIC, and over real devices -----------------------------------------------

_CASES = ["p2p.ring_send_recv", "p2p.large_bidirectional", "p2p.any_source_status", "reduce.allreduce",
          "repeated.allreduce_repeated"]
_SMALL = {"PYCOLL_IB_BUFFER": "256K", "PYCOLL_IB_CHUNK": "64K", "PYCOLL_IB_ZCOPY": "128K", "PYCOLL_DEBUG": "INFO"}


@pytest.mark.timeout(120)
def test_collectives_between_ranks_over_the_fake_nic(tmp_path):
    """Three ranks with shared memory off: every pair talks RDMA (fake NIC), rings wrapping, large sends direct."""
    env = dict(_SMALL, PYCOLL_IB_FAKE="1")
    res = harness.run_cases(3, _CASES, transport="tcp", out_dir=str(tmp_path), job_timeout=90, env=env)
    res.assert_ok()
    assert "0:self, 1:rdma, 2:rdma" in res.proc.stderr, res.proc.stderr[-3000:]


@pytest.mark.timeout(120)
def test_a_rank_dying_mid_allreduce_fails_the_others_not_hangs(tmp_path):
    """The last of three ranks exits during 4 MB Allreduces; the others raise errors naming it, well before
    their 120 s timeout."""
    env = dict(_SMALL, PYCOLL_IB_FAKE="1", PYCOLL_LAUNCH_GRACE="60")
    res = harness.run_cases(3, ["errors.dead_peer_midstream"], transport="tcp", out_dir=str(tmp_path), job_timeout=75,
                            comm_timeout=120, env=env)
    got = res.records("errors.dead_peer_midstream")
    assert got.get(2, {}).get("class") == "victim", res.report()
    for r in (0, 1):
        d = res.ranks.get(r) or {}
        assert d.get("finished") and not d.get("failures"), res.report()
        assert any(name in got[r].get("mro", [got[r].get("class")]) for name in ("PeerFailureError", "RemoteError")), got
    assert any(2 in (got[r].get("peers") or []) for r in (0, 1)), got
    assert "1:rdma, 2:rdma" in res.proc.stderr


@pytest.mark.timeout(150)
def test_virtual_hosts_use_rdma_between_them_and_shm_within(tmp_path):
    """Two network-namespace hosts of two ranks each: the fake NIC between hosts, shared memory within one."""
    why = harness.multihost_unavailable()
    if why is not None:
        pytest.skip(f"no virtual hosts here: {why}")
    env = dict(_SMALL, PYCOLL_IB_FAKE="1")
    res = harness.run_cases_on_hosts(["p2p.ring_send_recv", "reduce.allreduce"], hosts=2, n=4, env=env, job_timeout=120,
                                     out_dir=str(tmp_path))
    res.assert_ok()
    assert "0:self, 1:shm, 2:rdma, 3:rdma" in res.proc.stderr, res.proc.stderr[-3000:]
    assert "0:rdma, 1:rdma, 2:self, 3:shm" in res.proc.stderr


def test_channel_over_a_real_device(small, monkeypatch):
    """The in-process transfer of the first test, through a real device: two queue pairs on one port."""
    need_device()
    monkeypatch.setenv("PYCOLL_IB_ZCOPY", "32K")
    with _pair(VerbsProvider) as (ts, a, b):
        rng = np.random.default_rng(2)
        ab = rng.integers(0, 256, 700_000, dtype=np.uint8)  # direct (registered) sends
        ba = rng.integers(0, 256, 3_001, dtype=np.uint8).tobytes()  # bounce blocks
        out_ab, out_ba = bytearray(len(ab)), bytearray(len(ba))
        _pump([(a, memoryview(ab), b, out_ab), (b, ba, a, out_ba)])
        assert bytes(out_ab) == ab.tobytes() and bytes(out_ba) == ba


@pytest.mark.timeout(180)
def test_ranks_over_a_real_device(tmp_path):
    need_device()
    res = harness.run_cases(2, _CASES[:5], transport="tcp", out_dir=str(tmp_path), job_timeout=150, env=dict(_SMALL))
    res.assert_ok()
    assert "0:self, 1:rdma" in res.proc.stderr, res.proc.stderr[-3000:]
