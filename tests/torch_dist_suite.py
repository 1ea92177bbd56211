"""Runs PyTorch's own distributed test suite (``torch/testing/_internal/distributed/distributed_test.py``, from the
installed wheel, unmodified) on the "pycoll" backend, as PyTorch's ``test_distributed_spawn.py`` runs it for gloo.

The tests see ``BACKEND=gloo``, so its skip decorators keep exactly the tests gloo runs and the test bodies take
gloo's branches (CPU tensors, gloo's expected errors). Every process group they ask gloo for is made on
``--backend`` instead (pycoll, or gloo itself for the reference): ``init_process_group``, ``new_group`` and
``new_subgroups*`` are wrapped to substitute it. Processes are forked rather than spawned (torch is imported once).

    python tests/torch_dist_suite.py --world-size 2 [--backend pycoll|gloo] [--json FILE] [-k PATTERN ...]

Prints one line per test and a summary; ``--json`` writes {test name: passed|failed|skipped, ...} and the errors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import unittest


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--backend", default="pycoll", choices=["pycoll", "gloo"])
    ap.add_argument("--json", help="write each test's outcome here")
    ap.add_argument("-k", dest="patterns", action="append", default=[], help="run the tests whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the selected tests and exit")
    return ap.parse_args()


class _Outcomes(unittest.TextTestResult):
    """Records each test's outcome by its method name."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, str] = {}
        self.errors_by_test: dict[str, str] = {}

    @staticmethod
    def _name(test: unittest.TestCase) -> str:
        return test.id().rsplit(".", 1)[-1]

    def addSuccess(self, test):  # noqa: N802
        super().addSuccess(test)
        self.outcomes[self._name(test)] = "passed"

    def addFailure(self, test, err):  # noqa: N802
        super().addFailure(test, err)
        self.outcomes[self._name(test)] = "failed"
        self.errors_by_test[self._name(test)] = self._exc_info_to_string(err, test)[-4000:]

    def addError(self, test, err):  # noqa: N802
        super().addError(test, err)
        self.outcomes[self._name(test)] = "failed"
        self.errors_by_test[self._name(test)] = self._exc_info_to_string(err, test)[-4000:]

    def addSkip(self, test, reason):  # noqa: N802
        super().addSkip(test, reason)
        self.outcomes[self._name(test)] = "skipped"

    def addExpectedFailure(self, test, err):  # noqa: N802
        super().addExpectedFailure(test, err)
        self.outcomes[self._name(test)] = "passed"

    def addUnexpectedSuccess(self, test):  # noqa: N802
        super().addUnexpectedSuccess(test)
        self.outcomes[self._name(test)] = "failed"


def _substitute_backend(name: str) -> None:
    """Make every group the tests ask gloo for (by name, or by default) a ``name`` group."""
    import functools

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def swap(value):
        return name if isinstance(value, str) and value.lower() == "gloo" else value

    def wrap(fn, position):
        @functools.wraps(fn)
        def call(*a, **kw):
            if "backend" in kw:
                kw["backend"] = swap(kw["backend"])
            elif len(a) > position:
                a = a[:position] + (swap(a[position]),) + a[position + 1:]
            return fn(*a, **kw)
        return call

    for module in (dist, c10d):
        module.init_process_group = wrap(c10d.init_process_group, 0)
        module.new_group = wrap(c10d.new_group, 2)
        module.new_subgroups = wrap(c10d.new_subgroups, 3)
        module.new_subgroups_by_enumeration = wrap(c10d.new_subgroups_by_enumeration, 2)


def main() -> int:
    args = _parse()
    temp = tempfile.mkdtemp(prefix="pycoll-torch-suite-")
    try:
        return _run_suite(args, temp)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _run_suite(args: argparse.Namespace, temp: str) -> int:
    os.environ.update(BACKEND="gloo", WORLD_SIZE=str(args.world_size), TEMP_DIR=temp)
    # the suite's per-test store files (NamedTemporaryFile(delete=False)) land in temp and go with it
    tempfile.tempdir = temp
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch
    import torch.multiprocessing as mp
    from torch.testing._internal.distributed import distributed_test as suite

    import pycoll.torch  # noqa: F401  (registers the backend)

    if args.backend != "gloo":
        _substitute_backend(args.backend)

    class TestDistBackendWithFork(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        def setUp(self) -> None:
            super().setUp()
            self._start_processes(mp.get_context("fork").Process)

    loader = unittest.TestLoader()
    names = [n for n in loader.getTestCaseNames(TestDistBackendWithFork)
             if not args.patterns or any(p in n for p in args.patterns)]
    if args.list:
        print("\n".join(names))
        return 0
    tests = unittest.TestSuite(TestDistBackendWithFork(n) for n in names)
    runner = unittest.TextTestRunner(resultclass=_Outcomes, verbosity=2, stream=sys.stdout)
    torch_version = torch.__version__
    t0 = time.monotonic()
    result = runner.run(tests)
    counts = {k: sum(v == k for v in result.outcomes.values()) for k in ("passed", "failed", "skipped")}
    print(f"torch distributed_test.py on {args.backend}, {args.world_size} ranks (gloo's selection): {counts}, "
          f"{time.monotonic() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "world_size": args.world_size, "torch": torch_version,
                       "outcomes": result.outcomes,
                       "errors": result.errors_by_test}, f, indent=1, sort_keys=True)
    return 0 if counts["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
