"""The ahead-of-time kernel modules as ranks load them (pycoll.native): names tied to the sources, checked views
that refuse buffers of another kind, scalar-only exports handed out as they are."""

from __future__ import annotations

import numpy as np
import pytest

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
