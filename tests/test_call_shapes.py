"""The one execution path: every collective called as programs call it (specs, fresh arrays, views), on 1..5 ranks."""

from __future__ import annotations

import pytest

import harness
from pycoll.netns import unavailable

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,transport", [(1, "shm"), (2, "shm"), (5, "shm"), (3, "tcp")])
def test_call_shapes(n: int, transport: str, tmp_path) -> None:
    """Results against NumPy on every call; a shape is planned once, whatever buffers later calls pass."""
    res = harness.run_cases(n, ["shapes.shapes", "shapes.shapes_reductions"], transport=transport, out_dir=str(tmp_path),
                            job_timeout=260)
    res.assert_ok()
    plans = res.records("shapes.shapes", "plans")
    assert len(set(plans.values())) == 1 and 0 < plans[0] <= 64, plans


@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", [2, 3])
def test_fresh_arrays_plan_once_and_run_inline(n: int, tmp_path) -> None:
    """A hundred calls on fresh arrays take one plan per spelling (Allreduce spec and bare, Bcast spec), and on one
    host they run as compiled kernel calls (on 2 ranks, one per core, some must finish inside the kernel)."""
    res = harness.run_cases(n, ["shapes.shapes_planned_once"], transport="shm", out_dir=str(tmp_path), job_timeout=160)
    res.assert_ok()
    assert res.records("shapes.shapes_planned_once", "plans") == dict.fromkeys(range(n), 3)
    inline = res.records("shapes.shapes_planned_once", "inline")
    if n == 2:
        assert all(v > 0 for v in inline.values()), inline


def test_prebuilt_kernels_run_from_the_first_call(tmp_path) -> None:
    """With the ahead-of-time build (made by the test session's start, as by an install), a rank has its kernels
    before its first call: the first calls run compiled, and Numba is never imported."""
    res = harness.run_cases(2, ["shapes.shapes_prebuilt_kernels"], transport="shm", out_dir=str(tmp_path), job_timeout=120)
    res.assert_ok()
    assert res.records("shapes.shapes_prebuilt_kernels", "ready_at_start") == {0: True, 1: True}
    assert res.records("shapes.shapes_prebuilt_kernels", "numba_imported") == {0: False, 1: False}
    inline = res.records("shapes.shapes_prebuilt_kernels", "inline_of_first_20")
    assert all(v > 0 for v in inline.values()), inline


@pytest.mark.slow  # its fixture compiles every kernel into Numba's cache (about a minute): in the full run
@pytest.mark.timeout(400)
def test_kernels_load_in_the_background(tmp_path, jit_cache) -> None:
    """Without a build (PYCOLL_KERNELS=jit), a rank starts without the kernels (a Barrier-only job never loads them:
    tests/test_startup.py); repeated calls load them from Numba's cache in the background, right all along, and
    then run compiled."""
    res = harness.run_cases(2, ["shapes.shapes_background_load"], transport="shm", out_dir=str(tmp_path),
                            job_timeout=160, env={"PYCOLL_KERNELS": "jit"})
    res.assert_ok()
    assert res.records("shapes.shapes_background_load", "loaded_at_start") == {0: False, 1: False}
    assert res.records("shapes.shapes_background_load", "loaded") == {0: True, 1: True}
    inline = res.records("shapes.shapes_background_load", "inline_after_load")
    assert all(v > 0 for v in inline.values()), inline


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,transport", [(2, "shm"), (3, "shm"), (2, "tcp")])
def test_resized_plans(n: int, transport: str, tmp_path) -> None:
    """A call of a new length is planned from the checked plan of another (ten collectives, specs with and without a
    count), right; the calls those checks refuse are still refused; a user-defined op's calls are planned from
    scratch; and a program of ever new lengths leaves the cyclic collector nothing (dropped plans had been cycles of
    30-50 objects each)."""
    res = harness.run_cases(n, ["resized.resized_plans", "resized.resized_plan_errors",
                                "resized.dropped_plans_leave_no_cycles"], transport=transport, out_dir=str(tmp_path),
                            job_timeout=260)
    res.assert_ok()
    assert all(set(b) == {"Allreduce", "Reduce", "Bcast", "Scan", "Exscan", "Allgather", "Alltoall",
                          "Reduce_scatter_block", "Gather", "Scatter"}
               for b in res.records("resized.resized_plans", "bases").values())
    assert all(d >= 60 for d in res.records("resized.resized_plans", "derived").values())
    assert res.records("resized.resized_plans", "user_op_bases") == dict.fromkeys(range(n), 0)
    assert res.records("resized.dropped_plans_leave_no_cycles", "garbage") == dict.fromkeys(range(n), {})


@pytest.mark.timeout(300)
@pytest.mark.skipif(unavailable() is not None, reason=f"no virtual hosts here: {unavailable()}")
@pytest.mark.parametrize("n", [2, 4])
def test_resized_plans_across_hosts(n: int, tmp_path) -> None:
    """The same on two virtual hosts: two ranks straight through their socket, four as calls composed of each
    host's and the leaders' (whose dropped plans' socket pairs had held themselves in cycles)."""
    res = harness.run_cases_on_hosts(["resized.resized_plans", "resized.dropped_plans_leave_no_cycles"], hosts=2, n=n,
                                     out_dir=str(tmp_path), job_timeout=240)
    res.assert_ok()
    assert all(d >= 60 for d in res.records("resized.resized_plans", "derived").values())
    assert res.records("resized.dropped_plans_leave_no_cycles", "garbage") == dict.fromkeys(range(n), {})


# the mismatch first: the communicator it broke is its own, and the spans' fast paths of the cases after it (on other
# communicators of the same processes) still run (``Engine.broken_here``)
_SPAN_CASES = ["resized.span_plan_mismatch", "resized.span_plans", "resized.span_plan_late_peer",
               "resized.span_plan_against_planned_peer"]


_SPANNED_SIX = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall")


def _check_span_records(res, n: int, least: int, one_host: bool = True) -> None:
    res.assert_ok()
    spans = res.records("resized.span_plans", "span_calls")
    assert all(v >= least for v in spans.values()), spans
    # ten lengths in two size spans a family: planned once a span where every call after a family's first runs on its
    # span (at most half of them, where a late peer made a span's call decline), ten times where none does
    families = {"Allgather": 2, "Alltoall": 1 + one_host, "Reduce_scatter_block": 1 + one_host}
    for rank, planned in res.records("resized.span_plans", "planned").items():
        over = {label: planned.get(label, 0) for label, k in families.items() if planned.get(label, 0) > 5 * k}
        assert not over, (rank, planned)
    if n == 2:  # the span's calls on rank 0 alone: its peer planned each for its length
        against = res.records("resized.span_plan_against_planned_peer", "span_calls")
        # rank 1 planned each family's first call after the change, for its own length, then spanned from that plan
        assert against[0] >= 20 and against[1] <= against[0] - 6, against
        forced = res.records("resized.span_plan_against_planned_peer", "forced")[0]
        assert {c for c, _ in forced} == set(_SPANNED_SIX), forced
    late = res.records("resized.span_plan_late_peer", "span_calls")
    assert all(v > 0 for v in late.values()), late
    assert all(v > 0 for v in res.records("resized.span_plan_mismatch", "span_calls_before").values())
    assert all(v is not None for v in res.records("resized.span_plan_mismatch", "mismatch").values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,transport", [(2, "shm"), (3, "shm"), (2, "tcp")])
def test_span_plans(n: int, transport: str, tmp_path) -> None:
    """A call whose length changes inside a size span runs on the span's fast path without a plan of its own (on one
    host: the slots' Reduce, Bcast, Scan, Allgather, Gather, Reduce_scatter_block and Alltoall), right; a late
    peer's rest is made for the call's own length; ranks whose lengths differ get a mismatch, not a hang. Over TCP
    two ranks have no arena and no socket path of their own: nothing is spanned there, and the cases check the
    results alone."""
    res = harness.run_cases(n, _SPAN_CASES, transport=transport, out_dir=str(tmp_path), job_timeout=200)
    if transport == "tcp":
        res.assert_ok()
        return
    _check_span_records(res, n, 60)


@pytest.mark.timeout(300)
@pytest.mark.skipif(unavailable() is not None, reason=f"no virtual hosts here: {unavailable()}")
@pytest.mark.parametrize("n", [2, 4])
def test_span_plans_across_hosts(n: int, tmp_path) -> None:
    """The same on two virtual hosts: two ranks straight through their socket (the frames carry each call's own
    count), four as composed calls whose host and leaders' steps are spanned too."""
    res = harness.run_cases_on_hosts(_SPAN_CASES, hosts=2, n=n, out_dir=str(tmp_path), job_timeout=200)
    _check_span_records(res, n, 20, one_host=False)
