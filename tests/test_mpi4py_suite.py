"""mpi4py's own test files run unchanged on pycoll (`pycoll run --mpi4py`), judged by a strict expected-failure list.

One pytest case per (file, rank count).

The pinned sdist (tests/mpi4py_runner.py: MPI4PY_VERSION) is fetched with pip into ~/.cache/pycoll/ once; the cases
skip, saying why, when it cannot be fetched. Each file runs with mpi4py's own test program on its array, NumPy and
CPU DLPack backends (tests/mpi4py_rank.py; its fake-GPU arrays, host memory behind __cuda_array_interface__, are
left out: pycoll takes that interface for device memory). A case fails when a test fails that EXPECTED_FAILURES does not list,
and also when a listed test passes or no longer exists: remove its entry as the feature lands. FLAKY lists tests
that fail in some runs only (races): either outcome passes. A test that failed only with CommunicatorBrokenError
("broken": an earlier test's failure broke the communicator) is shown but not judged; that earlier failure is.

Rank counts: the five large files (BIG_FILES) run at 1 and 3 ranks, the others at 1, 2, 3 and 4 (about 2 minutes
on 2 cores). PYCOLL_MPI4PY_RANKS=1,2,3,4 runs every file at the rank counts given (that full matrix: about 6
minutes). The large files also run at 4 ranks on two virtual hosts (network namespaces; about 45 s). perf/mpi4py_suite.py
prints the pass/fail/skip counts of every file at every rank count.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import harness
import mpi4py_runner
from mpi4py_rank import DEFAULT_BACKENDS
from pycoll.launcher import MPI4PY_ALIAS_DIR, mpi4py_path_first
from pycoll.netns import unavailable

BIG_FILES = ["test_cco_buf", "test_cco_nb_buf", "test_cco_vec", "test_cco_nb_vec", "test_p2p_buf"]
SMALL_FILES = ["test_cco_obj", "test_p2p_obj", "test_request", "test_status", "test_op",
               "test_comm", "test_comm_topo", "test_group", "test_info", "test_cco_ngh_buf", "test_cco_ngh_obj"]
RANKS_ENV = "PYCOLL_MPI4PY_RANKS"

# mpi4py test id (module.Class.method) -> why it fails on pycoll today. "id@2,3": expected to fail at those rank
# counts only. Strict: a listed test that passes fails its case, so this list only shrinks.
EXPECTED_FAILURES: dict[str, str] = {}

# Same form: tests that fail in some runs and pass in others today; either outcome is accepted.
FLAKY: dict[str, str] = {}  # none since a refused call on one rank stopped shifting the ranks' call numbers


def _rank_counts(module: str) -> list[int]:
    raw = os.environ.get(RANKS_ENV)
    if raw:
        return [int(x) for x in raw.split(",") if x.strip()]
    return [1, 3] if module in BIG_FILES else [1, 2, 3, 4]


def _expected(module: str, n: int, table: "dict[str, str] | None" = None) -> dict[str, str]:
    """The entries of EXPECTED_FAILURES (or ``table``) for ``module`` at ``n`` ranks: test id -> reason."""
    out = {}
    for key, reason in (EXPECTED_FAILURES if table is None else table).items():
        test_id, _, ranks = key.partition("@")
        if test_id.split(".", 1)[0] != module:
            continue
        if ranks and n not in {int(r) for r in ranks.split(",")}:
            continue
        out[test_id] = reason
    return out


CASES = [pytest.param(m, n, id=f"{m}-{n}") for m in BIG_FILES + SMALL_FILES for n in _rank_counts(m)]


@pytest.fixture(scope="module")
def testdir():
    try:
        return mpi4py_runner.fetch_testdir()
    except mpi4py_runner.FetchError as exc:
        pytest.skip(f"mpi4py {mpi4py_runner.MPI4PY_VERSION}'s sdist cannot be fetched: {exc}")


def _first_line(message: str) -> str:
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:300]


@pytest.mark.ranks
@pytest.mark.timeout(700)
@pytest.mark.parametrize("module,n", CASES)
def test_mpi4py_file(testdir, module, n):
    _judge(mpi4py_runner.run_file(testdir, module, n, timeout=600), module, n,
           f"mpi4py {mpi4py_runner.MPI4PY_VERSION} {module} at {n} rank(s)")


@pytest.mark.ranks
@pytest.mark.timeout(400)
@pytest.mark.skipif(unavailable() is not None, reason=f"no virtual hosts here: {unavailable()}")
@pytest.mark.parametrize("module", BIG_FILES)
def test_mpi4py_file_across_hosts(testdir, module):
    """The large files at 4 ranks on two virtual hosts, 2 a host: the small collectives composed of each host's and
    the leaders' calls, the two-rank socket paths among the leaders, point-to-point between hosts; judged by the
    same expected-failure list (at 4 ranks)."""
    _judge(mpi4py_runner.run_file(testdir, module, 4, timeout=300, hosts=2), module, 4,
           f"mpi4py {mpi4py_runner.MPI4PY_VERSION} {module} at 4 ranks on 2 hosts")


def _judge(run: "mpi4py_runner.FileRun", module: str, n: int, where: str) -> None:
    """Fail with a report where ``run`` went wrong or its outcomes differ from EXPECTED_FAILURES (and FLAKY)."""
    if run.problems:
        pytest.fail(f"{where}: the job went wrong: {'; '.join(run.problems)}\ncommand: {' '.join(run.proc.cmd)}\n"
                    f"---- stderr (tail) ----\n{run.proc.stderr[-5000:]}", pytrace=False)
    assert run.backends == list(DEFAULT_BACKENDS), f"{where}: ran on backends {run.backends}"
    expected, flaky = _expected(module, n), _expected(module, n, FLAKY)
    unexpected = [t for t in run.ids("fail") if t not in expected and t not in flaky]
    fixed = [t for t in expected if run.outcomes.get(t) == "pass"]
    gone = [t for t in {**expected, **flaky} if t not in run.outcomes]
    report = []
    if unexpected:
        report.append(f"{len(unexpected)} test(s) failed that EXPECTED_FAILURES does not list:")
        report += [f"  {t}: {_first_line(run.messages.get(t, ''))}" for t in unexpected]
    if fixed:
        report.append(f"{len(fixed)} test(s) listed in EXPECTED_FAILURES now pass; remove their entries:")
        report += [f"  {t}" for t in fixed]
    if gone:
        report.append(f"{len(gone)} test(s) listed in EXPECTED_FAILURES did not run (renamed, or removed?):")
        report += [f"  {t}" for t in gone]
    if report:
        broken = run.ids("broken")
        if broken:
            report.append(f"{len(broken)} test(s) met a communicator an earlier failure broke (not judged): "
                          + ", ".join(t.split(".", 1)[1] for t in broken))
        c = run.counts()
        pytest.fail(f"{where} ({c['pass']} passed, {c['fail']} failed, {c['broken']} broken, {c['skip']} skipped)\n"
                    + "\n".join(report), pytrace=False)


def test_expected_failures_name_target_files():
    """Every entry names a test of a file this job runs, with a reason, and valid rank counts."""
    for key, reason in {**EXPECTED_FAILURES, **FLAKY}.items():
        test_id, _, ranks = key.partition("@")
        assert test_id.split(".", 1)[0] in BIG_FILES + SMALL_FILES, key
        assert test_id.count(".") >= 1 and reason.strip(), key
        assert not ranks or all(r.strip().isdigit() and 1 <= int(r) <= 4 for r in ranks.split(",")), key


def test_alias_goes_first_on_pythonpath():
    assert mpi4py_path_first("") == MPI4PY_ALIAS_DIR
    joined = mpi4py_path_first(os.pathsep.join(["/a", MPI4PY_ALIAS_DIR, "/b"]))
    assert joined.split(os.pathsep) == [MPI4PY_ALIAS_DIR, "/a", "/b"]


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_switch_makes_mpi4py_imports_load_pycoll(tmp_path):
    """Under `pycoll run --mpi4py` every way into mpi4py reaches pycoll; without it an installed mpi4py is used."""
    program = tmp_path / "prog.py"
    program.write_text(textwrap.dedent("""
        import mpi4py
        import mpi4py.MPI
        from mpi4py import MPI, rc
        import pycoll.MPI
        assert MPI is mpi4py.MPI is pycoll.MPI, MPI
        assert rc.thread_level == "multiple" and mpi4py.get_config() == {}
        rc.threads = False
        try:
            rc.no_such_option = 1
        except TypeError:
            pass
        else:
            raise AssertionError("mpi4py.rc took an unknown option")
        comm = MPI.COMM_WORLD
        assert comm.allgather(comm.Get_rank()) == list(range(comm.Get_size()))
        assert MPI.get_vendor()[0] == "pycoll" and MPI.Query_thread() in (MPI.THREAD_SINGLE, MPI.THREAD_FUNNELED,
                                                                          MPI.THREAD_SERIALIZED, MPI.THREAD_MULTIPLE)
        import sys
        with open(f"{sys.argv[1]}/rank{comm.Get_rank()}.ok", "w") as f:  # not stdout: the ranks' lines interleave
            f.write("alias ok")
    """))
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", "2", "--mpi4py", "--timeout", "90", "--",
           sys.executable, str(program), str(tmp_path)]
    proc = harness.launch(cmd, harness.rank_env("shm", comm_timeout=30), timeout=100)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert [(tmp_path / f"rank{r}.ok").read_text() if (tmp_path / f"rank{r}.ok").exists() else None
            for r in (0, 1)] == ["alias ok", "alias ok"], proc.stdout
    if not harness.have_mpi4py():
        return
    probe = [sys.executable, "-m", "pycoll", "run", "-n", "1", "--", sys.executable, "-c",
             "import mpi4py; print(mpi4py.__file__)"]
    plain = subprocess.run(probe, env=harness.rank_env("shm"), capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and MPI4PY_ALIAS_DIR not in plain.stdout, plain.stdout + plain.stderr
