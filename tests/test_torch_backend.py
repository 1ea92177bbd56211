"""The "pycoll" torch.distributed backend: every operation against gloo, Work and futures, errors, DDP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import harness

torch = pytest.importorskip("torch", reason="the torch backend needs torch (the test extra installs it)")

ROOT = Path(__file__).resolve().parent.parent
RANKS = Path(__file__).resolve().parent / "torch_ranks"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("n", [2, 3])
def test_every_operation_matches_gloo(n: int, tmp_path: Path) -> None:
    """float32, float64, bfloat16, int64, uint8; every op; odd counts; every root; subgroups; p2p."""
    proc = harness.run_script(n, RANKS / "against_gloo.py", ["--out", str(tmp_path)])
    results = harness.rank_reports(proc, tmp_path, n)
    assert all(r["backend"] == "pycoll" for r in results)
    assert min(r["checks"] for r in results) > 300


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher,init", [("torchrun", "env"), ("pycoll", "store"), ("pycoll", "tcp")])
def test_launchers_and_init_methods(launcher: str, init: str, tmp_path: Path) -> None:
    """torchrun's env://, an explicit TCPStore, and a tcp:// init_method."""
    proc = harness.run_script(2, RANKS / "against_gloo.py", ["--out", str(tmp_path), "--init", init, "--quick"], launcher=launcher)
    harness.rank_reports(proc, tmp_path, 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3])
def test_async_work_futures_and_errors(n: int, tmp_path: Path) -> None:
    proc = harness.run_script(n, RANKS / "work_and_errors.py", ["--out", str(tmp_path)])
    harness.rank_reports(proc, tmp_path, n)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3])
def test_device_mesh_dtensor_functional_collectives_and_fsdp2(n: int, tmp_path: Path) -> None:
    """Group names (and destroying a subgroup), the functional collectives, DeviceMesh, DTensor redistribution,
    FSDP2's aliased all-gather, and 5 FSDP2 steps that end where gloo's end."""
    proc = harness.run_script(n, RANKS / "mesh_and_fsdp.py", ["--out", str(tmp_path)])
    results = harness.rank_reports(proc, tmp_path, n)
    assert all(r["checks"] >= 18 for r in results)
    assert max(r["fsdp2_max_abs_diff"] for r in results) <= 1e-6


@pytest.mark.timeout(200)
def test_every_group_honours_its_own_timeout(tmp_path: Path) -> None:
    """Groups with 1, 2 and 3 s timeouts: a blocking call, Work.wait() and a barrier raise at that time, naming it
    and the rank waited for; the default group works afterwards."""
    proc = harness.run_script(2, RANKS / "timeouts.py", ["--out", str(tmp_path)])
    results = harness.rank_reports(proc, tmp_path, 2)
    assert len(results[0]["seconds"]) == 3


@pytest.mark.timeout(400)
def test_ddp_in_reproducible_mode_gives_the_same_bits_for_any_bucket_size(tmp_path: Path) -> None:
    """3 ranks train from one seed with tiny buckets and with one large one (pg_options, then PYCOLL_REPRODUCIBLE):
    every parameter agrees bit for bit, on every rank (docs/reproducibility.md); torch's all_reduce, reduce and
    reduce_scatter_tensor give NumPy's left fold bit for bit."""
    proc = harness.run_script(3, RANKS / "reproducible_ddp.py", [str(tmp_path)])
    results = harness.rank_reports(proc, tmp_path, 3)
    # 3 training checks; 9 (dtype, count) points of torch calls: all_reduce, AVG, reduce_scatter, and reduce on rank 0
    assert [res["checks"] for res in results] == [3 + 9 * 4, 3 + 9 * 3, 3 + 9 * 3]


@pytest.mark.timeout(400)
def test_ddp_trains_like_gloo(tmp_path: Path) -> None:
    """20 steps of the README's DDP example on pycoll and on gloo, same seed: the parameters agree."""
    out = tmp_path / "ddp.json"
    proc = harness.run_script(2, ROOT / "examples" / "ddp_mlp.py", ["--compare", "gloo", "--json", str(out)])
    assert proc.returncode == 0 and out.exists(), f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    res = json.loads(out.read_text())
    assert res["steps"] == 20 and res["ranks"] == 2
    assert res["params_allclose"], f"parameters differ from gloo's by up to {res['max_abs_diff']}"
    assert abs(res["pycoll"]["loss"] - res["gloo"]["loss"]) <= 1e-5 * max(1.0, abs(res["gloo"]["loss"]))


def test_registration_is_idempotent_and_names_the_backend() -> None:
    import torch.distributed as dist

    import pycoll.torch as pt

    pt.register()
    pt.register()
    assert "PYCOLL" in dist.Backend._plugins
    assert dist.Backend("pycoll") == "pycoll"


_THP_PROBE = """
import os, sys, torch
early = torch.ones(4) if sys.argv[1] == "early" else None   # a tensor made before the import: torch has decided
import pycoll.torch as pt
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), pt.huge_page_tensors())
"""


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
                    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
                    reason="this kernel has no transparent huge pages")
@pytest.mark.parametrize("setting,order,expected", [(None, "late", "1 True"), ("0", "late", "0 False"),
                                                    (None, "early", "1 False")])
def test_large_tensors_go_on_huge_pages_unless_the_user_says(setting, order, expected) -> None:
    """``import pycoll.torch`` asks torch's allocator for huge pages from 2 MiB (the kernel's cross-memory copy reads
    them 1.5-1.9x as fast); a value the user set stands, and a tensor made before the import leaves torch's choice."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting is not None:
        env["THP_MEM_ALLOC_ENABLE"] = setting
    out = subprocess.run([sys.executable, "-c", _THP_PROBE, order], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == expected


def test_torch_threads_are_shared_among_a_hosts_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from pycoll.torch import threads as torch_threads

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(4)
        torch_threads.share_cores(2, 4)  # 2 ranks on 4 cores: 2 threads each
        assert torch.get_num_threads() == 2
        torch.set_num_threads(4)
        torch_threads.share_cores(8, 4)  # more ranks than cores: one each
        assert torch.get_num_threads() == 1
        torch.set_num_threads(4)
        torch_threads.share_cores(1, 4)  # alone on the machine: all of them
        assert torch.get_num_threads() == 4
        monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's choice stands
        torch_threads.share_cores(2, 4)
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


def test_a_calls_view_is_the_tensors_memory_and_holds_no_tensor() -> None:
    """The blocking host path's NumPy view: the tensor's own bytes (writes show in the tensor), one array per memory
    range and dtype (what pycoll's caches meet again), and no reference that keeps a freed tensor alive."""
    import gc
    import weakref

    import ml_dtypes
    import numpy as np

    from pycoll.torch import tensors as T

    for dtype, np_dtype in ((torch.float32, np.float32), (torch.bfloat16, ml_dtypes.bfloat16), (torch.bool, np.bool_),
                            (torch.int64, np.int64)):
        t = torch.zeros(7, dtype=dtype)
        view = T.call_view(t)
        assert view.dtype == np_dtype and view.shape == (7,) and view.ctypes.data == t.data_ptr()
        view[3] = 1
        assert bool(t[3] != 0), dtype
        assert T.call_view(t) is view  # found again by address, size and dtype
        assert T.call_view(t.view(torch.uint8) if dtype != torch.bool else t.view(torch.int8)) is not view
    t = torch.ones(5)
    view = T.call_view(t)
    gone = weakref.ref(t)
    del t
    gc.collect()
    assert gone() is None and view.base is not None
    empty = torch.zeros(0)
    assert T.call_view(empty).shape == (0,)


def test_reduce_ops_are_found_by_value_whatever_form_torch_passes() -> None:
    """A ReduceOp object and its RedOpType name the same op; bool sums are logical or; unsupported ones raise."""
    import torch.distributed as dist

    from pycoll import ops
    from pycoll.errors import InvalidArgumentError
    from pycoll.torch import tensors as T

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    assert T.reduce_op("allreduce", opts.reduceOp, torch.float32) is ops.MAX
    assert T.reduce_op("allreduce", dist.ReduceOp.MAX, torch.float32) is ops.MAX
    assert T.reduce_op("allreduce", dist.ReduceOp.SUM, torch.float32) is ops.SUM
    assert T.reduce_op("allreduce", dist.ReduceOp(dist.ReduceOp.SUM), torch.bool) is ops.LOR
    assert T.reduce_op("allreduce", dist.ReduceOp(dist.ReduceOp.SUM), torch.float32) is ops.SUM
    with pytest.raises(InvalidArgumentError, match="allreduce"):
        T.reduce_op("allreduce", dist.ReduceOp.BAND, torch.float32)
