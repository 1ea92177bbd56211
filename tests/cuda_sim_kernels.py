"""Checks of pycoll.cuda's kernels against NumPy, run in a subprocess: on the CUDA simulator, a GPU, or as PTX."""

# python tests/cuda_sim_kernels.py sim     sets NUMBA_ENABLE_CUDASIM=1 itself, before numba.cuda is imported
# python tests/cuda_sim_kernels.py device  needs a CUDA device; arrays past a million elements
# python tests/cuda_sim_kernels.py ptx     compiles for sm_80 and sm_90 with NVVM and ptxas; no device needed
# The last line printed is JSON: {"cases": {id: "ok" | "skip: ..." | "FAIL: ..."}, "seconds": t}.
# case_ids(mode) lists the ids without importing numba.cuda, for pytest to parametrize over.
# CUDA_SIM_CASES=prefix,prefix runs a subset.

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
import zlib
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np

from pycoll import ops as O
from pycoll.cuda import dtypes as D
from pycoll.datatypes import BFLOAT16

MODE = "sim"
cuda: Any = None  # numba.cuda, once main() has set the mode
C: Any = None  # pycoll.cuda.launch
K: Any = None  # pycoll.cuda.kernels

AVG_DTYPES = [dt for dt in D.DTYPES if D.check(O.AVG, dt) is None]


def _sizes() -> tuple[int, ...]:
    # the simulator launches at most 4 blocks of 32 threads: 129 and 257 take the grid-stride loop around
    return (1, 3, 33, 129, 257) if MODE == "sim" else (1, 3, 4099, 1 << 20 | 5)


def _pick(seq: Any, key: str) -> Any:
    return seq[zlib.crc32(key.encode()) % len(seq)]


# --- data and references ------------------------------------------------------------------------------------------


def _float_data(rng: np.random.Generator, dt: np.dtype, n: int) -> np.ndarray:
    """Values over a range of exponents, a quarter random bit patterns, and a few specials."""
    x = (rng.standard_normal(n) * 2.0 ** rng.integers(-8, 9, n)).astype(dt)
    bits = np.dtype(f"u{dt.itemsize}")
    raw = rng.random(n) < 0.25
    x[raw] = rng.integers(0, np.iinfo(bits).max, size=int(raw.sum()), dtype=bits, endpoint=True).view(dt)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0], np.float64)
    if n >= 16:
        where = rng.choice(n, size=len(specials), replace=False)
        with np.errstate(all="ignore"):
            x[where] = specials.astype(dt)
    return x


def data(rng: np.random.Generator, dt: np.dtype, n: int, op: O.Op) -> np.ndarray:
    fam = D.layout(dt).family
    if fam == D.INT:
        info = np.iinfo(dt)
        x = rng.integers(info.min, info.max, size=n, dtype=dt, endpoint=True)
        if op.name.startswith("L"):
            x[rng.random(n) < 0.3] = 0
        return x
    if fam == D.BOOL:
        return rng.random(n) < 0.5
    if fam == D.COMPLEX:
        part = np.dtype(np.float32 if dt == np.complex64 else np.float64)
        x = np.empty(n, dt)
        x.real, x.imag = _float_data(rng, part, n), _float_data(rng, part, n)
        return x
    return _float_data(rng, dt, n)


def cmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Complex product with every real product rounded (NumPy's array loop may fuse them, which is not bit-defined)."""
    out = np.empty_like(a)
    out.real = a.real * b.real - a.imag * b.imag
    out.imag = a.real * b.imag + a.imag * b.real
    return out


def host2(op: O.Op, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """pycoll's host reduce of two arrays (HostMemory.reduce)."""
    if op is O.PROD and a.dtype.kind == "c":
        return cmul(a, b)
    out = np.empty_like(a)
    op.ufunc(a, b, out=out)
    return out


def host_many(op: O.Op, srcs: list[np.ndarray], divisor: int | None = None) -> np.ndarray:
    """The n-ary kernels' contract: rank-order reduction; float16/bfloat16 sums and products in float32, rounded once."""
    dt = srcs[0].dtype
    if D.layout(dt).family in (D.F16, D.BF16) and op.name in ("SUM", "PROD", "AVG"):
        acc = srcs[0].astype(np.float32)
        for s in srcs[1:]:
            acc = op.ufunc(acc, s.astype(np.float32))
        if op.averages:
            acc = acc / np.float32(divisor or len(srcs))
        return acc.astype(dt)
    out = srcs[0].copy()
    for s in srcs[1:]:
        out = host2(op, out, s)
    if op.averages:
        np.divide(out, dt.type(divisor or len(srcs)), out=out)
    return out


def compare(got: np.ndarray, ref: np.ndarray) -> str | None:
    """None when equal bit for bit; NaN matches any NaN (devices canonicalise NaN payloads)."""
    dt = ref.dtype
    if got.dtype != dt or got.shape != ref.shape:
        return f"got {got.dtype}{got.shape}, want {dt}{ref.shape}"
    if dt.kind == "c":
        part = np.float32 if dt == np.complex64 else np.float64
        return compare(got.view(part), ref.view(part))
    gb, rb = got.view(f"u{dt.itemsize}"), ref.view(f"u{dt.itemsize}")
    bad = gb != rb
    if dt.kind == "f" or dt == BFLOAT16:
        gn, rn = np.isnan(got), np.isnan(ref)
        bad = (bad & ~(gn & rn)) | (gn != rn)
    if not bad.any():
        return None
    i = int(np.flatnonzero(bad)[0])
    return f"{int(bad.sum())}/{bad.size} differ; first at {i}: got {got[i]!r} ({int(gb[i]):#x}), want {ref[i]!r} ({int(rb[i]):#x})"


# --- device arrays: the same helpers serve the simulator and a GPU ----------------------------------------------


def dev(x: np.ndarray) -> Any:
    return cuda.to_device(x.view(np.uint16) if x.dtype == BFLOAT16 else x)


def host(d: Any, dt: np.dtype) -> np.ndarray:
    out = d.copy_to_host()
    return out.view(dt) if dt == BFLOAT16 else out


def kw(dt: np.dtype) -> dict:
    return {"dtype": dt} if dt == BFLOAT16 else {}


def _rng(key: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(key.encode()))


# --- cases ------------------------------------------------------------------------------------------------------


def case_reduce2(key: str, op: O.Op, dt: np.dtype) -> str | None:
    rng = _rng(key)
    for n in (_pick(_sizes()[:-1], key), _sizes()[-1]):  # a short odd length, then past the grid
        a, b = data(rng, dt, n, op), data(rng, dt, n, op)
        ref = host2(op, a, b)
        da, db = dev(a), dev(b)
        alias = _pick(("a", "b", "none"), f"{key}{n}")
        out = {"a": da, "b": db, "none": None}[alias]
        if out is None:
            out = dev(np.zeros_like(a))
        C.reduce2(op, out, da, db, **kw(dt))
        why = compare(host(out, dt), ref)
        if why:
            return f"n={n} out={alias}: {why}"
    return None


def case_signed_zero_nan(key: str, dt: np.dtype) -> str | None:
    """MIN/MAX on +0/-0 ties and NaN: float16 keeps the first operand on a tie, NumPy's other floats the second."""
    a = np.array([0.0, -0.0, 0.0, -0.0, np.nan, 1.0, np.nan, -np.inf, 2.0], np.float64).astype(dt)
    b = np.array([-0.0, 0.0, 0.0, -0.0, 1.0, np.nan, np.nan, np.inf, 2.0], np.float64).astype(dt)
    for op in (O.MIN, O.MAX):
        out = dev(np.zeros_like(a))
        C.reduce2(op, out, dev(a), dev(b), **kw(dt))
        why = compare(host(out, dt), host2(op, a, b))
        if why:
            return f"reduce2 {op.name}: {why}"
        C.reduce_many(op, out, [dev(a), dev(b), dev(a)], **kw(dt))
        why = compare(host(out, dt), host_many(op, [a, b, a]))
        if why:
            return f"reduce_many {op.name}: {why}"
    return None


def case_reduce_many(key: str, op: O.Op, dt: np.dtype, nsrc: int | None = None) -> str | None:
    rng, n = _rng(key), _pick(_sizes(), key)
    nsrc = nsrc or 1 + zlib.crc32(key.encode()) % 6
    srcs = [data(rng, dt, n, op) for _ in range(nsrc)]
    ref = host_many(op, srcs)
    dsrcs = [dev(s) for s in srcs]
    alias = _pick(("first", "last", "none"), key + "alias")
    out = {"first": dsrcs[0], "last": dsrcs[-1], "none": None}[alias]
    if out is None:
        out = dev(np.zeros_like(srcs[0]))
    C.reduce_many(op, out, dsrcs, **kw(dt))
    why = compare(host(out, dt), ref)
    return why and f"n={n} nsrc={nsrc} out={alias}: {why}"


def case_avg_pairwise(key: str, dt: np.dtype) -> str | None:
    """reduce2/reduce_copy with a divisor = the host's reduce then scale (divisor rounded to the dtype)."""
    rng = _rng(key)
    for n in (_sizes()[-1], 2):
        for p in (3, 6, 257):
            a, b = data(rng, dt, n, O.AVG), data(rng, dt, n, O.AVG)
            ref = host2(O.AVG, a, b)
            np.divide(ref, dt.type(p), out=ref)
            da, db, d2 = dev(a), dev(b), dev(np.zeros_like(a))
            C.reduce2(O.AVG, db, da, db, divisor=p, **kw(dt))
            why = compare(host(db, dt), ref)
            if why:
                return f"reduce2 n={n} p={p}: {why}"
            da, db, d1 = dev(a), dev(b), dev(np.zeros_like(a))
            C.reduce_copy(O.AVG, d1, d2, da, db, divisor=p, **kw(dt))
            why = compare(host(d1, dt), ref) or compare(host(d2, dt), ref)
            if why:
                return f"reduce_copy n={n} p={p}: {why}"
    return None


def case_avg_many(key: str, dt: np.dtype) -> str | None:
    """AVG over n sources with an explicit divisor (a subset of ranks, averaged over all)."""
    rng, n = _rng(key), _sizes()[-2]
    srcs = [data(rng, dt, n, O.AVG) for _ in range(3)]
    ref = host_many(O.AVG, srcs, divisor=5)
    out = dev(np.zeros_like(srcs[0]))
    C.reduce_many(O.AVG, out, [dev(s) for s in srcs], divisor=5, **kw(dt))
    return compare(host(out, dt), ref)


def case_scale(key: str, dt: np.dtype) -> str | None:
    rng, n = _rng(key), _sizes()[-1]
    for p in (1, 3, 257):
        a = data(rng, dt, n, O.AVG)
        ref = a.copy()
        np.divide(ref, dt.type(p), out=ref)
        da = dev(a)
        C.scale(da, p, **kw(dt))
        why = compare(host(da, dt), ref)
        if why:
            return f"in place p={p}: {why}"
        da, do = dev(a), dev(np.zeros_like(a))
        C.scale(da, p, out=do, **kw(dt))
        why = compare(host(do, dt), ref) or compare(host(da, dt), a)
        if why:
            return f"out of place p={p}: {why}"
    return None


def case_fused(key: str, op: O.Op, dt: np.dtype) -> str | None:
    rng, n = _rng(key), _sizes()[-1]
    a, b = data(rng, dt, n, op), data(rng, dt, n, op)
    ref = host2(op, a, b)
    da, db, d2 = dev(a), dev(b), dev(np.zeros_like(a))
    C.reduce_copy(op, da, d2, da, db, **kw(dt))
    return compare(host(da, dt), ref) or compare(host(d2, dt), ref)


def case_wide_bitwise(key: str, op: O.Op, dt: np.dtype) -> str | None:
    """BAND/BOR/BXOR run on whole words when sizes and addresses allow; misaligned slices fall back."""
    rng = _rng(key)
    base = 8 * (_sizes()[-1] // 8 + 1)
    for lo, n in ((0, base), (1, base - 2), (0, base - 1), (8 // dt.itemsize, base // 2)):
        a, b = data(rng, dt, lo + n, op), data(rng, dt, lo + n, op)
        ref = host2(op, a[lo:], b[lo:])
        da, db = dev(a), dev(b)
        C.reduce2(op, da[lo:], da[lo:], db[lo:])
        why = compare(host(da, dt)[lo:], ref) or compare(host(da, dt)[:lo], a[:lo])
        if why:
            return f"offset {lo} n={n}: {why}"
    return None


def case_explicit_dtype(key: str) -> str | None:
    """``dtype=`` reinterprets same-size arrays: float16 data handed over as uint16, int32 as float32 rejected."""
    rng, n = _rng(key), 37
    a, b = data(rng, np.dtype(np.float16), n, O.SUM), data(rng, np.dtype(np.float16), n, O.SUM)
    da, db = cuda.to_device(a.view(np.uint16)), cuda.to_device(b.view(np.uint16))
    C.reduce2("sum", da, da, db, dtype=np.float16)
    why = compare(da.copy_to_host().view(np.float16), a + b)
    if why:
        return why
    from pycoll.datatypes import DATATYPES

    x = data(rng, BFLOAT16, n, O.MAX)
    dx = cuda.to_device(x.view(np.int16))  # any 2-byte carrier, named by an MPI Datatype
    C.reduce_many("max", dx, [dx, dev(x[::-1].copy())], dtype=DATATYPES["BFLOAT16"])
    why = compare(dx.copy_to_host().view(BFLOAT16), np.maximum(x, x[::-1]))
    if why:
        return why
    try:
        C.reduce2("sum", dev(np.zeros(4, np.int16)), dev(np.zeros(4, np.int16)), dev(np.zeros(4, np.int16)), dtype=np.float32)
    except TypeError:
        return None
    return "a 2-byte array taken as float32"


def case_bf16_codec(key: str) -> str | None:
    """float32 -> bfloat16 rounding (ties, overflow, NaN, subnormals) and back, against ml_dtypes."""
    rng = _rng(key)
    edges = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F800001, 0xFFC00000, 0x7FFFFFFF, 0x7F7FFFFF, 0xFF7FFFFF,
             0x7F7F8000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F80FFFF, 0x00000001, 0x00008000, 0x00018000,
             0x007FFFFF, 0x807F8000, 0x3F7FFFFF, 0x0000FFFF, 0x00010000]
    bits = np.concatenate([np.array(edges, np.uint32), rng.integers(0, 2**32, 300, dtype=np.uint32)])
    x = bits.view(np.float32)

    @cuda.jit
    def roundtrip(out_bits, back, src):
        for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
            h = K.bf16_from_f32(src[i])
            out_bits[i] = h
            back[i] = K.bf16_to_f32(h)

    d_out, d_back = cuda.to_device(np.zeros(x.size, np.uint16)), cuda.to_device(np.zeros(x.size, np.float32))
    grid, block = C.launch_config(x.size)
    roundtrip[grid, block](d_out, d_back, cuda.to_device(x))
    got = d_out.copy_to_host()
    with np.errstate(all="ignore"):
        want = x.astype(BFLOAT16).view(np.uint16)
    if not np.array_equal(got, want):  # NaN included: both give 0x7fc0 with the sign
        i = int(np.flatnonzero(got != want)[0])
        return f"f32 {int(bits[i]):#010x} -> {int(got[i]):#06x}, ml_dtypes {int(want[i]):#06x}"
    return compare(d_back.copy_to_host(), want.view(BFLOAT16).astype(np.float32))


def case_copy(key: str) -> str | None:
    rng = _rng(key)
    big = _sizes()[-1]
    plans = [(np.float32, big, 0), (np.uint8, big * 3 + 1, 3), (np.uint8, 64, 0), (np.int16, big, 1),
             (np.complex128, big // 2, 0), (BFLOAT16, big, 0), (np.bool_, 77, 5)]
    for t, n, lo in plans:
        dt = np.dtype(t)
        src = data(rng, dt, n + lo, O.BAND if dt.kind in "biu" else O.SUM)
        dsrc, ddst = dev(src), dev(np.zeros_like(src))
        C.copy(ddst[lo:], dsrc[lo:])
        got = host(ddst, dt)
        why = compare(got[lo:], src[lo:]) or compare(got[:lo], np.zeros_like(src[:lo]))
        if why:
            return f"{dt.name} n={n} offset={lo}: {why}"
    a = data(rng, np.dtype(np.float64), 99, O.SUM)
    d1, d2, dsrc = dev(np.zeros(99 * 8, np.uint8)), dev(np.zeros_like(a)), dev(a)  # dtypes differ, bytes agree
    C.copy(d1, dsrc, dst2=d2)
    why = compare(d1.copy_to_host().view(np.float64), a) or compare(d2.copy_to_host(), a)
    if why:
        return f"dual copy: {why}"
    C.copy(dsrc, dsrc)  # same memory: nothing to do
    return compare(dsrc.copy_to_host(), a)


def case_word_choice(key: str) -> str | None:
    """Copies and bitwise ops use the widest word that every address and the size allow (a device faults otherwise)."""
    raw = dev(np.zeros(64, np.uint8))
    plans = [((raw, raw), 64, 8), ((raw[8:], raw[16:]), 48, 8), ((raw[4:], raw), 32, 4), ((raw[2:], raw[6:]), 8, 2),
             ((raw[1:], raw), 8, 1), ((raw, raw), 12, 4), ((raw, raw), 7, 1)]
    for arrs, nbytes, want in plans:
        got = C._word([C._array(a, "a") for a in arrs], nbytes).itemsize
        if got != want:
            return f"{nbytes} bytes at offsets {[C._address(a) - C._address(raw) for a in arrs]}: {got}-byte words, want {want}"
    return None


def case_copy_blocks(key: str) -> str | None:
    rng = _rng(key)
    plans = [  # dtype, nblocks, blocklen, src_off, src_stride, dst_off, dst_stride
        (np.float32, 5, 7, 1, 9, 2, 7),
        (np.int8, 6, 16, 0, 32, 8, 24),  # whole uint64 words
        (np.uint16, 3, 33, 3, 40, 0, 33),
        (BFLOAT16, 4, 10, 0, 10, 5, 12),
        (np.complex64, 2, 40, 1, 50, 0, 45),
    ]
    for t, nb, bl, so, ss, do, ds in plans:
        dt = np.dtype(t)
        src = data(rng, dt, so + ss * (nb - 1) + bl, O.BAND if dt.kind in "iu" else O.SUM)
        dst = np.zeros(do + ds * (nb - 1) + bl + 8, dt)  # a tail that the copy must leave alone
        want = dst.copy()
        for k in range(nb):
            want[do + k * ds : do + k * ds + bl] = src[so + k * ss : so + k * ss + bl]
        ddst = dev(dst)
        C.copy_blocks(ddst, dev(src), nb, bl, src_offset=so, src_stride=ss, dst_offset=do, dst_stride=ds)
        why = compare(host(ddst, dt), want)
        if why:
            return f"{dt.name} {nb}x{bl}: {why}"
    return None


def case_empty(key: str) -> str | None:
    z = dev(np.zeros(0, np.float32))
    C.reduce2("sum", z, z, z)
    C.reduce_copy("max", z, z, z, z)
    C.reduce_many("avg", z, [z, z, z])
    C.scale(z, 3)
    C.copy(z, z, dst2=z)
    C.copy_blocks(z, z, 0, 5)
    C.copy_blocks(z, z, 3, 0)
    return None


def _raises(exc: type, fn: Callable, *args: Any, **kws: Any) -> str | None:
    try:
        fn(*args, **kws)
    except exc:
        return None
    except Exception as e:  # noqa: BLE001
        return f"{fn.__name__}: {type(e).__name__} ({e}), want {exc.__name__}"
    return f"{fn.__name__}{args[:1]}: no {exc.__name__}"


def case_errors(key: str) -> str | None:
    f4, c8, i4 = (dev(np.zeros(4, t)) for t in (np.float32, np.complex64, np.int32))
    checks = [
        (TypeError, C.reduce2, "min", c8, c8, c8),
        (TypeError, C.reduce2, "avg", i4, i4, i4),
        (TypeError, C.reduce2, "band", f4, f4, f4),
        (TypeError, C.scale, i4, 2),
        (TypeError, C.get_kernels, "sum", np.longdouble),
        (TypeError, C.reduce2, "nosuchop", f4, f4, f4),
        (TypeError, C.reduce2, "sum", f4, i4, f4),  # int32 data is not float32 without dtype=
        (ValueError, C.reduce2, "sum", f4, f4, dev(np.zeros(5, np.float32))),
        (ValueError, C.reduce2, "sum", f4, f4, f4, {"divisor": 2}),
        (ValueError, C.reduce_many, "sum", f4, []),
        (ValueError, C.reduce_many, "sum", f4, [f4] * (D.MAX_SRCS + 1)),
        (ValueError, C.reduce2, "sum", dev(np.zeros((2, 2), np.float32)), f4, f4),
        (ValueError, C.copy, f4, dev(np.zeros(5, np.float32))),
        (ValueError, C.copy_blocks, f4, f4, 2, 3),
        (ValueError, C.copy_blocks, f4, f4, 1, 2, {"src_offset": 3}),
    ]
    if MODE == "device":
        checks.append((TypeError, C.reduce2, "sum", np.zeros(4, np.float32), f4, f4))
    for exc, fn, *args in checks:
        kws = args.pop() if args and isinstance(args[-1], dict) else {}
        why = _raises(exc, fn, *args, **kws)
        if why:
            return why
    ks = C.get_kernels("sum", np.float32)
    if ks is not C.get_kernels(O.SUM, np.dtype(np.float32)) or ks.reduce2 is not C.get_kernels("SUM", np.float32).reduce2:
        return "kernels are not cached per (op, dtype)"
    return None


def case_stream(key: str) -> str | None:
    rng, n = _rng(key), _sizes()[-1]
    a, b = data(rng, np.dtype(np.int32), n, O.SUM), data(rng, np.dtype(np.int32), n, O.SUM)
    s = cuda.stream()
    da, db = cuda.to_device(a, stream=s), cuda.to_device(b, stream=s)
    C.reduce2("sum", da, da, db, stream=s)
    C.reduce_many("max", db, [da, db], stream=s)
    C.copy(da, db, stream=s)
    s.synchronize()
    want = np.maximum(a + b, b)
    why = compare(da.copy_to_host(stream=s), want)
    if why or MODE != "device":
        return why
    C.scale(dev(np.ones(8, np.float32)), 2, stream=int(s))  # a raw cudaStream_t
    s.synchronize()
    return None


def case_launch(key: str) -> str | None:
    for n in (1, 31, 32, 33, 1000, 10**6, 10**9):
        grid, block = C.launch_config(n)
        if grid < 1 or block < 1 or (grid - 1) * block >= n:
            return f"n={n}: grid {grid} x {block}"
        if MODE == "sim" and grid > C.SIM_MAX_BLOCKS:
            return f"n={n}: {grid} blocks on the simulator"
        if MODE == "device":
            dev_ = cuda.get_current_device()
            if grid * block > dev_.MULTIPROCESSOR_COUNT * dev_.MAX_THREADS_PER_MULTI_PROCESSOR:
                return f"n={n}: {grid} x {block} is more than one wave"
    return None


def case_host_arrays(key: str) -> str | None:
    """The simulator takes NumPy arrays as device memory, in place: out=a writes the caller's array."""
    rng = _rng(key)
    a, b = data(rng, np.dtype(np.uint8), 50, O.SUM), data(rng, np.dtype(np.uint8), 50, O.SUM)
    want = a + b
    C.reduce2("sum", a, a, b)
    return compare(a, want)


# --- PTX ---------------------------------------------------------------------------------------------------------


def _ptx_plan() -> list[tuple[str, Callable, tuple]]:
    plan: list[tuple[str, Callable, tuple]] = []
    for op, dt in D.pairs():
        plan.append((f"ptx/pairwise/{op.name}/{dt.name}", case_ptx, ("pairwise", dt, op.name, (8, 0), {})))
    seen = set()
    for op, dt in D.pairs():  # n-ary: one dtype per (op, family) is enough for sm_90
        fam = D.layout(dt).family
        if (op.name, fam) not in seen:
            seen.add((op.name, fam))
            plan.append((f"ptx/nary/{op.name}/{dt.name}", case_ptx, ("nary", dt, op.name, (9, 0), {"nsrc": 3})))
    for dt in AVG_DTYPES:
        plan.append((f"ptx/finish/{dt.name}", case_ptx, ("pairwise", dt, "AVG", (9, 0), {"finish": True, "dual": True})))
        plan.append((f"ptx/nary-avg/{dt.name}", case_ptx, ("nary", dt, "AVG", (8, 0), {"finish": True, "nsrc": 8})))
        plan.append((f"ptx/scale/{dt.name}", case_ptx, ("scale", dt, "SUM", (9, 0), {})))
        # reproducible mode's fold, each step rounded to the dtype
        plan.append((f"ptx/nary-in-dtype/{dt.name}", case_ptx, ("nary", dt, "SUM", (9, 0), {"in_dtype": True, "nsrc": 3})))
        plan.append((f"ptx/nary-avg-in-dtype/{dt.name}", case_ptx,
                     ("nary", dt, "AVG", (8, 0), {"finish": True, "in_dtype": True, "nsrc": 4})))
    plan.append(("ptx/copies", case_ptx_copies, ()))
    return plan


_PTXAS: dict[str, str] = {}


def case_ptx(key: str, variant: str, dt: np.dtype, op: str, cc: tuple[int, int], flags: dict) -> str | None:
    ptx = K.compile_ptx(variant, dt, op, cc=cc, **dict(flags))
    if f".target sm_{cc[0]}{cc[1]}" not in ptx:
        return f"no .target sm_{cc[0]}{cc[1]} in the PTX"
    if D.layout(dt).family not in (D.INT, D.BOOL) and "fma." in ptx:
        return "a float kernel contains an FMA: NVVM fused a product into an add, results would differ from NumPy"
    if D.layout(dt).family in (D.F16, D.BF16, D.FLOAT) and ".f64" in ptx and dt != np.float64:
        return "a float32-accumulating kernel computes in float64"
    if not _PTXAS.get(f"{variant}{cc}"):  # assemble one kernel per (variant, cc)
        _PTXAS[f"{variant}{cc}"] = key
        return _assemble(ptx, cc)
    return None


def case_ptx_copies(key: str) -> str | None:
    from numba import types

    w = types.uint64[::1]
    sigs = [(K.copy_words, (w, w)), (K.copy_words2, (w, w, w)), (K.copy_blocks, (w, w) + (types.int64,) * 6)]
    for disp, sig in sigs:
        for cc in ((8, 0), (9, 0)):
            ptx, _ = cuda.compile_ptx(disp.py_func, sig, cc=cc)
            why = _assemble(ptx, cc)
            if why:
                return f"{disp.py_func.__name__}: {why}"
    return None


def _assemble(ptx: str, cc: tuple[int, int]) -> str | None:
    """ptxas accepts the PTX for sm_XY (skipped when no ptxas is installed)."""
    import shutil
    import subprocess
    import tempfile

    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, f"-arch=sm_{cc[0]}{cc[1]}", src, "-o", os.path.join(tmp, "k.cubin")],
                             check=False, capture_output=True, text=True)
    return None if res.returncode == 0 else f"ptxas sm_{cc[0]}{cc[1]}: {res.stderr.strip()[:500]}"


# --- the plan ------------------------------------------------------------------------------------------------------


def _plan(mode: str) -> list[tuple[str, Callable, tuple]]:
    if mode == "ptx":
        return _ptx_plan()
    plan: list[tuple[str, Callable, tuple]] = []
    for op, dt in D.pairs():
        plan.append((f"reduce2/{op.name}/{dt.name}", case_reduce2, (op, dt)))
        plan.append((f"reduce_many/{op.name}/{dt.name}", case_reduce_many, (op, dt)))
    for dt in AVG_DTYPES:
        if dt.kind != "c":
            plan.append((f"signed_zero_nan/{dt.name}", case_signed_zero_nan, (dt,)))
        plan.append((f"avg_pairwise/{dt.name}", case_avg_pairwise, (dt,)))
        plan.append((f"avg_many/{dt.name}", case_avg_many, (dt,)))
        plan.append((f"scale/{dt.name}", case_scale, (dt,)))
    for dt in (np.float16, BFLOAT16, np.float32, np.int64, np.uint8, np.complex64):  # every width past 32 sources
        plan.append((f"reduce_many_8/{np.dtype(dt).name}", case_reduce_many, (O.SUM, np.dtype(dt), 8)))
    plan.append(("reduce_many_max_srcs/float16", case_reduce_many, (O.AVG, np.dtype(np.float16), D.MAX_SRCS)))
    plan.append(("reduce_many_max_srcs/int8", case_reduce_many, (O.PROD, np.dtype(np.int8), D.MAX_SRCS)))
    for op, t in ((O.SUM, np.int32), (O.MAX, BFLOAT16), (O.PROD, np.float16), (O.BXOR, np.uint8), (O.SUM, np.complex128),
                  (O.LOR, np.bool_), (O.MIN, np.float64)):
        plan.append((f"reduce_copy/{op.name}/{np.dtype(t).name}", case_fused, (op, np.dtype(t))))
    for op, t in ((O.BAND, np.int8), (O.BOR, np.uint16), (O.BXOR, np.int32), (O.BAND, np.bool_)):
        plan.append((f"wide_bitwise/{op.name}/{np.dtype(t).name}", case_wide_bitwise, (op, np.dtype(t))))
    plan += [
        ("explicit_dtype", case_explicit_dtype, ()),
        ("bf16_codec", case_bf16_codec, ()),
        ("copy", case_copy, ()),
        ("copy_blocks", case_copy_blocks, ()),
        ("word_choice", case_word_choice, ()),
        ("empty", case_empty, ()),
        ("errors", case_errors, ()),
        ("stream", case_stream, ()),
        ("launch_config", case_launch, ()),
    ]
    if mode == "sim":
        plan.append(("host_arrays", case_host_arrays, ()))
    return plan


def case_ids(mode: str = "sim") -> list[str]:
    return [key for key, _, _ in _plan(mode)]


def main(argv: list[str]) -> int:
    global MODE, cuda, C, K
    MODE = argv[0] if argv else "sim"
    if MODE == "sim":
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    else:
        os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    warnings.simplefilter("ignore")  # NumPy overflow on integer wrap (wanted), numba performance hints
    np.seterr(all="ignore")
    t0 = time.time()
    from numba import cuda as _cuda

    cuda = _cuda
    results: dict[str, str] = {}
    skip = None
    if MODE == "ptx":
        from numba.cuda.cudadrv import nvvm

        if not nvvm.is_available():
            skip = "skip: NVVM (CUDA toolkit) not found"
        elif not _cuda.is_available():  # device functions ask the current device for its compute capability
            import types as _pytypes

            import numba.cuda.dispatcher as _disp

            _disp.get_current_device = lambda: _pytypes.SimpleNamespace(compute_capability=(8, 0))
    elif MODE == "device" and not _cuda.is_available():
        skip = "skip: no CUDA device"
    if skip is None:
        from pycoll.cuda import kernels as _k
        from pycoll.cuda import launch as _c

        C, K = _c, _k
    only = os.environ.get("CUDA_SIM_CASES")
    for key, fn, args in _plan(MODE):
        if only and not any(key.startswith(p) for p in only.split(",")):
            continue
        if skip:
            results[key] = skip
            continue
        try:
            why = fn(key, *args)
            results[key] = "ok" if why is None else f"FAIL: {why}"
        except Exception as e:  # noqa: BLE001 - reported per case
            tb = traceback.format_exception(type(e), e, e.__traceback__)
            results[key] = f"FAIL: {type(e).__name__}: {e}\n{''.join(tb[-4:])}"
    print(json.dumps({"cases": results, "seconds": round(time.time() - t0, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
