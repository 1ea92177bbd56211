"""pytest configuration: the repo's pycoll on sys.path, markers, and a skip while the library is incomplete."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
for _p in (TESTS, ROOT):  # ROOT ends up first: `import pycoll` finds the repo's package
    if _p in sys.path:
        sys.path.remove(_p)
    sys.path.insert(0, _p)
# ranks spawned by any test (ours or others') import the same pycoll
os.environ["PYTHONPATH"] = os.pathsep.join(
    dict.fromkeys([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
)


def pytest_configure(config):
    config.addinivalue_line("markers", "ranks: spawns local ranks through `python -m pycoll run` (tests/harness.py)")
    config.addinivalue_line("markers", "mpiexec: needs MPICH's mpiexec and mpi4py")
    config.addinivalue_line("markers", "large: moves 2**20+3-element messages")
    config.addinivalue_line("markers", "timeout(seconds): per-test time limit (pytest-timeout)")


def pytest_sessionstart(session):
    """Build the ahead-of-time kernels if the install did not (or the sources changed since), as `pycoll warmup`
    does, so every rank runs them from its first call; and the bytecode of pycoll and the tests, which the ranks
    would otherwise compile on every import where PYTHONDONTWRITEBYTECODE is set."""
    from pycoll import native_build
    from pycoll.algorithms import arena_jit

    native_build.compile_bytecode(pathlib.Path(TESTS))  # the ranks import pycoll and tests/ modules
    native_build.build(quiet=True)
    arena_jit.warm_up()


@pytest.fixture(scope="session")
def jit_cache() -> None:
    """Numba's disk cache filled with every kernel signature, for tests of the JIT path (PYCOLL_KERNELS=jit): their
    ranks then load the kernels in about a second instead of compiling them for minutes."""
    import subprocess

    env = dict(os.environ, PYCOLL_KERNELS="jit")
    subprocess.run([sys.executable, "-c", "from pycoll.algorithms import arena_jit; arena_jit.warm_up()"],
                   env=env, check=True, timeout=900)


def pytest_collection_modifyitems(config, items):
    import harness

    why = harness.library_missing()
    if not why:
        return
    skip = pytest.mark.skip(reason=f"pycoll not complete: {why}")
    for item in items:
        if "ranks" in item.keywords or "mpiexec" in item.keywords:
            item.add_marker(skip)
