"""Every signature of the arena kernels the arena paths call: one table for the JIT's loads and the ahead-of-time build.

``signatures()`` lists each kernel's (return type, argument types) for every dtype the kernels cover, the common
dtypes first. ``load_all`` has Numba load each from its disk cache (or compile it once) before any call needs it;
``pycoll.native_build`` compiles the same list ahead of time. A signature missing here is one no call may use:
the ahead-of-time kernels refuse it (TypeError) and the call runs on the Python path.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

# The dtypes of the typed kernels (``arena_jit.DTYPES``), the common ones first.
ORDER = (np.float32, np.float64, np.int64, np.int32, np.uint8, np.int8, np.int16, np.uint16, np.uint32, np.uint64,
         np.bool_, np.complex64, np.complex128)


def signatures() -> dict[str, list[Any]]:
    """Kernel name -> its Numba signatures (needs Numba)."""
    from numba import from_dtype, types as t

    i64, u8, b = t.int64, t.uint8, t.boolean

    def arr(dt: Any, nd: int = 1, layout: str = "C") -> Any:
        return t.Array(dt, nd, layout)

    words, ints = arr(t.uint64), arr(i64)
    raw = arr(u8)
    dts = [from_dtype(np.dtype(d)) for d in ORDER]
    return {
        "barrier": [i64(words, i64, ints, words, i64, i64, i64, i64, i64)],
        "spin": [i64(words, ints, i64, i64)],
        "broadcast": [t.Tuple((i64, i64, b))(words, raw, raw, i64, ints, words, i64, i64, i64, i64, i64, i64)],
        "pipe_broadcast": [t.UniTuple(i64, 2)(words, raw, raw, i64, i64, i64, i64, i64, i64, i64, i64)],
        "cma_moves": [i64(words, ints, words, ints, i64, i64, i64, i64, i64)],
        "slots_move": [i64(words, arr(u8, 3), arr(d), arr(d), ints, words, i64, i64, i64) for d in dts],
        "allreduce": [i64(words, arr(d, 3), arr(d), arr(d), i64, ints, words, i64, i64, i64, i64, i64, i64)
                      for d in dts],
        "slots_reduce": [i64(words, arr(d, 3), arr(d), arr(d), ints, words, i64, i64, i64) for d in dts],
        "blocks": [t.Tuple((i64, i64, b))(words, arr(d, 2), arr(d), arr(d), ints, ints, ints, i64, ints, words, i64,
                                          i64, i64, b, i64, i64, i64, i64) for d in dts],
        "pipe_blocks": [t.UniTuple(i64, 3)(words, arr(d, 2), arr(d), arr(d), ints, ints, ints, i64, i64, i64, b, i64,
                                           i64, i64, i64, i64) for d in dts],
    }


def load_all(k: Any, check: Callable[[], None] = lambda: None) -> None:
    """Have Numba load (or compile) every signature of ``signatures()`` on the kernels of module ``k``, the
    dtype-free kernels first, then dtype by dtype; ``check`` runs between two loads and may raise to stop them."""
    table = signatures()
    order = sorted(((j, name, sig) for name, sigs in table.items() for j, sig in enumerate(sigs)),
                   key=lambda e: e[0])
    for _, name, sig in order:
        check()
        getattr(k, name).compile(sig.args)
