"""The topology in the running job: per-rank devices, the merged cluster, ring order in algorithms, the NIC TCP uses."""

from __future__ import annotations

import itertools
import json
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest

import harness
from pycoll import ops, runtime
from pycoll.algorithms import ALGORITHMS, Call, Layout
from pycoll.algorithms.base import offsets
from pycoll.algorithms.cost import CostModel
from pycoll.algorithms.simulate import run_schedules
from pycoll.netns import unavailable
from pycoll.topology import Device, Topology, cli, comm_ring, fixtures, live, rings
from pycoll.topology.model import Nic, PathType, PciNode
from pycoll.transport.tcp import TcpTransport


@pytest.fixture(autouse=True)
def _fresh_local_topology():
    live.reset()
    yield
    live.reset()


def _crossings(host_of, order) -> int:
    return sum(host_of[order[i]] != host_of[order[(i + 1) % len(order)]] for i in range(len(order)))


# ---- Layout and the cost model ----------------------------------------------------------------------


def test_layout_ring_is_a_normalised_permutation() -> None:
    assert Layout((0, 0, 1), (0, 1, 2)) == Layout((0, 0, 1)) and Layout((0, 0, 1), (0, 1, 2)).ring == ()
    assert hash(Layout((0, 1), (0, 1))) == hash(Layout((0, 1)))
    lay = Layout.from_ids(["a", "b", "a", "b"], [0, 2, 1, 3])
    assert lay.ring == (0, 2, 1, 3) and lay.order == (0, 2, 1, 3) and lay != Layout.from_ids(["a", "b", "a", "b"])
    assert Layout.flat(3).order == (0, 1, 2)
    for bad in ((0, 0, 1), (0, 1), (1, 2, 3)):
        with pytest.raises(ValueError):
            Layout((0, 0, 0), bad)
    # a sublayout keeps the parent's order among its members, renumbered
    assert lay.sub([3, 0, 1]).ring == (1, 2, 0)
    assert lay.sub([0, 2]).ring == ()  # 0 then 2 is member order already


def test_cost_model_counts_host_crossings_along_the_ring() -> None:
    m = CostModel()
    flat = Layout((0, 1, 0, 1))
    ringed = Layout((0, 1, 0, 1), (0, 2, 1, 3))
    n = 8 << 20
    assert m.ring(flat, 6, n) == m.phase(flat, 6, n, flows=2)  # rank order leaves each host twice
    assert m.ring(ringed, 6, n) == m.phase(ringed, 6, n, flows=1)  # hosts contiguous: once
    assert m.ring(ringed, 6, n) < m.ring(flat, 6, n)
    blocks = Layout((0, 0, 1, 1))
    assert m.ring(blocks, 6, n) == m.phase(blocks, 6, n, flows=1)


# ---- ring algorithms under arbitrary ring orders (in-process schedule checker) ----------------------------------


def _data(rng, n: int, dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    return rng.uniform(0.5, 1.5, n).astype(dt) if dt.kind == "f" else rng.integers(0, 50, n).astype(dt)


def _reference(op, arrays):
    acc = arrays[0].copy()
    for a in arrays[1:]:
        op.ufunc(acc, a, out=acc)
    return acc / acc.dtype.type(len(arrays)) if op.averages else acc


def _close(got, want, label) -> None:
    if got.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=label)
    else:
        np.testing.assert_array_equal(got, want, err_msg=label)


def _perm(p: int, rng) -> tuple[int, ...]:
    while True:
        perm = tuple(int(r) for r in rng.permutation(p))
        if perm != tuple(range(p)):
            return perm


def _ring_layouts(p: int, rng) -> list[Layout]:
    """Random rings on one host, and on 2-3 interleaved hosts (random, and contiguous as the runtime makes them)."""
    out = [Layout((0,) * p, _perm(p, rng)) for _ in range(2)]
    if p >= 3:
        out.append(Layout(tuple(r % 2 for r in range(p)), _perm(p, rng)))
        interleaved = tuple(r % 3 for r in range(p))
        out.append(Layout(interleaved, tuple(sorted(range(p), key=lambda r: (interleaved[r], r)))))
    return out


def _ring_pairs(lay: Layout) -> set[tuple[int, int]]:
    o = lay.order
    return {(o[i], o[(i + 1) % len(o)]) for i in range(len(o))} | {(o[(i + 1) % len(o)], o[i]) for i in range(len(o))}


def _sent_pairs(net) -> set[tuple[int, int]]:
    return {(k[0], k[1]) for k in net.sends}


WALKERS = {("allreduce", "ring"), ("reduce_scatter", "ring"), ("allgather", "ring"), ("broadcast", "chain"),
           ("reduce", "chain")}


@pytest.mark.parametrize("p", range(2, 8))
def test_every_algorithm_is_right_under_a_permuted_ring(p: int) -> None:
    """Every allreduce, reduce-scatter, allgather, broadcast and reduce algorithm on layouts with random rings,
    against NumPy (odd counts, in place, pipelined chunks); the ring ones send only to ring neighbours."""
    rng = np.random.default_rng(1000 + p)
    for lay in _ring_layouts(p, rng):
        for coll, algos in (("allreduce", ALGORITHMS["allreduce"]), ("reduce_scatter", ALGORITHMS["reduce_scatter"]),
                            ("allgather", ALGORITHMS["allgather"]), ("broadcast", ALGORITHMS["broadcast"]),
                            ("reduce", ALGORITHMS["reduce"])):
            for name, algo in algos.items():
                for dtype, op, in_place, chunk in itertools.product(
                        (np.float64, np.int32), (ops.SUM, ops.MAX), (False, True), (64, 1 << 20)):
                    net = _run_one(coll, algo, lay, p, rng, dtype, op, in_place, chunk)
                    if net is not None and (coll, name) in WALKERS and chunk == 64:
                        assert _sent_pairs(net) <= _ring_pairs(lay), (coll, name, lay, _sent_pairs(net))


def _run_one(coll, algo, lay, p, rng, dtype, op, in_place, chunk):
    label = f"{coll}:{algo.name} p={p} {lay} {np.dtype(dtype)} {op.name} in_place={in_place} chunk={chunk}"
    dt = np.dtype(dtype)
    if coll == "allreduce":
        n = 13 * p + 5
        inputs = [_data(rng, n, dtype) for _ in range(p)]
        sends = [a.copy() for a in inputs]
        recvs = [s if in_place else np.full(n, 77, dtype) for s in sends]
        calls = [Call(coll, dt, sends[r], recvs[r], op, in_place=in_place) for r in range(p)]
        if algo.refusal(calls[0], lay) is not None:
            return None
        net = run_schedules(algo, calls, lay, chunk_bytes=chunk)
        want = _reference(op, inputs)
        for r in range(p):
            _close(recvs[r], want, f"{label} rank {r}")
        return net
    if coll == "reduce_scatter":
        counts = [3 + (r % 3) for r in range(p)]
        total = sum(counts)
        inputs = [_data(rng, total, dtype) for _ in range(p)]
        sends = [a.copy() for a in inputs]
        recvs = [s if in_place else np.full(counts[r] + 2, 77, dtype) for r, s in enumerate(sends)]
        calls = [Call(coll, dt, sends[r] if not in_place else recvs[r][:total], recvs[r], op, counts=counts,
                      in_place=in_place) for r in range(p)]
        if algo.refusal(calls[0], lay) is not None:
            return None
        net = run_schedules(algo, calls, lay, chunk_bytes=chunk)
        want, d = _reference(op, inputs), offsets(counts)
        for r in range(p):
            _close(recvs[r][: counts[r]], want[d[r]: d[r] + counts[r]], f"{label} rank {r}")
            if not in_place:
                assert (recvs[r][counts[r]:] == 77).all(), label
        return net
    if coll == "allgather":
        counts = [5 + (r % 2) for r in range(p)]
        displs = [d + 2 * i for i, d in enumerate(offsets(counts))]
        size = displs[-1] + counts[-1] + 2
        blocks = [_data(rng, counts[r], dtype) for r in range(p)]
        recvs = [np.full(size, 77, dtype) for _ in range(p)]
        sends = []
        for r in range(p):
            if in_place:
                recvs[r][displs[r]: displs[r] + counts[r]] = blocks[r]
            sends.append(None if in_place else blocks[r].copy())
        calls = [Call(coll, dt, sends[r], recvs[r], counts=counts, displs=displs, in_place=in_place) for r in range(p)]
        if algo.refusal(calls[0], lay) is not None:
            return None
        net = run_schedules(algo, calls, lay, chunk_bytes=chunk)
        want = np.full(size, 77, dtype)
        for r in range(p):
            want[displs[r]: displs[r] + counts[r]] = blocks[r]
        for r in range(p):
            np.testing.assert_array_equal(recvs[r], want, err_msg=f"{label} rank {r}")
        return net
    root = int(rng.integers(p))
    n = 21
    if coll == "broadcast":
        if in_place or op is not ops.SUM:
            return None
        data = _data(rng, n, dtype)
        bufs = [data.copy() if r == root else np.full(n, 77, dtype) for r in range(p)]
        net = run_schedules(algo, [Call(coll, dt, recv=bufs[r], root=root) for r in range(p)], lay, chunk_bytes=chunk)
        for r in range(p):
            np.testing.assert_array_equal(bufs[r], data, err_msg=f"{label} root {root} rank {r}")
        return net
    if in_place:
        return None
    inputs = [_data(rng, n, dtype) for _ in range(p)]
    recv = np.full(n, 77, dtype)
    calls = [Call(coll, dt, inputs[r].copy(), recv if r == root else None, op, root=root) for r in range(p)]
    net = run_schedules(algo, calls, lay, chunk_bytes=chunk)
    _close(recv, _reference(op, inputs), f"{label} root {root}")
    return net


# ---- rings from a topology -----------------------------------------------------------------------------


def test_comm_ring_keeps_cpu_hosts_in_rank_order_and_hosts_contiguous() -> None:
    cpu = fixtures.load("cpu-2socket")
    devs = [Device(0, "cpu", n) for n in (1, 0, 1, 0, 1)]
    assert comm_ring(cpu, devs) == [0, 1, 2, 3, 4]  # one CPU host: rank order, whatever the NUMA nodes
    two = Topology.cluster(cpu, 3)
    hosts = [0, 1, 0, 2, 1, 0, 2]
    devs = [Device(h, "cpu", 0) for h in hosts]
    order = comm_ring(two, devs)
    assert [hosts[i] for i in order] == sorted(hosts) and order == sorted(range(7), key=lambda r: (hosts[r], r))
    assert _crossings(hosts, order) == 3 < _crossings(hosts, list(range(7)))


def test_comm_ring_follows_gpu_links_and_pycoll_topo_prints_it(capsys: pytest.CaptureFixture) -> None:
    pcie = fixtures.load("pcie-4gpu")
    assert comm_ring(pcie, pcie.place(4, "gpu")) == [0, 2, 1, 3]
    dgx2 = fixtures.load("cluster-2x-dgx-h100")
    devs = [Device(r % 2, "gpu", r // 2) for r in range(16)]  # hosts interleaved A, B, A, B...
    order = comm_ring(dgx2, devs)
    assert _crossings([d.host for d in devs], order) == 2
    assert cli.comm_ring is rings.comm_ring and runtime.comm_ring is rings.comm_ring  # one function for both
    cli.report(pcie, np=4)
    assert "0(GPU0) 2(GPU2) 1(GPU1) 3(GPU3)" in capsys.readouterr().out


# ---- this rank's device and NIC ---------------------------------------------------------------------------


def test_own_device_from_cuda_conventions_and_affinity() -> None:
    dgx = fixtures.load("dgx-h100").hosts[0]
    assert live.own_gpu(dgx, 3, {}) == 3
    assert live.own_gpu(dgx, 11, {}) == 3  # local rank modulo the GPUs
    assert live.own_gpu(dgx, None, {}) is None  # no launcher local rank: unknown
    assert live.own_gpu(dgx, 5, {"CUDA_VISIBLE_DEVICES": "6"}) == 6  # one visible GPU per rank
    assert live.own_gpu(dgx, 1, {"CUDA_VISIBLE_DEVICES": "4,5,6"}) == 5
    assert live.own_gpu(dgx, None, {"CUDA_VISIBLE_DEVICES": "4,5"}) == 4
    assert live.own_gpu(dgx, 0, {"CUDA_VISIBLE_DEVICES": ""}) is None
    assert live.own_gpu(dgx, 0, {"CUDA_VISIBLE_DEVICES": "-1"}) is None
    assert live.own_gpu(dgx, 0, {"CUDA_VISIBLE_DEVICES": "GPU-8a1b"}) is None
    assert live.own_gpu(dgx, 0, {"CUDA_VISIBLE_DEVICES": "9"}) is None  # not on this host
    assert live.own_device(dgx, 2, {}) == ("gpu", 2)
    cpu = fixtures.load("cpu-2socket").hosts[0]
    assert live.own_device(cpu, 0, {"CUDA_VISIBLE_DEVICES": "0"}, cpus={33}) == ("cpu", 1)  # no GPU: by affinity
    assert live.own_device(cpu, 0, {}, cpus={40, 41}) == ("cpu", 1)
    assert live.own_device(cpu, 0, {}, cpus={0, 1, 40}) == ("cpu", 0)
    assert live.own_device(cpu, 0, {}, cpus=set(range(128))) == ("cpu", 0)  # a tie: the lowest node
    assert live.own_device(cpu, 0, {}, cpus={500}) == ("cpu", 0)


def _addresses(host) -> dict[str, str]:
    return {n.name: f"10.0.{i}.1" for i, n in enumerate(host.nics)}


def test_each_dgx_gpu_listens_on_the_nic_on_its_switch() -> None:
    dgx = fixtures.load("dgx-h100")
    addrs = _addresses(dgx.hosts[0])
    for g in range(8):
        name, addr = live.listen_nic(dgx, Device(0, "gpu", g), addrs)
        assert name == f"mlx5_{g}" and addr == addrs[name]
        assert dgx.path(Device(0, "gpu", g), Device(0, "nic", name)).type == PathType.PIX
    # CPU ranks: a NIC on their own socket
    assert live.listen_nic(dgx, Device(0, "cpu", 0), addrs)[0] == "mlx5_0"
    assert live.listen_nic(dgx, Device(0, "cpu", 1), addrs)[0] == "mlx5_4"
    # only NICs with an address count: GPU0's switch NICs have none, so the nearest with one (PHB, socket 0)
    some = {k: v for k, v in addrs.items() if k not in ("mlx5_0", "mlx5_1")}
    assert live.listen_nic(dgx, Device(0, "gpu", 0), some)[0] in ("mlx5_2", "mlx5_3")
    # fewer than two addressed NICs: keep the default
    assert live.listen_nic(dgx, Device(0, "gpu", 0), {"mlx5_5": "10.0.5.1"}) is None
    assert live.listen_nic(dgx, Device(0, "gpu", 0), {}) is None


def test_cpu_ranks_listen_on_their_sockets_nic() -> None:
    cpu = fixtures.load("cpu-2socket")
    assert live.listen_nic(cpu, Device(0, "cpu", 1), _addresses(cpu.hosts[0])) is None  # one NIC: default
    host = cpu.hosts[0]
    host.pci.append(PciNode("0000:81:00.0", "nic", "0000:80", 16.0, 16, 1))
    host.nics.append(Nic("ens3f0", "0000:81:00.0", numa=1, speed_Gbps=100.0))
    addrs = _addresses(host)
    assert live.listen_nic(cpu, Device(0, "cpu", 0), addrs) == ("ens2f0", addrs["ens2f0"])
    assert live.listen_nic(cpu, Device(0, "cpu", 1), addrs) == ("ens3f0", addrs["ens3f0"])


def test_the_runtime_hands_the_nearest_nic_to_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    dgx = fixtures.load("dgx-h100")
    addrs = _addresses(dgx.hosts[0])
    monkeypatch.setattr(runtime, "ipv4_addresses", lambda names: {n: addrs[n] for n in names})
    fake = SimpleNamespace(size=4, rank=1, info=SimpleNamespace(store_host="192.0.2.7"))
    assert runtime.Runtime._nearest_nic(fake, dgx, Device(0, "gpu", 5)) == addrs["mlx5_5"]
    fake.info.store_host = "127.0.0.1"  # a store on loopback: one host, keep the default
    assert runtime.Runtime._nearest_nic(fake, dgx, Device(0, "gpu", 5)) is None
    monkeypatch.delenv("PYCOLL_SOCKET_ADDR", raising=False)
    monkeypatch.delenv("PYCOLL_SOCKET_IFNAME", raising=False)
    t = TcpTransport()
    t.near_address = "127.0.0.1"
    try:
        assert t.listen(SimpleNamespace(rank=0), "127.0.0.2")[0] == "127.0.0.1"  # before the store's address
    finally:
        t.close()


def test_an_untuned_runtime_takes_its_links_from_the_topology() -> None:
    """Host-buffer ranks on GPU hosts count as the CPU nearest their GPU; two DGX nodes give the network of
    their NICs, one host keeps the built-in network; a topology the model cannot read keeps the constants."""
    two = fixtures.load("cluster-2x-dgx-h100")
    placement = [Device(h, "gpu", g) for h in range(2) for g in range(8)]
    fake = SimpleNamespace(topology=two, placement=placement)
    base = CostModel()
    model = runtime.Runtime._topology_model(fake, base)
    assert model.source.startswith("topology") and "16 cpu ranks on 2 hosts" in model.source
    assert model.net_GBps > 10 * base.net_GBps  # 400 Gb/s NICs, not the built-in 1 GB/s
    assert (model.msg_us, model.reduce_GBps, model.copy_GBps) == (base.msg_us, base.reduce_GBps, base.copy_GBps)
    one = runtime.Runtime._topology_model(SimpleNamespace(topology=fixtures.load("dgx-h100"), placement=placement[:8]), base)
    assert one.net_GBps == base.net_GBps and one.source.startswith("topology")
    broken = SimpleNamespace(topology=two, placement=[Device(7, "cpu", 0)] * 2)  # a host the topology lacks
    assert runtime.Runtime._topology_model(broken, base) is base


# ---- the local topology and the merged cluster -----------------------------------------------------------


def test_local_topology_is_found_once_and_never_fails(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv("PYCOLL_TOPO_FILE", raising=False)
    monkeypatch.delenv("PYCOLL_TOPO_DUMP_FILE", raising=False)
    monkeypatch.delenv("PYCOLL_TOPO_DISCOVER", raising=False)
    first = live.local_topology()
    assert live.local_topology() is first and len(first.hosts) == 1 and first.source == "discovered"
    assert live.local_seconds() > 0
    live.reset()
    monkeypatch.setenv("PYCOLL_TOPO_DISCOVER", "0")
    off = live.local_topology()
    assert off.source == "host only" and "topology" in off.hosts[0].absent and not off.hosts[0].nics
    live.reset()
    monkeypatch.setenv("PYCOLL_TOPO_DISCOVER", "1")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    monkeypatch.setenv("PYCOLL_TOPO_FILE", str(bad))
    assert live.local_topology().source == "host only"
    live.reset()
    monkeypatch.setenv("PYCOLL_TOPO_FILE", fixtures.path("cluster-2x-dgx-h100"))
    two = live.local_topology()
    assert len(two.hosts) == 1 and two.hosts[0].name == "dgx0"


def test_cluster_merges_hosts_and_checks_devices() -> None:
    dgx, cpu = fixtures.load("dgx-h100"), fixtures.load("cpu-2socket")
    ids = ["a", "b", "a", "b", "c"]
    devices = [["gpu", 0], ["cpu", 1], ["gpu", 7], ["cpu", 9], ["gpu", 0]]
    topo, placement = live.cluster(ids, devices, {"a": dgx, "b": cpu})
    assert [h.name for h in topo.hosts] == ["dgx-h100", "cpu-2socket", "c"]
    assert placement == [Device(0, "gpu", 0), Device(1, "cpu", 1), Device(0, "gpu", 7),
                         Device(1, "cpu", 0),  # no NUMA node 9 there: its first node
                         Device(2, "cpu", 0)]  # no topology from host c: host only, CPU
    assert topo.hosts[2].absent and not topo.hosts[2].gpus
    again, placement2 = live.cluster(ids, devices, {"a": dgx, "b": cpu})
    assert again.to_dict() == topo.to_dict() and placement2 == placement  # deterministic


# ---- live runs -----------------------------------------------------------------------------------------------

# Every rank: JSON of what it holds (topology digest, placement, its comms' rings) after checking ring-walking
# collectives against NumPy on MPI.COMM_WORLD and on comms whose ranks interleave hosts (Split by a key).
RANK = textwrap.dedent("""
    import hashlib, json, os
    import numpy as np
    from pycoll import MPI
    from pycoll.runtime import current

    world = MPI.COMM_WORLD
    rt = current()
    size = world.Get_size()

    def check(comm, tag):
        p, r = comm.Get_size(), comm.Get_rank()
        for n in (1, 7, 3 * p + 1, 1001):
            x = (np.arange(n) % 97 + 1).astype(np.float64) * (r + 1)
            want = (np.arange(n) % 97 + 1) * sum(q + 1 for q in range(p))
            out = np.empty_like(x)
            comm.Allreduce(x, out)
            assert np.array_equal(out, want), (tag, "Allreduce", n)
            y = x.copy()
            comm.Allreduce(MPI.IN_PLACE, y)
            assert np.array_equal(y, want), (tag, "Allreduce in place", n)
            counts = [n + (q % 3) for q in range(p)]
            full = (np.arange(sum(counts)) % 89 + 1).astype(np.int64) * (r + 1)
            block = np.empty(counts[r], np.int64)
            comm.Reduce_scatter(full, block, counts)
            lo = sum(counts[:r])
            assert np.array_equal(block, (np.arange(lo, lo + counts[r]) % 89 + 1) * sum(q + 1 for q in range(p))), \\
                (tag, "Reduce_scatter", n)
            mine = np.full(counts[r], r, np.int32)
            got = np.empty(sum(counts), np.int32)
            comm.Allgatherv(mine, [got, counts])
            assert np.array_equal(got, np.repeat(np.arange(p, dtype=np.int32), counts)), (tag, "Allgatherv", n)
            buf = np.empty(sum(counts), np.int32)
            buf[lo:lo + counts[r]] = r
            comm.Allgatherv(MPI.IN_PLACE, [buf, counts])
            assert np.array_equal(buf, got), (tag, "Allgatherv in place", n)
            b = np.arange(n, dtype=np.float32) if r == p - 1 else np.zeros(n, np.float32)
            comm.Bcast(b, root=p - 1)
            assert np.array_equal(b, np.arange(n, dtype=np.float32)), (tag, "Bcast", n)
        return {"host_of": list(comm._layout.host_of), "order": list(comm._layout.order)}

    line = {"rank": world.Get_rank(), "device": [rt.device.kind, rt.device.id],
            "placement": [[d.host, d.kind, d.id] for d in rt.placement],
            "hosts": [h.name for h in rt.topology.hosts], "source": rt.topology.source, "model": rt.cost_model.source,
            "digest": hashlib.sha256(json.dumps(rt.topology.to_dict(), sort_keys=True).encode()).hexdigest(),
            "comms": {"world": check(world, "world")}}
    for tag, order in json.loads(os.environ.get("SPLITS", "{}")).items():
        key = order.index(world.Get_rank()) if world.Get_rank() in order else 0
        sub = world.Split(0 if world.Get_rank() in order else 1, key)
        if world.Get_rank() in order:
            line["comms"][tag] = check(sub, tag)
        sub.Free()
    world.Barrier()
    os.write(1, (json.dumps(line) + "\\n").encode())
""")

FORCE_RINGS = {"PYCOLL_ALGO": "allreduce:ring,reduce_scatter:ring,allgather:ring,broadcast:chain"}


def _lines(proc, n: int) -> list[dict]:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = sorted((json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")), key=lambda d: d["rank"])
    assert [d["rank"] for d in lines] == list(range(n)), proc.stdout + proc.stderr
    return lines


def _same_everywhere(lines: list[dict], *keys: str) -> None:
    for key in keys:
        assert len({json.dumps(d[key], sort_keys=True) for d in lines}) == 1, (key, [d[key] for d in lines])


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_ranks_agree_on_a_gpu_topology_and_walk_its_ring() -> None:
    """4 ranks on one machine that loads the PCIe 4-GPU box: each drives GPU LOCAL_RANK, the world ring pairs GPUs
    on one switch (0, 2, 1, 3), and forced ring collectives stay right on it."""
    env = {"PYCOLL_TOPO_FILE": fixtures.path("pcie-4gpu"), **FORCE_RINGS,
           "SPLITS": json.dumps({"three": [3, 0, 2]})}
    proc = harness.launch(harness.launcher_cmd(4, [harness.PYTHON, "-c", RANK]), harness.rank_env("shm", 60.0, env),
                          timeout=110)
    lines = _lines(proc, 4)
    _same_everywhere(lines, "digest", "placement")
    assert len({json.dumps(d["comms"]["world"]) for d in lines}) == 1
    assert len({json.dumps(d["comms"]["three"]) for d in lines if d["rank"] != 1}) == 1
    assert [d["device"] for d in lines] == [["gpu", r] for r in range(4)]
    assert lines[0]["placement"] == [[0, "gpu", r] for r in range(4)] and lines[0]["hosts"] == ["pcie-4gpu"]
    assert lines[0]["comms"]["world"]["order"] == [0, 2, 1, 3]
    assert lines[0]["model"].startswith("topology") and all(d["model"].endswith("(from rank 0)") for d in lines[1:])
    # members 3, 0, 2 (comm ranks 0, 1, 2 on GPUs 3, 0, 2): GPU0 and GPU2 share a switch, so they are neighbours
    assert lines[0]["comms"]["three"]["order"] in ([0, 1, 2], [0, 2, 1])


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_discovery_off_gives_a_host_only_cpu_placement() -> None:
    proc = harness.launch(harness.launcher_cmd(3, [harness.PYTHON, "-c", RANK]),
                          harness.rank_env("tcp", 60.0, {"PYCOLL_TOPO_DISCOVER": "0", **FORCE_RINGS}), timeout=110)
    lines = _lines(proc, 3)
    _same_everywhere(lines, "digest", "placement", "comms")
    assert lines[0]["source"].endswith("(host only)") and len(lines[0]["hosts"]) == 1
    assert lines[0]["placement"] == [[0, "cpu", 0]] * 3
    assert lines[0]["comms"]["world"]["order"] == [0, 1, 2]


@pytest.mark.ranks
@pytest.mark.timeout(240)
@pytest.mark.skipif(unavailable() is not None, reason=f"no virtual hosts here: {unavailable()}")
def test_interleaved_hosts_ring_crosses_each_host_boundary_once() -> None:
    """5 ranks on 3 virtual hosts (2, 1, 2): every rank holds the same 3-host topology and placement; comms whose
    ranks interleave the hosts get a ring that keeps each host's ranks together (as few crossings as hosts), and
    ring collectives on them match NumPy."""
    splits = {"abcac": [0, 2, 3, 1, 4], "acac": [0, 3, 1, 4], "cab": [4, 0, 2]}
    proc = harness.run_on_hosts(RANK, hosts=3, n=5, ranks_per_host=[2, 1, 2], timeout=200,
                                env={**FORCE_RINGS, "SPLITS": json.dumps(splits)})
    lines = _lines(proc, 5)
    _same_everywhere(lines, "digest", "placement", "hosts")
    assert len(lines[0]["hosts"]) == 3
    assert [pl[0] for pl in lines[0]["placement"]] == [0, 0, 1, 2, 2]
    assert all(d["device"][0] == "cpu" for d in lines)
    world = lines[0]["comms"]["world"]
    assert world["order"] == [0, 1, 2, 3, 4] and _crossings(world["host_of"], world["order"]) == 3
    for tag, members in splits.items():
        seen = [d["comms"][tag] for d in lines if d["rank"] in members]
        assert len({json.dumps(c) for c in seen}) == 1, tag
        host_of, order = seen[0]["host_of"], seen[0]["order"]
        hosts = len(set(host_of))
        if tag != "cab":  # one rank a host: every order crosses alike
            assert _crossings(host_of, list(range(len(members)))) > hosts  # rank order would cross more often
        assert _crossings(host_of, order) == hosts, (tag, host_of, order)
        # each host's ranks are contiguous and in rank order; hosts come in world order
        world_hosts = [[pl[0] for pl in lines[0]["placement"]][members[i]] for i in order]
        assert world_hosts == sorted(world_hosts), (tag, world_hosts)
