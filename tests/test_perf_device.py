"""`pycoll perf --device cuda`: the option, the nccl peer's absence and skip reasons, the device limit line,
and a 2-rank device sweep of pycoll under numba's CUDA simulator checked for wrong results."""

from __future__ import annotations

import contextlib
import ctypes
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pycoll.perf import backends, devices, options, peers, plot, reference, sweep, worker
from test_device_buffers import _gpu_missing  # numba.cuda's own answer, asked without the simulator

ROOT = Path(__file__).resolve().parents[1]
DUP = "NCCL error in: ProcessGroupNCCL.cpp:1, invalid usage\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 0"


# ---------------------------------------------------------------- host buffers


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``addr`` (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize("dtype", ["float32", "int8", "float64"])
def test_host_buffers_have_mappings_of_their_own(dtype: str) -> None:
    big = (3 << 20) // np.dtype(dtype).itemsize + 1  # not a whole number of pages
    a = devices.HostArrays().zeros(big, dtype)
    assert (a.shape, a.dtype, a.flags.writeable, a.flags.c_contiguous) == ((big,), np.dtype(dtype), True, True)
    assert not a.any() and a.ctypes.data % (2 << 20) == 0
    a[:] = 7
    assert int(a[-1]) == 7 and int(a.sum()) == 7 * big
    if sys.platform.startswith("linux"):
        assert "hg" in _vm_flags(a.ctypes.data)  # advised for huge pages, whatever malloc did before
    small = devices.HostArrays().zeros(5, dtype)
    assert small.shape == (5,) and not small.any()


def test_host_inputs_are_copied_into_fresh_buffers() -> None:
    src = reference.inputs(1, (1 << 20) + 3, "sum", np.float32)
    got = devices.HostArrays().from_host(src)
    assert got is not src and not np.shares_memory(got, src)
    np.testing.assert_array_equal(got, src)
    assert got.ctypes.data % (2 << 20) == 0


# ---------------------------------------------------------------- options


def test_device_option() -> None:
    assert options.parse_args([]).device == "host"
    o = options.parse_args(["--device", "cuda", "--np", "2,4", "--peers", "pycoll,nccl"])
    assert o.device == "cuda"
    rebuilt = options.PerfOptions(**{**o.to_dict(), "argv": []}).command()
    assert rebuilt.endswith("--device cuda") and "--device" not in options.PerfOptions().command()
    spec = sweep.worker_spec(o, "pycoll")
    assert (spec["device"], spec["nccl_via"]) == ("cuda", None)
    assert sweep.worker_spec(o, "nccl", nccl_via="cupy")["nccl_via"] == "cupy"
    assert sweep.worker_spec(options.parse_args([]), "pycoll")["device"] == "host"


def test_bad_device_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        options.parse_args(["--device", "gpu"])
    assert exc.value.code == 2 and "invalid choice: 'gpu'" in capsys.readouterr().err


# ---------------------------------------------------------------- peers: absence and skips


def test_peer_reasons_with_device_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    assert "CUDA-aware" in peers.unavailable("mpi", device="cuda")
    monkeypatch.setattr(devices, "numba_cuda_missing", lambda: "no CUDA device (numba.cuda.is_available() is False)")
    assert peers.unavailable("pycoll", device="cuda") == "no CUDA device (numba.cuda.is_available() is False)"
    assert peers.unavailable("pycoll") is None  # host buffers need no device
    monkeypatch.setattr(devices, "numba_cuda_missing", lambda: None)
    assert peers.unavailable("pycoll", device="cuda") is None
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    assert devices.simulator() and "simulator" in peers._cupy_nccl_missing()


def test_nccl_route_and_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYCOLL_PERF_NCCL", raising=False)
    monkeypatch.setattr(peers, "_torch_nccl_missing", lambda: "no CUDA GPU on this machine")
    monkeypatch.setattr(peers, "_cupy_nccl_missing", lambda: "cupy is not installed")
    assert peers.nccl_route() == (None, "no CUDA GPU on this machine")
    assert peers.unavailable("nccl") == "no CUDA GPU on this machine"
    monkeypatch.setattr(peers, "_cupy_nccl_missing", lambda: "cupy.cuda.nccl is unusable (ImportError: libnccl)")
    assert peers.nccl_route() == (None, "torch: no CUDA GPU on this machine; CuPy: cupy.cuda.nccl is unusable "
                                        "(ImportError: libnccl)")
    monkeypatch.setattr(peers, "_cupy_nccl_missing", lambda: None)
    assert peers.nccl_route() == ("cupy", "") and peers.unavailable("nccl") is None
    monkeypatch.setattr(peers, "_torch_nccl_missing", lambda: None)
    assert peers.nccl_route() == ("torch", "")  # torch first
    monkeypatch.setenv("PYCOLL_PERF_NCCL", "cupy")
    assert peers.nccl_route() == ("cupy", "")
    monkeypatch.setattr(peers, "_cupy_nccl_missing", lambda: "cupy is not installed")
    assert peers.nccl_route() == (None, "cupy is not installed")  # forced: torch is not tried
    monkeypatch.setenv("PYCOLL_PERF_NCCL", "mpi")
    assert "choose torch or cupy" in peers.nccl_route()[1]
    assert "virtual hosts" in peers.unavailable("nccl", hosts=2)


def test_nccl_absent_here_is_reported() -> None:
    """On this machine (no GPU, torch without CUDA) the nccl peer says why it cannot run."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: nccl may run")
    reason = peers.unavailable("nccl")
    assert reason and ("CUDA" in reason or "cupy" in reason.lower())


def test_duplicate_gpu_jobs_are_skipped() -> None:
    why = peers.job_unavailable("nccl", 2, 1)
    assert why and "Duplicate GPU detected" in why and "2 ranks on 1 GPU " in why
    assert peers.job_unavailable("nccl", 1, 1) is None and peers.job_unavailable("nccl", 4, 8) is None
    assert peers.job_unavailable("pycoll", 8, 1) is None and peers.job_unavailable("gloo", 8, 0) is None
    assert worker.skip_reason(RuntimeError(DUP)) == \
        "NCCL takes one GPU per rank (Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 0)"
    assert worker.skip_reason(RuntimeError("NCCL error: unhandled system error")) is None


class _DupBackend(backends.Backend):
    """A 1-rank backend whose collectives fail as NCCL does with two ranks on one GPU."""

    name = "nccl"

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def prepare(self, coll: str, inplace: bool, count: int, dtype: str, op: str, root: int) -> backends.Prepared:
        raise RuntimeError(DUP)


def test_worker_reports_a_duplicate_gpu_as_a_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker, "make_backend", lambda *a: _DupBackend())
    spec = sweep.worker_spec(options.parse_args(["-C", "allreduce,broadcast", "-b", "8", "-e", "8"]), "nccl")
    recs: list[dict[str, Any]] = []
    worker.run_peer(spec, recs.append)
    assert [(r["collective"], "error" in r, r["skipped"].startswith("NCCL takes one GPU per rank")) for r in recs] == \
        [("allreduce", False, True), ("broadcast", False, True)]


def test_sweep_records_skipped_nccl_jobs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """np=2 on one GPU: the nccl job is not launched, the JSON says why, and the sweep does not fail."""
    monkeypatch.setattr(peers, "unavailable", lambda peer, *a, **k: None)
    monkeypatch.setattr(peers, "nccl_route", lambda: ("torch", ""))
    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    monkeypatch.setattr(sweep, "measure_limits", lambda: {"copy_GBps": 1.0, "reduce_GBps": 1.0})
    launched: list[Any] = []
    monkeypatch.setattr(sweep, "run_job", lambda *a: launched.append(a) or ([], None))
    out = tmp_path / "s.json"
    opts = options.parse_args(["--np", "2", "--peers", "nccl", "-C", "allreduce", "-b", "1K", "-e", "1K",
                               "--json", str(out), "--no-progress"])
    assert sweep.run_sweep(opts) == 0 and not launched
    text = capsys.readouterr().out
    assert "# nccl through torch.distributed" in text
    assert "# peer nccl, 2 ranks: skipped (NCCL refuses 2 ranks on 1 GPU" in text
    meta = json.loads(out.read_text())["meta"]
    assert meta["jobs_skipped"] == [{"peer": "nccl", "nranks": 2, "reason": peers.job_unavailable("nccl", 2, 1)}]
    assert meta["device"] == "host" and meta["nccl_via"] == "torch"


def test_check_in_chunks_counts_every_wrong_element(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reference, "CHECK_CHUNK", 3)  # 10 elements: chunks of 3, 3, 3 and 1
    for coll, n, count in (("allreduce", 3, 10), ("allgather", 2, 5), ("alltoall", 2, 5), ("reduce_scatter", 2, 10)):
        length = reference.output_length(coll, n, count)
        good = reference.expected(coll, 1, n, count, "sum", 0, "float32")
        assert good.size == length and reference.check_result(good, coll, 1, n, count, "sum", 0, "float32") == 0
        bad = good.astype("float32")
        bad[[0, 4, length - 1]] += 1
        assert reference.check_result(bad, coll, 1, n, count, "sum", 0, "float32") == 3, coll
        assert reference.check_result(bad[:-1], coll, 1, n, count, "sum", 0, "float32") == length  # wrong size
    assert reference.check_result(None, "reduce", 1, 2, 4, "sum", 0, "float32") == 0  # not the root: nothing to check


class _PtrArray(np.ndarray):
    """A NumPy array with CuPy's ``.data.ptr`` (its address), for a fake NCCL that works on addresses."""

    @property
    def data(self) -> Any:  # type: ignore[override]
        return types.SimpleNamespace(ptr=self.ctypes.data)


class _FakeArrays(devices.HostArrays):
    """CupyArrays' interface over _PtrArray host memory."""

    name = "cupy"
    stream = contextlib.nullcontext()  # `with stream:` as CuPy's; .ptr below
    stream.ptr = 0  # type: ignore[attr-defined]
    cp = types.SimpleNamespace(copyto=np.copyto)

    def from_host(self, host: np.ndarray) -> Any:
        return host.copy().view(_PtrArray)

    def zeros(self, n: int, dtype: Any) -> Any:
        return np.zeros(n, dtype).view(_PtrArray)


class _FakeNcclComm:
    """One rank's NCCL: every collective is a copy of count elements; send/recv pair up inside a group."""

    SIZES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}  # nccl.h datatype -> bytes

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.sent: list[tuple[int, int]] = []

    def _copy(self, name: str, src: int, dst: int, count: int, dtype: int) -> None:
        self.calls.append(name)
        ctypes.memmove(dst, src, count * self.SIZES[dtype])

    def allReduce(self, src, dst, count, dtype, op, stream):  # noqa: N802 - CuPy's names
        self._copy("allReduce", src, dst, count, dtype)

    def reduceScatter(self, src, dst, count, dtype, op, stream):  # noqa: N802
        self._copy("reduceScatter", src, dst, count, dtype)

    def allGather(self, src, dst, count, dtype, stream):  # noqa: N802
        self._copy("allGather", src, dst, count, dtype)

    def broadcast(self, src, dst, count, dtype, root, stream):
        self._copy("broadcast", src, dst, count, dtype)

    def reduce(self, src, dst, count, dtype, op, root, stream):
        self._copy("reduce", src, dst, count, dtype)

    def send(self, src, count, dtype, peer, stream):
        self.sent.append((src, count * self.SIZES[dtype]))

    def recv(self, dst, count, dtype, peer, stream):
        src, nbytes = self.sent.pop(0)
        self.calls.append("sendrecv")
        ctypes.memmove(dst, src, nbytes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_cupy_nccl_peer_calls_on_one_rank(dtype: str) -> None:
    """The CuPy NCCL peer's buffers, counts, in-place offsets and datatypes, against a 1-rank fake NCCL."""
    b = object.__new__(backends._CupyNccl)
    b.arrays, b.nc, b.size, b.rank = _FakeArrays(), _FakeNcclComm(), 1, 0
    b.nccl = types.SimpleNamespace(groupStart=lambda: None, groupEnd=lambda: None)  # no NCCL_* names: nccl.h values
    for coll in options.COLLECTIVES:
        if coll not in options.DEFAULT_COLLECTIVES:  # the calls nccl-tests' six do not cover say so, as a skip
            with pytest.raises(backends.Unsupported, match="cupy.cuda.nccl"):
                b.prepare(coll, False, 7, dtype, "sum", 0)
            continue
        for inplace in (False, True):
            run, result = b.prepare(coll, inplace, 7, dtype, "sum", 0)
            run()
            assert reference.check_result(result(), coll, 0, 1, 7, "sum", 0, dtype) == 0, (coll, inplace)
    assert b.nc.calls.count("sendrecv") == 2 and b.nc.calls.count("allReduce") == 2
    assert b._const(b.DTYPES, dtype) == {"float32": 7, "bfloat16": 9, "int64": 4}[dtype]


# ---------------------------------------------------------------- the limit line


def test_device_limits_under_the_simulator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")  # the child process that measures inherits it
    lim = sweep.sweep_limits("cuda")
    assert lim["memory"] == "cuda" and lim["copy_GBps"] > 0 and lim["via"] == "numba"
    assert lim["device_name"] == "numba simulator" and lim["limit_bytes"] == devices.SIM_LIMIT_BYTES
    assert lim["host_copy_GBps"] > 0 and lim["host_reduce_GBps"] > 0
    line = sweep.limit_line(lim)
    assert line.startswith("# limit: device-to-device copy ") and "numba simulator (numba, 4 MiB); host copy" in line
    assert plot._copy_bound([{"limits": lim}]) == (lim["copy_GBps"], plot.DEVICE_BOUND)
    assert plot._copy_bound([{"limits": {"copy_GBps": 3.0}}]) == (3.0, plot.HOST_BOUND)


def test_device_limit_failure_draws_no_line(monkeypatch: pytest.MonkeyPatch) -> None:
    failed = {"memory": "cuda", "error": "the device copy measurement failed (exit 1: CudaSupportError)",
              "host_copy_GBps": 2.0, "host_reduce_GBps": 1.0}
    assert sweep.limit_line(failed) == ("# limit: device copy not measured (the device copy measurement failed "
                                        "(exit 1: CudaSupportError)); host copy 2.00 GB/s")
    assert plot._copy_bound([{"limits": failed}]) is None
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    if devices.numba_cuda_missing() is not None:  # no device here: the child fails and says so
        got = devices.device_limits(timeout=120)
        assert got["memory"] == "cuda" and "copy_GBps" not in got and got["error"].startswith("the device copy")


# ---------------------------------------------------------------- a device sweep under the simulator


@pytest.mark.timeout(150)
def test_device_sweep_under_the_simulator(tmp_path: Path) -> None:
    out = tmp_path / "dev.json"
    argv = ["--np", "2", "--peers", "pycoll,mpi,gloo,nccl", "--device", "cuda", "-b", "64", "-e", "1K", "-f", "16",
            "-n", "2", "-w", "1", "--json", str(out), "--no-progress"]
    env = dict(__import__("os").environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, "-m", "pycoll", "perf", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=140, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    recs = data["records"]
    got = {(r["collective"], r["bytes"], r["inplace"]) for r in recs}
    want = {(c, s, ip) for c in options.DEFAULT_COLLECTIVES for s in (64, 1024) for ip in (False, True)}
    assert got == want and all(r["peer"] == "pycoll" and r["nranks"] == 2 for r in recs)
    assert all(r["device"] == "cuda" for r in recs)
    assert sum(r["wrong"] for r in recs) == 0 and "# Out of bounds values : 0 OK" in proc.stdout
    assert set(data["meta"]["peers_skipped"]) == {"mpi", "gloo", "nccl"}
    assert "CUDA-aware" in data["meta"]["peers_skipped"]["mpi"]
    assert data["meta"]["device"] == "cuda" and " --device cuda " in data["meta"]["command"]
    assert data["limits"]["memory"] == "cuda" and data["limits"]["copy_GBps"] > 0
    assert "# device buffers (--device cuda) on numba's CUDA simulator" in proc.stdout
    assert "2 ranks, allreduce, dtype float, op sum, CUDA buffers" in proc.stdout
    pytest.importorskip("matplotlib")
    written = plot.make_plots([out], tmp_path / "png", False, ["allreduce"])
    assert [p.name for p in written] == ["busbw_allreduce_np2.png", "latency_allreduce_np2.png"]


@pytest.mark.timeout(120)
def test_device_sweep_bfloat16_and_wrong_results_are_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 device buffers travel with their datatype; and a sweep whose results are corrupted reports them."""
    spec = sweep.worker_spec(options.parse_args(["-C", "allreduce", "-b", "64", "-e", "64", "-n", "1", "-w", "0",
                                                 "-d", "bfloat16", "--device", "cuda"]), "pycoll")
    script = ("import json, sys; from pycoll.perf import backends, worker\n"
              "spec = json.loads(sys.argv[1]); bad = sys.argv[2] == '1'\n"
              "if bad:\n"
              "    real = backends._MpiStyle.prepare\n"
              "    def prepare(self, *a):\n"
              "        run, result = real(self, *a)\n"
              "        return run, lambda: result() + (self.rank == 0)\n"
              "    backends._MpiStyle.prepare = prepare\n"
              "worker.run_peer(spec, lambda r: print(json.dumps(r)) if r.get('bytes') else None)\n")
    env = dict(__import__("os").environ, NUMBA_ENABLE_CUDASIM="1")
    for bad in ("0", "1"):
        proc = subprocess.run([sys.executable, "-m", "pycoll", "run", "-n", "2", "--", sys.executable, "-c", script,
                               json.dumps(spec), bad], capture_output=True, text=True, cwd=ROOT, timeout=100, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        recs = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
        assert [(r["dtype"], r["device"], r["count"]) for r in recs] == [("bfloat16", "cuda", 32)] * 2
        assert [r["wrong"] for r in recs] == ([0, 0] if bad == "0" else [32, 32])


@pytest.mark.gpu
@pytest.mark.timeout(400)
def test_device_sweep_on_gpu(tmp_path: Path) -> None:
    """A real --device cuda sweep: pycoll on 1 and 2 ranks, NCCL where it runs (skipped, saying why, where not)."""
    why = _gpu_missing()
    if why:
        pytest.skip(why)
    out = tmp_path / "gpu.json"
    argv = ["--np", "1,2", "--peers", "pycoll,nccl", "--device", "cuda", "-C", "allreduce,allgather,reduce_scatter,"
            "broadcast,reduce,alltoall", "-b", "1K", "-e", "4M", "-f", "64", "-n", "3", "-w", "1", "-d", "bfloat16",
            "--json", str(out), "--no-progress"]
    env = {k: v for k, v in __import__("os").environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-m", "pycoll", "perf", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=380, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["limits"]["memory"] == "cuda" and data["limits"]["copy_GBps"] > 0, data["limits"]
    recs = data["records"]
    mine = {(r["nranks"], r["collective"]) for r in recs if r["peer"] == "pycoll"}
    assert mine == {(n, c) for n in (1, 2) for c in options.COLLECTIVES}
    assert all(r["device"] == "cuda" and r["wrong"] == 0 for r in recs)
    skipped = {(s["peer"], s["nranks"]) for s in data["meta"]["jobs_skipped"]}
    if "nccl" not in data["meta"]["peers_skipped"]:
        assert any(r["peer"] == "nccl" and r["nranks"] == 1 for r in recs)
        assert devices.gpu_count() >= 2 or ("nccl", 2) in skipped
