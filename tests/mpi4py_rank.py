"""Rank side of the mpi4py conformance job: runs one of mpi4py's test files with its own test program and writes every test's outcome on this rank as JSON.

Usage (one process per rank, under ``python -m pycoll run --mpi4py`` or, for the reference, ``mpiexec``)::

    python tests/mpi4py_rank.py --testdir DIR --out OUTDIR [--impl pycoll|mpi4py] [--backends a,b,...] test_cco_buf

Writes OUTDIR/rank<R>.json: {"rank", "size", "impl", "backends", "current", "finished", "tests": {id: {...}}},
rewritten as each test starts and ends, so a crash leaves the test that was running. A test's outcome is "pass",
"fail", "skip", or "broken": it failed only with CommunicatorBrokenError, because an earlier test broke the comm.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import unittest
from typing import Any, Optional

# mpi4py's array backends this job runs on (its test/arrayimpl.py names them by `backend`).
DEFAULT_BACKENDS = ("array", "numpy", "dlpack-array", "dlpack-numpy")
_MESSAGE_CHARS = 1500  # of each failure's traceback kept in the JSON


def _atomic_write(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1, default=repr)
    os.replace(tmp, path)


def _broke_earlier(err: Any) -> bool:
    """True for pycoll's CommunicatorBrokenError: the test never ran its check, an earlier failure broke the comm."""
    value = err[1] if isinstance(err, tuple) else err
    return any(cls.__name__ == "CommunicatorBrokenError" and cls.__module__.startswith("pycoll")
               for cls in type(value).__mro__)


def _short(err: Any) -> str:
    """The end of a formatted exception: where it was raised and what it said."""
    text = "".join(traceback.format_exception(*err)) if isinstance(err, tuple) else str(err)
    return text if len(text) <= _MESSAGE_CHARS else "..." + text[-_MESSAGE_CHARS:]


class Recorder:
    """This rank's outcomes, written to OUTDIR/rank<R>.json after every change."""

    def __init__(self, path: Optional[str], header: dict) -> None:
        self.path = path
        self.data = dict(header, current=None, finished=False, tests={})

    def flush(self) -> None:
        if self.path:
            _atomic_write(self.path, self.data)

    def entry(self, test: unittest.TestCase) -> dict:
        return self.data["tests"].setdefault(test.id(), {"outcome": "running", "subtests_failed": [], "message": ""})


def recording_result(recorder: Recorder) -> type:
    """A TextTestResult class that also tells ``recorder`` each test's outcome (a failed subtest fails its test)."""

    class RecordingResult(unittest.TextTestResult):
        def startTest(self, test):  # noqa: N802 - unittest's name
            recorder.data["current"] = test.id()
            recorder.entry(test)["started"] = time.time()
            recorder.flush()
            super().startTest(test)

        def stopTest(self, test):  # noqa: N802
            super().stopTest(test)
            entry = recorder.entry(test)
            entry["seconds"] = round(time.time() - entry.pop("started", time.time()), 3)
            recorder.data["current"] = None
            recorder.flush()

        def addSubTest(self, test, subtest, err):  # noqa: N802
            super().addSubTest(test, subtest, err)
            if err is not None:
                entry = recorder.entry(test)
                self._failed(entry, err)
                entry["subtests_failed"].append(subtest._subDescription())

        @staticmethod
        def _failed(entry: dict, err: Any) -> None:
            """A failure makes the test "fail"; one that only met a communicator broken earlier, "broken"."""
            outcome = "broken" if _broke_earlier(err) else "fail"
            if entry["outcome"] != "fail":
                entry["outcome"] = outcome
                if outcome == "fail" or not entry["message"]:
                    entry["message"] = _short(err)

        def _set(self, test, outcome: str, message: str = "") -> None:
            entry = recorder.entry(test)
            if entry["outcome"] in ("fail", "broken") and outcome == "pass":
                return  # a test whose subtests failed may still report success at its end
            entry["outcome"] = outcome
            entry["message"] = entry["message"] or message

        def addSuccess(self, test):  # noqa: N802
            super().addSuccess(test)
            self._set(test, "pass")

        def addFailure(self, test, err):  # noqa: N802
            super().addFailure(test, err)
            self._failed(recorder.entry(test), err)

        def addError(self, test, err):  # noqa: N802 - also class/module set-up errors (a placeholder "test")
            super().addError(test, err)
            self._failed(recorder.entry(test), err)

        def addSkip(self, test, reason):  # noqa: N802
            super().addSkip(test, reason)
            self._set(test, "skip", str(reason))

        def addExpectedFailure(self, test, err):  # noqa: N802 - mpi4py's own expected failures count as passes
            super().addExpectedFailure(test, err)
            self._set(test, "pass")

        def addUnexpectedSuccess(self, test):  # noqa: N802
            super().addUnexpectedSuccess(test)
            self._set(test, "fail", "unexpected success of a test mpi4py marks as an expected failure")

    return RecordingResult


def recording_runner(recorder: Recorder) -> type:
    """A TextTestRunner class that records into ``recorder`` and prints only its one-line summary."""

    class RecordingRunner(unittest.TextTestRunner):
        resultclass = recording_result(recorder)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["stream"] = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the run
            kwargs["verbosity"] = 0
            super().__init__(*args, **kwargs)

    return RecordingRunner


def keep_backends(arrayimpl: Any, wanted: list[str]) -> list[str]:
    """Narrow mpi4py's array backends (arrayimpl.ArrayBackends, a list it loops over) to ``wanted``, in place.

    Its fake-GPU arrays are dropped too, though their `backend` reads "array" or "numpy": they put host pointers in
    __cuda_array_interface__, which pycoll takes for device memory.
    """
    fake_gpu = getattr(arrayimpl, "BaseFakeGPUArray", ())
    kept = [cls for cls in arrayimpl.ArrayBackends
            if cls.backend in wanted and not (fake_gpu and issubclass(cls, fake_gpu))]
    arrayimpl.ArrayBackends[:] = kept
    return [cls.backend for cls in kept]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("module", help="an mpi4py test module in --testdir, e.g. test_cco_buf")
    p.add_argument("--testdir", required=True, help="the test/ folder of mpi4py's source distribution")
    p.add_argument("--out", required=True, help="directory for rank<R>.json")
    p.add_argument("--impl", default="pycoll", choices=("pycoll", "mpi4py"),
                   help="which MPI `from mpi4py import MPI` must give (pycoll: run under `pycoll run --mpi4py`)")
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS), help="mpi4py array backends to run on")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, os.path.abspath(args.testdir))
    from mpi4py import MPI

    if args.impl == "pycoll" and not MPI.__name__.startswith("pycoll"):
        sys.stderr.write(f"mpi4py_rank: `from mpi4py import MPI` gave {MPI.__name__}, not pycoll: start with "
                         "`python -m pycoll run --mpi4py`\n")
        return 2
    rank = MPI.COMM_WORLD.Get_rank()
    # mpi4py's test program hides numba from later imports unless told --numba, and pycoll loads its Numba kernels
    # lazily: so it is told --numba, and the numba GPU backend arrayimpl then adds is dropped with the unwanted ones.
    import arrayimpl  # noqa: E402 - mpi4py's, from --testdir

    backends = keep_backends(arrayimpl, [b for b in args.backends.split(",") if b])
    recorder = Recorder(os.path.join(args.out, f"rank{rank}.json"),
                        {"rank": rank, "size": MPI.COMM_WORLD.Get_size(), "impl": args.impl, "backends": backends})
    recorder.flush()
    try:  # a name missing at the module's top level fails all its tests: one failure, named after the module
        __import__(args.module)
    except Exception:  # noqa: BLE001 - whatever the import raised is the finding
        recorder.data["tests"][f"{args.module}.<import>"] = {
            "outcome": "fail", "subtests_failed": [], "message": _short(sys.exc_info())}
        recorder.data["finished"] = True
        recorder.flush()
        return 0
    import main as mpi4py_main  # noqa: E402 - mpi4py's test/main.py

    try:
        mpi4py_main.main(module=args.module, argv=[args.module, "--numba"], testRunner=recording_runner(recorder),
                         exit=False)
    except SystemExit:  # its runTests always ends in sys.exit
        pass
    recorder.data["finished"] = True
    recorder.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
