"""The "pycoll" torch backend on CUDA tensors: the conversion to device buffers, every operation under numba's
simulator (CPU tensors sent down the device path), and the same operations on a GPU where there is one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs torch (the test extra installs it)")

from pycoll import buffers  # noqa: E402
from pycoll.datatypes import BFLOAT16  # noqa: E402
from pycoll.errors import InvalidArgumentError  # noqa: E402
from pycoll.torch import tensors as T  # noqa: E402
from harness import rank_reports, run_script  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "torch_ranks" / "cuda_sim.py"


def _as_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors count as CUDA ones (what tests/torch_ranks/cuda_sim.py does in its ranks)."""
    monkeypatch.setattr(T, "is_device", lambda t: True)


def test_cuda_view_exports_the_tensor_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    _as_device(monkeypatch)
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = T.buffer(t)
    iface = view.__cuda_array_interface__
    assert iface == {"shape": (12,), "typestr": "<f4", "data": (t.data_ptr(), False), "strides": None, "version": 3}
    parsed = buffers.parse(view, "recvbuf", "Allreduce", writable=True)
    assert parsed.memory == "cuda" and parsed.count == 12 and parsed.dtype == np.float32
    assert parsed.array.ptr == t.data_ptr() and parsed.array.owner.tensor.data_ptr() == t.data_ptr()


def test_bfloat16_bool_and_grad_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    _as_device(monkeypatch)
    b = torch.ones(5, dtype=torch.bfloat16)
    spec = T.buffer(b)
    assert isinstance(spec, list) and spec[1] == BFLOAT16 and spec[0].__cuda_array_interface__["typestr"] == "<u2"
    parsed = buffers.parse(spec, "sendbuf", "Allreduce")
    assert parsed.dtype == BFLOAT16 and parsed.count == 5
    assert T.vector(spec, [2, 3]) == [spec[0], [2, 3], BFLOAT16]
    vparsed = buffers.parse_vector(T.vector(spec, [2, 3]), "recvbuf", "Allgatherv", 2, writable=True)
    assert vparsed.dtype == BFLOAT16 and vparsed.counts == [2, 3]
    assert T.buffer(torch.zeros(3, dtype=torch.bool)).__cuda_array_interface__["typestr"] == "|b1"
    w = torch.ones(4, requires_grad=True)  # torch's own interface refuses these; ours reads the detached memory
    assert T.buffer(w).__cuda_array_interface__["data"][0] == w.data_ptr()
    assert T.buffer(torch.empty(0)).__cuda_array_interface__["data"] == (0, False)


def test_staged_non_contiguous_goes_through_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    _as_device(monkeypatch)
    t = torch.arange(6, dtype=torch.float64).reshape(2, 3).t()
    st = T.Staged(t)
    assert st.copy is not None and st.arr.__cuda_array_interface__["data"][0] == st.copy.data_ptr()
    st.copy.mul_(10)
    st.done()
    assert t.tolist() == [[0.0, 30.0], [10.0, 40.0], [20.0, 50.0]]


def test_host_tensors_stay_numpy_views() -> None:
    t = torch.arange(4, dtype=torch.int32)
    arr = T.buffer(t)
    assert isinstance(arr, np.ndarray) and np.shares_memory(arr, t.numpy())
    assert T.vector(arr, [1, 3])[1] == [1, 3]
    place = T.Placement(t)
    assert not place.cuda and place.stream is None
    with place.scope():
        place.synchronize()


def test_device_checks_name_the_devices() -> None:
    with pytest.raises(InvalidArgumentError, match="meta.*CPU and CUDA"):
        T.check_tensor("allreduce", torch.ones(2, device="meta"))
    with pytest.raises(InvalidArgumentError, match="cpu and meta"):
        T.same_device("all_gather", [torch.ones(2), torch.ones(2, device="meta")], torch.device("cpu"))
    T.same_device("all_gather", [torch.ones(2), torch.ones(3)], torch.device("cpu"))


def test_flat_concat_and_split_keep_shapes() -> None:
    parts = [torch.ones(2, 2), torch.arange(3, dtype=torch.float32)]
    flat = T.flat_concat(parts)
    assert flat.tolist() == [1, 1, 1, 1, 0, 1, 2]
    outs = [torch.empty(2, 2), torch.empty(3, 1).t()]  # the second is not contiguous
    T.split_into(flat * 2, outs)
    assert outs[0].tolist() == [[2, 2], [2, 2]] and outs[1].tolist() == [[0, 2, 4]]
    assert T.flat_empty(5, torch.ones(1, dtype=torch.int16)).dtype == torch.int16


def _launch(n: int, out: Path, env: dict[str, str], args: list[str], timeout: float) -> None:
    proc = run_script(n, SCRIPT, ["--out", str(out), *args], env, timeout=timeout)
    assert min(res["checks"] for res in rank_reports(proc, out, n)) > 30


@pytest.mark.timeout(200)
def test_every_operation_on_the_device_path_under_the_simulator(tmp_path: Path) -> None:
    """allreduce (float32, bfloat16, bool, AVG of a non-contiguous tensor, async), broadcast, reduce, all_gather
    (even and uneven), all_gather_into_tensor, reduce_scatter(_tensor), all_to_all(_single), gather, scatter,
    send/recv: each through pycoll's device staging, with the caller's stream."""
    _launch(2, tmp_path, {"NUMBA_ENABLE_CUDASIM": "1"}, [], 180)


@pytest.mark.gpu
@pytest.mark.timeout(400)
def test_every_operation_on_cuda_tensors(tmp_path: Path) -> None:
    """The same operations on CUDA tensors: 2 ranks sharing GPU 0 (or one GPU each)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch (torch.cuda.is_available() is False)")
    _launch(2, tmp_path, {"NUMBA_ENABLE_CUDASIM": "0"}, ["--real"], 380)
