"""`pycoll simulate` and the cost model taken from a topology: physical predictions, JSON for `pycoll plot`, scale."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import time
from pathlib import Path

import pytest

from pycoll.algorithms import CostModel, Layout
from pycoll.algorithms import cost, cost_topology
from pycoll.perf.plot import load_sweep
from pycoll.topology import files as topology_files
from pycoll.topology.model import Topology
from pycoll.perf.simulate import main, placement_of, simulate

ROOT = Path(__file__).resolve().parent.parent


def _check_module():
    spec = importlib.util.spec_from_file_location("simulate_check", ROOT / "perf" / "simulate_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECK = _check_module()
SIZES = [1 << k for k in range(10, 33, 2)]  # 1 KiB .. 4 GiB


def _by_peer(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for rec in records:
        out.setdefault(rec["peer"], []).append(rec)
    return out


def test_a_model_from_a_topology_takes_its_links_from_the_paths_and_nics() -> None:
    node = CHECK.dgx_h100()
    placement, _ = placement_of(node, 8, "gpu")
    m = CostModel.from_topology(node, placement, "gpu")
    assert m.shm_GBps == pytest.approx(18 * 25.0 * cost_topology.NVLINK_EFFICIENCY)
    assert m.msg_us == 0 and m.fused and m.call_us > 0 and m.over(Layout.flat(8)) == 1.0
    two = Topology.cluster(node, 2)
    placement, _ = placement_of(two, 16, "gpu")
    m2 = CostModel.from_topology(two, placement)
    assert m2.net_GBps == pytest.approx(8 * 50.0 * cost_topology.RDMA_EFFICIENCY)  # a channel per NIC: all 8 per host
    placement, _ = placement_of(two, 4, "gpu", per_host=2)
    assert CostModel.from_topology(two, placement).net_GBps == pytest.approx(2 * 50.0 * cost_topology.RDMA_EFFICIENCY)  # a NIC per rank
    # CPU ranks keep the fitted host constants; the namespace hosts get their NIC and their share of the cores.
    ns = CHECK.namespace_hosts(2, 2, "1gbit")
    placement, _ = placement_of(ns, 4, "cpu", per_host=2)
    m3 = CostModel.from_topology(ns, placement, "cpu")
    assert m3.shm_GBps == CostModel().shm_GBps and m3.msg_us == CostModel().msg_us and not m3.fused
    assert m3.net_GBps == pytest.approx(0.125 * cost_topology.TCP_EFFICIENCY) and m3.cores == 1


def test_without_a_topology_the_model_is_as_before() -> None:
    m = CostModel()
    assert not m.fused and m.call_us == 0.0
    lay = Layout((0, 0, 1, 1))
    # phase without wire/local: the per-rank bytes times the flows over the host link, as it always was
    lat, bw = m.link(lay)
    expected = (2 * lat + 2 * m.messages(1e6 / 2) * m.msg_us * 1e-6 + 5e5 / (m.reduce_GBps * 1e9)) * m.over(lay) + 1e6 * 2 / bw
    assert m.phase(lay, 2, 1e6, reduced=5e5, flows=2) == pytest.approx(expected, rel=1e-12)
    assert CostModel.from_json(m.to_json()) == m


def test_time_grows_with_size_and_ring_busbw_approaches_the_nvlink_bottleneck() -> None:
    node = CHECK.dgx_h100()
    recs = simulate(node, "allreduce", 8, SIZES, "gpu")
    for peer, rows in _by_peer(recs).items():
        times = [r["time_us"] for r in sorted(rows, key=lambda r: r["bytes"])]
        assert all(a < b for a, b in zip(times, times[1:])), peer
    placement, _ = placement_of(node, 8, "gpu")
    bottleneck = CostModel.from_topology(node, placement).shm_GBps
    ring = sorted((r for r in recs if r["peer"] == "sim[ring]"), key=lambda r: r["bytes"])
    assert all(r["busbw_GBps"] <= bottleneck * (1 + 1e-9) for r in ring)
    assert ring[-1]["busbw_GBps"] == pytest.approx(bottleneck, rel=0.02)
    assert ring[0]["busbw_GBps"] < 0.05 * bottleneck  # 1 KiB: latency-bound
    # Across hosts a ring is as slow as its slowest hop: here NVLink (370.8 GB/s), not the 8 NICs (397.5 GB/s).
    two = Topology.cluster(node, 2)
    placement, _ = placement_of(two, 16, "gpu")
    m = CostModel.from_topology(two, placement)
    assert m.net_GBps > m.shm_GBps
    ring = [r for r in simulate(two, "allreduce", 16, SIZES, "gpu") if r["peer"] == "sim[ring]"]
    assert max(r["busbw_GBps"] for r in ring) <= m.shm_GBps * (1 + 1e-9)
    # CPU ranks on the same hosts: the Python engine's shared-memory rate bounds them, whatever the NICs.
    cpu = [r for r in simulate(two, "allreduce", 8, SIZES, "cpu", per_host=4) if r["peer"] == "sim[ring]"]
    assert max(r["busbw_GBps"] for r in cpu) <= CostModel().shm_GBps


def test_more_hosts_never_raise_busbw_above_the_nic_bound() -> None:
    node = CHECK.dgx_a100()
    best = []
    for hosts in (2, 4, 8, 16):
        topo = Topology.cluster(node, hosts)
        p = 8 * hosts
        placement, _ = placement_of(topo, p, "gpu")
        net = CostModel.from_topology(topo, placement).net_GBps
        # An allreduce must move 2(H-1)/H of the vector out of every host: algbw <= net / (2(H-1)/H).
        bound = net * _bus_bound(p, hosts)
        recs = simulate(topo, "allreduce", p, [1 << 20, 1 << 26, 1 << 30], "gpu")
        assert all(r["busbw_GBps"] <= bound * (1 + 1e-9) for r in recs), hosts
        best.append(max(r["busbw_GBps"] for r in recs if r["peer"] == "sim" and r["bytes"] == 1 << 30))
    assert all(b <= a * (1 + 1e-9) for a, b in zip(best, best[1:])), best


def _bus_bound(p: int, hosts: int) -> float:
    """busbw / host-link bandwidth at best: busbw = algbw · 2(p-1)/p and algbw <= net / (2(H-1)/H)."""
    return (2 * (p - 1) / p) / (2 * (hosts - 1) / hosts)


def test_selection_on_a_topology_is_sensible() -> None:
    two = Topology.cluster(CHECK.dgx_h100(), 2)
    picks = {r["bytes"]: r["algo_used"] for r in simulate(two, "allreduce", 16, [1 << 10, 1 << 30], "gpu") if r["peer"] == "sim"}
    assert picks[1 << 30] in ("ring", "hierarchical")
    assert picks[1 << 10] in ("doubling", "tree")  # few steps for small messages
    recs = simulate(two, "allreduce", 16, [1 << 10], "gpu")
    assert not {"oneshot", "cma", "staged"} & {r["algo"] for r in recs}  # host-memory arena algorithms: not for GPUs
    vm = CHECK.this_vm(2)
    picks = {r["bytes"]: r["algo_used"] for r in simulate(vm, "allreduce", 4, [1 << 10, 64 << 20], "cpu", per_host=4)
             if r["peer"] == "sim"}
    assert picks[1 << 10] == "oneshot" and picks[64 << 20] in ("staged", "cma")
    ns = CHECK.namespace_hosts(2, 2, "1gbit")
    picks = {r["bytes"]: r["algo_used"] for r in simulate(ns, "allreduce", 4, [8, 64 << 20], "cpu", per_host=2)
             if r["peer"] == "sim"}
    assert picks[64 << 20] == "hierarchical" and picks[8] != "ring"


def test_published_nccl_figures_are_met_within_25_percent() -> None:
    rows = CHECK.published_checks()
    assert len(rows) >= 4
    for row in rows:
        assert row["pass"], row


def test_json_is_a_perf_file_that_plot_reads(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    topo_file = tmp_path / "node.json"
    CHECK.dgx_a100().dump(str(topo_file))
    out = tmp_path / "sim.json"
    assert main(["--topo", str(topo_file), "--collective", "allreduce", "--np", "8,16", "-b", "1K", "-e", "1G",
                 "-f", "4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "# peer sim[ring], 8 ranks, allreduce" in text and "2 copies of its host" in text
    data = load_sweep(out)
    assert data["meta"]["simulated"] is True and data["meta"]["topology"]
    peers = {r["peer"] for r in data["records"]}
    assert {"sim", "sim[ring]", "sim[tree]"} <= peers
    assert {r["nranks"] for r in data["records"]} == {8, 16}
    assert all(r["algo"] == "auto" for r in data["records"] if r["peer"] == "sim")
    pytest.importorskip("matplotlib")
    from pycoll.perf.plot import make_plots

    pngs = make_plots([out], tmp_path / "plots", False, None)
    assert pngs and all(p.exists() for p in pngs)


def test_bad_arguments_fail_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--topo", str(tmp_path / "missing.json")]) == 2
    topo_file = tmp_path / "node.json"
    CHECK.this_vm(2).dump(str(topo_file))
    assert main(["--topo", str(topo_file), "--np", "2", "--algos", "nosuch"]) == 2
    assert "has no algorithm nosuch" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_4096_ranks_complete() -> None:
    cluster = Topology.cluster(CHECK.dgx_h100(), 512)
    t0 = time.perf_counter()
    recs = simulate(cluster, "allreduce", 4096, [1 << k for k in range(10, 31)], "gpu")
    elapsed = time.perf_counter() - t0
    picks = [r for r in recs if r["peer"] == "sim"]
    assert len(picks) == 21 and all(r["nranks"] == 4096 and r["hosts"] == 512 for r in picks)
    assert all(math.isfinite(r["time_us"]) and r["time_us"] > 0 for r in recs)
    print(f"4096 ranks, 21 sizes: {elapsed:.2f} s")


def test_check_script_writes_its_files(tmp_path: Path) -> None:
    sweep = {"meta": {"cpus": 2, "hosts": 1}, "limits": {"copy_GBps": 8.0, "reduce_GBps": 6.0}, "records": [
        {"peer": "pycoll", "algo": "auto", "algo_used": "staged", "hosts": 1, "link_rate": None, "collective": "allreduce",
         "nranks": 2, "bytes": 16 << 20, "count": 4 << 20, "dtype": "float", "op": "sum", "root": -1, "inplace": False,
         "time_us": 3000.0, "algbw_GBps": 5.6, "busbw_GBps": 5.6, "wrong": 0}]}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(sweep))
    CHECK.main([str(path), "--out", str(tmp_path / "out")])
    rows = json.loads((tmp_path / "out" / "simulate_check.json").read_text())["rows"]
    measured = [r for r in rows if r["kind"] == "measured"]
    assert len(measured) == 1 and measured[0]["algo"] == "staged" and measured[0]["predicted"] > 0
    load_sweep(tmp_path / "out" / "sim_dgx_h100_8gpu_allreduce.json")


def test_check_takes_the_fastest_memory_speed_a_sweep_measured() -> None:
    """The reference is a point's best round, so the model runs at the sweep's fastest memory measurement."""
    start = {"copy_GBps": 8.0, "reduce_GBps": 6.0}
    old = {"limits": start, "records": [{"time_us": 1.0}]}
    assert CHECK.undisturbed_memory(old) == start  # sweeps from before per-job measurements: the start's
    new = {"limits": start, "records": [{"round_limits": [[9.0, 5.0], [4.0, 7.0]]}, {"limit_copy_GBps": 7.5, "limit_reduce_GBps": 6.5}]}
    assert CHECK.undisturbed_memory(new) == {"copy_GBps": 9.0, "reduce_GBps": 7.0}


def test_check_judges_one_host_points_by_their_median_ratio_over_the_sweeps(tmp_path: Path, monkeypatch) -> None:
    def sweep(name: str, us: float) -> str:
        rec = {"peer": "pycoll[staged]", "algo": "staged", "algo_used": "staged", "hosts": 1, "link_rate": None,
               "collective": "allreduce", "nranks": 2, "bytes": 16 << 20, "count": 4 << 20, "dtype": "float", "op": "sum",
               "root": -1, "inplace": False, "time_us": us, "wrong": 0}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"meta": {"cpus": 2}, "limits": {"copy_GBps": 8.0, "reduce_GBps": 6.0}, "records": [rec]}))
        return str(path)

    model_us = CHECK.measured_checks([sweep("probe", 1000.0)])[0]["predicted"]
    current = CHECK.measured_checks([sweep("current", model_us / 0.6)])  # this sweep alone misses
    # sweeps with uncontrolled buffer pages are counted and printed, never judged
    monkeypatch.setattr(CHECK, "UNCONTROLLED_PAGES", {"old": [sweep("old", model_us / 0.3)], "older": [sweep("older", model_us / 0.4)]})
    for ratios, verdict in (((1.0, 1.1), True), ((0.7, 1.1), False)):
        monkeypatch.setattr(CHECK, "EARLIER", {f"e{i}": [sweep(f"e{i}", model_us / r)] for i, r in enumerate(ratios)})
        text, across = CHECK.across_sweeps(current, builtin=False)
        assert len(across) == 1 and across[0]["pass"] is verdict, text
        assert sorted(across[0]["ratios"]) == pytest.approx(sorted((0.6,) + ratios))
        assert "current: 0 of 1 within" in text and "old (pages uncontrolled, not judged): 0 of 1 within" in text


def test_the_subcommand_registers_as_simulate(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import argparse

    from pycoll.perf.simulate import add_simulate_parser

    parser = argparse.ArgumentParser(prog="pycoll")
    add_simulate_parser(parser.add_subparsers(dest="command"))
    topo_file = tmp_path / "vm.json"
    CHECK.this_vm(2).dump(str(topo_file))
    args = parser.parse_args(["simulate", "--topo", str(topo_file), "-b", "1M", "-e", "4M", "-C", "broadcast"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "2 cpu ranks on 1 hosts" in out and "# peer sim, 2 ranks, broadcast" in out


def test_a_file_tuned_across_hosts_with_the_older_cost_functions_loses_its_network_terms(tmp_path: Path) -> None:
    old = dict(CostModel(net_GBps=0.19, net_latency_us=318.0, shm_GBps=3.5).to_json(),
               corrections={"allreduce:tree@net": [0.6, 0.7], "allreduce:ring@shm": [0.9, 1.3]},
               residuals={"allreduce:tree@hosts=0.0.1.1": [[1024, 1.2]], "allreduce:ring@hosts=0.0.0.0": [[1024, 0.9]]})
    del old["formula"]  # as written before the version field existed
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    m = cost.load(str(path))
    assert (m.net_GBps, m.net_latency_us) == (CostModel().net_GBps, CostModel().net_latency_us)
    assert m.shm_GBps == 3.5 and m.formula == cost.FORMULA  # one-host terms stay
    assert [c[0] for c in m.corrections] == ["allreduce:ring@shm"]
    assert [r[0] for r in m.residuals] == ["allreduce:ring@hosts=0.0.0.0"]
    assert CostModel.from_json({"net_GBps": 0.1}).net_GBps == 0.1  # a hand-written file is taken as it is
    assert cost.load(m.save(str(tmp_path / "new.json"))) == m


def test_a_file_tuned_before_the_host_memory_bound_takes_the_built_in_cma_terms_at_its_memory_speed(tmp_path: Path) -> None:
    """Formula 2 charged cma one rate whoever copied: its cma_GBps and cma residuals mean something else now."""
    old = dict(CostModel(copy_GBps=16.0, cma_GBps=11.0, cma_call_us=40.0, shm_GBps=3.5).to_json(), formula=2,
               residuals={"allreduce:cma@hosts=0.0": [[1024, 1.4]], "allreduce:ring@hosts=0.0": [[1024, 0.9]]})
    del old["host_memory_GBps"], old["cma_sync_us"]  # fields formula 2 did not have
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    m = cost.load(str(path))
    built_in = CostModel()
    assert m.copy_GBps == 16.0 and m.shm_GBps == 3.5  # its measured and fitted terms stay
    assert m.cma_GBps == pytest.approx(built_in.cma_GBps * 2) and m.host_memory_GBps == pytest.approx(built_in.host_memory_GBps * 2)
    assert (m.cma_call_us, m.cma_sync_us) == (built_in.cma_call_us, built_in.cma_sync_us)
    assert [r[0] for r in m.residuals] == ["allreduce:ring@hosts=0.0"]
    assert cost.load(m.save(str(tmp_path / "new.json"))) == m  # a file of this formula loads as it is


def test_a_measured_link_whose_two_ways_at_once_halve_gives_the_cores_socket_rate() -> None:
    """An unshaped veth pair, as `pycoll tune --links-only` measured it: 3.67 GB/s one way and 1.78 each way both ways
    at once, so the cores' socket copies bound it, each core copying both ways: ``tcp_GBps`` is twice each way's rate.
    Its wire hid behind the cores: it is priced at what they feed a socket in cache (``tcp_cache_speedup`` times their
    rate), or at the NICs' line rate where the hosts name one, so the copies bound the call. A link that carries both
    ways as fast as one (1 Gbit/s) bounds them itself: its reading is its wire's, and the built-in socket rate stays;
    as for a link measured before both ways were (0)."""
    from pycoll.topology import HostLink

    ns = CHECK.namespace_hosts(2, 1, "10gbit")
    placement, _ = placement_of(ns, 2, "cpu", per_host=1)
    a, b = (h.name for h in ns.hosts)
    cores_bound = HostLink(a, b, GBps=3.67, latency_us=9.0, both_ways_GBps=1.78)
    in_cache = 3.56 * CostModel().tcp_cache_speedup
    assert cost_topology.wire_GBps(cores_bound, CostModel().tcp_cache_speedup) == pytest.approx(in_cache)
    assert cost_topology.wire_GBps(cores_bound, 1.5, nic_GBps=11.0) == 11.0
    assert cost_topology.wire_GBps(cores_bound, 0.5) == 3.67  # never below the reading
    unshaped = CostModel.from_topology(ns.with_links([cores_bound]), placement, "cpu")
    assert (unshaped.net_GBps, unshaped.tcp_GBps) == (3.67, pytest.approx(3.56))  # the fixture's 10 Gbit/s NICs
    for host in ns.hosts:  # a veth pair reports no speed
        host.nics = [dataclasses.replace(nic, speed_Gbps=0.0) for nic in host.nics]
    unshaped = CostModel.from_topology(ns.with_links([cores_bound]), placement, "cpu")
    assert (unshaped.net_GBps, unshaped.tcp_GBps) == (pytest.approx(in_cache), pytest.approx(3.56))
    for both in (0.117, 0.0):
        shaped = CostModel.from_topology(ns.with_links([HostLink(a, b, GBps=0.118, latency_us=9.0, both_ways_GBps=both)]),
                                         placement, "cpu")
        assert (shaped.net_GBps, shaped.tcp_GBps) == (0.118, CostModel().tcp_GBps)
    assert cost_topology.tcp_rate(3.67, 1.78) == pytest.approx(3.56) and cost_topology.tcp_rate(1.18, 1.12) is None


def test_the_hosts_measured_memory_sets_the_memory_bound_rates_where_every_host_of_the_job_has_it(tmp_path: Path) -> None:
    """`pycoll tune --hosts` writes each host's memory copy and reduction rates into the topology; an untuned job's
    model takes the slowest of its hosts', and the other memory-bound rates (cma, the host's total) in proportion. A
    host left unmeasured leaves the built-in rates; the file keeps the rates."""
    from pycoll.topology import HostMemory

    ns = CHECK.namespace_hosts(3, 1, "10gbit")
    placement, _ = placement_of(ns, 3, "cpu", per_host=1)
    names = [h.name for h in ns.hosts]
    built_in = CostModel()
    measured = ns.with_memory([HostMemory(names[0], 16.0, 11.0), HostMemory(names[1], 14.0, 12.0),
                               HostMemory(names[2], 15.0, 10.5)])
    m = CostModel.from_topology(measured, placement, "cpu")
    assert (m.copy_GBps, m.reduce_GBps) == (14.0, 10.5) and "memory 14 GB/s copies, 10.5 reductions" in m.source
    assert m.cma_GBps == pytest.approx(built_in.cma_GBps * 14.0 / built_in.copy_GBps)
    assert m.host_memory_GBps == pytest.approx(built_in.host_memory_GBps * 14.0 / built_in.copy_GBps)
    two, _ = placement_of(measured, 2, "cpu", per_host=1)  # only the job's own hosts count
    assert CostModel.from_topology(measured, two, "cpu").copy_GBps == 14.0
    partial = ns.with_memory(measured.memory[:2])
    left = CostModel.from_topology(partial, placement, "cpu")
    assert (left.copy_GBps, left.reduce_GBps, left.cma_GBps) == (built_in.copy_GBps, built_in.reduce_GBps,
                                                                 built_in.cma_GBps) and "memory" not in left.source
    out = tmp_path / "topology.json"
    measured.dump(str(out))
    loaded = topology_files.load(str(out))
    assert loaded.memory == measured.memory and loaded.memory_rates(range(3)) == (14.0, 10.5)
    assert ns.memory_rates(range(3)) is None and "memory" not in ns.to_dict()  # files without it read as before
    again = measured.with_memory([HostMemory(names[1], 9.0, 8.0)])  # a new measurement replaces the host's old one
    assert len(again.memory) == 3 and again.memory_rates(range(3)) == (9.0, 8.0)


def test_measured_links_replace_the_nics_when_every_host_pair_has_one() -> None:
    from pycoll.topology import HostLink

    ns = CHECK.namespace_hosts(3, 1, "10gbit")
    placement, _ = placement_of(ns, 3, "cpu", per_host=1)
    names = [h.name for h in ns.hosts]
    nic_model = CostModel.from_topology(ns, placement, "cpu")
    two_pairs = ns.with_links([HostLink(names[0], names[1], GBps=0.9, latency_us=12.0),
                               HostLink(names[1], names[2], GBps=0.3, latency_us=30.0)])
    partial = CostModel.from_topology(two_pairs, placement, "cpu")  # hosts 0 and 2 unmeasured: the NICs decide
    assert (partial.net_GBps, partial.net_latency_us) == (nic_model.net_GBps, nic_model.net_latency_us)
    full = two_pairs.with_links([HostLink(names[2], names[0], GBps=0.6, latency_us=20.0)])
    m = CostModel.from_topology(full, placement, "cpu")
    assert (m.net_GBps, m.net_latency_us) == (0.3, 30.0)  # the slowest pair bounds every step that crosses hosts
    gpus = Topology.cluster(CHECK.dgx_h100(), 2)
    on_gpus, _ = placement_of(gpus, 16, "gpu")
    names = [h.name for h in gpus.hosts]
    g = CostModel.from_topology(gpus.with_links([HostLink(names[0], names[1], GBps=45.0, latency_us=4.0)]), on_gpus)
    assert g.net_GBps == 45.0 and g.net_latency_us == pytest.approx(4.0 + cost_topology.GPU_STEP_US)
    # only the job's own hosts count: ranks on hosts 0 and 1 see that pair alone
    two, _ = placement_of(full, 2, "cpu", per_host=1)
    assert CostModel.from_topology(full, two, "cpu").net_GBps == 0.9
