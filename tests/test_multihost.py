"""Virtual hosts: namespaces made and removed, `pycoll run --hosts` with tcp between hosts and shm within one."""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import harness
from pycoll import netns
from pycoll.algorithms import cost

ROOT = Path(__file__).resolve().parents[1]
REASON = netns.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no virtual hosts here: {REASON}")

# Every rank: check three collectives against NumPy, then that peers on its own host use shm and the others tcp.
# PLACEMENT is the ranks per host, e.g. "2,1,2". Prints one JSON line per rank.
RANK_CHECKS = textwrap.dedent("""
    import json, os, subprocess
    import numpy as np
    from pycoll import MPI, netns
    from pycoll.runtime import current, host_id

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    counts = [int(c) for c in os.environ["PLACEMENT"].split(",")]
    host_of = [h for h, c in enumerate(counts) for _ in range(c)]
    me = host_of[rank]

    x = np.arange(1000, dtype=np.float64) * (rank + 1)
    out = np.empty_like(x)
    comm.Allreduce(x, out, op=MPI.SUM)
    assert np.array_equal(out, np.arange(1000) * sum(r + 1 for r in range(size))), "Allreduce"
    gathered = np.empty(size * 3, dtype=np.int32)
    comm.Allgather(np.full(3, rank, dtype=np.int32), gathered)
    assert np.array_equal(gathered, np.repeat(np.arange(size, dtype=np.int32), 3)), "Allgather"
    b = np.arange(70000, dtype=np.float32) if rank == size - 1 else np.zeros(70000, dtype=np.float32)
    comm.Bcast(b, root=size - 1)
    assert np.array_equal(b, np.arange(70000, dtype=np.float32)), "Bcast"

    rt = current()
    want = {p: "self" if p == rank else ("shm" if host_of[p] == me else "tcp") for p in range(size)}
    assert rt.transport_of == want, (rt.transport_of, want)
    assert rt.hosts == len(counts), rt.hosts
    assert rt.local_ranks == [p for p in range(size) if host_of[p] == me], rt.local_ranks
    assert int(os.environ["PYCOLL_LOCAL_SIZE"]) == counts[me]
    assert int(os.environ["PYCOLL_LOCAL_RANK"]) == rank - sum(counts[:me])
    ns = subprocess.run([netns.ip_binary(), "netns", "identify", str(os.getpid())],
                        capture_output=True, text=True).stdout.strip()
    from pycoll.algorithms import cost
    line = {"rank": rank, "host": me, "host_id": host_id(), "netns": ns, "listen": rt.me.addresses.get("tcp"),
            "link_rate": os.environ.get("PYCOLL_LINK_RATE"), "net_GBps": cost.current().net_GBps}
    if os.environ.get("SHOW_QDISC"):
        line["qdisc"] = subprocess.run([netns.tc_binary(), "qdisc", "show", "dev", netns.HOST_IFNAME],
                                       capture_output=True, text=True).stdout
    comm.Barrier()
    os.write(1, (json.dumps(line) + "\\n").encode())
""")


def _rank_lines(proc: harness.Proc, n: int) -> list[dict]:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = sorted((json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")), key=lambda d: d["rank"])
    assert [d["rank"] for d in lines] == list(range(n)), proc.stdout
    return lines


def _check_placement(lines: list[dict], counts: list[int]) -> None:
    host_of = [h for h, c in enumerate(counts) for _ in range(c)]
    assert [d["host"] for d in lines] == host_of
    for h in range(len(counts)):
        on_h = [d for d in lines if d["host"] == h]
        assert len({d["host_id"] for d in on_h}) == 1 and len({d["netns"] for d in on_h}) == 1
        assert len({d["listen"][0] for d in on_h}) == 1  # TCP listens on the host's own address
    assert len({d["host_id"] for d in lines}) == len(counts)
    assert len({d["listen"][0] for d in lines}) == len(counts)
    left = set(netns.list_namespaces()) & {d["netns"] for d in lines}
    assert all(d["netns"].startswith("pycoll-") for d in lines) and not left, f"namespaces left behind: {left}"


def _serve_once(listener: socket.socket, out: dict) -> None:
    conn, _ = listener.accept()
    with conn:
        got = 0
        while chunk := conn.recv(1 << 16):
            got += len(chunk)
        out["got"] = got


@pytest.mark.timeout(60)
def test_virtual_hosts_are_made_joined_and_removed() -> None:
    root_links = subprocess.run([netns.ip_binary(), "-o", "link"], capture_output=True, text=True).stdout
    with netns.VirtualHosts(3) as vh:
        assert set(vh.names + [vh.switch]) <= set(netns.list_namespaces())
        assert len(set(vh.addresses)) == 3 and all(ipaddress.ip_address(a) in vh.subnet for a in vh.addresses)
        ids = [vh.run(i, [sys.executable, "-c", "from pycoll.runtime import host_id; print(host_id())"],
                      capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip() for i in range(3)]
        assert len(set(ids)) == 3  # distinct hosts to pycoll
        addr = vh.run(2, [netns.ip_binary(), "-4", "-o", "addr", "show", "dev", netns.HOST_IFNAME],
                      capture_output=True, text=True)
        assert f"{vh.addresses[2]}/24" in addr.stdout
        # host 1 and host 2 reach a listener in host 0, through the switch namespace
        for client in (1, 2):
            listener = vh.call(0, socket.create_server, (vh.addresses[0], 0))
            port = listener.getsockname()[1]
            code = (f"import socket; s = socket.create_connection(('{vh.addresses[0]}', {port}), timeout=10); "
                    "s.sendall(b'x' * 100000); s.close()")
            got: dict = {}
            t = threading.Thread(target=_serve_once, args=(listener, got))
            t.start()
            vh.run(client, [sys.executable, "-c", code], check=True, timeout=30)
            t.join(10)
            listener.close()
            assert got.get("got") == 100000
        # the root namespace is not connected to them
        assert not any(ip in subprocess.run([netns.ip_binary(), "-4", "-o", "addr"], capture_output=True,
                                            text=True).stdout for ip in vh.addresses)
        names = vh.names + [vh.switch]
    assert not set(names) & set(netns.list_namespaces())
    assert subprocess.run([netns.ip_binary(), "-o", "link"], capture_output=True, text=True).stdout.count("\n") == \
        root_links.count("\n")


@pytest.mark.timeout(60)
def test_namespaces_removed_after_an_exception() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with netns.VirtualHosts(2) as vh:
            names = vh.names + [vh.switch]
            raise RuntimeError("boom")
    assert not set(names) & set(netns.list_namespaces())


@pytest.mark.timeout(60)
def test_a_failed_set_up_names_its_command_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = netns._run

    def refuse_addresses(argv, stdin=None, timeout=60.0):  # the hosts' own batch: the switch is made by then
        if stdin and "addr add" in stdin:
            raise netns.NetnsError(f"`{' '.join(argv)}` failed: RTNETLINK answers: Operation not permitted")
        return real(argv, stdin, timeout)

    monkeypatch.setattr(netns, "_run", refuse_addresses)
    vh = netns.VirtualHosts(2)
    with pytest.raises(netns.NetnsError, match=r"cannot make virtual hosts: `.*-batch -` failed: RTNETLINK"):
        vh.create()
    assert not set(vh.names + [vh.switch]) & set(netns.list_namespaces())


@pytest.mark.timeout(60)
def test_link_rate_shapes_both_directions() -> None:
    reason = netns.unavailable(need_tc=True)
    if reason:
        pytest.skip(reason)
    with netns.VirtualHosts(2, rate="100mbit") as vh:
        for i in range(2):
            for side in (False, True):
                q = vh.qdiscs(i, switch_side=side)
                assert "tbf" in q and "rate 100Mbit" in q, q
        # 2 MB at 100 Mbit/s takes ~0.16 s; unshaped veth moves it in a few ms
        listener = vh.call(0, socket.create_server, (vh.addresses[0], 0))
        got: dict = {}
        t = threading.Thread(target=_serve_once, args=(listener, got))
        t.start()
        sender = vh.call(1, socket.create_connection, (vh.addresses[0], listener.getsockname()[1]), 10)
        t0 = time.monotonic()
        sender.sendall(b"x" * (2 << 20))
        sender.close()
        t.join(20)
        elapsed = time.monotonic() - t0
        listener.close()
        assert got.get("got") == 2 << 20 and elapsed > 0.1, elapsed


def test_the_token_bucket_holds_a_millisecond_within_a_frame_and_two_offload_packets() -> None:
    """A shaped link bursts no further above its rate than a NIC would: 1 ms of traffic, but never below one frame
    nor above 128 KiB, so a 1 MiB call at 10 Gbit/s cannot cross at the unshaped speed."""
    assert netns.tbf_settings(1_000_000_000)[0] == 125_000
    assert netns.tbf_settings(100_000_000)[0] == 32 << 10
    assert netns.tbf_settings(10_000_000_000)[0] == 128 << 10
    assert netns.tbf_settings(100_000_000_000)[0] == 128 << 10


@pytest.mark.timeout(60)
def test_a_fast_links_qdisc_carries_the_capped_bucket() -> None:
    reason = netns.unavailable(need_tc=True)
    if reason:
        pytest.skip(reason)
    with netns.VirtualHosts(2, rate="10gbit") as vh:
        for side in (False, True):
            q = vh.qdiscs(0, switch_side=side)
            burst = re.search(r"burst (\d+)b", q)  # tc keeps the bucket in its clock's ticks: 131072 reads back as 130000
            assert "rate 10Gbit" in q and burst and abs(int(burst.group(1)) - (128 << 10)) < 4096, q


@pytest.mark.timeout(120)
def test_pycoll_run_two_hosts() -> None:
    proc = harness.run_on_hosts(RANK_CHECKS, hosts=2, n=4, env={"PLACEMENT": "2,2"}, timeout=90)
    _check_placement(_rank_lines(proc, 4), [2, 2])


@pytest.mark.timeout(120)
def test_pycoll_run_uneven_hosts_with_link_rate() -> None:
    reason = netns.unavailable(need_tc=True)
    if reason:
        pytest.skip(reason)
    proc = harness.run_on_hosts(RANK_CHECKS, hosts=3, n=5, ranks_per_host=[2, 1, 2], link_rate="1gbit",
                                env={"PLACEMENT": "2,1,2", "SHOW_QDISC": "1"}, timeout=90)
    lines = _rank_lines(proc, 5)
    _check_placement(lines, [2, 1, 2])
    for d in lines:
        assert "tbf" in d["qdisc"] and "rate 1Gbit" in d["qdisc"], d["qdisc"]
        # the launcher tells the ranks the rate, and rank 0's cost model (every rank's) takes it for the network
        assert d["link_rate"] == "1gbit" and abs(d["net_GBps"] - 0.125 * 1448 / 1538) < 1e-9, d


@pytest.mark.timeout(120)
def test_perf_on_hosts_with_forced_algorithms(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    argv = ["--np", "2", "--hosts", "2", "--peers", "pycoll", "-C", "allreduce", "-b", "1K", "-e", "4K", "-f", "4",
            "-n", "2", "-w", "1", "--algos", "allreduce:ring", "--json", str(out), "--no-progress"]
    proc = subprocess.run([sys.executable, "-m", "pycoll", "perf", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert {r["peer"] for r in data["records"]} == {"pycoll", "pycoll[ring]"}
    assert {r["algo"] for r in data["records"]} == {"auto", "ring"}
    assert all(r["hosts"] == 2 and r["link_rate"] is None and r["wrong"] == 0 for r in data["records"])
    assert "# peer pycoll, 2 ranks on 2 hosts, allreduce" in proc.stdout
    check = subprocess.run([sys.executable, str(ROOT / "perf" / "algo_selection.py"), str(out)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode in (0, 1) and "allreduce np=2 hosts=2" in check.stdout, check.stdout + check.stderr


def _owned(pid: int) -> list[str]:
    return [n for n in netns.list_namespaces() if n.startswith(f"pycoll-{pid}-")]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["fail", "timeout", "sigint"])
def test_namespaces_removed_when_the_job_ends(how: str) -> None:
    script = "import os, sys, time\nif os.environ['PYCOLL_RANK'] == '1': sys.exit(5)\ntime.sleep(0.5)"
    args = ["-n", "3", "--hosts", "2"]
    if how != "fail":
        script = "import time; time.sleep(100)"
        args += ["--timeout", "3"] if how == "timeout" else []
    cmd = [sys.executable, "-m", "pycoll", "run", *args, "--", sys.executable, "-c", script]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=harness.rank_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    if how == "sigint":
        deadline = time.monotonic() + 30
        while len(_owned(proc.pid)) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, "the virtual hosts never appeared"
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(2)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == {"fail": 5, "timeout": 124, "sigint": 130}[how], err
    assert _owned(proc.pid) == [], f"left behind: {_owned(proc.pid)}"


def test_launcher_script_runs_a_command_on_the_host_it_names(tmp_path: Path) -> None:
    with netns.VirtualHosts(2) as vh:
        script = vh.write_launcher(str(tmp_path / "on-host"))
        ids = []
        for i, addr in enumerate(vh.addresses):
            # as hydra's ssh launcher calls it: -x, the host, then the command words (joined, run by sh -c)
            got = subprocess.run([script, "-x", addr, sys.executable, "-c",
                                  "'from pycoll import netns; print(netns.namespace_id(), netns.sent_bytes())'"],
                                 capture_output=True, text=True, timeout=30)
            assert got.returncode == 0, got.stderr
            ns, sent = got.stdout.split()
            assert sent != "None"  # the host's own link is there
            ids.append(int(ns))
            owner = subprocess.run(vh.exec_prefix(i) + [sys.executable, "-c", "from pycoll import netns; "
                                                        "print(netns.namespace_id())"], capture_output=True, text=True)
            assert int(owner.stdout) == ids[-1]
        assert len(set(ids)) == 2 and netns.namespace_id() not in ids
        bad = subprocess.run([script, "-x", "192.0.2.1", "true"], capture_output=True, text=True, timeout=30)
        assert bad.returncode == 255 and "unknown virtual host 192.0.2.1" in bad.stderr


@pytest.mark.timeout(240)
def test_perf_on_hosts_runs_mpich_beside_pycoll_and_counts_link_bytes(tmp_path: Path) -> None:
    """MPICH runs on the namespaces with its traffic on the links, like pycoll; both report the bytes sent."""
    from pycoll.perf import peers

    if peers.unavailable("mpi"):
        pytest.skip(f"mpi peer: {peers.unavailable('mpi')}")
    out = tmp_path / "s.json"
    argv = ["--np", "2", "--hosts", "2", "--peers", "pycoll,mpi", "-C", "allreduce,broadcast", "-b", "64K",
            "-e", "256K", "-f", "4", "-n", "3", "-w", "1", "--inplace", "out", "--json", str(out), "--no-progress"]
    proc = subprocess.run([sys.executable, "-m", "pycoll", "perf", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=220)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = json.loads(out.read_text())["records"]
    assert {r["peer"] for r in recs} == {"pycoll", "mpi"}
    assert all(r.get("predicted_us", 0) > 0 for r in recs if r["peer"] == "pycoll" and r.get("algo_used"))
    assert any("predicted_us" in r for r in recs) and not any("predicted_us" in r for r in recs if r["peer"] == "mpi")
    for r in recs:
        assert r["wrong"] == 0 and r["hosts"] == 2
        least = (2 if r["collective"] == "allreduce" else 1) * r["bytes"]  # 2 hosts, 1 rank each
        assert r["link_min_bytes"] == least
        # frames carry headers; a peer whose traffic stayed off the link (shared memory) would show about 0
        assert 0.9 * least <= r["link_bytes"] <= 1.5 * least, r
    assert "link/min" in proc.stdout


MODEL_OF_RANK_0 = textwrap.dedent("""
    import json
    from pycoll import MPI
    from pycoll.algorithms import cost
    comm = MPI.COMM_WORLD
    comm.Barrier()
    m = cost.current()
    if comm.Get_rank() == 0:
        print("MODEL " + json.dumps({"net_GBps": m.net_GBps, "net_latency_us": m.net_latency_us, "tcp_GBps": m.tcp_GBps,
                                     "copy_GBps": m.copy_GBps, "reduce_GBps": m.reduce_GBps, "source": m.source}))
""")


@pytest.mark.timeout(180)
def test_tune_measures_each_host_pair_into_the_topology_file_and_jobs_price_links_from_it(tmp_path: Path) -> None:
    reason = netns.unavailable(need_tc=True)
    if reason:
        pytest.skip(reason)
    topo = tmp_path / "topology.json"
    proc = subprocess.run([sys.executable, "-m", "pycoll", "tune", "-n", "3", "--hosts", "3", "--link-rate", "1gbit",
                           "--links-only", "--topology", str(topo)], capture_output=True, text=True, cwd=ROOT,
                          timeout=150, env=harness.rank_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(topo.read_text())
    assert len(data["hosts"]) == 3 and len(data["links"]) == 3  # every pair of 3 hosts, each once
    assert {frozenset((lk["a"], lk["b"])) for lk in data["links"]} == {
        frozenset(p) for p in [(data["hosts"][0]["name"], data["hosts"][1]["name"]),
                               (data["hosts"][0]["name"], data["hosts"][2]["name"]),
                               (data["hosts"][1]["name"], data["hosts"][2]["name"])]}
    for lk in data["links"]:
        assert 0.08 < lk["GBps"] < 0.125, lk  # 1 Gbit/s less TCP's headers: the link, not memory
        assert 0.08 < lk["both_ways_GBps"] < 0.125, lk  # the link carries each way at its rate: the cores keep up
        assert 0 < lk["latency_us"] < 5000 and lk["source"].startswith("pycoll tune"), lk
    assert sorted(m["host"] for m in data["memory"]) == sorted(h["name"] for h in data["hosts"])
    for m in data["memory"]:  # and each host's memory, one core's copies and reductions
        assert m["copy_GBps"] > 0.1 and m["reduce_GBps"] > 0.1 and m["source"].startswith("pycoll tune"), m
    # a job that loads the file prices its links from the slowest measured pair, unless the user gives a rate
    env = {"PYCOLL_TOPO_FILE": str(topo), "PYCOLL_TUNE_FILE": "builtin", "PYCOLL_LINK_RATE": ""}
    job = harness.run_on_hosts(MODEL_OF_RANK_0, hosts=3, n=3, env=env, timeout=90)
    assert job.returncode == 0, job.stdout + job.stderr
    model = json.loads(next(ln[6:] for ln in job.stdout.splitlines() if ln.startswith("MODEL ")))
    assert model["net_GBps"] == min(lk["GBps"] for lk in data["links"])
    assert model["net_latency_us"] == max(lk["latency_us"] for lk in data["links"])
    assert model["tcp_GBps"] == cost.CostModel().tcp_GBps  # the link bound both ways: the cores' rate stays the built-in
    assert model["copy_GBps"] == min(m["copy_GBps"] for m in data["memory"])  # the slowest host's memory
    assert model["reduce_GBps"] == min(m["reduce_GBps"] for m in data["memory"])
    given = harness.run_on_hosts(MODEL_OF_RANK_0, hosts=3, n=3, env=dict(env, PYCOLL_LINK_RATE="10gbit"), timeout=90)
    model = json.loads(next(ln[6:] for ln in given.stdout.splitlines() if ln.startswith("MODEL ")))
    assert model["net_GBps"] > 1.0 and "PYCOLL_LINK_RATE" in model["source"]


START_UP_ROUNDS = textwrap.dedent("""
    import hashlib, json, os
    from pycoll import runtime

    calls = []
    real_publish, real_barrier = runtime.publish_all, runtime.store_barrier

    def publish(info, key, value, timeout):
        calls.append("exchange " + key)
        real_get = type(info.store).get

        def get(self, k, t):  # every read of the exchange is of its keys; none other happens during start-up
            calls.append("read " + k.rsplit("/", 1)[0])
            return real_get(self, k, t)

        type(info.store).get = get
        return real_publish(info, key, value, timeout)

    runtime.publish_all = publish
    runtime.store_barrier = lambda store, name, size, timeout: (calls.append(f"barrier {name} of {size}"),
                                                                real_barrier(store, name, size, timeout))[1]
    rt = runtime.get_runtime()
    model = {k: v for k, v in rt.cost_model.to_json().items() if k != "source"}
    digest = hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()
    with open(os.path.join(os.environ["ROUNDS_DIR"], f"{rt.rank}.json"), "w") as f:
        json.dump({"rank": rt.rank, "calls": sorted(set(calls)), "model": digest,
                   "missing": [h.absent.get("topology") for h in rt.topology.hosts]}, f)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_start_up_is_one_exchange_and_shared_memory_meets_per_host(n: int, tmp_path: Path) -> None:
    """Peers, every host's topology and rank 0's cost model travel in one exchange through the store; shared memory
    is set up by each host's ranks among themselves; nothing else waits on other ranks."""
    proc = harness.run_on_hosts(START_UP_ROUNDS, hosts=2, n=n, timeout=90, env={"ROUNDS_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("*.json"))]
    assert len(rows) == n
    per_host = n // 2
    for row in rows:
        first = row["rank"] - row["rank"] % per_host
        expected = ["exchange pycoll/peers", "read pycoll/peers"]
        if per_host > 1:
            expected += [f"barrier pycoll/shm-attached/{first} of {per_host}", f"barrier pycoll/shm-created/{first} of {per_host}"]
        assert row["calls"] == sorted(expected), row
    assert len({row["model"] for row in rows}) == 1  # derived on every rank from the same bytes: identical
    assert all(row["missing"] == [None, None] for row in rows), rows  # both hosts' topologies came in the exchange


@pytest.mark.timeout(400)
def test_two_ranks_across_hosts_take_small_calls_straight_through_the_socket(tmp_path: Path) -> None:
    """Two ranks on two hosts: the small collectives with a paired form (pycoll.paired) take it from their first
    call, put one frame each way on the socket, match NumPy over the op x dtype x count x in-place cases and a
    peer that waits through the engine; mismatched calls and wrong arguments still fail as they should."""
    cases = ["topology.paired_calls", "reduce.allreduce", "reduce.reduce", "reduce.reduce_scatter_block",
             "movement.bcast", "movement.allgather", "movement.alltoall", "movement.barrier", "errors.bad_args_allreduce",
             "errors.bad_args_other"]
    res = harness.run_cases_on_hosts(cases, hosts=2, n=2, out_dir=str(tmp_path), job_timeout=300)
    res.assert_ok()
    # a mismatch (each rank's shape known, so each sends straight through) is named on both ranks
    bad = harness.run_cases_on_hosts(["errors.mismatch_collective_warm"], hosts=2, n=2, out_dir=str(tmp_path / "bad"),
                                     job_timeout=120)
    bad.assert_ok()
    outcomes = bad.records("errors.mismatch_collective_warm")
    assert {o["class"] for o in outcomes.values()} == {"MismatchError"}, outcomes
    assert "allgather" in outcomes[0]["cause"] and "allreduce" in outcomes[1]["cause"], outcomes
    for name in ("Allreduce", "Allreduce in place", "Bcast", "Reduce", "Allgather", "Alltoall", "Reduce_scatter_block"):
        assert set(res.records("topology.paired_calls", f"fast {name}").values()) == {True}, name
    for name in ("Allgather", "Alltoall", "Reduce_scatter_block"):  # whole buffers larger than the staging area
        assert set(res.records("topology.paired_calls", f"fast {name} of fitting blocks").values()) == {True}, name
        # blocks past the staging area, within a chunk: one exchange in C; past the chunk, the Allgather and the
        # Reduce_scatter_block a chunk at a time through C as their schedules cut them, the Alltoall's block whole, as
        # its schedule sends it
        assert set(res.records("topology.paired_calls", f"fast {name} of larger blocks").values()) == {True}, name
        assert set(res.records("topology.paired_calls", f"fast {name} of chunk-sized blocks").values()) == {True}, name
    # every call of a shape, its first too (3 calls): the larger blocks' 3 exchanges x 3 collectives, and the
    # chunk-sized blocks' 3 calls x 2 chunks x 2 collectives and 3 whole Alltoall blocks (a chunk whose previous one
    # the engine finished may go through the engine's exchange instead)
    assert all(9 + 3 + 1 <= n <= 9 + 12 + 3 for n in res.records("topology.paired_calls", "block exchanges").values())
    # the own block copied into the result inside those exchanges, while the socket waited: the Allgather's larger
    # blocks' 3 calls and its chunk-sized blocks' 3 calls x 2 chunks (bar a chunk the engine took), the Alltoall's 6
    assert all(1 <= n <= 9 + 6 for n in res.records("topology.paired_calls", "own blocks copied in exchanges").values())
    # a two-rank Bcast sends its buffer whole, however large: still direct past the chunk (its frame through the
    # exchange in C from the shape's first call: one out of the root, one into the other rank, each call)
    assert set(res.records("topology.paired_calls", "Bcast past the chunk: frames exchanged in C").values()) == {3}
    # an Allreduce past the chunk runs the two-rank ring a chunk at a time through C (its closure), and matches a
    # peer that runs the ring's schedule
    assert set(res.records("topology.paired_calls", "Allreduce past the chunk: algorithm").values()) == {"ring"}
    assert set(res.records("topology.paired_calls", "fast Allreduce past the chunk").values()) == {True}
    assert set(res.records("topology.paired_calls", "fast Reduce past the chunk").values()) == {True}
    # 7 calls x 4 counts x 4 repeats and 3 Barriers, each one frame out of each rank (Bcast and Reduce: one rank's)
    # in one system call, a shape's first call too (its frames over 16 KiB went through the engine's send queue while
    # that call was scheduled)
    sends = res.records("topology.paired_calls", "socket sends")
    assert sum(sends.values()) == 2 * (5 * 4 * 4 + 3) + 2 * 4 * 4, sends


@pytest.mark.timeout(300)
def test_a_two_rank_call_of_large_blocks_in_one_exchange_fails_as_its_schedule_would(tmp_path: Path) -> None:
    """2 ranks on 2 hosts, a Reduce_scatter_block of 320 KiB blocks (past the socket's staging area, within a chunk)
    whose shape both know, so that it runs as one exchange in C (pycoll.paired, Engine.frame_exchanger): a rank
    that calls it with a block one element longer makes both raise a mismatch naming the two calls (the inputs
    intact), and a rank that never calls makes the other time out after comm.timeout, naming it."""
    from pycoll.transport import tcp

    if tcp.exchange_blocks is None:
        pytest.skip("pycoll/transport/_tcpframe.c was not compiled: the engine moves these frames")
    results = {}
    for case in ("errors.mismatch_reduce_scatter_large_warm", "errors.timeout_reduce_scatter_large_warm"):
        res = results[case] = harness.run_cases_on_hosts([case], hosts=2, n=2, out_dir=str(tmp_path / case),
                                                         job_timeout=120)
        res.assert_ok()
        assert set(res.records(case, "fast Reduce_scatter_block").values()) == {True}, case
        assert all(k >= 2 for k in res.records(case, "block exchanges").values()), case  # the warm calls
    outcomes = results["errors.mismatch_reduce_scatter_large_warm"].records(
        "errors.mismatch_reduce_scatter_large_warm", "outcome")
    assert len(outcomes) == 2, outcomes
    for o in outcomes.values():  # MismatchError here, PeerMismatchError where the peer found it
        assert o["class"].endswith("MismatchError") and o["op"] == "Reduce_scatter_block #4", outcomes
        assert "count=80002" in o["cause"] and "count=80000" in o["cause"], outcomes  # the whole inputs
    outcomes = results["errors.timeout_reduce_scatter_large_warm"].records(
        "errors.timeout_reduce_scatter_large_warm", "outcome")
    assert outcomes[1] == {"class": "absent"}
    assert outcomes[0]["class"] == "TimeoutError" and outcomes[0]["op"] == "Reduce_scatter_block #4", outcomes
    assert outcomes[0]["peers"] == [1], outcomes


@pytest.mark.timeout(300)
def test_an_alltoall_run_as_one_exchange_fails_as_its_schedule_would(tmp_path: Path) -> None:
    """4 ranks on 2 hosts, an Alltoall of 64 KiB blocks whose shape every rank knows, so that it runs as one
    exchange in C (pycoll.exchanged): a rank that calls it with a block one element longer makes every rank raise
    a mismatch that names the two calls (the inputs intact), and a rank that never calls makes the others time out
    after comm.timeout, one of them naming it."""
    from pycoll.transport import tcp

    if tcp.exchange is None:
        pytest.skip("pycoll/transport/_tcpframe.c was not compiled: the engine moves these frames")
    results = {}
    for case in ("errors.mismatch_alltoall_warm", "errors.timeout_alltoall_warm"):  # a job each: the first breaks it
        res = results[case] = harness.run_cases_on_hosts([case], hosts=2, n=4, out_dir=str(tmp_path / case),
                                                         job_timeout=120)
        res.assert_ok()
        assert set(res.records(case, "fast Alltoall").values()) == {True}, case
    outcomes = results["errors.mismatch_alltoall_warm"].records("errors.mismatch_alltoall_warm", "outcome")
    assert len(outcomes) == 4, outcomes
    for o in outcomes.values():  # MismatchError here, PeerMismatchError where a peer found it
        assert o["class"].endswith("MismatchError") and o["op"] == "Alltoall #3", outcomes
        assert "count=8193" in o["cause"] and "count=8192" in o["cause"], outcomes
    outcomes = results["errors.timeout_alltoall_warm"].records("errors.timeout_alltoall_warm", "outcome")
    assert outcomes[3] == {"class": "absent"}
    waited = [o for r, o in outcomes.items() if r != 3]
    assert all(o["op"] == "Alltoall #3" and o["class"] in ("TimeoutError", "RemoteError") for o in waited), outcomes
    assert any(o["class"] == "TimeoutError" and o["peers"] == [3] for o in waited), outcomes


@pytest.mark.timeout(300)
def test_a_composed_allreduce_in_segments_fails_and_leaves_nothing_waiting(tmp_path: Path) -> None:
    """4 ranks on 2 hosts, a 4 MiB Allreduce composed in segments (a 1 Gbit/s link given to the model). A rank that
    calls it with one element more: the mismatch reaches the other host through its leader (none waits for a
    timeout), every input intact. A rank that never calls: its host-mate times out, and the others raise
    that timeout as a remote error, or time out themselves, or name a rank that timed out and left before them. Every
    error names the user's call on its communicator, the rank and the peers there; its cause, the inner step."""
    results = {}
    for case in ("errors.mismatch_allreduce_segments", "errors.timeout_allreduce_segments"):
        res = results[case] = harness.run_cases_on_hosts([case], hosts=2, n=4, out_dir=str(tmp_path / case),
                                                         env={"PYCOLL_LINK_RATE": "1gbit"}, job_timeout=120)
        res.assert_ok()
        assert set(res.records(case, "in segments").values()) == {2}, case  # the warm calls
    outcomes = results["errors.mismatch_allreduce_segments"].records("errors.mismatch_allreduce_segments", "outcome")
    assert len(outcomes) == 4, outcomes
    # the second host's step finds the counts differ; its ranks break the leaders' and the rails' communicators, and
    # the first host's leader its host's, so the mismatch reaches the first host (MismatchError where it was found).
    # A rank waiting on its host's arena may see the rank that told it leave first: it names that rank, or is told
    # so by a peer that saw it leave (PeerLostError).
    assert outcomes[0]["class"].endswith("MismatchError"), outcomes  # through the leaders' communicator
    for o in outcomes.values():
        assert o["class"].endswith("MismatchError") or o["class"] in ("PeerFailureError", "PeerLostError"), outcomes
        if o["class"].endswith("MismatchError"):
            assert "count=125001" in o["cause"] and "count=125000" in o["cause"], outcomes
            assert o["cause"].count("found by") <= 1, outcomes  # a relayed report keeps its finder, once
    outcomes = results["errors.timeout_allreduce_segments"].records("errors.timeout_allreduce_segments", "outcome")
    assert outcomes[3] == {"class": "absent"}
    waited = [o for r, o in outcomes.items() if r != 3]
    # the absent rank's host-mate times out; the ranks it tells (through the leaders, then the first host's)
    # raise RemoteError naming that timeout, unless their own wait ran out first or they saw a rank leave
    assert any(o["class"] == "TimeoutError" for o in waited), outcomes
    assert all(o["class"] in ("TimeoutError", "RemoteError", "PeerFailureError") for o in waited), outcomes
    assert all("TimeoutError" in o["cause"] for o in waited if o["class"] == "RemoteError"), outcomes
    for case, res in results.items():
        _named_as_the_users_call(res.records(case, "outcome"), lambda rank: "Allreduce")


@pytest.mark.timeout(180)
def test_a_composed_mismatch_is_a_mismatch_on_a_leader_that_arrives_after_the_report(tmp_path: Path) -> None:
    """4 ranks on 2 hosts, a small composed Allreduce that rank 0 calls with one element fewer, the second host's
    leader 0.5 s late. The first host's ranks find the mismatch in their host's step and break the leaders' and the
    rails' communicators before that leader reaches its step there. It and its host-mate still raise the mismatch
    (they had raised CommunicatorBrokenError and RemoteError: the report had broken every call, the one they were
    about to make as if it came after the failure)."""
    case = "errors.mismatch_composed_leader_arrives_late"
    res = harness.run_cases_on_hosts([case], hosts=2, n=4, out_dir=str(tmp_path), job_timeout=120)
    res.assert_ok()
    outcomes = res.records(case, "outcome")
    assert len(outcomes) == 4, outcomes
    for o in outcomes.values():
        assert o["class"] in ("MismatchError", "PeerMismatchError"), outcomes
        assert "count=4" in o["cause"] and "count=5" in o["cause"], outcomes
    _named_as_the_users_call(outcomes, lambda rank: "Allreduce")


def _named_as_the_users_call(outcomes: dict, call_of: Any) -> None:
    """Each failed rank's error names the call it made on the world communicator (``call_of(rank)``), numbered as
    that communicator's calls, this rank, peers among the world's ranks, and the composed call's inner step."""
    failed = {r: o for r, o in outcomes.items() if o.get("class") not in (None, "absent")}
    assert failed, outcomes
    for r, o in failed.items():
        assert re.fullmatch(rf"{call_of(r)} #\d+", o["op"] or ""), (r, o)
        assert o["rank"] == r and all(0 <= p < len(outcomes) and p != r for p in o["peers"]), (r, o["peers"], o["cause"])
        assert "[in its step " in o["cause"] and "composed across hosts" in o["cause"], (r, o)
    assert len({o["op"] for r, o in failed.items() if call_of(r) == call_of(0)}) == 1, failed  # numbered alike


@pytest.mark.timeout(300)
def test_a_small_composed_call_fails_as_the_users_call(tmp_path: Path) -> None:
    """4 ranks on 2 hosts, small calls composed from calls in each host and among the leaders: rank 0 calls
    Allreduce where the others call Allgather, and, in a second job, rank 3 never calls an Allreduce. Each failed
    rank's error names its own call on the world communicator (not the host's or the leaders' call it arose in),
    its rank and peers in the world's numbering, and says which step, among which of its ranks, failed."""
    bad = harness.run_cases_on_hosts(["errors.mismatch_collective_warm"], hosts=2, n=4, out_dir=str(tmp_path / "bad"),
                                     job_timeout=120)
    bad.assert_ok()
    outcomes = bad.records("errors.mismatch_collective_warm", "outcome")
    assert len(outcomes) == 4 and all(o["class"] is not None for o in outcomes.values()), outcomes
    _named_as_the_users_call(outcomes, lambda rank: "Allreduce" if rank == 0 else "Allgather")
    late = harness.run_cases_on_hosts(["errors.timeout_allreduce"], hosts=2, n=4, out_dir=str(tmp_path / "late"),
                                      job_timeout=120)
    late.assert_ok()
    outcomes = late.records("errors.timeout_allreduce", "outcome")
    assert outcomes[3] == {"class": "absent"}, outcomes
    _named_as_the_users_call(outcomes, lambda rank: "Allreduce")


@pytest.mark.timeout(300)
def test_blocks_to_other_hosts_move_together_in_c(tmp_path: Path) -> None:
    """Alltoall(v) blocks past the small-frame size on 2 hosts of 2 and on hosts of 2, 1 and 2 ranks, and the
    single-chunk frames of a two-rank step (Allreduce, Reduce_scatter_block, Allgather): every case matches NumPy,
    the frames to and from the other hosts move in one call into C (``Engine.exchange_frames``), the host peer's
    through its rings in the same call (unless PYCOLL_EXCHANGE_RINGS=0),
    and where C's waits are cut to nothing and the sockets' buffers and the rings to 64 KiB, frames that C moved in
    part are finished by the engine, still matching NumPy."""
    from pycoll.transport import tcp

    if tcp.exchange is None:
        pytest.skip("pycoll/transport/_tcpframe.c was not compiled: the engine moves these frames")
    # compositions off: at 2 ranks a host the model composes these calls, and then only the hosts' leaders cross
    res = harness.run_cases_on_hosts(["movement.alltoall_large_blocks", "reduce.blocks_past_small_frames"], hosts=2, n=4,
                                     env={"PYCOLL_SMP_BYTES": "0"}, out_dir=str(tmp_path / "a"), job_timeout=240)
    res.assert_ok()
    for case in ("movement.alltoall_large_blocks", "reduce.blocks_past_small_frames"):
        moved = res.records(case, "frames exchanged")
        assert len(moved) == 4 and all(k > 0 for k in moved.values()), (case, moved)
    # the host peer's blocks join that call through the rings (PYCOLL_EXCHANGE_RINGS), and stay with the engine
    # where it is off
    rings = res.records("movement.alltoall_large_blocks", "ring frames exchanged")
    assert len(rings) == 4 and all(k > 0 for k in rings.values()), rings
    # from a shape's second call, the Alltoall is that exchange alone (pycoll.exchanged)
    assert set(res.records("movement.alltoall_large_blocks", "fast Alltoall").values()) == {True}
    # and that exchange is one call into C with the blocks and headers made once (Engine.frame_exchanger)
    blocks = res.records("movement.alltoall_large_blocks", "block exchanges")
    assert len(blocks) == 4 and all(k > 0 for k in blocks.values()), blocks
    # each rank's own block copied into its result in that call, while the sockets waited
    copies = res.records("movement.alltoall_large_blocks", "own blocks copied in exchanges")
    assert len(copies) == 4 and all(0 < copies[r] <= blocks[r] for r in copies), (copies, blocks)
    res = harness.run_cases_on_hosts(["movement.alltoall_large_blocks"], hosts=2, n=4,
                                     env={"PYCOLL_SMP_BYTES": "0", "PYCOLL_EXCHANGE_RINGS": "0"},
                                     out_dir=str(tmp_path / "rings-off"), job_timeout=240)
    res.assert_ok()
    assert set(res.records("movement.alltoall_large_blocks", "ring frames exchanged").values()) == {0}
    assert set(res.records("movement.alltoall_large_blocks", "fast Alltoall").values()) == {False}  # the schedule's
    # rank 0, owing another host a message as an Alltoall starts, does not wait in C (its peer may need those bytes
    # first); it moves what is ready and leaves the rest to the engine
    assert res.records("movement.alltoall_large_blocks", "exchanges unwaited")[0] >= 1
    cut = {"PYCOLL_TCP_EAGER_WAIT_MS": "0", "PYCOLL_YIELD_US": "0", "PYCOLL_SPIN_US": "0", "PYCOLL_SOCKET_BUFFER": "64K",
           "PYCOLL_SHM_BUFFER": "64K"}
    res = harness.run_cases_on_hosts(["movement.alltoall_large_blocks"], hosts=3, n=5, ranks_per_host=[2, 1, 2],
                                     env=cut, out_dir=str(tmp_path / "b"), job_timeout=240)
    res.assert_ok()
    handed_on = res.records("movement.alltoall_large_blocks", "frames handed on")
    assert len(handed_on) == 5 and sum(handed_on.values()) > 0, handed_on
    assert all(k > 0 for k in res.records("movement.alltoall_large_blocks", "block exchanges").values())
    rings = res.records("movement.alltoall_large_blocks", "ring frames handed on")  # blocks past a ring's 64 KiB
    assert all(rings[r] > 0 for r in (0, 1, 3, 4)) and rings[2] == 0, rings  # rank 2 is alone on its host
    # one rank on each of two hosts: the rings' and the recursive doubling's single step is one swap in C (the
    # 2**20-element cases, of several chunks, keep the engine's pipeline beside them)
    res = harness.run_cases_on_hosts(["reduce.blocks_past_small_frames", "large.allreduce", "large.reduce_family",
                                      "large.movement"], hosts=2, n=2, out_dir=str(tmp_path / "c"), job_timeout=240)
    res.assert_ok()
    moved = res.records("reduce.blocks_past_small_frames", "frames exchanged")
    assert len(moved) == 2 and all(k > 0 for k in moved.values()), moved


def test_a_large_sendrecv_with_one_peer_on_another_host_is_one_exchange_in_c(tmp_path: Path) -> None:
    """Sendrecv past the eager size with a partner on the other host, dest and source the same and one tag: both frames
    move in one call into C (``Engine.sendrecv_frames``), and every case the engine must take instead (a shorter
    message, another tag's message ahead, a partner's Recv then Send, Sendrecv_replace) matches. With C's waits cut
    and the sockets' buffers at 64 KiB, frames that C moved in part are finished by the engine."""
    from pycoll.transport import tcp

    if tcp.exchange is None:
        pytest.skip("pycoll/transport/_tcpframe.c was not compiled: the engine moves these frames")
    case = "p2p.sendrecv_large_one_peer"
    # with it, the eager Sendrecv round a ring of hosts of two ranks (one partner on the host, one off it)
    res = harness.run_cases_on_hosts([case, "p2p.sendrecv_ring_late_peer"], hosts=2, n=4, out_dir=str(tmp_path / "a"),
                                     job_timeout=120)
    res.assert_ok()
    moved = res.records(case, "frames exchanged")
    assert len(moved) == 4 and all(k >= 6 for k in moved.values()), moved  # three rounds both ways at least
    cut = {"PYCOLL_TCP_EAGER_WAIT_MS": "0", "PYCOLL_YIELD_US": "0", "PYCOLL_SPIN_US": "0", "PYCOLL_SOCKET_BUFFER": "64K"}
    res = harness.run_cases_on_hosts([case], hosts=2, n=2, env=cut, out_dir=str(tmp_path / "b"), job_timeout=120)
    res.assert_ok()
    handed_on = res.records(case, "frames handed on")
    assert len(handed_on) == 2 and sum(handed_on.values()) > 0, handed_on


def test_a_posted_receive_from_another_host_waits_for_its_message_in_c(tmp_path: Path) -> None:
    """Irecv posted before the partner on the other host sends, then Isend and Waitall or Wait: the wait takes the
    message from the socket in C (``Engine.take_posted_from_socket``) on every rank, and the cases it must leave to
    the engine (another tag's message ahead, ANY_TAG with a status, a longer buffer) match. The wait in C is let run
    past the partner's 5 ms lateness, so that each of the three exchanges where the partner comes late counts."""
    case = "p2p.exchange_posted_first"
    for n in (2, 4):
        res = harness.run_cases_on_hosts([case], hosts=2, n=n, env={"PYCOLL_TCP_EAGER_WAIT_MS": "200"},
                                         out_dir=str(tmp_path / f"n{n}"), job_timeout=120)
        res.assert_ok()
        took = res.records(case, "posted socket takes")
        assert len(took) == n and all(k >= 3 for k in took.values()), took


@pytest.mark.timeout(200)
def test_ranks_the_scheduler_put_on_one_cpu_spin_briefly_until_they_run_apart(tmp_path: Path) -> None:
    """Two ranks on two hosts, moved onto one CPU after start-up (as a launcher that does not bind may leave them):
    their socket waits see each first yield hand the CPU to the peer and switch to the short spin, and switch back
    once the ranks run apart again (``Engine.seen_cpu``), in collectives and in point-to-point calls alike; every
    result matches NumPy meanwhile."""
    cases = ["placement.peer_on_this_cpu", "placement.peer_on_this_cpu_p2p"]
    res = harness.run_cases_on_hosts(cases, hosts=2, n=2, out_dir=str(tmp_path), job_timeout=160)
    res.assert_ok()
    for case in cases:  # the collectives' frame swaps, then the point-to-point waits alone
        seen = res.records(case, "cpu_shared")
        if not seen:
            why = {d.get("skipped", {}).get(case) for d in res.ranks.values()}
            pytest.skip(f"the case skipped: {sorted(map(str, why))}")
        assert seen == dict.fromkeys(range(2), [False, True, False]), (case, seen)
