"""Tests of launcher detection and rendezvous: pycoll run, env://, torchrun, srun, mpiexec and singleton."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

import pycoll.bootstrap as bs
from pycoll.bootstrap import BootstrapInfo, TCPStore, TCPStoreServer, detect_launcher, publish_all
from pycoll.errors import InvalidArgumentError, PeerFailureError, TimeoutError

REPO = Path(__file__).resolve().parents[1]
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_LAUNCHER_PREFIXES = ("PYCOLL_", "SLURM_", "PMI_", "PMIX_", "OMPI_", "TORCHELASTIC_", "MPI_LOCAL")
TOKEN = "a-job-token-for-tests"

# One rank: bootstrap, allgather through the store, a final barrier, then its view as JSON in VIEW_DIR
# (a file per rank: mpiexec and torchrun may merge the ranks' stdout mid-line).
RANK_SCRIPT = """
import json, os, pathlib, sys
if os.environ.get("HIDE_TORCH"):
    sys.modules["torch"] = None  # makes torch un-importable
if os.environ.get("HIDE_MPI4PY"):
    sys.modules["mpi4py"] = None
from pycoll.bootstrap import barrier, bootstrap, publish_all
info = bootstrap(30)
values = publish_all(info, "test", f"value-{info.rank}".encode(), 30)
if info.store is not None:
    barrier(info.store, "end", info.size, 30)
view = (json.dumps(dict(rank=info.rank, size=info.size, job_id=info.job_id, launcher=info.launcher,
                      local_rank=info.local_rank, local_size=info.local_size, store_host=info.store_host,
                      store=type(info.store).__name__, values=[v.decode() for v in values],
                      token=info.token)))
pathlib.Path(os.environ["VIEW_DIR"], f"{info.rank}.json").write_text(view)
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith(_LAUNCHER_PREFIXES)
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def rank_script(tmp_path: Path, monkeypatch) -> Path:
    path = tmp_path / "rank.py"
    path.write_text(RANK_SCRIPT)
    (tmp_path / "views").mkdir()
    monkeypatch.setenv("VIEW_DIR", str(tmp_path / "views"))  # clean_env() passes it on
    return path


def parse_views(script: Path) -> list[dict]:
    views = [json.loads(p.read_text()) for p in (script.parent / "views").glob("*.json")]
    return sorted(views, key=lambda v: v["rank"])


def run_ranks(script: Path, envs: list[dict[str, str]], timeout: float = 90) -> list[dict]:
    """Start one process per env, all at once; return their JSON views in rank order."""
    procs = [
        subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=clean_env(**e), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for e in envs
    ]
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return parse_views(script)


def check_job(views: list[dict], n: int, launcher: str, local_size: Optional[int]) -> None:
    assert [v["rank"] for v in views] == list(range(n))
    assert {v["size"] for v in views} == {n}
    assert len({v["job_id"] for v in views}) == 1 and len(views[0]["job_id"]) == 32
    assert len({v["token"] for v in views}) == 1 and views[0]["token"]  # one job token, on every rank
    assert {v["launcher"] for v in views} == {launcher}
    assert all(v["values"] == [f"value-{r}" for r in range(n)] for v in views)
    assert {v["store_host"] for v in views} == {"127.0.0.1"}
    if local_size is not None:
        assert [v["local_rank"] for v in views] == list(range(n))
        assert {v["local_size"] for v in views} == {local_size}


# ----------------------------------------------------------------------------- detection


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, "singleton"),
        ({"SLURM_JOB_ID": "42", "SLURM_NNODES": "2"}, "singleton"),  # an salloc shell is not a job step
        ({"PYCOLL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2"}, "pycoll"),
        ({"RANK": "1", "WORLD_SIZE": "2"}, "env"),
        ({"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}, "torchrun"),
        ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "env"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "PMI_RANK": "0"}, "srun"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "mpiexec"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "mpiexec"),
        ({"PMIX_RANK": "0"}, "mpiexec"),
    ],
)
def test_detect_launcher(env, expected):
    assert detect_launcher(env) == expected


@pytest.mark.timeout(10)
def test_slurm_tasks_per_node_parsing():
    assert [bs.slurm_tasks_on_node("2(x3),1", i) for i in range(5)] == [2, 2, 2, 1, None]
    assert bs.slurm_tasks_on_node("4", 0) == 4
    assert bs.slurm_tasks_on_node("garbage", 0) is None


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "env, message",
    [
        ({"PYCOLL_RANK": "x", "PYCOLL_SIZE": "2", "PYCOLL_STORE_ADDR": "127.0.0.1:1"}, "PYCOLL_RANK='x'"),
        ({"PYCOLL_RANK": "0"}, "PYCOLL_SIZE"),
        ({"PYCOLL_RANK": "0", "PYCOLL_SIZE": "2", "PYCOLL_STORE_ADDR": "nohostport"}, "host:port"),
        ({"PYCOLL_RANK": "2", "PYCOLL_SIZE": "2", "PYCOLL_STORE_ADDR": "127.0.0.1:1"}, "rank 2 of size 2"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "export PYCOLL_MASTER_ADDR="),
        ({"PYCOLL_RANK": "0", "PYCOLL_SIZE": "2", "PYCOLL_STORE_ADDR": "127.0.0.1:1"}, "PYCOLL_JOB_TOKEN is not"),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "PYCOLL_MASTER_ADDR": "127.0.0.1", "PYCOLL_MASTER_PORT": "1"},
            "export PYCOLL_JOB_TOKEN=",
        ),
    ],
)
def test_bad_launcher_env_is_invalid_argument(monkeypatch, env, message):
    for k in list(os.environ):
        if k in _LAUNCHER_VARS or k.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(").replace("$", r"\$")):
        bs.bootstrap(5)


# ----------------------------------------------------------------------------- publish_all


@pytest.mark.timeout(30)
def test_publish_all_timeout_names_missing_ranks():
    with TCPStoreServer() as srv:
        store = TCPStore(*srv.address, connect_timeout=10, token=srv.token)
        info = BootstrapInfo(rank=0, size=4, store=store, job_id="j", launcher="pycoll", local_rank=0,
                             local_size=4, store_host="127.0.0.1")
        store.set("addr/2", b"two")  # rank 2 published, 1 and 3 did not
        with pytest.raises(TimeoutError, match=r"'addr/1' \(ranks that had not published: 1, 3\)") as exc:
            publish_all(info, "addr", b"zero", 0.3)
        assert exc.value.peers == (1, 3) and exc.value.rank == 0
        store.set("addr/1", b"one")
        store.set("addr/3", b"three")
        assert publish_all(info, "addr", b"zero", 5) == [b"zero", b"one", b"two", b"three"]
        store.close()


@pytest.mark.timeout(10)
def test_publish_all_singleton():
    info = BootstrapInfo(rank=0, size=1, store=None, job_id="j", launcher="singleton", local_rank=0,
                         local_size=1, store_host="")
    assert publish_all(info, "k", b"v", 1.0) == [b"v"]


# ----------------------------------------------------------------------------- launchers


@pytest.mark.timeout(60)
def test_singleton(rank_script):
    (view,) = run_ranks(rank_script, [{}])
    assert view["launcher"] == "singleton" and view["rank"] == 0 and view["size"] == 1
    assert view["store"] == "NoneType" and view["store_host"] == "" and view["values"] == ["value-0"]
    assert view["token"] == ""
    assert len(view["job_id"]) == 32


@pytest.mark.timeout(90)
def test_pycoll_run(rank_script):
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", "3", "--", sys.executable, str(rank_script)]
    res = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=80)
    assert res.returncode == 0, res.stderr
    views = parse_views(rank_script)
    check_job(views, 3, "pycoll", local_size=3)
    assert {v["store"] for v in views} == {"TCPStore"}
    assert len(views[0]["token"]) == 64  # generated by the launcher


@pytest.mark.timeout(90)
def test_pycoll_run_passes_the_users_token(rank_script):
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", "2", "--", sys.executable, str(rank_script)]
    res = subprocess.run(cmd, cwd=REPO, env=clean_env(PYCOLL_JOB_TOKEN=TOKEN), capture_output=True, text=True,
                         timeout=80)
    assert res.returncode == 0, res.stderr
    assert {v["token"] for v in parse_views(rank_script)} == {TOKEN}


@pytest.mark.timeout(30)
def test_rank_with_the_wrong_token_is_refused(monkeypatch):
    for k in list(os.environ):
        if k in _LAUNCHER_VARS or k.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(k)
    with TCPStoreServer("127.0.0.1", 0, token=TOKEN) as srv:
        host, port = srv.address
        monkeypatch.setenv("PYCOLL_RANK", "1")
        monkeypatch.setenv("PYCOLL_SIZE", "2")
        monkeypatch.setenv("PYCOLL_STORE_ADDR", f"{host}:{port}")
        monkeypatch.setenv("PYCOLL_JOB_TOKEN", "some-other-job")
        with pytest.raises(PeerFailureError, match="PYCOLL_JOB_TOKEN differs"):
            bs.bootstrap(5)
        assert srv.keys() == []  # it read and wrote nothing


@pytest.mark.timeout(90)
def test_env_without_torch(rank_script):
    port = str(free_port())
    envs = [
        dict(RANK=str(r), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK=str(r),
             LOCAL_WORLD_SIZE="3", HIDE_TORCH="1", PYCOLL_JOB_TOKEN=TOKEN)
        for r in range(3)
    ]
    views = run_ranks(rank_script, envs)
    check_job(views, 3, "env", local_size=3)
    assert {v["store"] for v in views} == {"TCPStore"}


def _need_torch() -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install the CPU wheel to run this test)")


@pytest.mark.timeout(120)
def test_env_with_torch(rank_script):
    _need_torch()
    port = str(free_port())
    envs = [dict(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(2)]
    views = run_ranks(rank_script, envs)
    check_job(views, 2, "env", local_size=None)
    assert {v["store"] for v in views} == {"TorchStore"}
    assert {v["local_rank"] for v in views} == {None}


@pytest.mark.timeout(180)
def test_torchrun(rank_script):
    _need_torch()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(rank_script)]
    res = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=170)
    assert res.returncode == 0, res.stderr
    views = parse_views(rank_script)
    check_job(views, 2, "torchrun", local_size=2)
    assert {v["store"] for v in views} == {"TorchStore"}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("master_vars", ["PYCOLL_MASTER", "MASTER"])
def test_srun(rank_script, master_vars):
    port = str(free_port())
    envs = [
        {
            "SLURM_PROCID": str(r), "SLURM_NTASKS": "3", "SLURM_LOCALID": str(r), "SLURM_NODEID": "0",
            "SLURM_JOB_ID": "1234", "SLURM_TASKS_PER_NODE": "3(x2)",
            f"{master_vars}_ADDR": "127.0.0.1", f"{master_vars}_PORT": port, "PYCOLL_JOB_TOKEN": TOKEN,
        }
        for r in range(3)
    ]
    views = run_ranks(rank_script, envs)
    check_job(views, 3, "srun", local_size=3)


def _mpiexec() -> str:
    path = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if path is None:
        pytest.skip(f"no mpiexec next to {sys.executable}")
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed")
    return path


@pytest.mark.timeout(120)
def test_mpiexec(rank_script):
    cmd = [_mpiexec(), "-n", "3", sys.executable, str(rank_script)]
    res = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stderr
    check_job(parse_views(rank_script), 3, "mpiexec", local_size=3)


@pytest.mark.timeout(60)
def test_mpiexec_env_without_mpi4py(rank_script):
    res = subprocess.run([sys.executable, str(rank_script)], cwd=REPO, capture_output=True, text=True, timeout=50,
                         env=clean_env(PMI_RANK="0", PMI_SIZE="1", HIDE_MPI4PY="1"))
    assert res.returncode != 0
    assert "InvalidArgumentError" in res.stderr and "pip install 'pycoll[mpi]'" in res.stderr


@pytest.mark.timeout(60)
def test_info_names_the_bootstrap():
    cmd = [sys.executable, "-m", "pycoll", "info"]
    res = subprocess.run(cmd, cwd=REPO, env=clean_env(SLURM_PROCID="0", SLURM_NTASKS="2"), capture_output=True,
                         text=True, timeout=50)
    assert res.returncode == 0, res.stderr
    rows = dict(ln.split(None, 1) for ln in res.stdout.splitlines())
    assert rows["bootstrap"].startswith("srun")
    assert set(rows) >= {"pycoll", "python", "numpy", "mpi4py", "torch", "cupy", "numba", "ml_dtypes", "pynvml"}
