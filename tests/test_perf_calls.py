"""Tests of `pycoll perf`'s newer calls (gather ... p2p_bw), its --buffers modes, and perf/host_calls.py --quick."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pycoll.perf import backends, metrics, options, peers, reference

ROOT = Path(__file__).resolve().parents[1]
NEW = ["gather", "scatter", "sendrecv", "scan", "barrier", "pingpong", "p2p_bw"]


def test_new_collectives_parse_and_factors() -> None:
    o = options.parse_args(["-C", ",".join(NEW), "--buffers", "fresh"])
    assert o.collectives == NEW and o.buffers == "fresh"
    assert options.parse_args([]).buffers == "spec" and options.parse_args([]).collectives == list(
        options.DEFAULT_COLLECTIVES)
    assert "--buffers array" in options.PerfOptions(buffers="array").command()
    assert metrics.bus_factor("gather", 4) == metrics.bus_factor("scatter", 4) == pytest.approx(0.75)
    assert [metrics.bus_factor(c, 4) for c in ("sendrecv", "scan", "pingpong", "p2p_bw", "barrier")] == [1, 1, 1, 1, 0]
    assert metrics.round_size("gather", 1024, 4, 3) == (1020, 85)
    assert metrics.round_size("barrier", 1 << 20, 4, 2) == (0, 0)
    assert metrics.calls_per_iteration("pingpong") == 2 and metrics.calls_per_iteration("p2p_bw") == 64


def test_references_of_new_collectives() -> None:
    # rank r's input element i is (i + r) % 3 + 1
    assert reference.expected("gather", 0, 2, 2, "sum", 0, "float32").tolist() == [1, 2, 2, 3]
    assert reference.expected("gather", 1, 2, 2, "sum", 0, "float32") is None
    assert reference.expected("scatter", 1, 2, 2, "sum", 0, "float32").tolist() == [3, 1]  # block 1 of rank 0's input
    assert reference.expected("sendrecv", 0, 3, 2, "sum", 0, "float32").tolist() == [3, 1]  # from rank 2
    assert reference.expected("scan", 1, 3, 3, "sum", 0, "float32").tolist() == [3, 5, 4]  # ranks 0 and 1
    assert reference.expected("pingpong", 1, 2, 2, "sum", 0, "float32").tolist() == [1, 2]
    assert reference.expected("pingpong", 2, 3, 2, "sum", 0, "float32") is None
    assert reference.expected("p2p_bw", 1, 2, 2, "sum", 0, "float32").tolist() == [1, 2] * 64
    assert reference.expected("barrier", 0, 2, 0, "sum", 0, "float32") is None


def test_check_catches_a_wrong_result() -> None:
    """A sabotaged output (one element off, a block from the wrong rank) is counted, not passed."""
    good = reference.expected("scan", 1, 2, 6, "sum", 0, "float32")
    assert reference.check_result(good.astype(np.float32), "scan", 1, 2, 6, "sum", 0, "float32") == 0
    bad = good.copy()
    bad[4] += 1
    assert reference.check_result(bad, "scan", 1, 2, 6, "sum", 0, "float32") == 1
    # a sendrecv that received from the right neighbour instead of the left one (3 ranks)
    wrong_peer = reference.expected("sendrecv", 2, 3, 6, "sum", 0, "float32")  # rank 1's input, what rank 0 should not get
    assert reference.check_result(wrong_peer, "sendrecv", 0, 3, 6, "sum", 0, "float32") > 0
    assert reference.check_result(None, "gather", 0, 2, 6, "sum", 0, "float32") == 12


def test_buffer_spec_uses_the_module_own_datatype() -> None:
    from pycoll import MPI as pmpi

    assert backends.mpi_datatype(pmpi, np.float32) is pmpi.FLOAT
    assert backends.mpi_datatype(pmpi, np.int64) is pmpi.INT64_T
    mpi4py = pytest.importorskip("mpi4py.MPI")
    assert backends.mpi_datatype(mpi4py, np.float64) == mpi4py.DOUBLE


def _sweep(tmp_path: Path, buffers: str, peer: str = "pycoll", np_: str = "2") -> dict:
    out = tmp_path / f"{peer}-{buffers}.json"
    argv = ["--np", np_, "--peers", peer, "-C", ",".join(NEW), "-b", "8", "-e", "4K", "-f", "512", "-n", "2", "-w", "1",
            "--buffers", buffers, "--no-progress", "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "pycoll", "perf", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=170)
    assert f"# buffers: {buffers}" in proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"proc": proc, "data": json.loads(out.read_text())}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("buffers", ["spec", "array", "fresh"])
def test_new_collectives_run_and_check(tmp_path: Path, buffers: str) -> None:
    run = _sweep(tmp_path, buffers)
    recs, meta = run["data"]["records"], run["data"]["meta"]
    assert meta["buffers"] == buffers
    got = {(r["collective"], r["bytes"], r["inplace"]) for r in recs}
    for coll in NEW:
        if coll == "scan" and any(j["reason"].startswith("scan:") for j in meta["jobs_skipped"]):
            continue  # pycoll's Comm.Scan not there yet: reported as a skip
        if coll == "barrier":
            assert got >= {("barrier", 0, False)}
            continue
        modes = [False] if coll in metrics.NO_INPLACE else [False, True]
        assert {(coll, b, ip) for b in (8, 4096) for ip in modes} <= got, coll
    assert all(r["wrong"] == 0 and r["buffers"] == buffers for r in recs)
    assert all(r["time_us"] > 0 for r in recs)
    assert "# Out of bounds values : 0 OK" in run["proc"].stdout


@pytest.mark.timeout(180)
def test_mpi_peer_with_buffer_specs(tmp_path: Path) -> None:
    if peers.unavailable("mpi"):
        pytest.skip(peers.unavailable("mpi"))
    recs = _sweep(tmp_path, "spec", peer="mpi")["data"]["records"]
    assert {r["collective"] for r in recs} == set(NEW)  # MPICH has every one, Scan included
    assert all(r["wrong"] == 0 for r in recs)


@pytest.mark.timeout(120)
def test_host_calls_quick(tmp_path: Path) -> None:
    if peers.find_mpiexec() is None or peers.unavailable("mpi"):
        pytest.skip("no mpiexec / mpi4py here")
    proc = subprocess.run([sys.executable, "perf/host_calls.py", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "| ranks | call | size | MPICH µs | pycoll µs | ratio | target | result |" in out
    for call in ("Send/Recv pingpong", "Isend x64 bw", "Allreduce", "Reduce_scatter_block", "Barrier", "halo step",
                 "first 300 small calls"):
        assert f"| 2 | {call}" in out, call
    assert re.search(r"\d+/\d+ targets pass", out)
    data = json.loads((tmp_path / "host-calls-np2.json").read_text())
    rows = {(r["call"], r["size"]): r for r in data["rows"]}
    assert rows[("Allreduce", 8)]["mpich_us"] > 0 and rows[("Allreduce", 65536)]["pycoll_us"] > 0
    assert all(r["verdict"] != "WRONG" for r in data["rows"])
    assert (tmp_path / "host-calls-np2.md").read_text().count("| 2 |") == len(data["rows"])


def test_host_calls_plans_the_calls_asked_for_in_their_order() -> None:
    """``--calls`` times a subset in the order given (the points before a call can change its time); names outside
    the suite are refused, naming the ones it has."""
    sys.path.insert(0, str(ROOT / "perf"))
    try:
        import host_calls
    finally:
        sys.path.pop(0)
    args = host_calls.build_parser().parse_args(["--calls", "Sendrecv,Barrier,Bcast", "--sizes", "8,1M"])
    assert host_calls.plan(2, args.sizes, args.calls) == [("Sendrecv", 8), ("Sendrecv", 1 << 20), ("Barrier", 0),
                                                          ("Bcast", 8), ("Bcast", 1 << 20)]
    assert host_calls.plan(2, args.sizes) == host_calls.plan(2, args.sizes, host_calls.CALLS)
    assert [c for c, _ in host_calls.plan(2, [8])] == [c for c in host_calls.CALLS]
    with pytest.raises(SystemExit):
        host_calls.build_parser().parse_args(["--calls", "Allreduce,Bogus"])
