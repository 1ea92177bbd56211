"""numba.cuda kernels: pairwise and n-ary reductions for every (op, dtype), scaling, and word-wide copies."""

# Every kernel is a grid-stride loop. A reduction widens ``storage`` elements to the layout's ``acc`` type (dtypes.py),
# combines there and narrows once on store:
# - float16 converts natively (cvt.f32.f16, cvt.rn.f16.f32), as NumPy does on the host; one source for sim and device.
# - bfloat16 has no numba type: uint16 bits, widened by shifting into a float32's high half, narrowed with
#   round-to-nearest-even (NaN becomes ml_dtypes' quiet NaN, sign kept).
# - Pairwise float16/bfloat16 results equal NumPy's (float32 arithmetic rounded once is correctly rounded for them);
#   n-ary ones accumulate in float32 over all sources and round once, as NCCL does.
# - Integers accumulate in 32 or 64 bits and wrap like NumPy when narrowed.
# Float code uses no untyped literals: numba would widen float32 to float64 where NumPy (the simulator) would not.

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba import cuda, types

from . import dtypes as _dt

SIM = bool(numba.config.ENABLE_CUDASIM)

_U16 = np.uint32(16)
_ONE = np.uint32(1)
_ABS = np.uint32(0x7FFFFFFF)
_INF = np.uint32(0x7F800000)
_SIGN = np.uint32(0x80000000)
_HALF_ULP = np.uint32(0x7FFF)
_QNAN = np.uint16(0x7FC0)
_QNAN_NEG = np.uint16(0xFFC0)

# Bit casts and products NVVM may not fuse into an FMA: libdevice on the device; the simulator runs plain Python.
if SIM:

    def _bits_to_f32(u: Any) -> Any:
        return np.uint32(u).view(np.float32)

    def _f32_to_bits(x: Any) -> Any:
        return np.float32(x).view(np.uint32)

    def _fmul_rn(a: Any, b: Any) -> Any:
        return a * b

    _dmul_rn = _fmul_rn

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _bits_to_f32(u):
        return libdevice.int_as_float(types.int32(u))

    @cuda.jit(device=True, inline=True)
    def _f32_to_bits(x):
        return types.uint32(libdevice.float_as_int(x))

    _fmul_rn, _dmul_rn = libdevice.fmul_rn, libdevice.dmul_rn


# --- element codecs (storage -> compute -> storage) -------------------------------------------------------------


@cuda.jit(device=True, inline=True)
def _ident(x):
    return x


@cuda.jit(device=True, inline=True)
def bf16_to_f32(h):
    """bfloat16 bits (uint16) to float32: the bits become the high half of the float."""
    return _bits_to_f32(types.uint32(h) << _U16)


@cuda.jit(device=True, inline=True)
def bf16_from_f32(x):
    """float32 to bfloat16 bits (uint16), round to nearest even; NaN to a quiet NaN of the same sign."""
    u = _f32_to_bits(x)
    if (u & _ABS) > _INF:
        return _QNAN_NEG if u >= _SIGN else _QNAN
    return types.uint16((u + _HALF_ULP + ((u >> _U16) & _ONE)) >> _U16)


# --- combining two values in the compute type ---------------------------------------------------------------------


@cuda.jit(device=True, inline=True)
def _add(a, b):
    return a + b


@cuda.jit(device=True, inline=True)
def _mul(a, b):
    return a * b


def _complex_ops(mul: Callable) -> tuple[Callable, Callable]:
    """(product, AVG finish) for one complex precision; ``mul`` rounds each product (NVVM would contract into FMAs)."""

    @cuda.jit(device=True, inline=True)
    def cmul(a, b):
        # C99 Annex G without contraction, as NumPy's scalar path (its SIMD loops may use FMA: not bit-defined)
        re = mul(a.real, b.real) - mul(a.imag, b.imag)
        im = mul(a.real, b.imag) + mul(a.imag, b.real)
        return complex(re, im)

    @cuda.jit(device=True, inline=True)
    def cscale(x, s):
        # NumPy's x / (p + 0j) is (re + im*0) * (1/p), (im - re*0) * (1/p); s = 1/p, z a zero of s's type
        z = s - s
        return complex(mul(x.real + mul(x.imag, z), s), mul(x.imag - mul(x.real, z), s))

    return cmul, cscale


_COMPLEX_OPS = {np.dtype(np.complex64): _complex_ops(_fmul_rn), np.dtype(np.complex128): _complex_ops(_dmul_rn)}


# NumPy's float minimum/maximum propagate NaN; on a tie (+0 vs -0) float16 keeps ``a``, the other float types ``b``.
@cuda.jit(device=True, inline=True)
def _min_tie_a(a, b):
    return a if (a <= b or a != a) else b  # noqa: PLR0124 - a != a: NaN


@cuda.jit(device=True, inline=True)
def _max_tie_a(a, b):
    return a if (a >= b or a != a) else b  # noqa: PLR0124 - a != a: NaN


@cuda.jit(device=True, inline=True)
def _min_tie_b(a, b):
    return a if (a < b or a != a) else b  # noqa: PLR0124 - a != a: NaN


@cuda.jit(device=True, inline=True)
def _max_tie_b(a, b):
    return a if (a > b or a != a) else b  # noqa: PLR0124 - a != a: NaN


@cuda.jit(device=True, inline=True)
def _band(a, b):
    return a & b


@cuda.jit(device=True, inline=True)
def _bor(a, b):
    return a | b


@cuda.jit(device=True, inline=True)
def _bxor(a, b):
    return a ^ b


@cuda.jit(device=True, inline=True)
def _land(a, b):
    return a != 0 and b != 0


@cuda.jit(device=True, inline=True)
def _lor(a, b):
    return a != 0 or b != 0


@cuda.jit(device=True, inline=True)
def _lxor(a, b):
    return (a != 0) != (b != 0)


# --- the AVG finish: divide the sum -------------------------------------------------------------------------------


@cuda.jit(device=True, inline=True)
def _div(x, d):
    return x / d


_COMBINE: dict[str, Callable] = {
    "SUM": _add,
    "AVG": _add,
    "PROD": _mul,
    "BAND": _band,
    "BOR": _bor,
    "BXOR": _bxor,
    "LAND": _land,
    "LOR": _lor,
    "LXOR": _lxor,
}


def _combine(dtype: np.dtype, family: str, op: str) -> Callable:
    if op == "PROD" and family == _dt.COMPLEX:
        return _COMPLEX_OPS[dtype][0]
    if op in ("MIN", "MAX"):
        tie_a = family in (_dt.F16, _dt.INT, _dt.BOOL)  # ints: ties are equal values
        return {("MIN", True): _min_tie_a, ("MAX", True): _max_tie_a, ("MIN", False): _min_tie_b, ("MAX", False): _max_tie_b}[
            (op, tie_a)
        ]
    return _COMBINE[op]


@functools.cache
def _parts(dtype: np.dtype, op: str) -> tuple[Callable, Callable, Callable, Callable, Callable]:
    """(load, acc, combine, store, finish) for one (dtype, op): the pieces every kernel body is built from."""
    lay = _dt.layout(dtype)
    acc = numba.from_dtype(lay.acc)
    store = bf16_from_f32 if lay.family == _dt.BF16 else numba.from_dtype(lay.storage)
    load = bf16_to_f32 if lay.family == _dt.BF16 else _ident
    finish = _COMPLEX_OPS[lay.dtype][1] if lay.family == _dt.COMPLEX else _div
    return load, acc, _combine(lay.dtype, lay.family, op), store, finish


# --- kernel factories: one numba dispatcher per (dtype, op, variant); numba compiles it once per signature --------


@functools.cache
def pairwise(dtype: np.dtype, op: str, dual: bool = False, finish: bool = False) -> Any:
    """Kernel ``(out, out2, a, b, div)``: ``out[i] = a[i] op b[i]``, also into ``out2`` when ``dual``.

    With ``finish`` the stored result is divided by ``div`` and stored again, as the host's reduce-then-scale.
    ``out`` may alias ``a`` or ``b``; ``out2`` is ignored unless ``dual``.
    """
    LD, A, OP, ST, FIN = _parts(np.dtype(dtype), op)

    @cuda.jit
    def kernel(out, out2, a, b, div):
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            v = ST(A(OP(A(LD(a[i])), A(LD(b[i])))))
            if finish:
                v = ST(A(FIN(A(LD(v)), div)))
            out[i] = v
            if dual:
                out2[i] = v

    return kernel


@functools.cache
def nary(dtype: np.dtype, op: str, finish: bool = False, in_dtype: bool = False) -> Any:
    """Kernel ``(out, srcs, div)``: ``out[i] = srcs[0][i] op srcs[1][i] op ...`` in rank order, ``srcs`` a tuple.

    The accumulator is the layout's ``acc`` type, narrowed once on store (after ``/ div`` when ``finish``). With
    ``in_dtype`` every partial result is narrowed to the dtype, as NumPy's left fold rounds each step (reproducible
    mode); AVG then divides the rounded fold. Each tuple length compiles once. ``out`` may alias any source.
    """
    LD, A, OP, ST, FIN = _parts(np.dtype(dtype), op)

    @cuda.jit
    def kernel(out, srcs, div):
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            x = A(LD(srcs[0][i]))
            for j in range(1, len(srcs)):
                x = A(OP(x, A(LD(srcs[j][i]))))
                if in_dtype:
                    x = A(LD(ST(x)))
            if finish:
                x = A(FIN(x, div))
            out[i] = ST(x)

    return kernel


@functools.cache
def scale(dtype: np.dtype) -> Any:
    """Kernel ``(out, a, div)``: ``out[i] = a[i] / div``, as the host backend's ``scale``; ``out`` may alias ``a``."""
    LD, A, _, ST, FIN = _parts(np.dtype(dtype), "SUM")

    @cuda.jit
    def kernel(out, a, div):
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            out[i] = ST(A(FIN(A(LD(a[i])), div)))

    return kernel


@cuda.jit
def copy_words(dst, src):
    """``dst[i] = src[i]``; the launcher views both as the widest unsigned word their sizes and addresses allow."""
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = src[i]


@cuda.jit
def copy_words2(dst, dst2, src):
    """``dst[i] = dst2[i] = src[i]``: one read, two writes (a pipeline's receive-copy-send)."""
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        v = src[i]
        dst[i] = v
        dst2[i] = v


@cuda.jit
def copy_blocks(dst, src, blocklen, total, doff, dstride, soff, sstride):
    """Block k of ``blocklen`` words: ``dst[doff + k*dstride + j] = src[soff + k*sstride + j]``, ``total`` words in all."""
    for i in range(cuda.grid(1), total, cuda.gridsize(1)):
        k = i // blocklen
        j = i - k * blocklen
        dst[doff + k * dstride + j] = src[soff + k * sstride + j]


# --- compile checks without a device ------------------------------------------------------------------------------


def _array_type(dt: np.dtype) -> Any:
    return numba.from_dtype(dt)[::1]


def _div_type(dtype: np.dtype, wide: bool) -> Any:
    lay = _dt.layout(dtype)
    if lay.family in (_dt.INT, _dt.BOOL):
        return types.float64  # unused
    return numba.typeof(_dt.divisor_arg(dtype, 2, wide))


def signature(variant: str, dtype: Any, op: str = "SUM", nsrc: int = 2) -> tuple:
    """The argument types a launcher passes to ``variant`` ('pairwise', 'nary', 'scale') for 1-D arrays of ``dtype``."""
    dtype = np.dtype(dtype)
    arr = _array_type(_dt.layout(dtype).storage)
    if variant == "pairwise":
        return (arr, arr, arr, arr, _div_type(dtype, False))
    if variant == "nary":
        return (arr, types.UniTuple(arr, nsrc), _div_type(dtype, True))
    if variant == "scale":
        return (arr, arr, _div_type(dtype, False))
    raise ValueError(f"no kernel variant {variant!r}")


def compile_ptx(variant: str, dtype: Any, op: str = "SUM", cc: tuple[int, int] = (8, 0), **flags: Any) -> str:
    """PTX for one kernel; ``flags`` as for the factories.

    Needs NVVM (a CUDA toolkit). numba 0.68 also asks the current device for its compute capability when it compiles
    the device functions; without a GPU, tests/cuda_sim_kernels.py stubs that lookup.
    """
    dtype = np.dtype(dtype)
    nsrc = flags.pop("nsrc", 2)
    if variant == "pairwise":
        disp = pairwise(dtype, op, **flags)
    elif variant == "nary":
        disp = nary(dtype, op, **flags)
    elif variant == "scale":
        disp = scale(dtype)
    else:
        raise ValueError(f"no kernel variant {variant!r}")
    ptx, _ = cuda.compile_ptx(disp.py_func, signature(variant, dtype, op, nsrc), cc=cc)
    return ptx
