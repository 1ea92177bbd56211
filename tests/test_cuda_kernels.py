"""pycoll.cuda kernels: every (op, dtype) bit-exact against NumPy on the CUDA simulator, PTX for sm_80/sm_90, a GPU."""

# numba picks the simulator when numba.cuda is first imported, and other tests in this process may import it without,
# so the kernel checks run in subprocesses (tests/cuda_sim_kernels.py); each case is reported as its own test.

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from pycoll import ops as O
from pycoll.cuda import dtypes as D
from pycoll.datatypes import BFLOAT16

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(TESTS, "cuda_sim_kernels.py")

_spec = importlib.util.spec_from_file_location("cuda_sim_kernels", SCRIPT)
script: Any = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(script)  # type: ignore[union-attr]

_procs: dict[str, subprocess.Popen] = {}
_results: dict[str, dict[str, str]] = {}


def _start(mode: str) -> None:
    if mode not in _procs:
        _procs[mode] = subprocess.Popen([sys.executable, SCRIPT, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)


def results(mode: str) -> dict[str, str]:
    """The script's verdict per case; the simulator and PTX runs start together (they use a core each)."""
    if mode not in _results:
        for m in ("sim", "ptx") if mode in ("sim", "ptx") else (mode,):
            _start(m)
        out, err = _procs[mode].communicate(timeout=900)
        lines = out.strip().splitlines()
        if _procs[mode].returncode != 0 or not lines:
            pytest.fail(f"cuda_sim_kernels.py {mode} exited {_procs[mode].returncode}:\n{err[-3000:]}")
        _results[mode] = json.loads(lines[-1])["cases"]
    return _results[mode]


def _verdict(mode: str, case: str) -> None:
    got = results(mode).get(case, "FAIL: case did not run")
    if got.startswith("skip:"):
        pytest.skip(got[5:].strip())
    assert got == "ok", got


@pytest.mark.parametrize("case", script.case_ids("sim"))
def test_sim(case: str) -> None:
    _verdict("sim", case)


@pytest.mark.parametrize("case", script.case_ids("ptx"))
def test_ptx(case: str) -> None:
    _verdict("ptx", case)


def _gpu_missing() -> str | None:
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return "NUMBA_ENABLE_CUDASIM is set: numba.cuda is the simulator in this process"
    try:
        from numba import cuda
    except ImportError as exc:  # pragma: no cover - numba is a core dependency
        return f"numba.cuda is not importable ({exc})"
    return None if cuda.is_available() else "no CUDA device (numba.cuda.is_available() is False)"


@pytest.mark.gpu
@pytest.mark.timeout(900)  # a few hundred kernels compile on first launch
def test_gpu_kernels() -> None:
    """The same cases on a real device, with arrays past a million elements."""
    why = _gpu_missing()
    if why:
        pytest.skip(why)
    failed = {k: v for k, v in results("device").items() if v != "ok"}
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())


# --- the dtype layer, in this process (it imports no numba.cuda) ---------------------------------------------------


def test_pairs_cover_every_op_and_dtype() -> None:
    got = {(op.name, dt) for op, dt in D.pairs()}
    want = {(op.name, dt) for op in O.OPS.values() for dt in D.DTYPES if op.check(dt) is None}
    assert got == want
    assert {name for name, _ in got} == set(O.OPS)
    assert {dt for _, dt in got} == set(D.DTYPES)
    names = {dt.name for dt in D.DTYPES}
    assert {"int8", "uint64", "float16", "bfloat16", "float32", "float64", "complex64", "complex128", "bool"} <= names
    assert D.check("sum", np.longdouble) is not None and D.check("min", np.complex64) is not None
    assert D.check("avg", np.int32) is not None  # as on the host: AVG takes float and complex dtypes


def test_layouts() -> None:
    assert D.layout(BFLOAT16).storage == np.uint16 and D.layout(BFLOAT16).acc == np.float32
    assert D.layout(np.float16).storage == np.float16 and D.layout(np.float16).acc == np.float32
    assert D.layout(np.bool_).storage == np.uint8
    assert D.layout(np.int8).acc == np.int32 and D.layout(np.uint16).acc == np.uint32
    assert D.layout(np.int64).acc == np.int64 and D.layout(np.complex64).acc == np.complex64
    with pytest.raises(TypeError):
        D.layout(np.longdouble)


def test_divisor_args() -> None:
    assert D.divisor_arg(BFLOAT16, 257, wide=False) == np.float32(256)  # rounded to bfloat16, as the host divides
    assert D.divisor_arg(BFLOAT16, 257, wide=True) == np.float32(257)
    assert D.divisor_arg(np.float16, 3, wide=False).dtype == np.float32
    assert D.divisor_arg(np.float64, 3, wide=True).dtype == np.float64
    assert D.divisor_arg(np.complex64, 3, wide=False) == np.float32(1) / np.float32(3)
    with pytest.raises(TypeError):
        D.divisor_arg(np.int32, 3, wide=False)


def test_import_is_lazy() -> None:
    """``import pycoll.cuda`` leaves numba.cuda alone, so a later NUMBA_ENABLE_CUDASIM still takes effect."""
    code = "import sys, pycoll.cuda as c; c.pairs(); print('numba.cuda' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
