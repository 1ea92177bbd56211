"""Start-up stays light: what the launcher and a Barrier-only rank import, and the CLI and store paths it relies on."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pycoll.bootstrap.store_client import TCPStore
from pycoll.bootstrap.store_server import TCPStoreServer

REPO = Path(__file__).resolve().parents[1]
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_LAUNCHER_PREFIXES = ("PYCOLL_", "SLURM_", "PMI_", "PMIX_", "OMPI_", "TORCHELASTIC_")

# Never imported by a job that only starts and calls Barrier (heavy, optional, or for other subcommands).
UNUSED = (
    "torch", "cupy", "matplotlib", "pynvml", "pyverbs", "mpi4py",
    "importlib.metadata", "email", "uuid",
    "pycoll.torch", "pycoll.perf", "pycoll.tune", "pycoll.netns",
    "pycoll.cuda.kernels", "pycoll.cuda.launch", "pycoll.cuda.memory",
    "pycoll.topology.nccl_xml", "pycoll.perf.simulate", "pycoll.topology.cli",
)
RANK_MUST_NOT_IMPORT = UNUSED + ("pycoll.launcher", "pycoll.cli")
# Numba and the compiled arena kernels: checked on their own (test_barrier_rank_loads_no_numba).
NUMBA = ("numba", "pycoll.algorithms._arena_kernels")
# The launcher starts ranks without any of the communication stack.
LAUNCHER_MUST_NOT_IMPORT = UNUSED + NUMBA + (
    "numpy", "ml_dtypes", "pycoll.comm", "pycoll.MPI", "pycoll.p2p", "pycoll.buffers", "pycoll.algorithms",
    "pycoll.runtime", "pycoll.transport", "pycoll.topology",
)

_REPORT = """
import json, sys
names = json.loads(sys.argv[1])
print("IMPORTED " + json.dumps(sorted(n for n in names if n in sys.modules)))
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith(_LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def _imported(output: str) -> list[list[str]]:
    """Every IMPORTED report in ``output``."""
    return [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith("IMPORTED ")]


_BARRIER_PROG = """
import json, os, sys
from pycoll import MPI
MPI.COMM_WORLD.Barrier()
MPI.COMM_WORLD.Barrier()
names = json.loads(sys.argv[1])
with open(os.path.join(sys.argv[2], f"rank{MPI.COMM_WORLD.rank}.json"), "w") as f:
    json.dump(sorted(n for n in names if n in sys.modules), f)
"""


def _rank_imports(tmp_path: Path, names: tuple[str, ...], **env: str) -> list[list[str]]:
    """Which of ``names`` each rank of a 2-rank Barrier-only job under `pycoll run` had imported at its end."""
    prog = tmp_path / "barrier.py"
    prog.write_text(_BARRIER_PROG)
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", "2", "--", sys.executable, str(prog), json.dumps(names), str(tmp_path)]
    out = subprocess.run(cmd, cwd=REPO, env=clean_env(**env), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_barrier_rank_imports_nothing_it_does_not_use(tmp_path):
    """A rank started by exec (the default) imports neither the launcher nor anything the job does not use."""
    assert _rank_imports(tmp_path, RANK_MUST_NOT_IMPORT) == [[], []]


def test_forked_barrier_rank_holds_the_launchers_modules_and_nothing_unused(tmp_path):
    """A forked rank inherits the launcher's modules (they cost it nothing) and imports nothing else it does not use."""
    assert _rank_imports(tmp_path, UNUSED, PYCOLL_RUN_FORK="1") == [[], []]
    assert _rank_imports(tmp_path, ("pycoll.launcher", "pycoll.cli"), PYCOLL_RUN_FORK="1") == [["pycoll.cli", "pycoll.launcher"]] * 2


def test_barrier_rank_loads_no_numba(tmp_path):
    """Numba costs a rank more CPU than all the rest of its start-up; a job that never reduces must not pay it,
    not even in a background thread (two ranks on two cores have no core to spare)."""
    assert _rank_imports(tmp_path, NUMBA) == [[], []]


def test_launcher_process_imports_no_numpy(tmp_path):
    """The `pycoll run` process itself, when it execs its ranks (here: called from another program, which it never
    forks): parse, start the store, spawn, wait, without NumPy or pycoll's stack."""
    code = textwrap.dedent(f"""
        import json, sys
        from pycoll.cli import main
        rc = main(["run", "-n", "2", "--", sys.executable, "-c", "pass"])
        names = {json.dumps(LAUNCHER_MUST_NOT_IMPORT)}
        print("IMPORTED " + json.dumps(sorted(n for n in names if n in sys.modules)))
        sys.exit(rc)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert _imported(out.stdout) == [[]], out.stdout


def test_singleton_rank_imports_nothing_it_does_not_use():
    """With no launcher (MPI's singleton init) the same holds."""
    code = "from pycoll import MPI\nMPI.COMM_WORLD.Barrier()\n" + _REPORT
    out = subprocess.run([sys.executable, "-c", code, json.dumps(RANK_MUST_NOT_IMPORT)], cwd=REPO, env=clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert _imported(out.stdout) == [[]], out.stdout


def test_import_pycoll_is_light_and_its_lazy_names_still_resolve():
    code = textwrap.dedent("""
        import sys
        import pycoll
        print("numpy" in sys.modules, "importlib.metadata" in sys.modules)
        print(pycoll.IN_PLACE is pycoll.buffers.IN_PLACE, isinstance(pycoll.__version__, str) and bool(pycoll.__version__))
        from pycoll import IN_PLACE, MPI
        print(IN_PLACE is MPI.IN_PLACE)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True", "True", "True"]


def test_cli_builds_only_the_subcommand_it_runs(capsys):
    from pycoll.cli import SUBCOMMANDS, build_parser, main

    assert set(build_parser("run")._subparsers._group_actions[0].choices) == {"run"}  # type: ignore[union-attr]
    assert set(build_parser()._subparsers._group_actions[0].choices) == {n for n, _ in SUBCOMMANDS}  # type: ignore[union-attr]
    assert main(["run", "-n", "2"]) == 2  # no command: the launcher's own message
    assert "no command given" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["run"])  # -n missing: argparse's error, under the same prog name
    assert exc.value.code == 2
    assert "pycoll run: error: the following arguments are required: -n/--np" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["no-such-command"])  # unknown: the full parser answers, listing every subcommand
    err = capsys.readouterr().err
    assert "invalid choice: 'no-such-command'" in err and all(name in err for name, _ in SUBCOMMANDS)


def test_store_server_stops_at_once_and_frees_its_port():
    server = TCPStoreServer("127.0.0.1", 0, token="t")
    host, port = server.start()
    client = TCPStore(host, port, token="t")
    client.set("k", b"v")
    assert client.get("k", 1.0) == b"v"
    server.stop()
    assert not server.is_serving()
    with pytest.raises(OSError):
        socket.create_connection((host, port), timeout=5.0).close()
    client.close()
    server.stop()  # twice is fine


def test_store_server_stop_without_clients_and_restart():
    for _ in range(3):
        server = TCPStoreServer("127.0.0.1", 0, token="t")
        server.start()
        assert server.is_serving()
        server.stop()
        assert not server.is_serving()


def _has_rdma_device() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


@pytest.mark.skipif(_has_rdma_device(), reason="this host lists an RDMA device: the RDMA transport loads")
def test_rank_on_a_host_without_rdma_loads_no_rdma_code(tmp_path):
    rdma = ("pycoll.transport.rdma", "pycoll.transport.rdma_proto", "pycoll.transport.rdma_verbs")
    assert _rank_imports(tmp_path, rdma) == [[], []]


def test_rdma_stand_in_is_off_as_the_real_transport_is(monkeypatch, caplog, tmp_path):
    """Without a device the stand-in says and logs what RdmaTransport says, and takes part in the set-up barrier."""
    import logging

    from pycoll.transport import selection as tr
    from pycoll.transport import rdma_verbs
    from pycoll.transport.rdma import RdmaTransport

    missing = str(tmp_path / "missing")
    monkeypatch.setattr(tr, "_SYSFS_IB", missing)
    monkeypatch.setattr(rdma_verbs, "SYSFS_IB", missing)
    for key in [k for k in os.environ if k.startswith("PYCOLL_IB_")]:
        monkeypatch.delenv(key)
    real = RdmaTransport()
    with caplog.at_level(logging.INFO, logger="pycoll"):
        assert not real.enabled()
        real_lines = [r.getMessage() for r in caplog.records]
        caplog.clear()
        monkeypatch.delitem(sys.modules, "pycoll.transport.rdma")  # as in a rank that never loaded it
        stand_in = [t for t in tr.make_transports() if t.name == "rdma"][0]
        assert not stand_in.enabled()
        assert "pycoll.transport.rdma" not in sys.modules
    assert stand_in.reason == real.reason and [r.getMessage() for r in caplog.records] == real_lines
    barriers: list[str] = []
    me = tr.PeerInfo(rank=0, host_id="h", hostname="h", pid=1, transports=["self", "shm", "tcp"])
    assert stand_in.listen(me, "127.0.0.1") is None and not stand_in.can_connect(me, me)
    assert stand_in.connect(me, [], "job", barriers.append, 1.0) == {} and barriers == ["rdma-connected"]
    stand_in.close()


def test_bytecode_is_written_where_python_is_told_not_to_write_any(tmp_path):
    """native_build.compile_bytecode writes what an import under PYTHONDONTWRITEBYTECODE then reads (it writes none
    itself), for pycoll and for the folders named; a folder it cannot write says so."""
    import importlib.util
    import stat

    from pycoll import native_build

    mod = tmp_path / "probe_module_for_bytecode.py"
    mod.write_text("VALUE = 42\n")
    cached = importlib.util.cache_from_source(str(mod))
    assert not os.path.exists(cached)
    assert native_build.compile_bytecode(tmp_path)
    assert os.path.isfile(cached)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(tmp_path))
    # the import reads it: a source of the same size and time that says otherwise is not compiled again
    stamp = os.stat(mod)
    mod.write_text("VALUE = 43\n")
    os.utime(mod, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    probe = [sys.executable, "-c", "import probe_module_for_bytecode as m; print(m.VALUE)"]
    got = subprocess.run(probe, env=env, check=True, timeout=60, capture_output=True, text=True)
    assert got.stdout.strip() == "42", got.stdout
    os.remove(cached)
    got = subprocess.run(probe, env=env, check=True, timeout=60, capture_output=True, text=True)
    assert got.stdout.strip() == "43" and not os.path.exists(cached)  # Python compiled it, and wrote nothing
    import pycoll

    for name in ("comm", "executor", "p2p_fast"):  # pycoll's own modules have current bytecode after the call
        src = os.path.join(os.path.dirname(pycoll.__file__), f"{name}.py")
        pyc = importlib.util.cache_from_source(src)
        assert os.path.isfile(pyc) and os.path.getmtime(pyc) >= os.path.getmtime(src)
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "other_probe.py").write_text("X = 1\n")
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(locked, os.W_OK):  # root writes anyway: nothing to check here
            return
        assert native_build.compile_bytecode(locked) is False
    finally:
        locked.chmod(stat.S_IRWXU)
