"""Tests of `pycoll perf`: options, nccl-tests bandwidth math, report formatting, JSON, and one tiny real sweep."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pycoll.perf import backends, metrics, options, peers, reference, report, sweep, worker

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- options


def test_sizes_with_suffixes_and_expansion() -> None:
    o = options.parse_args(["-b", "1K", "-e", "1M", "-f", "4"])
    assert (o.minbytes, o.maxbytes, o.stepfactor) == (1024, 1 << 20, 4)
    assert o.sizes() == [1024, 4096, 16384, 65536, 262144, 1048576]
    assert options.parse_args(["-b", "8", "-e", "100", "-f", "2"]).sizes() == [8, 16, 32, 64]  # stops below -e
    assert options.parse_args(["-b", "2G", "-e", "2G"]).sizes() == [2 << 30]


def test_defaults_match_nccl_tests() -> None:
    o = options.parse_args([])
    assert (o.minbytes, o.maxbytes, o.stepfactor, o.iters, o.warmup, o.check) == (8, 256 << 20, 2, 20, 5, 1)
    assert (o.dtype, o.np_dtype, o.itemsize, o.op, o.root, o.modes()) == ("float", "float32", 4, "sum", 0, [False, True])
    assert o.peers == ["pycoll", "mpi", "gloo", "nccl"] and len(o.collectives) == 6


def test_lists_and_flags() -> None:
    o = options.parse_args(["--np", "1,2,4", "--peers", "mpi,pycoll", "-C", "allgather,alltoall", "-n", "3", "-w", "0",
                            "-c", "0", "-d", "int", "-o", "max", "--inplace", "in", "-r", "0", "--json", "x.json",
                            "--no-progress"])
    assert o.nps == [1, 2, 4] and o.peers == ["mpi", "pycoll"] and o.collectives == ["allgather", "alltoall"]
    assert (o.iters, o.warmup, o.check, o.dtype, o.itemsize, o.op, o.modes(), o.json, o.progress) == \
        (3, 0, 0, "int32", 4, "max", [True], "x.json", False)
    assert options.parse_args(["--coll", "broadcast"]).collectives == ["broadcast"]
    assert options.parse_args(["--collectives", "reduce"]).collectives == ["reduce"]
    assert options.parse_args(["-d", "half"]).itemsize == 2
    assert options.parse_args(["-d", "float64"]).dtype == "double"


@pytest.mark.parametrize("argv", [
    ["-b", "lots"], ["-b", "-3"], ["-b", "1M", "-e", "1K"], ["-f", "1"], ["-n", "0"], ["--np", "0"], ["--np", "a,b"],
    ["--peers", "pycoll,foo"], ["-C", "allreduce,exscan"], ["--buffers", "views"], ["-d", "float128"], ["-o", "xor"], ["-c", "2"],
    ["--inplace", "maybe"], ["--np", "1,2", "-r", "1"],
])
def test_bad_values_are_argparse_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        options.parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_hosts_link_rate_and_algos() -> None:
    from pycoll.algorithms import ALGORITHMS

    o = options.parse_args(["--np", "4", "--hosts", "2", "--link-rate", "1gbit", "-C", "allreduce,allgather",
                            "--algos", "all"])
    assert (o.hosts, o.link_rate) == (2, "1gbit")
    want = [f"{c}:{a}" for c in ("allreduce", "allgather") for a in ALGORITHMS[c]]
    assert o.algos == want and "--hosts 2 --link-rate 1gbit" in options.PerfOptions(**{
        **o.to_dict(), "argv": []}).command()
    groups = dict(o.algo_groups())
    assert groups["ring"] == [c for c in ("allreduce", "allgather") if "ring" in ALGORITHMS[c]]
    assert options.parse_args(["-C", "allreduce", "--algos", "allreduce:ring"]).algos == ["allreduce:ring"]
    assert options.parse_args(["-C", "allreduce", "--algos", "ring"]).algos == ["allreduce:ring"]
    assert options.parse_args(["--algos", "allreduce:ring,allreduce:ring"]).algos == ["allreduce:ring"]
    plain = options.parse_args([])
    assert (plain.hosts, plain.link_rate, plain.algos) == (None, None, [])


@pytest.mark.parametrize("argv", [
    ["--link-rate", "1gbit"], ["--np", "2", "--hosts", "3"], ["--hosts", "0"], ["--hosts", "2", "--link-rate", "1zbit"],
    ["--hosts", "2", "--link-rate", "fast"], ["-C", "allreduce", "--algos", "allreduce:nosuch"],
    ["-C", "allreduce", "--algos", "allgather:ring"], ["--algos", "nosuch"], ["--algos", "scan:ring"],
])
def test_bad_multihost_and_algo_flags(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        options.parse_args(argv)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err


def test_jobs_and_launch_commands() -> None:
    o = options.parse_args(["--np", "4", "--hosts", "2", "--link-rate", "1gbit", "-C", "allreduce",
                            "--algos", "allreduce:ring"])
    jobs = sweep.plan_jobs(o, ["pycoll", "gloo"])
    assert [(j.label, j.algo, j.collectives, j.env) for j in jobs] == [
        ("pycoll", "auto", ["allreduce"], {"PYCOLL_ALGO": ""}), ("gloo", None, ["allreduce"], {}),
        ("pycoll[ring]", "ring", ["allreduce"], {"PYCOLL_ALGO": "allreduce:ring"})]
    spec = sweep.worker_spec(o, "pycoll", jobs[2])
    assert (spec["label"], spec["algo"], spec["hosts"], spec["link_rate"], spec["collectives"]) == \
        ("pycoll[ring]", "ring", 2, "1gbit", ["allreduce"])
    cmd, env = peers.launch_command("pycoll", 4, "{}", 2, "1gbit", jobs[2].env)
    assert cmd[cmd.index("run"):cmd.index("--")] == ["run", "-n", "4", "--hosts", "2", "--link-rate", "1gbit"]
    assert env["PYCOLL_ALGO"] == "allreduce:ring"
    assert sweep.plan_jobs(options.parse_args([]), ["pycoll"])[0].env == {}  # without --algos: PYCOLL_ALGO as exported
    cmd, env = peers.launch_command("gloo", 4, "{}", 2)
    assert "--hosts" in cmd and "MASTER_ADDR" not in env and env["GLOO_SOCKET_IFNAME"] == "veth0" and env["MASTER_PORT"]
    cmd, env = peers.launch_command("gloo", 4, "{}")
    assert "--hosts" not in cmd and env["MASTER_ADDR"] == "127.0.0.1"
    assert "virtual hosts" in (peers.unavailable("nccl", hosts=2) or "")
    cmd, env = peers.launch_command("mpi", 4, "{}", 2, "1gbit")  # mpiexec on the virtual hosts
    assert cmd[1:cmd.index("--")] == ["-m", "pycoll.perf.mpi_hosts", "-n", "4", "--hosts", "2", "--link-rate", "1gbit"]
    assert cmd[cmd.index("--") + 1:][1:3] == ["-m", "pycoll.perf.worker"]
    assert peers.unavailable("pycoll", hosts=2) is None


def test_algorithm_used_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import pycoll.algorithms as algorithms
    registry = sys.modules.get("pycoll.algorithms.registry")
    for mod in (registry, algorithms):
        if mod is not None:
            monkeypatch.delattr(mod, "last_choice", raising=False)
    assert worker.algorithm_used("pycoll", "allreduce") is None  # no hook: nothing recorded
    for choice, want in [
        (types.SimpleNamespace(collective="allreduce", algorithm="tree"), "tree"),
        (types.SimpleNamespace(collective="barrier", algorithm="direct"), None),  # another collective's choice
        ({"allreduce": types.SimpleNamespace(name="ring")}, "ring"),
        (lambda coll: "hierarchical", "hierarchical"),
        (lambda: 1 / 0, None),
        ("ring", "ring"),
    ]:
        monkeypatch.setattr(algorithms, "last_choice", choice, raising=False)
        assert worker.algorithm_used("pycoll", "allreduce") == want
    assert worker.algorithm_used("gloo", "allreduce") is None
    # the communicator's own record wins: the barriers between timed calls and the communicators an algorithm
    # calls make choices of their own, which the process-wide record holds last
    comm = types.SimpleNamespace(_x=types.SimpleNamespace(ran={"allreduce": ("hierarchical", 1 << 20)}))
    monkeypatch.setattr(algorithms, "last_choice", types.SimpleNamespace(collective="barrier", algorithm="composed"),
                        raising=False)
    assert worker.algorithm_used("pycoll", "allreduce", comm) == "hierarchical"
    assert worker.algorithm_used("pycoll", "broadcast", comm) is None  # neither record has one


def test_a_composed_calls_prediction_is_its_steps_or_none_where_unpriced() -> None:
    """A composed Allreduce's predicted time is the sum of its host and leaders' steps (pycoll.composed.predict);
    a composed Bcast's depends on its root (from a host's leader, one host step fewer); a composed Alltoall, which
    the model does not price, records none (not infinity)."""
    import types

    from pycoll import composed
    from pycoll.algorithms import Layout, cost

    lay = Layout((0, 0, 1, 1))
    comm = types.SimpleNamespace(_layout=lay, _x=types.SimpleNamespace(
        ran={"allreduce": ("composed", 1 << 20), "alltoall": ("composed", 1 << 10), "broadcast": ("composed", 1 << 20)}))
    b = types.SimpleNamespace(name="pycoll", comm=comm)
    want = composed.predict(cost.current(), "allreduce", 1 << 20, lay) * 1e6
    assert want > 0 and worker.predicted_us(b, "allreduce", "composed") == pytest.approx(want, abs=1e-3)
    assert worker.predicted_us(b, "alltoall", "composed") is None
    leader, other = (worker.predicted_us(b, "broadcast", "composed", root) for root in (2, 1))
    assert leader == pytest.approx(composed.predict(cost.current(), "broadcast", 1 << 20, lay, root=2) * 1e6, abs=1e-3)
    assert other == pytest.approx(composed.predict(cost.current(), "broadcast", 1 << 20, lay, root=1) * 1e6, abs=1e-3)
    assert other > leader


@pytest.mark.timeout(120)
def test_a_sweep_across_hosts_names_each_calls_algorithm_and_its_prediction(tmp_path: Path) -> None:
    """4 ranks on 2 namespace hosts: the composed Barrier before every timed call and the host communicators of a
    hierarchical or composed call record choices of their own; each record still names the call's algorithm and its
    model's time (no algorithm and no prediction was recorded at 4 ranks while the process-wide record was read; a
    composed call's is the sum of its steps')."""
    from pycoll import netns

    if netns.unavailable() is not None:
        pytest.skip(f"virtual hosts unavailable: {netns.unavailable()}")
    out = tmp_path / "hosts.json"
    argv = ["--np", "4", "--hosts", "2", "--peers", "pycoll", "-C", "allreduce,alltoall,reduce_scatter", "-b", "1M", "-e", "4M",
            "-f", "2", "-n", "2", "-w", "1", "--no-progress", "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "pycoll", "perf", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by_call = {(r["collective"], r["bytes"]): r for r in json.loads(out.read_text())["records"] if r["peer"] == "pycoll"}
    mib = 1 << 20
    assert by_call[("allreduce", mib)]["algo_used"] == "composed"  # priced below the flat algorithms (pycoll.composed)
    # composed (by rails), beyond 2 MiB with each host's run of blocks in pieces that fit a host arena's slot (the
    # flat ring put 1.5x the fewest bytes on the link at 4 MiB and ran 1.6x as long)
    for size in (mib, 2 * mib, 4 * mib):
        assert by_call[("reduce_scatter", size)]["algo_used"] == "composed", size
    assert by_call[("alltoall", mib)]["algo_used"] == "pairwise"
    assert all(r.get("predicted_us", 0) > 0 for r in by_call.values())


_OWN_CALLS_RANK = """
import sys
import numpy as np
from pycoll.perf import backends, worker
b = backends.make_backend("pycoll")
run, _ = b.prepare("allgather", False, 1 << 16, "float32", "sum", 0)
for _ in range(3):
    run()  # the first call plans the point; the others take its fast path
    b.most(7)  # the harness's own object calls between them
    b.gather(b.rank)
ran = worker._comm_record(b.comm).get("allgather")
assert ran is not None and ran[1] == 2 * (1 << 16) * 4, ran  # the whole output's bytes, as selection saw them
from pycoll.algorithms import cost, registry
algo = registry.ALGORITHMS["allgather"][ran[0]]
assert worker.predicted_us(b, "allgather", ran[0]) > algo.predict(cost.current(), 512, b.comm._layout) * 1e6
b.close()
print("ok", ran)
"""


@pytest.mark.timeout(120)
def test_a_points_prediction_is_of_its_own_calls_not_the_harness(tmp_path: Path) -> None:
    """The benchmark's object calls (the iteration count's maximum, the gathers of times) go on a copy of the timed
    communicator: on it, they replaced the record of the point's algorithm and size with their own 512 B Allgather
    once the point's calls took their fast path, and the first point of a sweep was predicted at a 512 B call's time
    (35 µs for a 1 MiB Allgather between hosts that took 460)."""
    from harness import run_script

    script = tmp_path / "rank.py"
    script.write_text(_OWN_CALLS_RANK)
    proc = run_script(2, script, [], timeout=100)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ok") == 2


def _algo_rec(peer: str, algo: str, nbytes: int, t: float, hosts: int = 2, used: Any = None) -> dict[str, Any]:
    return {"peer": peer, "algo": algo, "algo_used": used, "hosts": hosts, "link_rate": "1gbit",
            "collective": "allreduce", "nranks": 4, "bytes": nbytes, "inplace": False, "time_us": t, "wrong": 0}


def _perf_script(name: str) -> Any:
    """perf/NAME.py loaded as module NAME (registered, as its dataclasses need)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "perf" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_algo_selection_checker(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sel = _perf_script("algo_selection")
    mib = 1 << 20
    recs = [
        _algo_rec("pycoll", "auto", 1024, 100.0), _algo_rec("pycoll[ring]", "ring", 1024, 95.0),
        _algo_rec("pycoll[tree]", "tree", 1024, 50.0, used="ring"),  # tree declined: left out
        _algo_rec("pycoll", "auto", mib, 1000.0), _algo_rec("pycoll[ring]", "ring", mib, 2000.0),
        _algo_rec("pycoll[hierarchical]", "hierarchical", mib, 900.0),
        _algo_rec("gloo", None, mib, 10.0),  # other peers never count
    ]
    rows = sel.compare(recs)
    assert [(r.key[4], r.best, r.best_us, round(r.ratio, 3), r.ok) for r in rows] == [
        (1024, "ring", 95.0, 1.053, True), (mib, "hierarchical", 900.0, 1.111, False)]
    assert [(h.key[4], h.ok) for h in sel.hier_checks(recs)] == [(mib, True)]
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"meta": {}, "limits": {}, "records": recs}))
    assert sel.main([str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "hierarchical" in out and "1 failed" in out.splitlines()[-1]
    recs[3]["time_us"] = 980.0  # within 1.10 x 900
    path.write_text(json.dumps({"meta": {}, "limits": {}, "records": recs}))
    assert sel.main([str(path)]) == 0
    recs[3]["time_us"], recs[3]["algo_used"] = 1500.0, "hierarchical"  # slower, though it ran the same algorithm
    path.write_text(json.dumps({"meta": {}, "limits": {}, "records": recs}))
    assert sel.main([str(path)]) == 1 and "FAIL (same algorithm" in capsys.readouterr().out
    assert sel.main([str(path), "--same-algo-passes"]) == 0 and "PASS (same algorithm" in capsys.readouterr().out
    recs[5]["time_us"] = 2500.0  # hierarchical slower than ring at 1 MiB on 2 hosts
    path.write_text(json.dumps({"meta": {}, "limits": {}, "records": recs}))
    assert sel.main([str(path), "--tolerance", "10"]) == 1
    assert sel.main([str(path), "--hier-min-bytes", "2M", "--tolerance", "10"]) == 0
    path.write_text(json.dumps({"meta": {}, "limits": {}, "records": [_algo_rec("pycoll", "auto", 8, 1.0)]}))
    assert sel.main([str(path)]) == 2


def test_cli_registers_perf_lazily() -> None:
    code = ("import sys; from pycoll.cli import build_parser; build_parser(); "
            "print('pycoll.perf.sweep' in sys.modules, 'pycoll.perf.worker' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False"]
    from pycoll.cli import build_parser
    args = build_parser().parse_args(["perf", "--np", "2", "-b", "1K"])
    assert args.command == "perf" and args.np == [2] and args.minbytes == 1024


# ---------------------------------------------------------------- metrics


def test_bus_factors() -> None:
    assert metrics.bus_factor("allreduce", 4) == pytest.approx(1.5)
    assert metrics.bus_factor("allreduce", 1) == 0.0
    for coll in ("reduce_scatter", "allgather", "alltoall"):
        assert metrics.bus_factor(coll, 4) == pytest.approx(0.75)
        assert metrics.bus_factor(coll, 8) == pytest.approx(0.875)
    assert metrics.bus_factor("broadcast", 8) == 1.0 and metrics.bus_factor("reduce", 3) == 1.0
    with pytest.raises(ValueError):
        metrics.bus_factor("exscan", 2)


def test_algbw_busbw_by_hand() -> None:
    # 1 MiB in 812.3 us: 1048576 / 812.3e-6 s = 1.29087 GB/s
    assert metrics.algbw(1 << 20, 812.3) == pytest.approx(1.290872, rel=1e-5)
    assert metrics.busbw("allreduce", 2, 1 << 20, 812.3) == pytest.approx(1.290872, rel=1e-5)
    # 256 MB allreduce on 8 ranks in 10 ms: algbw 26.8435 GB/s, busbw * 14/8 = 46.976
    assert metrics.busbw("allreduce", 8, 256 << 20, 10_000) == pytest.approx(46.97620, rel=1e-5)
    assert metrics.busbw("allgather", 4, 4_000_000, 1000) == pytest.approx(3.0)
    assert metrics.algbw(100, 0) == 0.0


def test_count_rounding() -> None:
    assert metrics.round_size("allreduce", 1 << 20, 4, 2) == (1 << 20, 262144)
    assert metrics.round_size("allreduce", 1030, 4, 3) == (1028, 257)       # whole elements
    assert metrics.round_size("broadcast", 7, 8, 1) == (0, 0)
    assert metrics.round_size("allgather", 1024, 4, 3) == (1020, 85)        # per-rank count, size = count*4*3
    assert metrics.round_size("reduce_scatter", 1000, 2, 4) == (1000, 125)
    assert metrics.round_size("alltoall", 1000, 8, 3) == (984, 41)


def test_slowest_rank_median() -> None:
    # per iteration max over ranks: [3, 5, 4, 9] -> median 4.5
    assert metrics.slowest_rank_time([[1, 5, 4, 2], [3, 2, 1, 9]]) == 4.5
    assert metrics.median([5.0, 1.0, 3.0]) == 3.0


def test_reference_results_and_wrong_count() -> None:
    ref = reference.expected("allreduce", 0, 3, 5, "sum", 0, "float32")
    assert ref.tolist() == [6.0] * 5  # 1+2+3 in every column
    assert reference.expected("reduce", 1, 2, 4, "sum", 0, "float32") is None
    ag = reference.expected("allgather", 0, 2, 2, "sum", 0, "float32")
    assert ag.tolist() == [1, 2, 2, 3]
    a2a = reference.expected("alltoall", 1, 2, 2, "sum", 0, "int32")
    assert a2a.tolist() == [3, 1, 1, 2]  # block 1 of rank 0 ([1,2,3,1]) then of rank 1 ([2,3,1,2])
    assert reference.count_wrong(ref, ref, "float32", "sum") == 0
    bad = ref.copy()
    bad[[1, 3]] = 0
    assert reference.count_wrong(bad, ref, "float32", "sum") == 2
    assert reference.count_wrong(None, ref, "float32", "sum") == 5


# ---------------------------------------------------------------- report


def _rec(size: int, inplace: bool, busbw: float, coll: str = "allreduce") -> dict[str, Any]:
    return {"peer": "pycoll", "collective": coll, "nranks": 2, "bytes": size, "count": size // 4, "dtype": "float",
            "op": "sum", "root": -1, "inplace": inplace, "time_us": 10.0, "algbw_GBps": busbw, "busbw_GBps": busbw,
            "wrong": 0, "iters": 2, "warmup": 1}


def test_header_with_hosts_and_algo_column() -> None:
    assert report.header("pycoll[ring]", 4, "allreduce", "float", "sum", 2, "1gbit") == \
        "# peer pycoll[ring], 4 ranks on 2 hosts (1gbit links), allreduce, dtype float, op sum"
    assert report.header("pycoll", 4, "allgather", "float", "sum", 3) == \
        "# peer pycoll, 4 ranks on 3 hosts, allgather, dtype float, op none"
    recs = [dict(_rec(1024, False, 1.0), algo="auto", algo_used="ring"), dict(_rec(1024, True, 1.0), algo="auto",
                                                                            algo_used="tree")]
    lines = report.format_block("pycoll", 2, "allreduce", "float", "sum", recs, [False, True]).splitlines()
    assert lines[2].endswith("  algo") and lines[4].endswith("  ring/tree")


def test_table_columns_and_footer() -> None:
    recs = [_rec(1024, False, 1.0), _rec(1024, True, 2.0), _rec(4096, False, 3.0), _rec(4096, True, 6.0)]
    text = report.format_block("pycoll", 2, "allreduce", "float", "sum", recs, [False, True])
    lines = text.splitlines()
    assert lines[0] == "# peer pycoll, 2 ranks, allreduce, dtype float, op sum"
    assert "out-of-place" in lines[1] and "in-place" in lines[1]
    for col in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"):
        assert col in lines[2]
    assert lines[2].count("busbw") == 2
    row = lines[4].split()
    assert row[:5] == ["1024", "256", "float", "sum", "-1"] and len(row) == 13
    assert lines[-1] == "# Avg bus bandwidth : 3.0000"  # mean of 1, 2, 3, 6
    only_in = report.format_block("mpi", 2, "allgather", "float", "sum", recs[1::2], [True])
    assert "out-of-place" not in only_in and "op none" in only_in.splitlines()[0]
    assert only_in.splitlines()[-1].endswith(": 4.0000")


def test_progress_bar() -> None:
    assert report.Progress.line(12, 48, "pycoll np=2 allreduce 1M", 10) == "[##........] 12/48 pycoll np=2 allreduce 1M"
    buf = io.StringIO()
    p = report.Progress(4, True, buf)
    p.advance("x")
    p.clear()
    assert buf.getvalue().startswith("\r[#####") and "1/4 x" in buf.getvalue()
    quiet = io.StringIO()
    report.Progress(4, False, quiet).advance("x")
    assert quiet.getvalue() == ""
    assert [report.human(n) for n in (512, 1024, 3 << 20, 1536)] == ["512", "1K", "3M", "1536"]


def test_json_round_trip(tmp_path: Path) -> None:
    meta = {"command": "pycoll perf", "date": "2026-01-01T00:00:00+00:00", "host": "h", "cpus": 2, "python": "3.11.7",
            "pycoll": "0.1.0", "peers_skipped": {"nccl": "no CUDA GPU on this machine"}}
    limits = {"copy_GBps": 8.1, "reduce_GBps": 5.2}
    path = tmp_path / "p.json"
    report.write_json(str(path), meta, limits, [_rec(1024, False, 1.0)])
    assert report.read_json(str(path)) == {"meta": meta, "limits": limits, "records": [_rec(1024, False, 1.0)]}


def test_marker_parsing() -> None:
    assert sweep.parse_line(worker.MARKER + '{"a": 1}\n') == {"a": 1}
    assert sweep.parse_line("hello\n") is None and sweep.parse_line(worker.MARKER + "{oops") is None


def test_limit_measurement_positive() -> None:
    lim = sweep.measure_limits(4 << 20, repeats=2)
    assert set(lim) == {"copy_GBps", "reduce_GBps"} and lim["copy_GBps"] > 0 and lim["reduce_GBps"] > 0


# ---------------------------------------------------------------- end to end


@pytest.mark.timeout(120)
def test_tiny_sweep_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    argv = ["--np", "1,2", "--peers", "pycoll,mpi,gloo,nccl", "-C", "allreduce,allgather", "-b", "1K", "-e", "4K",
            "-f", "4", "-n", "2", "-w", "1", "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "pycoll", "perf", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^# limit: copy [0-9.]+ GB/s, reduce [0-9.]+ GB/s$", proc.stdout, re.M)
    data = json.loads(out.read_text())
    assert set(data) == {"meta", "limits", "records"}
    assert data["limits"]["copy_GBps"] > 0 and data["meta"]["command"].startswith("pycoll perf --np 1,2")
    expect = {"pycoll"}
    for peer in ("mpi", "gloo", "nccl"):
        reason = peers.unavailable(peer)
        if reason:
            assert data["meta"]["peers_skipped"][peer] == reason
            assert f"{peer}: skipped ({reason})" in proc.stdout
        else:
            expect.add(peer)
    if importlib.util.find_spec("torch") is None or not __import__("torch").cuda.is_available():
        assert "nccl: skipped (no CUDA GPU on this machine)" in proc.stdout or "nccl" not in expect
    got = {(r["peer"], r["nranks"], r["collective"], r["bytes"], r["inplace"]) for r in data["records"]}
    want = {(p, n, c, s, ip) for p in expect for n in (1, 2) for c in ("allreduce", "allgather")
            for s in (1024, 4096) for ip in (False, True)}
    assert got == want
    assert all(r["wrong"] == 0 for r in data["records"])
    fields = {"peer", "algo", "algo_used", "hosts", "link_rate", "device", "collective", "nranks", "bytes", "count",
              "dtype", "op", "root", "inplace", "buffers", "time_us", "algbw_GBps", "busbw_GBps", "wrong", "iters",
              "warmup", "limit_copy_GBps", "limit_reduce_GBps"}  # the host memory's speed measured just before the record's job
    assert all(set(r) - {"predicted_us"} == fields for r in data["records"])  # pycoll's cost model's prediction
    assert all("predicted_us" not in r for r in data["records"] if r["peer"] != "pycoll")
    assert all(r["predicted_us"] > 0 for r in data["records"] if r["peer"] == "pycoll" and r["nranks"] > 1
               and r["algo_used"] and "predicted_us" in r)
    assert any("predicted_us" in r for r in data["records"] if r["peer"] == "pycoll" and r["nranks"] > 1)
    assert all(r["device"] == ("cuda" if r["peer"] == "nccl" else "host") for r in data["records"])
    assert all(r["buffers"] == ("spec" if r["peer"] in ("pycoll", "mpi") else None) for r in data["records"])
    assert all(r["hosts"] == 1 and r["link_rate"] is None for r in data["records"])
    assert {r["algo"] for r in data["records"] if r["peer"] == "pycoll"} == {"auto"}
    assert all(r["algo"] is None and r["algo_used"] is None for r in data["records"] if r["peer"] != "pycoll")
    assert data["meta"]["hosts"] == 1 and data["meta"]["algos"] == []
    assert proc.stdout.count("# Avg bus bandwidth : ") == len(expect) * 2 * 2


def test_rounds_flag_and_median_merge() -> None:
    opts = options.parse_args(["--rounds", "3"])
    assert opts.rounds == 3 and "--rounds 3" in dataclasses.replace(opts, argv=[]).command()
    base = {"peer": "pycoll", "algo": "auto", "collective": "allreduce", "nranks": 4, "bytes": 1 << 20,
            "inplace": False, "wrong": 0}
    rounds = [[dict(base, time_us=t, iters=n)] for t, n in ((300.0, 20), (100.0, 900), (200.0, 400))]
    (merged,) = sweep.merge_rounds(rounds)
    assert merged["time_us"] == 200.0 and merged["rounds"] == 3 and merged["round_times_us"] == [100.0, 200.0, 300.0]
    assert merged["round_iters"] == [900, 400, 20]  # each round's count of timed calls, in the times' order
    assert merged["algbw_GBps"] == pytest.approx((1 << 20) / 200e-6 / 1e9, rel=1e-3)
    assert merged["busbw_GBps"] == pytest.approx(merged["algbw_GBps"] * 2 * 3 / 4, rel=1e-3)
    assert sweep.merge_rounds([[dict(base, time_us=5.0, round=0)]]) == [dict(base, time_us=5.0)]
    # each round's memory speed, measured before its job, stays with that round's time
    timed = [[dict(base, time_us=t, round=i, limit_copy_GBps=c, limit_reduce_GBps=c / 2)]
             for i, (t, c) in enumerate(((300.0, 7.0), (100.0, 9.0), (200.0, 8.0)))]
    (merged,) = sweep.merge_rounds(timed)
    assert merged["round_times_us"] == [100.0, 200.0, 300.0]
    assert merged["round_limits"] == [[9.0, 4.5], [8.0, 4.0], [7.0, 3.5]]
    assert not {"round", "limit_copy_GBps", "limit_reduce_GBps"} & set(merged)


class _FakeBackend(backends.Backend):
    """One rank that records which PYCOLL_ALGO each timed call ran under."""

    name = "fake"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def barrier(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def prepare(self, coll: str, inplace: bool, count: int, dtype: str, op: str, root: int) -> backends.Prepared:
        env = __import__("os").environ.get("PYCOLL_ALGO", "")
        return (lambda: self.calls.append(env)), (lambda: None)


def _interleaved_allreduce(**spec: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A spec of one rank's allreduce point and its runs: the job, then ring and tree forced (an allgather one is
    left out)."""
    spec = dict({"np_dtype": "float32", "dtype": "float", "itemsize": 4, "op": "sum", "root": 0, "warmup": 1,
                 "check": False, "label": "pycoll", "algo": "auto"}, **spec)
    runs = worker._variants(dict(spec, variants=[
        {"label": "pycoll[ring]", "algo": "ring", "env": {"PYCOLL_ALGO": "allreduce:ring"}, "collectives": ["allreduce"]},
        {"label": "pycoll[tree]", "algo": "tree", "env": {"PYCOLL_ALGO": "allreduce:tree"}, "collectives": ["allreduce"]},
        {"label": "pycoll[x]", "algo": "x", "env": {"PYCOLL_ALGO": "allgather:x"}, "collectives": ["allgather"]},
    ]), "allreduce")
    return spec, runs


def test_interleaved_variants_alternate_per_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYCOLL_ALGO", "")
    b = _FakeBackend()
    spec, runs = _interleaved_allreduce(iters=4)
    rows = worker.measure(b, spec, "allreduce", 1024, False, runs)
    assert [r["peer"] for r in rows] == ["pycoll", "pycoll[ring]", "pycoll[tree]"]  # the allgather one is left out
    assert [r["algo"] for r in rows] == ["auto", "ring", "tree"]
    a, r, t = "", "allreduce:ring", "allreduce:tree"
    timed = b.calls[3:]  # after one warm-up call each
    assert b.calls[:3] == [a, r, t]
    rounds = [timed[k:k + 3] for k in range(0, 12, 3)]
    assert all(sorted(x) == sorted([a, r, t]) for x in rounds)  # every run once an iteration
    order = []
    for i in range(4):  # the orders are the iteration's own, alike on every rank
        k = [0, 1, 2]
        __import__("random").Random(i).shuffle(k)
        order += [[a, r, t][j] for j in k]
    assert timed == order
    assert __import__("os").environ["PYCOLL_ALGO"] == ""  # restored after every call
    assert all(row["iters"] == 4 and row["time_us"] >= 0 for row in rows)


class _VariantBackend(_FakeBackend):
    """A rank whose interleaved runs each have a communicator of their own (numbered as ``on`` is told)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[int] = []
        self.variant = 0
        self.barriers: list[str] = []
        self.ran: list[tuple[int, str]] = []

    def variants(self, count: int) -> None:
        self.made.append(count)

    @contextlib.contextmanager
    def on(self, variant: int) -> Any:
        before, self.variant = self.variant, variant
        try:
            yield
        finally:
            self.variant = before

    def barrier(self) -> None:
        self.barriers.append(os.environ.get("PYCOLL_ALGO", ""))

    def prepare(self, coll: str, inplace: bool, count: int, dtype: str, op: str, root: int) -> backends.Prepared:
        variant, env = self.variant, os.environ.get("PYCOLL_ALGO", "")
        return (lambda: self.ran.append((variant, env))), (lambda: None)


def test_interleaved_runs_keep_their_own_communicators_and_the_jobs_barrier(monkeypatch: pytest.MonkeyPatch) -> None:
    # a forced algorithm's environment and communicator are its own; the Barrier before every call runs in the
    # job's environment (a switch of PYCOLL_ALGO around it made the job's plans give up their fast paths each call)
    monkeypatch.setenv("PYCOLL_ALGO", "")
    b = _VariantBackend()
    spec, runs = _interleaved_allreduce(iters=3, check=True)
    monkeypatch.setattr(worker, "check_result", lambda *a: 0)
    worker.measure(b, spec, "allreduce", 1024, False, runs)
    assert b.made == [3]
    envs = ["", "allreduce:ring", "allreduce:tree"]
    assert b.ran and all(env == envs[v] for v, env in b.ran), b.ran  # each run on its own, in its own environment
    assert sorted({v for v, _ in b.ran}) == [0, 1, 2]
    assert b.barriers == [""] * 9  # 3 timed iterations of 3 runs, each from a Barrier in the job's environment
    assert b.variant == 0 and os.environ["PYCOLL_ALGO"] == ""


def test_link_bytes_of_a_forced_run_are_counted_on_its_own_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    # the calls counted run in the forced algorithm's environment (they counted the automatic choice's bytes), the
    # barriers around them in the job's
    from pycoll import netns

    monkeypatch.setenv("PYCOLL_ALGO", "")
    monkeypatch.setattr(worker, "LINK_SETTLE_S", 0.0)
    sent = iter([100, 150, 1150])
    monkeypatch.setattr(netns, "sent_bytes", lambda: next(sent))
    monkeypatch.setattr(netns, "namespace_id", lambda: 7)
    b = _VariantBackend()
    seen: list[str] = []
    got = worker._link_bytes(b, lambda: seen.append(os.environ["PYCOLL_ALGO"]), 4, {"PYCOLL_ALGO": "allgather:ring"})
    assert got == (7, 1000, 50, 4)
    assert seen == ["allgather:ring"] * 4 and set(b.barriers) == {""} and os.environ["PYCOLL_ALGO"] == ""


def test_min_time_sets_how_many_iterations_a_point_gets() -> None:
    spec = {"iters": 20, "min_time": 0.02, "max_iters": 1000}
    assert worker.timed_iterations(spec, 10e-6) == 1000  # 2000 calls would fill 20 ms: capped
    assert worker.timed_iterations(spec, 100e-6) == 200
    assert worker.timed_iterations(spec, 1e-3) == 20  # 20 calls already take 20 ms: -n
    assert worker.timed_iterations(spec, 0.5) == 20
    assert worker.timed_iterations(dict(spec, min_time=0.0), 10e-6) == 20  # --min-time 0: exactly -n
    assert worker.timed_iterations(spec, 0.0) == 20  # no warm-up to time
    assert worker.timed_iterations(dict(spec, max_iters=5), 10e-6) == 20  # never below -n
    assert worker.timed_iterations({"iters": 7}, 1e-6) == 7  # a spec from before the option


class _SlowBackend(_FakeBackend):
    """A rank whose calls take ``call_s`` and whose peers (``others``) ask for their own iteration counts."""

    def __init__(self, call_s: float, others: int = 0) -> None:
        super().__init__()
        self.call_s, self.others = call_s, others
        self.asked: list[int] = []

    def most(self, value: int) -> int:
        self.asked.append(value)
        return max(value, self.others)

    def prepare(self, coll: str, inplace: bool, count: int, dtype: str, op: str, root: int) -> backends.Prepared:
        def run() -> None:
            time.sleep(self.call_s)
            self.calls.append("")
        return run, (lambda: None)


def test_min_time_runs_small_points_longer_with_the_count_every_rank_agrees_on() -> None:
    spec = {"np_dtype": "float32", "dtype": "float", "itemsize": 4, "op": "sum", "root": 0, "warmup": 3, "iters": 2,
            "check": False, "label": "fake", "algo": None, "min_time": 0.03, "max_iters": 200}
    b = _SlowBackend(0.002)
    row, = worker.measure(b, spec, "allreduce", 1024, False)
    assert 2 < row["iters"] <= 15, row  # 30 ms of 2 ms calls (a slower sleep asks for fewer)
    assert b.asked == [row["iters"]] and len(b.calls) == 3 + row["iters"]
    b = _SlowBackend(0.002, others=40)  # another rank's warm-up was faster: every rank runs its count
    row, = worker.measure(b, spec, "allreduce", 1024, False)
    assert row["iters"] == 40 and len(b.calls) == 3 + 40
    b = _SlowBackend(0.002)
    row, = worker.measure(b, dict(spec, min_time=0.0), "allreduce", 1024, False)
    assert row["iters"] == 2 and len(b.calls) == 3 + 2


def test_min_time_options() -> None:
    o = options.parse_args([])
    assert (o.min_time, o.max_iters) == (0.02, 1000)
    o = options.parse_args(["--min-time", "0.5", "--max-iters", "50", "-n", "3"])
    assert (o.min_time, o.max_iters, o.iters) == (0.5, 50, 3)
    assert "--min-time 0.5 --max-iters 50" in dataclasses.replace(o, argv=[]).command()
    spec = sweep.worker_spec(o, "pycoll")
    assert (spec["min_time"], spec["max_iters"], spec["iters"]) == (0.5, 50, 3)
    for bad in (["--min-time", "-1"], ["--min-time", "nan"], ["--min-time", "inf"], ["--min-time", "x"],
                ["--max-iters", "0"]):
        with pytest.raises(SystemExit):
            options.parse_args(bad)


@pytest.mark.timeout(120)
def test_interleaved_forced_algorithms_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "algos.json"
    argv = ["--np", "3", "--peers", "pycoll", "-C", "allreduce", "-b", "1K", "-e", "64K", "-f", "8", "-n", "2",
            "-w", "1", "--inplace", "out", "--algos", "allreduce:ring,allreduce:tree", "--interleave",
            "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "pycoll", "perf", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# forced algorithms (interleaved in the automatic job)" in proc.stdout
    recs = json.loads(out.read_text())["records"]
    by_peer: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        by_peer.setdefault(r["peer"], []).append(r)
    assert set(by_peer) == {"pycoll", "pycoll[ring]", "pycoll[tree]"}
    for peer, name in (("pycoll[ring]", "ring"), ("pycoll[tree]", "tree")):
        assert [r["bytes"] for r in by_peer[peer]] == [1024, 8192, 65536]
        assert all(r["algo"] == name and r["algo_used"] == name and r["wrong"] == 0 for r in by_peer[peer])
    assert all(r["algo"] == "auto" and r["wrong"] == 0 for r in by_peer["pycoll"])
    assert proc.stdout.count("# Avg bus bandwidth : ") == 3


def test_fewest_link_bytes_per_collective() -> None:
    from pycoll.perf.metrics import min_link_bytes

    n = 1 << 20
    assert min_link_bytes("allreduce", n, [2, 2]) == 2 * n
    assert min_link_bytes("allreduce", n, [1, 1, 1]) == 4 * n
    assert min_link_bytes("allreduce", n, [4]) == 0
    assert min_link_bytes("broadcast", n, [2, 1, 2]) == 2 * n
    assert min_link_bytes("allgather", n, [2, 2]) == n and min_link_bytes("reduce_scatter", n, [3, 1]) == n
    # alltoall: n is one rank's send buffer; 4 ranks on 2 hosts send half of it across
    assert min_link_bytes("alltoall", n, [2, 2]) == 4 * n / 2
    assert min_link_bytes("gather", n, [3, 1], root_host=0) == n / 4
    assert min_link_bytes("scatter", n, [3, 1], root_host=1) == 3 * n / 4
    assert min_link_bytes("pingpong", n, [1, 1], p2p_hosts=(0, 1)) == n
    assert min_link_bytes("pingpong", n, [2], p2p_hosts=(0, 0)) == 0
    assert min_link_bytes("barrier", 0, [1, 1]) is None and min_link_bytes("scan", n, [1, 1]) is None


def test_link_row_counts_each_host_once() -> None:
    from pycoll.perf.worker import _link_row

    # ranks 0, 1 on namespace 7, rank 2 on 9: (namespace, bytes in the window with the calls, without, calls);
    # rank 0 read its host's counter while trailing bytes still left: its quiet window is not the quietest
    per_rank = [(7, 5000, 900, 10), (7, 5100, 100, 10), (9, 3000, 0, 10)]
    row = _link_row(per_rank, "broadcast", 400, root=2, per_call=1)
    assert row == {"link_bytes": (5100 - 100 + 3000) // 10, "link_min_bytes": 400}
    row = _link_row([(7, 640, 0, 10), (9, 640, 0, 10)], "pingpong", 8, root=0, per_call=2)
    assert row == {"link_bytes": 64, "link_min_bytes": 8}
    assert _link_row([(7, 5, 10, 1), (9, 10, 0, 1)], "barrier", 0, 0, 1) == {"link_bytes": 10, "link_min_bytes": None}


def test_multihost_table_targets_and_stability_between_two_jobs(tmp_path: Path) -> None:
    table = _perf_script("multihost_table")

    def job(path: Path, pycoll_us: dict[int, float]) -> Path:
        recs = []
        for nbytes, t in pycoll_us.items():
            common = {"collective": "allreduce", "nranks": 2, "hosts": 2, "bytes": nbytes, "inplace": False}
            recs += [dict(common, peer="pycoll", time_us=t, link_bytes=3 * nbytes, link_min_bytes=2 * nbytes),
                     dict(common, peer="mpi", time_us=10.0, link_bytes=2 * nbytes, link_min_bytes=2 * nbytes)]
        path.write_text(json.dumps({"records": recs}))
        return path

    one = job(tmp_path / "one.json", {8: 12.0, 4096: 16.0, 1 << 20: 10.5})
    text, met, checked = table.table(one)
    assert (met, checked) == (2, 3)  # 8 B at 1.2x and 1 MiB at 1.05x pass; 4 KiB at 1.6x fails the 1.5x target
    assert "| allreduce | 2 | 4 KiB | 10.0 | - | 16.0 | 1.60 | <=1.5x FAIL | 1.50 | 1.00 |" in text
    two = job(tmp_path / "two.json", {8: 30.0, 4096: 17.0, 1 << 20: 10.0})
    text, ok, n = table.stability(one, two)
    assert (ok, n) == (2, 3) and "| pycoll | 3 | 2 | allreduce 2 ranks 8 B | 2.50 |" in text
    assert "| mpi | 3 | 3 |" in text
    # the cost model's predictions from 1 MiB: 1 MiB predicted 1.2x (within 25 %), 4 MiB 0.7x (off); smaller sizes
    # and records without a prediction are left out
    recs = [{"peer": "pycoll", "collective": "reduce", "nranks": 4, "bytes": b, "algo_used": "chain", "time_us": t,
             "predicted_us": p} for b, t, p in ((8, 10.0, 40.0), (1 << 20, 100.0, 120.0), (4 << 20, 400.0, 280.0))]
    recs.append(dict(recs[1], peer="mpi", predicted_us=None))
    (tmp_path / "pred.json").write_text(json.dumps({"records": recs}))
    text, good, total = table.predictions([tmp_path / "pred.json"])
    assert (good, total) == (1, 2) and "| pred.json | reduce | 4 | 4 MiB | chain | 400 | 280 | 0.70 (off) |" in text


def test_slow_windows_finds_runs_of_slow_calls_on_the_loops_clock() -> None:
    mod = _perf_script("slow_windows")
    # 1000 calls of 100 µs (0.1 s), then 20 of 1000 µs (20 ms), 1000 more of 100 µs, 3 lone slow calls 11 ms apart,
    # and 100 calls of 100 µs after them
    calls = [100.0] * 1000 + [1000.0] * 20 + [100.0] * 1000 + ([1000.0] + [100.0] * 100) * 3
    found = mod.windows(calls, factor=2.5, gap_s=0.05, least=10)
    assert len(found) == 1
    start, length, count = found[0]
    assert count == 20 and abs(start - 0.1) < 1e-9 and abs(length - 0.02) < 1e-9
    joined = mod.windows(calls, factor=2.5, gap_s=0.05, least=3)  # the lone ones, 11 ms apart, join into one run
    assert [k for _, _, k in joined] == [20, 3]
    assert mod.windows(calls, factor=2.5, gap_s=0.005, least=2) == [found[0]]  # 5 ms apart: not joined


def test_reproducible_mode_runs_as_its_own_pycoll_job_or_interleaved() -> None:
    o = options.parse_args(["--np", "2", "-C", "allreduce,allgather", "--reproducible"])
    jobs = sweep.plan_jobs(o, ["pycoll", "mpi"])
    assert [(j.label, j.algo, j.env) for j in jobs] == [
        ("pycoll", "auto", {}), ("mpi", None, {}),
        ("pycoll[reproducible]", "auto", {"PYCOLL_REPRODUCIBLE": "1", "PYCOLL_ALGO": ""})]
    o = options.parse_args(["--np", "2", "-C", "allreduce", "--reproducible", "--interleave"])
    auto, = sweep.plan_jobs(o, ["pycoll"])
    assert [(v.label, v.env["PYCOLL_REPRODUCIBLE"]) for v in auto.variants] == [("pycoll[reproducible]", "1")]
    assert sweep.plan_jobs(o, ["mpi"])[0].variants == []  # no pycoll job: nothing to compare the mode with
