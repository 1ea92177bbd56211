"""Topology: fixtures and JSON, path classes, discovery on fake sysfs trees and this machine, NCCL XML, rings, `pycoll topo`."""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from pycoll.topology import Device, PathType, Topology, discover, fixtures, load_or_discover, merge, ring_order, trees
from pycoll.topology.cli import add_topo_parser
from pycoll.topology.values import normalize_bus_id, parse_cpulist
from pycoll.topology import files as topology_files
from pycoll.topology.model import Gpu, Host, Numa, NvLink, PciNode, pcie_GBps
from pycoll.topology.nccl_xml import cpumask_to_cpulist, parse
from pycoll.topology.rings import _btree_parents, ring_bottleneck

DATA = Path(__file__).resolve().parent / "data"
GEN4_X16 = pcie_GBps(16.0, 16)  # 1.969 GB/s a lane after 128b/130b coding, 16 lanes
GEN5_X16 = pcie_GBps(32.0, 16)


def gpu(h: int, i: int) -> Device:
    return Device(h, "gpu", i)


def nic(h: int, name: str) -> Device:
    return Device(h, "nic", name)


# ---- fixtures and JSON -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(fixtures.BUILDERS))
def test_every_fixture_loads_round_trips_and_matches_its_builder(name: str) -> None:
    topo = fixtures.load(name)
    assert topo.to_dict() == Topology.from_dict(json.loads(topo.dumps())).to_dict()
    with open(fixtures.path(name)) as f:
        committed = json.load(f)
    assert committed == fixtures.BUILDERS[name]().to_dict(), f"{name}.json is stale: run python -m pycoll.topology.fixtures"


def test_fixture_files_ship_as_package_data() -> None:
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert '"topology/fixtures/*.json"' in text
    for name in fixtures.BUILDERS:
        assert os.path.isfile(fixtures.path(name))


def test_fixture_shapes() -> None:
    dgx = fixtures.load("dgx-h100")
    (h,) = dgx.hosts
    assert len(h.gpus) == 8 and len(h.nics) == 8 and len(h.numa) == 2
    assert sum(1 for p in h.pci if p.kind == "switch") == 4
    assert all(n.rdma and n.speed_Gbps == 400 for n in h.nics)
    assert all(g.nvlink_GBps("nvswitch") == 18 * 25 for g in h.gpus)
    c16 = fixtures.load("cluster-16x-dgx-h100")
    assert len(c16.hosts) == 16 and len(c16.devices("gpu")) == 128
    assert len({x.name for x in c16.hosts}) == 16
    assert len(fixtures.load("cluster-2x-dgx-h100").hosts) == 2
    cpu = fixtures.load("cpu-2socket")
    assert cpu.hosts[0].gpus == [] and [n.socket for n in cpu.hosts[0].numa] == [0, 1]
    assert "nvml" in cpu.hosts[0].absent


# ---- path classes ----------------------------------------------------------------------------------


def test_dgx_paths() -> None:
    topo = fixtures.load("dgx-h100")
    for a in range(8):
        for b in range(8):
            p = topo.path(gpu(0, a), gpu(0, b))
            if a == b:
                assert p.type is PathType.LOC
            else:
                assert (p.type, p.GBps) == (PathType.NVS, 450.0)
    nearest = [topo.nearest_nic(gpu(0, g)).name for g in range(8)]
    assert nearest == [f"mlx5_{g}" for g in range(8)]  # each GPU its own NIC, the pair on a switch sharing none
    for g in range(8):
        p = topo.path(gpu(0, g), nic(0, nearest[g]))
        assert p.type is PathType.PIX and p.GBps == pytest.approx(GEN5_X16)
    assert topo.path(gpu(0, 0), nic(0, "mlx5_2")).type is PathType.PHB  # same socket, the other switch
    sys_path = topo.path(gpu(0, 0), nic(0, "mlx5_4"))  # the other socket
    assert sys_path.type is PathType.SYS and sys_path.GBps == 22.0
    assert topo.path(gpu(0, 7), nic(0, "mlx5_0")).type is PathType.SYS
    assert topo.numa_of(gpu(0, 5)) == 1 and topo.numa_of(nic(0, "mlx5_1")) == 0


def test_cluster_paths_cross_hosts_over_the_network() -> None:
    topo = fixtures.load("cluster-2x-dgx-h100")
    p = topo.path(gpu(0, 3), gpu(1, 3))
    assert p.type is PathType.NET and p.GBps == 400 / 8
    assert topo.path(gpu(1, 0), gpu(1, 1)).type is PathType.NVS


def test_pcie_box_paths() -> None:
    topo = fixtures.load("pcie-4gpu")
    assert topo.path(gpu(0, 0), gpu(0, 2)).type is PathType.PIX
    assert topo.path(gpu(0, 1), gpu(0, 3)).type is PathType.PIX
    assert topo.path(gpu(0, 0), gpu(0, 1)).type is PathType.PHB
    assert topo.path(gpu(0, 0), gpu(0, 2)).GBps == pytest.approx(GEN4_X16)
    assert topo.nearest_nic(gpu(0, 2)).name == "ens1f0np0"  # on its switch, and faster than the on-board port
    assert topo.path(gpu(0, 1), nic(0, "ens1f0np0")).type is PathType.PHB


def test_cpu_node_paths_and_placement() -> None:
    topo = fixtures.load("cpu-2socket")
    assert topo.path(Device(0, "cpu", 0), Device(0, "cpu", 1)).type is PathType.SYS
    ranks = topo.place(128, "cpu")
    assert [d.id for d in ranks].count(0) == 64 and [d.id for d in ranks].count(1) == 64


# ---- discovery on fake sysfs trees -----------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


class FakeSys:
    """A sysfs tree under tmp_path: NUMA nodes, CPUs, PCI functions (with bus/pci/devices links), NICs, IB."""

    def __init__(self, root: Path) -> None:
        self.root = root / "sys"
        self.devices = self.root / "devices"

    def numa(self, node: int, cpus: str, socket_id: int, kb: int) -> None:
        base = self.devices / "system/node" / f"node{node}"
        _write(base / "cpulist", cpus)
        _write(base / "meminfo", f"Node {node} MemTotal:       {kb} kB\nNode {node} MemFree:        1 kB")
        for c in parse_cpulist(cpus):
            _write(self.devices / f"system/cpu/cpu{c}/topology/physical_package_id", str(socket_id))

    def pci(self, path: str, cls: str, vendor: str = "0x8086", numa: int = -1, gts: str = "", width: str = "",
            current: str = "") -> Path:
        d = self.devices / path
        _write(d / "class", cls)
        _write(d / "vendor", vendor)
        _write(d / "numa_node", str(numa))
        if gts:
            _write(d / "max_link_speed", gts)
            _write(d / "max_link_width", width)
        if current:
            _write(d / "current_link_speed", current)
            _write(d / "current_link_width", width)
        link = self.root / "bus/pci/devices" / d.name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(d)
        return d

    def net(self, name: str, device: Path | None, speed: str | None) -> None:
        d = self.root / "class/net" / name
        d.mkdir(parents=True)
        if device is not None:
            (d / "device").symlink_to(device)
        if speed is not None:
            _write(d / "speed", speed)

    def ib(self, name: str, device: Path, rate: str) -> None:
        d = self.root / "class/infiniband" / name
        d.mkdir(parents=True)
        (d / "device").symlink_to(device)
        _write(d / "ports/1/rate", rate)


def two_socket_box(tmp_path: Path) -> FakeSys:
    """Socket 0: a Gen4 switch (behind a root port) holding GPU0, GPU1 and an InfiniBand NIC; socket 1: a Gen3 x8
    Ethernet NIC (two ports, one a virtio-style child device) straight on a root port; a memory-only node 2."""
    fs = FakeSys(tmp_path)
    fs.numa(0, "0-3", 0, 16 * 2**20)
    fs.numa(1, "4-7", 1, 16 * 2**20)
    _write(fs.devices / "system/node/node2/cpulist", "")
    rp = "pci0000:00/0000:00:01.0"
    fs.pci(rp, "0x060400", numa=0, gts="16.0 GT/s PCIe", width="16")
    fs.pci(f"{rp}/0000:01:00.0", "0x060400", "0x1000", 0, "16.0 GT/s PCIe", "16")
    for port, fn, cls, vendor in [("0000:02:00.0", "0000:03:00.0", "0x030200", "0x10de"),
                                  ("0000:02:01.0", "0000:04:00.0", "0x030200", "0x10de"),
                                  ("0000:02:02.0", "0000:05:00.0", "0x020700", "0x15b3")]:
        fs.pci(f"{rp}/0000:01:00.0/{port}", "0x060400", "0x1000", 0, "16.0 GT/s PCIe", "16")
        # an idle GPU trains down to 2.5 GT/s: discovery must read the maximum
        fs.pci(f"{rp}/0000:01:00.0/{port}/{fn}", cls, vendor, 0, "16.0 GT/s PCIe", "16", current="2.5 GT/s PCIe")
    fs.pci("pci0000:00/0000:00:1f.0", "0x060100", numa=0)  # an ISA bridge: not part of the model
    fs.pci("pci0000:80/0000:80:01.0", "0x060400", numa=1, gts="8.0 GT/s PCIe", width="8")
    eth1 = fs.pci("pci0000:80/0000:80:01.0/0000:81:00.0", "0x020000", numa=1, gts="8.0 GT/s PCIe", width="8")
    eth2 = fs.pci("pci0000:80/0000:80:01.0/0000:81:00.1", "0x020000", numa=1, gts="8.0 GT/s PCIe", width="8")
    (eth1 / "virtio3").mkdir()
    ib_fn = fs.devices / rp / "0000:01:00.0/0000:02:02.0/0000:05:00.0"
    fs.net("lo", None, "-1")
    fs.net("veth0", None, "10000")
    fs.net("ib0", ib_fn, "-1")
    fs.net("eth1", eth1 / "virtio3", "10000")
    fs.net("eth2", eth2, None)  # no speed file (link down)
    fs.ib("mlx5_0", ib_fn, "200 Gb/sec (4X HDR)")
    return fs


class FakeNvml:
    """What discovery uses of pynvml: two A100s (sm 80) joined by 4 direct NVLinks, or on an NVSwitch."""

    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 12
    NVML_NVLINK_DEVICE_TYPE_GPU = 0
    NVML_NVLINK_DEVICE_TYPE_SWITCH = 2

    class NVMLError(Exception):
        pass

    def __init__(self, buses: list[str], links: list[list[tuple[str, int]]], with_type: bool = True) -> None:
        self.buses, self.links, self.inits, self.shutdowns = buses, links, 0, 0
        if not with_type:
            self.nvmlDeviceGetNvLinkRemoteDeviceType = None

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.buses)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetPciInfo(self, h: int):
        return SimpleNamespace(busId=self.buses[h].encode())  # bytes, as older bindings return

    def nvmlDeviceGetName(self, h: int) -> str:
        return "NVIDIA A100-SXM4-80GB"

    def nvmlDeviceGetMemoryInfo(self, h: int):
        return SimpleNamespace(total=80 * 2**30, free=0, used=0)

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        return (8, 0)

    def _link(self, h: int, link: int) -> tuple[str, int]:
        if link >= self.NVML_NVLINK_MAX_LINKS:
            raise self.NVMLError("Invalid Argument")
        if link >= len(self.links[h]):
            raise self.NVMLError("Not Supported")
        return self.links[h][link]

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        self._link(h, link)
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int):  # nvidia-ml-py 13 names it so (the C _v2)
        return SimpleNamespace(busId=self._link(h, link)[0])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: int, link: int) -> int:
        return self._link(h, link)[1]


GPU0, GPU1 = "00000000:03:00.0", "00000000:04:00.0"


def test_discovery_of_a_two_socket_box(tmp_path: Path) -> None:
    fs = two_socket_box(tmp_path)
    nvml = FakeNvml([GPU0, GPU1], [[(GPU1, 0)] * 4, [(GPU0, 0)] * 4])
    topo = discover(str(fs.root), nvml=nvml, hostname="box")
    assert (nvml.inits, nvml.shutdowns) == (1, 1)
    (h,) = topo.hosts
    assert h.name == "box" and h.cores == 8 and topo.source == "discovered"
    assert [(n.id, n.cpus, n.socket, n.memory_GB) for n in h.numa] == [(0, "0-3", 0, 16.0), (1, "4-7", 1, 16.0)]
    pci = {p.bus_id: p for p in h.pci}
    assert set(pci) == {"0000:00", "0000:80", "0000:01:00.0", "0000:03:00.0", "0000:04:00.0", "0000:05:00.0",
                        "0000:81:00.0", "0000:81:00.1"}  # root and downstream ports fold away; the ISA bridge is left out
    assert (pci["0000:00"].kind, pci["0000:00"].numa, pci["0000:80"].numa) == ("root", 0, 1)
    assert (pci["0000:01:00.0"].kind, pci["0000:01:00.0"].parent) == ("switch", "0000:00")
    assert (pci["0000:03:00.0"].kind, pci["0000:03:00.0"].parent, pci["0000:03:00.0"].gts) == ("gpu", "0000:01:00.0", 16.0)
    assert (pci["0000:05:00.0"].kind, pci["0000:05:00.0"].parent) == ("nic", "0000:01:00.0")
    assert (pci["0000:81:00.0"].parent, pci["0000:81:00.0"].gts, pci["0000:81:00.0"].width) == ("0000:80", 8.0, 8)

    assert [(g.index, g.bus_id, g.numa, g.memory_GB) for g in h.gpus] == [(0, "0000:03:00.0", 0, 80.0), (1, "0000:04:00.0", 0, 80.0)]
    assert h.gpus[0].nvlinks == [NvLink("0000:04:00.0", 4, 25.0)]
    nics = {n.name: n for n in h.nics}
    assert set(nics) == {"ib0", "eth1", "eth2"}  # lo and veth0 have no device
    assert (nics["ib0"].bus_id, nics["ib0"].rdma, nics["ib0"].ib_device, nics["ib0"].speed_Gbps) == ("0000:05:00.0", True, "mlx5_0", 200.0)
    assert (nics["eth1"].bus_id, nics["eth1"].rdma, nics["eth1"].speed_Gbps, nics["eth1"].numa) == ("0000:81:00.0", False, 10.0, 1)
    assert nics["eth2"].speed_Gbps == 0.0
    assert "nvml" not in h.absent and "infiniband" not in h.absent

    assert topo.path(gpu(0, 0), gpu(0, 1)).type is PathType.NVL and topo.path(gpu(0, 0), gpu(0, 1)).GBps == 100.0
    ib = topo.path(gpu(0, 1), nic(0, "ib0"))
    assert ib.type is PathType.PIX and ib.GBps == pytest.approx(GEN4_X16)
    eth = topo.path(gpu(0, 0), nic(0, "eth1"))
    assert eth.type is PathType.SYS and eth.GBps == pytest.approx(pcie_GBps(8.0, 8))
    assert topo.nearest_nic(gpu(0, 0)).name == "ib0"
    assert Topology.from_dict(json.loads(topo.dumps())).to_dict() == topo.to_dict()


def test_discovery_on_an_nvswitch_and_without_the_device_type_call(tmp_path: Path) -> None:
    fs = two_socket_box(tmp_path)
    switch = "00000000:c0:00.0"  # not a PCI function this host shows
    for with_type in (True, False):
        nvml = FakeNvml([GPU0, GPU1], [[(switch, 2)] * 12, [(switch, 2)] * 12], with_type=with_type)
        topo = discover(str(fs.root), nvml=nvml)
        assert [g.nvlinks for g in topo.hosts[0].gpus] == [[NvLink("nvswitch", 12, 25.0)]] * 2
        assert topo.path(gpu(0, 0), gpu(0, 1)).type is PathType.NVS and topo.path(gpu(0, 0), gpu(0, 1)).GBps == 300.0


def test_discovery_reports_absent_sources(tmp_path: Path) -> None:
    fs = two_socket_box(tmp_path)

    class NoDriver(FakeNvml):
        def nvmlInit(self) -> None:
            raise self.NVMLError("Driver Not Loaded")

    topo = discover(str(fs.root), nvml=NoDriver([], []))
    h = topo.hosts[0]
    assert h.gpus == [] and "Driver Not Loaded" in h.absent["nvml"] and "2 NVIDIA GPUs on the PCI bus" in h.absent["nvml"]
    assert {n.name for n in h.nics} == {"ib0", "eth1", "eth2"}  # the rest is still discovered
    assert discover(str(fs.root), nvml=FakeNvml([], [])).hosts[0].absent["gpu"] == "NVML reports no GPU"

    empty = discover(str(tmp_path / "nothing"), nvml=NoDriver([], []))
    e = empty.hosts[0]
    assert set(e.absent) >= {"numa", "pci", "infiniband", "nic", "nvml"}
    assert len(e.numa) == 1 and e.gpus == [] and e.nics == [] and e.pci == []


def test_discovery_of_this_machine() -> None:
    topo = discover()
    (h,) = topo.hosts
    assert h.name == socket.gethostname()
    assert h.cores == len(os.sched_getaffinity(0))
    assert sorted(c for n in h.numa for c in parse_cpulist(n.cpus)) == sorted(
        set(parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())))
    names = {n.name for n in h.nics}
    assert "lo" not in names
    for name in os.listdir("/sys/class/net"):
        assert (name in names) == (name != "lo" and os.path.exists(f"/sys/class/net/{name}/device")), name
    if not os.path.exists("/sys/class/infiniband"):
        assert "infiniband" in h.absent and not any(n.rdma for n in h.nics)
    if not os.path.exists("/dev/nvidiactl"):  # no NVIDIA driver: NVML is absent or finds nothing
        assert h.gpus == [] and ("nvml" in h.absent or "gpu" in h.absent)
    for n in h.nics:
        assert n.numa in {x.id for x in h.numa} | {-1}
    assert Topology.from_dict(json.loads(topo.dumps())).to_dict() == topo.to_dict()


def test_load_or_discover_honours_the_knobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "dumped.json"
    monkeypatch.setenv("PYCOLL_TOPO_FILE", fixtures.path("dgx-h100"))
    monkeypatch.setenv("PYCOLL_TOPO_DUMP_FILE", str(out))
    topo = load_or_discover()
    assert len(topo.hosts[0].gpus) == 8
    assert topology_files.load(str(out)).to_dict() == topo.to_dict()
    monkeypatch.delenv("PYCOLL_TOPO_FILE")
    fs = two_socket_box(tmp_path)
    topo = load_or_discover(str(fs.root), nvml=FakeNvml([GPU0], [[]]))
    assert [g.bus_id for g in topo.hosts[0].gpus] == ["0000:03:00.0"]
    assert topology_files.load(str(out)).hosts[0].gpus[0].bus_id == "0000:03:00.0"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_merge_one_host_per_host_id() -> None:
    a, b = fixtures.dgx_h100("n"), fixtures.dgx_h100("n")  # same hostname: virtual hosts of one machine
    topo, rank_host = merge([a, a, b, a], ["id-a", "id-a", "id-b", "id-a"])
    assert rank_host == [0, 0, 1, 0] and [h.name for h in topo.hosts] == ["n", "n#1"]
    assert topo.path(gpu(0, 0), gpu(1, 0)).type is PathType.NET


def test_bus_ids_and_cpu_lists() -> None:
    assert normalize_bus_id(b"00000000:1B:00.0") == "0000:1b:00.0"
    assert normalize_bus_id("1b:00.1") == "0000:1b:00.1"
    assert normalize_bus_id("virtio3") == "" and normalize_bus_id("pci0000:00") == ""
    assert parse_cpulist("0-2,5,8-9") == [0, 1, 2, 5, 8, 9]
    assert cpumask_to_cpulist("0000ffff,0000000f") == "0-3,32-47"
    assert cpumask_to_cpulist("") == ""


# ---- NCCL XML --------------------------------------------------------------------------------------


def test_nccl_xml_import() -> None:
    path = str(DATA / "nccl_topo_dgx_like.xml")
    topo = topology_files.load(path)
    assert topo.source == f"nccl-xml:{path}"
    (h,) = topo.hosts
    assert [(n.id, n.cpus, n.socket) for n in h.numa] == [(0, "0-15,32-47", 0), (1, "16-31,48-63", 1)]
    assert h.cores == 64 and h.socket_GBps == 22.0  # family 6 model 143: Sapphire Rapids
    assert [(g.index, g.bus_id, g.numa) for g in h.gpus] == [
        (0, "0000:18:00.0", 0), (1, "0000:2a:00.0", 0), (2, "0000:9a:00.0", 1), (3, "0000:ab:00.0", 1)]
    assert all(g.nvlinks == [NvLink("nvswitch", 18, 25.0)] for g in h.gpus)
    nics = {n.name: n for n in h.nics}
    assert (nics["mlx5_0"].speed_Gbps, nics["mlx5_0"].rdma, nics["mlx5_0"].bus_id) == (400.0, True, "0000:17:00.0")
    assert (nics["eth0"].speed_Gbps, nics["eth0"].rdma, nics["eth0"].bus_id, nics["eth0"].numa) == (25.0, False, "", 1)

    def cls(a: Device, b: Device) -> PathType:
        return topo.path(a, b).type

    assert topo.path(gpu(0, 0), gpu(0, 3)).GBps == 450.0 and cls(gpu(0, 0), gpu(0, 3)) is PathType.NVS
    assert cls(gpu(0, 0), nic(0, "mlx5_0")) is PathType.PIX
    assert topo.path(gpu(0, 1), nic(0, "mlx5_0")).GBps == pytest.approx(GEN5_X16)
    assert cls(gpu(0, 3), nic(0, "mlx5_1")) is PathType.PIX
    assert cls(gpu(0, 2), nic(0, "mlx5_1")) is PathType.PXB  # through its sub-switch and the top one
    assert cls(gpu(0, 2), nic(0, "eth0")) is PathType.PHB
    assert cls(gpu(0, 0), nic(0, "mlx5_1")) is PathType.SYS and topo.path(gpu(0, 0), nic(0, "mlx5_1")).GBps == 22.0
    assert [topo.nearest_nic(gpu(0, g)).name for g in range(4)] == ["mlx5_0", "mlx5_0", "mlx5_1", "mlx5_1"]


def _xml(body: str, host_hash: str = "0x1", numa: int = 0) -> str:
    return (f'<cpu host_hash="{host_hash}" numaid="{numa}" affinity="0000000f" arch="x86_64" vendor="AuthenticAMD" '
            f'familyid="25" modelid="1">{body}</cpu>')


def test_nccl_xml_direct_nvlinks_and_hosts() -> None:
    pair = ('<pci busid="0000:01:00.0" class="0x030000" link_speed="16.0 GT/s PCIe" link_width="16">'
            '<gpu dev="0" sm="80" rank="{r0}" gdr="1"><nvlink target="0000:02:00.0" count="4" tclass="0x030200"/></gpu></pci>'
            '<pci busid="0000:02:00.0" class="0x030000" link_speed="16.0 GT/s PCIe" link_width="16">'
            '<gpu dev="1" sm="80" rank="{r1}" gdr="1"><nvlink target="0000:01:00.0" count="4" tclass="0x030200"/></gpu></pci>')
    text = f'<system version="1">{_xml(pair.format(r0=0, r1=1), "0xa")}{_xml(pair.format(r0=2, r1=3), "0xb")}</system>'
    topo = parse(text)
    assert [h.name for h in topo.hosts] == ["host0", "host1"] and topo.hosts[0].socket_GBps == 24.0
    assert topo.path(gpu(0, 0), gpu(0, 1)).type is PathType.NVL and topo.path(gpu(0, 0), gpu(0, 1)).GBps == 100.0
    assert topo.path(gpu(0, 0), gpu(1, 0)).type is PathType.NET
    assert topo.hosts[0].absent == {"nic": "no <net> in the XML"}


def _system(body: str) -> str:
    return "<system>" + _xml(body) + "</system>"


@pytest.mark.parametrize("text, problem", [
    ("<system><cpu", "not well-formed"),
    ('<graphs version="1"/>', "<system>"),
    ('<system version="1"/>', "no <cpu>"),
    ('<system><cpu affinity="f"/></system>', "numaid"),
    (_system("<pci class='0x060400'/>"), "busid"),
    (_system("<pci busid='0000:01:00.0' class='zz'/>"), "class"),
    (_system("<pci busid='0000:01:00.0' class='0x030000'><gpu sm='90'/></pci>"), "dev"),
    (_system("<pci busid='0000:01:00.0' class='0x030000'><gpu dev='0' sm='90'>"
             "<nvlink target='0000:09:00.0' count='2' tclass='0x030200'/></gpu></pci>"), "no <gpu>"),
    (_system("<pci busid='0000:01:00.0' class='0x030000'><gpu dev='0' sm='90'>"
             "<nvlink count='x' tclass='0x068000'/></gpu></pci>"), "count"),
    (_system("<pci busid='0000:01:00.0' class='0x030000' link_width='wide'/>"), "link_width"),
    (_system("<pci busid='0000:01:00.0' class='0x030000'/><pci busid='0000:01:00.0' class='0x030000'/>"), "twice"),
])
def test_nccl_xml_malformed_input_names_the_problem(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match="NCCL topology XML") as info:
        parse(text)
    assert problem in str(info.value)


# ---- rings and trees -------------------------------------------------------------------------------


def _nvlink_box(pairs: dict[tuple[int, int], int]) -> Topology:
    """4 GPUs on one PCIe switch with direct NVLinks: ``pairs`` maps (a, b) to a link count (25 GB/s each)."""
    host = Host("nv", numa=[Numa(0, "0-7", 0)], cores=8,
                pci=[PciNode("0000:00", "root", None, 0, 0, 0), PciNode("0000:01:00.0", "switch", "0000:00", 16.0, 16)])
    for i in range(4):
        bus = f"0000:0{i + 2}:00.0"
        host.pci.append(PciNode(bus, "gpu", "0000:01:00.0", 16.0, 16, 0))
        host.gpus.append(Gpu(i, bus))
    for (a, b), n in pairs.items():
        host.gpus[a].nvlinks.append(NvLink(host.gpus[b].bus_id, n))
        host.gpus[b].nvlinks.append(NvLink(host.gpus[a].bus_id, n))
    return Topology(hosts=[host])


def _adjacent(order: list[int], a: int, b: int) -> bool:
    i = order.index(a)
    return b in (order[i - 1], order[(i + 1) % len(order)])


def test_ring_pairs_gpus_that_share_a_switch() -> None:
    topo = fixtures.load("pcie-4gpu")
    devs = topo.place(4, "gpu")
    order = ring_order(topo, devs)
    assert order == [0, 2, 1, 3]
    assert ring_bottleneck(topo, devs, order)[3] == "PHB"  # two host-bridge crossings are unavoidable


def test_ring_follows_nvlinks_and_fixes_a_greedy_dead_end() -> None:
    # NVLink square 0-2-1-3-0: every ring link can be NVLink
    topo = _nvlink_box({(0, 2): 2, (2, 1): 2, (1, 3): 2, (3, 0): 2})
    devs = topo.place(4, "gpu")
    order = ring_order(topo, devs)
    assert all(_adjacent(order, a, b) for a, b in [(0, 2), (2, 1), (1, 3), (3, 0)])
    # triangle 0-1-2 (100 GB/s) and GPU3 on 1 and 2 only (50 GB/s): greedy goes 0,1,2,3 and closes 3-0 over PCIe
    topo = _nvlink_box({(0, 1): 4, (1, 2): 4, (0, 2): 4, (3, 1): 2, (3, 2): 2})
    order = ring_order(topo, devs)
    *_, bw, cls = ring_bottleneck(topo, devs, order)
    assert (cls, bw) == ("NVL", 50.0), order


def test_ring_keeps_hosts_contiguous_and_same_device_ranks_together() -> None:
    topo = fixtures.load("cluster-2x-dgx-h100")
    devs = topo.place(16, "gpu")
    order = ring_order(topo, devs)
    assert order == list(range(16))  # every in-host link is the same NVSwitch path
    shuffled = [devs[i] for i in (9, 3, 12, 0, 15, 6)]
    order = ring_order(topo, shuffled)
    assert [shuffled[i].host for i in order] == [0, 0, 0, 1, 1, 1]
    cpu = fixtures.load("cpu-2socket")
    devs = [Device(0, "cpu", n) for n in (0, 1, 0, 1, 0)]
    order = ring_order(cpu, devs)
    assert [devs[i].id for i in order] == [0, 0, 0, 1, 1]


def test_btree_shape() -> None:
    assert _btree_parents(8) == [-1, 2, 4, 2, 0, 6, 4, 6]
    assert _btree_parents(1) == [-1]
    assert _btree_parents(3) == [-1, 2, 0]


@pytest.mark.parametrize("n", range(1, 17))
def test_double_tree_over_hosts(n: int) -> None:
    topo = Topology.cluster(fixtures.dgx_h100(), n)
    devs = topo.place(8 * n, "gpu")
    dt = trees(topo, devs)
    assert dt.hosts == list(range(n))
    assert all(dt.chains[h] == list(range(8 * h, 8 * h + 8)) for h in range(n))
    for t in (0, 1):
        assert sum(1 for h in dt.hosts if dt.parents[t][h] == -1) == 1
        assert all(len(dt.children(t, h)) <= 2 for h in dt.hosts)
        for h in dt.hosts:  # every host reaches the root
            seen, x = set(), h
            while dt.parents[t][x] != -1:
                assert x not in seen
                seen.add(x)
                x = dt.parents[t][x]
    if n > 1 and n % 2 == 0:  # NCCL's property: no host is a leaf in both trees
        leaves = [{h for h in dt.hosts if not dt.children(t, h)} for t in (0, 1)]
        assert not leaves[0] & leaves[1]
    if n > 1:
        assert dt.root(0) != dt.root(1)
    text = str(dt)
    assert ("tree 0" in text) == (n > 1) and text.count("chain in") == n


# ---- pycoll topo -----------------------------------------------------------------------------------


def _topo_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="pycoll")
    add_topo_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["topo", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_topo_cli_on_the_dgx_fixture(capsys: pytest.CaptureFixture) -> None:
    rc, out, _ = _topo_cli(["--file", fixtures.path("dgx-h100")], capsys)
    assert rc == 0
    lines = out.splitlines()
    header = next(line for line in lines if "CPU Affinity" in line).split()
    assert header == [*(f"GPU{i}" for i in range(8)), *(f"mlx5_{i}" for i in range(8)), "CPU", "Affinity", "NUMA", "Affinity"]
    row = next(line for line in lines if line.startswith("GPU0 ") and " X " in line).split()
    assert row[0] == "GPU0" and row[1] == "X" and row[2:9] == ["NVS"] * 7
    assert row[9:17] == ["PIX", "PIX", "PHB", "PHB", "SYS", "SYS", "SYS", "SYS"]
    assert row[17:] == ["0-55,112-167", "0"]
    row5 = next(line for line in lines if line.startswith("GPU5 ") and " X " in line).split()
    assert row5[-2:] == ["56-111,168-223", "1"]
    assert "  GPU1: mlx5_1 (PIX" in out and "  GPU6: mlx5_6 (PIX" in out
    assert "NVS = NVLink through an NVSwitch" in out.replace("  ", " ")
    assert "ring of 8 ranks on GPUs" in out and "0(GPU0) 1(GPU1) 2(GPU2)" in out
    assert "one host: no tree between hosts" in out and "chain in dgx-h100: GPU0 > GPU1" in out


def test_topo_cli_on_a_cluster_and_nccl_xml(capsys: pytest.CaptureFixture) -> None:
    rc, out, _ = _topo_cli(["--file", fixtures.path("cluster-2x-dgx-h100"), "--host", "1", "--np", "16"], capsys)
    assert rc == 0 and "host 1: dgx1" in out and "tree 0 (root dgx0): dgx0 > dgx1" in out
    assert "tree 1 (root dgx1): dgx1 > dgx0" in out and "slowest link: 7(dgx0:GPU7) > 8(dgx1:GPU0): NET, 50 GB/s" in out
    rc, out, _ = _topo_cli(["--file", str(DATA / "nccl_topo_dgx_like.xml")], capsys)
    assert rc == 0 and "GPU2: mlx5_1 (PXB" in out
    assert _topo_cli(["--file", fixtures.path("dgx-h100"), "--host", "3"], capsys)[0] == 2
    rc, _, err = _topo_cli(["--file", str(DATA / "missing.json")], capsys)
    assert rc == 1 and "missing.json" in err


def test_topo_cli_on_this_machine_and_dump(tmp_path: Path, capsys: pytest.CaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYCOLL_TOPO_FILE", raising=False)
    monkeypatch.delenv("PYCOLL_TOPO_DUMP_FILE", raising=False)
    dump = tmp_path / "here.json"
    rc, out, _ = _topo_cli(["--dump", str(dump)], capsys)
    assert rc == 0 and f"wrote {dump}" in out
    here = topology_files.load(str(dump))
    assert here.hosts[0].name == socket.gethostname()
    assert "absent sources:" in out and "ring of" in out and "trees:" in out
    if not here.hosts[0].gpus:
        assert "no GPUs on this host" in out
        assert f"ring of {here.hosts[0].cores} rank" in out and "on CPUs (no GPU)" in out


def test_measured_links_price_the_paths_between_hosts_and_survive_json_and_merge(tmp_path: Path) -> None:
    from pycoll.topology import HostLink

    topo = fixtures.load("cluster-2x-dgx-h100")
    names = [h.name for h in topo.hosts]
    nic_path = topo.path(gpu(0, 3), gpu(1, 3))
    measured = topo.with_links([HostLink(names[1], names[0], GBps=11.5, latency_us=7.5, source="test")])
    p = measured.path(gpu(0, 3), gpu(1, 3))
    assert p.type is PathType.NET and (p.GBps, p.latency_us) == (11.5, 7.5)
    assert measured.path(gpu(1, 0), gpu(1, 1)) == topo.path(gpu(1, 0), gpu(1, 1))  # inside a host: unchanged
    assert topo.path(gpu(0, 3), gpu(1, 3)) == nic_path and not topo.links  # with_links copies
    again = measured.with_links([HostLink(names[0], names[1], GBps=3.0, latency_us=9.0)])
    assert len(again.links) == 1 and again.link(1, 0).GBps == 3.0  # a new measurement replaces the pair's old one
    out = tmp_path / "t.json"
    measured.dump(str(out))
    loaded = topology_files.load(str(out))
    assert loaded.links == measured.links and loaded.link(0, 1).source == "test"
    # every rank of a host brings the same links: the merged cluster holds each pair once
    one = [Topology(hosts=[h], links=measured.links) for h in measured.hosts]
    merged, _ = merge([one[0], one[0], one[1]], ["a", "a", "b"])
    assert merged.links == measured.links and merged.path(gpu(0, 0), gpu(1, 0)).GBps == 11.5
