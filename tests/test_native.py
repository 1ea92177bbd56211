"""The ahead-of-time kernel modules as ranks load them (pycoll.native): names tied to the sources, checked views
that refuse buffers of another kind, scalar-only exports handed out as they are."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from harness import run_script

from pycoll import native


def _loaded(kind: str) -> native.KernelSet:
    ks = native.load(kind)
    if ks is None:
        pytest.skip(f"no ahead-of-time build here: {native.why(kind)}")
    return ks


def test_module_names_follow_the_sources() -> None:
    for kind in native.SOURCES:
        digest = native.source_hash(kind)
        assert native.module_name(kind, digest) != native.module_name(kind, "0" * len(digest))
        assert native.source_hash(kind) == digest  # stable


def test_checked_views_refuse_other_buffers() -> None:
    ks = _loaded("arena")
    words = np.zeros(64, np.uint64)
    bases = np.zeros(2, np.int64)
    assert ks.spin(words, bases, 1, 0) is not None
    with pytest.raises(TypeError, match="spin"):
        ks.spin(words.astype(np.float64), bases, 1, 0)
    with pytest.raises(TypeError):
        ks.spin(np.zeros((8, 8), np.uint64), bases, 1, 0)
    with pytest.raises(TypeError):
        ks.spin(np.zeros(128, np.uint64)[::2], bases, 1, 0)  # not contiguous


def test_user_checked_views_pick_the_dtype_and_refuse_the_rest() -> None:
    ks = _loaded("arena")
    fast32 = ks.fast("slots_move", np.float32)
    with pytest.raises(TypeError):
        fast32(np.zeros(8, np.uint64), np.zeros((4, 2, 64), np.uint8), np.zeros(4), np.zeros(4),
               np.zeros(8, np.int64), np.zeros(5, np.uint64), 1, 1, False)
    assert ks.raw("slots_move", np.float32) is not ks.raw("slots_move", np.float64)


def test_scalar_only_kernels_are_the_exports_themselves() -> None:
    ks = _loaded("p2p")
    assert ks.take is ks.raw("take")  # no Python frame between a point-to-point call and its kernel
    assert ks.take_plain is not ks.raw("take_plain")  # array arguments: checked


def test_dispatch_by_dtype_checks_the_variant_it_picks_and_refuses_the_rest() -> None:
    calls: list[str] = []
    variants = [
        (dt, (lambda tag: lambda send, n: calls.append(tag) or n)(np.dtype(dt).name),
         [{"dtype": np.dtype(dt).str, "ndim": 1, "layout": "C"}, None])
        for dt in (np.float32, np.float64, np.int32)
    ]
    kernel = native._dispatcher("pipe", ["send", "n"], variants, every=True)
    assert kernel(np.zeros(3, np.float64), 7) == 7 and kernel(np.zeros(3, np.float32), 8) == 8
    assert kernel(np.zeros(3, np.float64), 9) == 9 and calls == ["float64", "float32", "float64"]
    for bad in (np.zeros(3, np.int8), np.zeros((2, 2), np.float32), np.zeros(6, np.int32)[::2], [1.0, 2.0]):
        with pytest.raises(TypeError, match="pipe"):
            kernel(bad, 1)
    assert calls == ["float64", "float32", "float64"]


_FIRST_CALLS = textwrap.dedent("""
    import json, sys, threading
    from pycoll import MPI, native
    from pycoll.algorithms import arena_jit, cost
    comm = MPI.COMM_WORLD  # the runtime starts the thread while its rendezvous waits
    started = [t for t in threading.enumerate() if t.name == "pycoll-first-calls"]
    for t in started:
        t.join()
    with open(f"{sys.argv[1]}/rank{comm.Get_rank()}.json", "w") as f:
        json.dump({"threads": len(started), "kernels": native._loaded.get("arena+staged") is not None,
                   "polls": arena_jit._ns_per_poll > 0, "cache": cost.last_level_cache.cache_info().currsize}, f)
""")


@pytest.mark.parametrize("kernels", ["auto", "jit"])
def test_the_runtime_prepares_a_hosts_first_calls_while_it_meets_its_peers(tmp_path: Path, kernels: str) -> None:
    """Ranks that share a host load the built arena kernels and measure the poll rate before their first call (one
    thread, started at start-up); with ``PYCOLL_KERNELS=jit`` only the cost model's cache size is read there."""
    _loaded("arena")
    script = tmp_path / "rank.py"
    script.write_text(_FIRST_CALLS)
    proc = run_script(2, script, [str(tmp_path)], env={"PYCOLL_KERNELS": kernels}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["threads"] <= 1 and got["cache"] == 1, got
        assert got["kernels"] == got["polls"] == (kernels == "auto"), got


def test_preparing_the_first_calls_loads_kernels_only_where_ranks_share_the_host() -> None:
    code = textwrap.dedent("""
        import threading
        from pycoll import native
        from pycoll.algorithms import arena_jit
        def finish():
            for t in threading.enumerate():
                if t.name == "pycoll-first-calls":
                    t.join()
        arena_jit.prepare_first_calls(None)  # not known yet: the cache size only
        finish()
        assert "arena+staged" not in native._loaded, native._loaded
        arena_jit.prepare_first_calls(1)
        finish()
        assert "arena+staged" not in native._loaded, native._loaded
        arena_jit.prepare_first_calls(2)
        finish()
        assert native._loaded.get("arena+staged") is not None and arena_jit._ns_per_poll > 0
        arena_jit.prepare_first_calls(2)
        assert not [t for t in threading.enumerate() if t.name == "pycoll-first-calls"]  # once per process
    """)
    _loaded("arena")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
