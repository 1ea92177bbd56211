"""mpi4py compatibility: examples/mpi4py_program.py prints the same under real MPI, under pycoll's launcher, and under mpiexec."""

from __future__ import annotations

import os
import re

import pytest

import harness

EXAMPLE = os.path.join(harness.ROOT, "examples", "mpi4py_program.py")
IMPORT_LINE = re.compile(r"^from mpi4py import MPI$", re.M)
N = 4

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(120)]


def _needs_mpiexec():
    if harness.find_mpiexec() is None:
        pytest.skip("mpiexec not found next to sys.executable or on PATH")
    if not harness.have_mpi4py():
        pytest.skip("mpi4py is not installed")


def _run(cmd, what):
    proc = harness.launch(cmd, harness.rank_env("shm", comm_timeout=60), timeout=90)
    if proc.timed_out or proc.returncode != 0:
        pytest.fail(
            f"{what} failed (exit {proc.returncode}, timed out: {proc.timed_out})\ncommand: {' '.join(cmd)}\n"
            f"---- stdout ----\n{proc.stdout[-3000:]}\n---- stderr ----\n{proc.stderr[-5000:]}",
            pytrace=False,
        )
    return proc.stdout


@pytest.fixture(scope="module")
def pycoll_program(tmp_path_factory):
    """The example with its import line rewritten to pycoll (and nothing else changed)."""
    with open(EXAMPLE) as fh:
        text = fh.read()
    assert len(IMPORT_LINE.findall(text)) == 1, "the example must import MPI with exactly one 'from mpi4py import MPI' line"
    path = tmp_path_factory.mktemp("compat") / "pycoll_program.py"
    path.write_text(IMPORT_LINE.sub("from pycoll import MPI", text))
    return str(path)


@pytest.fixture(scope="module")
def reference_output():
    """(a) the program as written, under mpiexec with real mpi4py."""
    _needs_mpiexec()
    out = _run(harness.launcher_cmd(N, [harness.PYTHON, EXAMPLE], "mpiexec"), "the mpi4py reference run")
    assert out.startswith(f"world size {N}\n"), out
    return out


def test_example_is_mpi4py_only():
    """The example uses mpi4py's import, so the reference run really is mpi4py."""
    with open(EXAMPLE) as fh:
        text = fh.read()
    assert IMPORT_LINE.search(text) and "pycoll" not in re.sub(r'""".*?"""', "", text, flags=re.S)


def test_pycoll_launcher_matches_mpi4py(reference_output, pycoll_program):
    """(b) the rewritten program under `python -m pycoll run -n 4`."""
    out = _run(harness.launcher_cmd(N, [harness.PYTHON, pycoll_program], "pycoll", timeout=80), "pycoll run")
    assert out == reference_output


def test_pycoll_under_mpiexec_matches_mpi4py(reference_output, pycoll_program):
    """(c) the rewritten program under `mpiexec -n 4` (pycoll bootstraps through mpi4py)."""
    out = _run(harness.launcher_cmd(N, [harness.PYTHON, pycoll_program], "mpiexec"), "pycoll under mpiexec")
    assert out == reference_output


def test_pycoll_tcp_matches_mpi4py(reference_output, pycoll_program):
    """(b) again with PYCOLL_SHM_DISABLE=1: the TCP transport gives the same output."""
    cmd = harness.launcher_cmd(N, [harness.PYTHON, pycoll_program], "pycoll", timeout=80)
    proc = harness.launch(cmd, harness.rank_env("tcp", comm_timeout=60), timeout=90)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert proc.stdout == reference_output
