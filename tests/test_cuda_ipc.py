"""CUDA IPC allreduce (one-shot, two-shot): selection, refusals, the IPC backends and mapping cache, and rank jobs.

The rank jobs run under numba's CUDA simulator, where the IPC buffers are shared-memory files (pycoll/cuda/ipc.py's
stand-in), so handle exchange, mapping cache, flags and kernels run across real processes; the ``gpu`` test runs the
same cases with real CUDA IPC and skips, saying why, where there is no device.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import harness
from pycoll.algorithms import ALGORITHMS, Call, CostModel, Layout, ranked, select
from pycoll.algorithms.cuda_ipc import IPC_BYTES
from pycoll.arrays import DeviceArray
from pycoll.cuda import ipc
from pycoll.ops import SUM
from test_device_buffers import SIM_ENV, _gpu_missing

IPC = ("ipc_oneshot", "ipc_twoshot")
MODEL = CostModel(cores=64)  # no oversubscription: the ranking of the algorithms themselves


def _device_call(nbytes: int) -> Call:
    """An allreduce on device buffers of ``nbytes`` (no memory behind them: selection reads sizes only)."""
    arr = DeviceArray(None, 1 << 40, 0, nbytes // 4, np.dtype(np.float32))
    return Call("allreduce", np.dtype(np.float32), arr, arr, SUM)


def _host_call(nbytes: int) -> Call:
    arr = np.zeros(nbytes // 4, np.float32)
    return Call("allreduce", np.dtype(np.float32), arr, arr, SUM)


# ---- registration, refusals, selection ---------------------------------------------------------------------------


def test_registered_for_device_buffers_only() -> None:
    for name in IPC:
        algo = ALGORITHMS["allreduce"][name]
        assert algo.memory == "cuda" and algo.cost is not None
        assert "device buffers only" in algo.refusal(_host_call(1024), Layout.flat(2))
        assert "more than one host" in algo.refusal(_device_call(1024), Layout((0, 0, 1, 1)))
        assert "one rank" in algo.refusal(_device_call(1024), Layout.flat(1))
        assert "PYCOLL_IPC_BYTES" in algo.refusal(_device_call(IPC_BYTES.get() + 4), Layout.flat(2))
        assert algo.refusal(_device_call(IPC_BYTES.get()), Layout.flat(8)) is None
    assert all(a.memory == "host" for n, a in ALGORITHMS["allreduce"].items() if n not in IPC)


def test_refusals_follow_the_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    algo = ALGORITHMS["allreduce"]["ipc_oneshot"]
    monkeypatch.setenv("PYCOLL_IPC_DISABLE", "1")
    assert "PYCOLL_IPC_DISABLE" in algo.refusal(_device_call(64), Layout.flat(2))
    monkeypatch.delenv("PYCOLL_IPC_DISABLE")
    monkeypatch.setenv("PYCOLL_ARENA_DISABLE", "1")
    assert "host arena" in algo.refusal(_device_call(64), Layout.flat(2))


def _best(nbytes: int, p: int, model: CostModel = MODEL, device: bool = True) -> str:
    call = _device_call(nbytes) if device else _host_call(nbytes)
    return ranked(call, Layout.flat(p), model)[0][1].name


def test_selection_one_shot_small_two_shot_medium_staged_large() -> None:
    for p in (4, 8):
        assert _best(4 << 10, p) == "ipc_oneshot"
        assert _best(1 << 20, p) == "ipc_twoshot"
        big = _best(64 << 20, p)  # past PYCOLL_IPC_BYTES: a host algorithm, staged
        assert big not in IPC and ALGORITHMS["allreduce"][big].memory == "host"
    # two ranks read the same bytes either way: one-shot has one meeting less
    assert {_best(n, 2) for n in (64, 64 << 10, 1 << 20, 8 << 20)} == {"ipc_oneshot"}
    # the crossover moves with the peer bandwidth (NVLink-class links favour one-shot longer)
    fast = dataclasses.replace(MODEL, ipc_GBps=150.0)
    assert _best(256 << 10, 4, fast) == "ipc_oneshot" and _best(256 << 10, 4) == "ipc_twoshot"


def test_host_calls_never_get_ipc_and_device_calls_pay_for_staging() -> None:
    for n in (64, 4 << 10, 1 << 20):
        host = ranked(_host_call(n), Layout.flat(4), MODEL)
        assert not any(a.name in IPC for _, a in host)
        device = dict((a.name, t) for t, a in ranked(_device_call(n), Layout.flat(4), MODEL))
        for t, a in host:
            assert device[a.name] == pytest.approx(t + MODEL.staging_s(n))
    # the selection cache keeps host and device calls of one size apart
    lay = Layout.flat(4)
    assert select(_device_call(4096), lay).name == select(_device_call(4096), lay).name
    assert select(_host_call(4096), lay).name not in IPC


def test_forcing_an_ipc_algorithm_falls_back_for_host_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYCOLL_ALGO", "allreduce:ipc_twoshot")
    assert select(_device_call(64), Layout.flat(3)).name == "ipc_twoshot"
    assert select(_host_call(64), Layout.flat(3)).name not in IPC


def test_topology_model_takes_the_gpu_link_for_ipc() -> None:
    from pycoll.perf.simulate import load_topology, placement_of

    topo = load_topology("dgx-h100")
    placement, _ = placement_of(topo, 8, "gpu", 0)
    model = CostModel.from_topology(topo, placement, "gpu")
    assert model.ipc_GBps == pytest.approx(model.shm_GBps) and model.ipc_GBps > CostModel().ipc_GBps
    assert model.latency_only.ipc_GBps == float("inf")


# ---- the IPC layer: slots, the mapping cache, the shared-memory stand-in ------------------------------------------


def test_slot_sizes() -> None:
    assert ipc.slot_bytes(0, 256, 4096) == 256
    assert ipc.slot_bytes(300, 256, 4096) == 512
    assert ipc.slot_bytes(4096, 256, 4096) == 4096
    assert ipc.slot_bytes(3000, 1024, 3000) == 3072  # capped at the limit, rounded up to the alignment
    assert ipc.slot_bytes(5, 64 << 10, 8 << 20) == 64 << 10


class _FakeBuf:
    def __init__(self, handle: bytes) -> None:
        self.handle, self.closed = handle, False

    def close(self) -> None:
        self.closed = True


class _FakeIpc:
    def __init__(self) -> None:
        self.opens: list[bytes] = []

    def open(self, handle: bytes) -> _FakeBuf:
        if handle == b"bad":
            raise ValueError("bad handle")
        self.opens.append(handle)
        return _FakeBuf(handle)


def test_mapping_cache_opens_once_per_peer_and_generation() -> None:
    fake = _FakeIpc()
    cache = ipc.MappingCache(fake)
    a = cache.get(1, 1, b"h1")
    assert cache.get(1, 1, b"ignored") is a and fake.opens == [b"h1"]  # cached: the handle is not opened again
    b = cache.get(2, 1, b"h2")
    c = cache.get(1, 2, b"h1'")
    assert cache.opened == 3 and len(cache) == 3 and cache.lookup(2, 1) is b
    assert cache.retire(2) == 2 and a.closed and b.closed and not c.closed and len(cache) == 1
    with pytest.raises(ValueError):
        cache.get(3, 2, b"bad")
    assert len(cache) == 1  # a failed open leaves nothing behind
    cache.drop(2)
    assert c.closed and len(cache) == 0
    d = cache.get(1, 3, b"h")
    cache.close()
    assert d.closed and len(cache) == 0


def test_shm_stand_in_shares_bytes_and_checks_handles(tmp_path) -> None:
    shm = ipc.ShmIpc(str(tmp_path))
    own = shm.allocate(4096)
    peer = shm.open(own.handle)
    try:
        own._host[:4] = [1, 2, 3, 4]
        assert list(peer._host[:4]) == [1, 2, 3, 4]  # one memory, two mappings
        assert peer.handle == b"" and os.path.exists(own.path)
        shm.published(own)
        assert not os.path.exists(own.path)  # the name goes once the peers have mapped it; the mappings stay
        own._host[4] = 9
        assert peer._host[4] == 9
        with pytest.raises(FileNotFoundError):
            shm.open(own.handle)
        for bad in (b"C" + own.handle[1:], b'S{"path": "/etc/passwd", "nbytes": 1}',
                    b'S{"path": "%s", "nbytes": 1}' % str(tmp_path / "other").encode()):
            with pytest.raises(ValueError):
                shm.open(bad)
    finally:
        peer.close()
        own.close()
    with pytest.raises(ValueError, match="not a CUDA IPC handle"):
        ipc.CudaIpc().open(own.handle)


def test_shm_stand_in_size_mismatch(tmp_path) -> None:
    shm = ipc.ShmIpc(str(tmp_path))
    own = shm.allocate(1024)
    forged = own.handle.replace(b'"nbytes": 1024', b'"nbytes": 2048')
    with pytest.raises(ValueError, match="has 1024 bytes"):
        shm.open(forged)
    own.close()
    shm.published(own)
    assert os.listdir(tmp_path) == []


# ---- rank jobs ------------------------------------------------------------------------------------------------------

CASES = ["cuda_ipc.allreduce", "cuda_ipc.same_bits_on_every_rank", "cuda_ipc.growth_and_limit", "cuda_ipc.nonblocking",
         "cuda_ipc.free", "cuda_ipc.setup_failure_stages_everywhere", "cuda_ipc.reproducible"]
ENV = {"PYCOLL_IPC_BYTES": "4K"}


def _check_mappings(res: harness.Result, n: int, backend: str) -> None:
    for r, rec in res.records("cuda_ipc.allreduce", "ipc").items():
        assert rec["backend"] == backend, (r, rec)
        assert rec["mapped"] == n - 1, (r, rec)  # one mapping per peer, of the generation in force
        assert rec["opened"] == rec["generation"] * (n - 1), (r, rec)  # each handle opened once per generation
        assert rec["slot"] >= 37 * 8, (r, rec)


@pytest.mark.ranks
@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", [2, 3, 4])  # 4 ranks on 2 cores in CI: two-shot blocks of every size
def test_ipc_allreduce_on_simulator(n: int, tmp_path) -> None:
    res = harness.run_cases(n, CASES, out_dir=str(tmp_path), env={**SIM_ENV, **ENV}, job_timeout=170)
    res.assert_ok()
    skipped = {r: d.get("skipped") for r, d in res.ranks.items() if d.get("skipped")}
    assert not skipped, skipped
    _check_mappings(res, n, "shm")
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("pycoll-ipc-")], "IPC files left behind"


@pytest.mark.ranks
@pytest.mark.timeout(90)
def test_ipc_late_peer_times_out(tmp_path) -> None:
    n, absent = 3, 2
    res = harness.run_cases(n, ["cuda_ipc.late_peer_times_out"], out_dir=str(tmp_path), env=SIM_ENV, job_timeout=60)
    res.assert_ok()
    got = res.records("cuda_ipc.late_peer_times_out")
    assert got.get(absent) == {"class": "absent"}, got
    for r in range(n - 1):
        info = got[r]
        assert info["class"] in ("TimeoutError", "RemoteError"), (r, info)
        assert "Allreduce" in (info["op"] or ""), (r, info)
    timeouts = [got[r] for r in range(n - 1) if got[r]["class"] == "TimeoutError"]
    assert timeouts and all(absent in t["peers"] for t in timeouts), got


@pytest.mark.ranks
@pytest.mark.timeout(90)
def test_ipc_mismatch_is_named(tmp_path) -> None:
    n = 3
    res = harness.run_cases(n, ["cuda_ipc.mismatch_is_named"], out_dir=str(tmp_path), env=SIM_ENV, job_timeout=60)
    res.assert_ok()
    got = res.records("cuda_ipc.mismatch_is_named")
    for r in range(n):
        info = got[r]
        assert "MismatchError" in info.get("mro", [info["class"]]), (r, info)
        assert "Allreduce" in (info["op"] or "") and "count=" in info["cause"], (r, info)


@pytest.mark.gpu
@pytest.mark.ranks
@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", [2, 4])
def test_ipc_allreduce_on_gpu(n: int, tmp_path) -> None:
    """Real CUDA IPC: 2 and 4 processes sharing the machine's GPU(s), the same cases."""
    why = _gpu_missing()
    if why:
        pytest.skip(why)
    env = {"NUMBA_ENABLE_CUDASIM": "0", **ENV}
    res = harness.run_cases(n, CASES, out_dir=str(tmp_path), env=env, job_timeout=500)
    res.assert_ok()
    _check_mappings(res, n, "cuda")
