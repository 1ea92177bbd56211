"""Loads every signature of the arena kernels ahead of use, by calling them on a private arena that no peer joins.

Each kernel is called as the arena paths call it (same argument kinds, every covered dtype) with a spin of one
poll, so it posts, finds no peer and returns at once. Numba loads each signature from its disk cache, or compiles
it once; afterwards no call in a user's loop meets a signature that is not loaded.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import numpy as np

from .. import ops as _ops
from ..transport.arena import HostArena
from ..transport.shm import SHM_DIR
from .arena_jit import DTYPES, covers, line_bases, sig_array, slot_matrix
from .base import Call

_ORDER = (np.float32, np.float64, np.int64, np.int32, np.uint8, np.int8, np.int16, np.uint16, np.uint32, np.uint64,
          np.bool_, np.complex64, np.complex128)  # the common ones first


def _private_arena() -> HostArena:
    where = SHM_DIR.get() if os.path.isdir(SHM_DIR.get()) else tempfile.gettempdir()
    path = os.path.join(where, f"pycoll-warmup-{os.getpid()}-{os.urandom(6).hex()}")
    arena = HostArena(path, 0, 2, 4096, create=True, stage_bytes=64 << 10)
    arena.unlink()
    return arena


def _op_for(dtype: np.dtype) -> _ops.Op:
    return _ops.SUM if covers(_ops.SUM, dtype) else _ops.LOR


def load_all(k: Any, check: Callable[[], None] = lambda: None) -> None:
    """Call every kernel the arena paths call, for every covered dtype (see the module doc); ``check`` runs between
    two dtypes and may raise to stop the load."""
    from . import slots

    arena = _private_arena()
    try:
        u64, bases, sig = arena.u64, line_bases(arena, 1), sig_array((1, 2, 3, 4))
        k.barrier(u64, 0, bases, sig, 1, 1)
        stage = arena.stage(0)
        data = np.zeros(64, np.uint8)
        k.broadcast(u64, stage, data, 0, bases, sig, 1, 1, 0, 64, 4, 1)
        k.pipe_broadcast(u64, stage, data, 0, 1, 2, 0, 64, 4, 0, 1)
        for t in _ORDER:
            check()
            dtype = np.dtype(t)
            if dtype not in DTYPES:
                continue
            op = _op_for(dtype)
            send, recv = np.zeros(8, dtype), np.zeros(8, dtype)
            k.allreduce(u64, slot_matrix(arena, 1, 8, dtype), send, recv, 0, bases, sig, 1, op.code, 1)
            if not covers(op, dtype):
                continue
            for coll in ("allreduce", "reduce_scatter"):
                _pipe(k, arena, Call(coll, dtype, send, recv if coll == "allreduce" else recv[:4], op, counts=[4, 4]), sig)
            call = Call("scan", dtype, send, recv, op)
            prep = slots.Prepared(arena, call, sig_from(sig), 0)
            slots.run_kernel(k, prep, arena, 1, call.send, call.recv, _Polls)
        _pipe(k, arena, Call("allgather", np.dtype(np.uint8), data[:32], data, counts=[32, 32], displs=[0, 32]), sig)
        prog = np.zeros(k.C_POSTED + 4 + 2 * 2, np.int64)
        prog[k.C_SIZE], prog[k.C_POLLS] = 2, 1
        k.cma_moves(u64, bases, sig, prog, 1, 0, 0, 0)
        move = Call("broadcast", np.dtype(np.uint8), recv=data, root=0)
        slots.run_kernel(k, slots.Prepared(arena, move, sig_from(sig), 0), arena, 1, move.send, move.recv, _Polls)
    finally:
        arena.close()


def _pipe(k: Any, arena: HostArena, call: Call, sig: np.ndarray) -> None:
    """A staged pipe's two kernels (the whole inline call, and the chunk loop a schedule runs) for ``call``."""
    from . import staged

    pipe = staged.Pipe(arena, call, 0, True)
    s, r = pipe.views(call)
    bases = line_bases(arena, 1)
    k.blocks(arena.u64, pipe.stages, s, r, pipe.sd, pipe.rd, pipe.counts, 0, bases, sig, 1, pipe.mode, pipe.code,
             pipe.local, 0, pipe.c, pipe.nslots, 1)
    k.pipe_blocks(arena.u64, pipe.stages, s, r, pipe.sd, pipe.rd, pipe.counts, 0, pipe.mode, pipe.code, pipe.local, 0,
                  pipe.c, pipe.nslots, 0, 1)


class _Polls:
    polls = 1


def sig_from(words: np.ndarray) -> Any:
    from ..p2p import Sig

    return Sig(*[int(w) for w in words[:4]])
