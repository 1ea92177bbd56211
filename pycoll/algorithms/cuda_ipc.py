"""One-shot and two-shot allreduce on device buffers of one host, through CUDA IPC buffers and host-arena flags.

Every rank owns an IPC buffer (pycoll/cuda/ipc.py) with two slots, and maps its peers' buffers once; the
handles travel as messages at the first device call (and again, with a new generation, when a larger call
needs bigger slots). A call copies its input into its own slot on the caller's stream, waits for that copy,
then meets the peers on the host arena's flags (arena_meeting.py: post, ready, done, with timeouts, liveness checks
and call matching). ``ipc_oneshot`` then reduces all ranks' slots, in rank order, into recv with one kernel;
``ipc_twoshot`` reduces only its own block into its slot, meets again, and copies every rank's reduced block
into recv. Slots alternate by arena number, so a rank never overwrites data a late peer still reads. The
result is in recv when the call returns (the caller's stream has finished the work), as on the staged path.
Where the IPC buffers cannot be set up, or the kernels do not reduce the (op, dtype), the call is staged
through host memory instead, on every rank alike.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Generator, Iterator, Optional

import numpy as np

from ..arrays import DeviceArray
from ..config import bool_param, size_param
from ..errors import DeviceError, PycollError
from .base import Call, Layout, Schedule, Steps, even_counts, offsets
from .cost import CostModel
from .halving_doubling import allreduce_doubling
from .registry import register
from .ring import allreduce_ring
from .arena_meeting import (
    arena_enabled,
    arena_ready,
    call_number,
    check_posts,
    meet_peers,
    owner_fallback,
    post_call,
    take_turn,
)

log = logging.getLogger("pycoll")

IPC_DISABLE = bool_param("PYCOLL_IPC_DISABLE", False, "Set to 1 to stage every device collective through host memory (no CUDA IPC algorithms).")
IPC_BYTES = size_param(
    "PYCOLL_IPC_BYTES", 8 << 20,
    "Largest device allreduce (bytes) the CUDA IPC algorithms take; each rank's IPC buffer grows to twice the largest call seen, up to twice this.",
)
IPC_MIN_SLOT = 64 << 10  # the first IPC buffer's slots; they double as larger calls come
_SMALL = 64 << 10  # the staged fallback runs recursive doubling up to this size, a ring above


class IpcState:
    """A communicator's CUDA IPC buffers: set up by its first IPC call (on every rank alike), then reused."""

    def __init__(self) -> None:
        self.status = "new"  # new -> ready | failed
        self.reason = ""
        self.generation = 0  # bumped by every exchange of handles that succeeded
        self.arena: Any = None  # pycoll.cuda.ipc.IpcArena of the current generation
        self.backend: Any = None
        self.cache: Any = None  # pycoll.cuda.ipc.MappingCache
        self.grow_failed = 0  # a larger buffer could not be set up for calls of this many bytes: stage them

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's (at Comm.Free)."""
        if self.cache is not None:
            self.cache.close()
        if self.arena is not None:
            self.arena.own.close()
            self.arena = None
        self.status = "closed"


# ---- refusal and cost ----------------------------------------------------------------------------


def _refuse_ipc(call: Call, lay: Layout) -> Optional[str]:
    if not isinstance(call.recv, DeviceArray):
        return "it takes device buffers only"
    if lay.size < 2:
        return "one rank needs no IPC"
    if lay.hosts != 1:
        return "the ranks are on more than one host (CUDA IPC maps the memory of one host's GPUs)"
    from ..cuda.dtypes import MAX_SRCS  # here: host-only jobs never load the device dtype tables

    if lay.size > MAX_SRCS:
        return f"{lay.size} ranks are more than one kernel reduces ({MAX_SRCS})"
    if IPC_DISABLE.get():
        return "CUDA IPC is turned off (PYCOLL_IPC_DISABLE)"
    if not arena_enabled():
        return "its flags live in the host arena, which is off (PYCOLL_ARENA_DISABLE, PYCOLL_SHM_DISABLE) or has no directory"
    if call.size_bytes > IPC_BYTES.get():
        return f"{call.size_bytes} bytes exceed the IPC buffer's {IPC_BYTES.get()} (PYCOLL_IPC_BYTES)"
    if call.reproducible and call.op is not None and call.op.name == "PROD" and call.dtype.kind == "c":
        # NumPy's complex product fuses a multiply-add where the CPU has FMA: the host fold (staged) keeps its bits
        return "reproducible complex products follow NumPy's CPU loop, which the device kernel does not promise"
    return None


def _ipc_cost(m: CostModel, n: float, lay: Layout, phases: int, read: float) -> float:
    """``phases`` meetings (each a stream sync, a flag meeting and a launch), a copy into the slot, ``read`` peer bytes."""
    sync = phases * m.ipc_sync_us * 1e-6 * m.over(lay)
    return sync + n / (m.device_GBps * 1e9) + read / (m.ipc_GBps * 1e9) + m.handovers(lay, phases)


def _oneshot_cost(m: CostModel, n: float, lay: Layout) -> float:
    return _ipc_cost(m, n, lay, 1, (lay.size - 1) * n)


def _twoshot_cost(m: CostModel, n: float, lay: Layout) -> float:
    return _ipc_cost(m, n, lay, 2, 2 * (lay.size - 1) / lay.size * n)


# ---- the device side: stream, views, errors ------------------------------------------------------


class _Device:
    """One call's stream and views of its device buffers; ``failing`` turns CUDA failures into DeviceError."""

    def __init__(self, st: Steps, call: Call) -> None:
        from ..cuda.memory import CudaMemory

        self.st, self.call = st, call
        from ..cuda.dtypes import layout

        self.storage = layout(call.dtype).storage
        self.mem = CudaMemory(call.stream)
        self.stream = self.mem.stream if self.mem.stream is not None else 0

    @contextlib.contextmanager
    def failing(self, what: str) -> Iterator[None]:
        try:
            yield
        except PycollError:
            raise
        except Exception as exc:  # noqa: BLE001 - numba's CUDA errors have no common base
            raise self.st.owner.error(DeviceError, f"{what} failed ({type(exc).__name__}: {exc})") from None

    def view(self, d: DeviceArray, dtype: Any = np.uint8) -> Any:
        from ..cuda.memory import device_view

        return device_view(d, dtype)

    def copy(self, dst: Any, src: Any) -> None:
        """``dst[:] = src`` (device arrays of equal dtype and size) on the stream, as a device-to-device copy."""
        dst.copy_to_device(src, stream=self.stream)

    def reduce(self, out: Any, srcs: list[Any]) -> None:
        """``out`` = op over ``srcs`` in order (``out`` may be one of them), one kernel on the stream; in reproducible
        mode each step rounds to the dtype, as the left fold does."""
        from ..cuda import launch

        launch.reduce_many(self.call.op, out, srcs, dtype=self.call.dtype, stream=self.stream,
                           in_dtype=self.call.reproducible)

    def copy_in(self, arena: Any, op: int) -> None:
        """This rank's input into its slot for ``op``, after the caller's queued work; complete on return."""
        send = self.call.send
        assert send is not None
        with self.failing("copying the input into the IPC buffer"):
            self.mem.wait_for_inputs()
            if send.nbytes:  # empty calls touch no memory, but meet all the same
                self.copy(arena.slot(self.st.rank, op, send.nbytes), self.view(send))
            self.mem.synchronize()  # peers read the slot as soon as this rank posts


# ---- set-up: allocate, exchange handles, map -------------------------------------------------------------------


def _allgather_blobs(st: Steps, mine: bytes) -> Generator[tuple, None, dict[int, bytes]]:
    """Every peer's byte string (lengths first, then the bytes), by messages on this call."""
    others = [q for q in range(st.size) if q != st.rank]
    size = np.array([len(mine)], np.int64)
    sizes = {q: np.zeros(1, np.int64) for q in others}
    yield tuple(st.send(q, size) for q in others) + tuple(st.recv(q, sizes[q]) for q in others)
    data = np.frombuffer(mine, np.uint8)
    blobs = {q: np.empty(int(sizes[q][0]), np.uint8) for q in others}
    yield tuple(st.send(q, data) for q in others) + tuple(st.recv(q, blobs[q]) for q in others)
    return {q: blobs[q].tobytes() for q in others}


def _exchange(st: Steps, state: IpcState, slot: int) -> Generator[tuple, None, str]:
    """Allocate a buffer of two ``slot``-byte slots, swap handles with every peer, map theirs and agree.

    Returns "" when every rank mapped every buffer (the new generation is in force), else why not (the old
    generation, if any, stays). A message starts with 1 and the handle, or 0 and why allocation failed.
    """
    from ..cuda import ipc

    p, r = st.size, st.rank
    gen = state.generation + 1
    own: Any = None
    why = ""
    try:
        if state.backend is None:
            state.backend = ipc.backend()
            state.cache = ipc.MappingCache(state.backend)
        own = state.backend.allocate(2 * slot)
        mine = b"\x01" + own.handle
    except Exception as exc:  # noqa: BLE001 - no device, out of memory, no shared memory: the peers are told
        why = f"rank {r} could not allocate its IPC buffer ({type(exc).__name__}: {exc})"
        mine = b"\x00" + why.encode()
    agreed = False
    try:
        blobs = yield from _allgather_blobs(st, mine)
        peers: dict[int, Any] = {}
        for q, blob in sorted(blobs.items()):
            if why:
                break
            if blob[:1] != b"\x01":
                why = blob[1:].decode(errors="replace")
                break
            try:
                peers[q] = state.cache.get(q, gen, blob[1:])
            except Exception as exc:  # noqa: BLE001 - the driver's refusals vary (no peer access, bad handle)
                why = f"rank {r} could not map rank {q}'s IPC buffer ({type(exc).__name__}: {exc})"
        votes = yield from _allgather_blobs(st, b"\x01" if not why else b"\x00" + why.encode())
        if not why:
            why = next((v[1:].decode(errors="replace") for _, v in sorted(votes.items()) if v[:1] != b"\x01"), "")
        if not why:
            old = state.arena
            state.arena = ipc.IpcArena(gen, r, p, slot, own, peers)
            state.generation, state.status = gen, "ready"
            agreed = True
            # every peer is in this call, so done with the old buffers: unmap theirs and free this rank's
            state.cache.retire(gen)
            if old is not None:
                old.own.close()
        return why
    finally:
        if own is not None:
            state.backend.published(own)  # every peer mapped it or gave up
        if not agreed:
            if state.cache is not None:
                state.cache.drop(gen)
            if own is not None:
                own.close()


def _prepared(st: Steps, state: IpcState, need: int) -> Generator[tuple, None, Any]:
    """The IPC arena with slots of at least ``need`` bytes (exchanging handles if there is none yet, or it is too
    small), or None: this call is staged. Every rank decides alike (the same sizes, the agreed outcomes)."""
    if state.status not in ("new", "ready"):
        return None
    arena = state.arena
    if arena is not None and arena.slot_bytes >= need:
        return arena
    if state.grow_failed and need >= state.grow_failed:
        return None
    why = yield from _exchange(st, state, _slot_for(need))
    if not why:
        return state.arena
    if state.arena is None:
        state.status, state.reason = "failed", why
        log.info("CUDA IPC unavailable (%s): device collectives are staged through host memory", why)
    else:
        state.grow_failed = need
        log.info("CUDA IPC buffers could not grow for %d bytes (%s): such calls are staged", need, why)
    return None


def _slot_for(need: int) -> int:
    """Slots for calls of ``need`` bytes: the first ones small (64 KiB, or 1/16 of a small limit), doubled to fit."""
    from ..cuda.ipc import SLOT_ALIGN, slot_bytes

    cap = IPC_BYTES.get()
    return slot_bytes(need, min(IPC_MIN_SLOT, max(SLOT_ALIGN, cap // 16)), cap)


# ---- the algorithms ------------------------------------------------------------------------------


def _kernels_refuse(call: Call) -> Optional[str]:
    from ..cuda.dtypes import check

    return check(call.op, call.dtype)


def _staged(st: Steps, call: Call) -> Schedule:
    """The call staged through pinned host memory and run by a host algorithm (the same on every rank)."""
    from ..cuda.memory import Staged

    try:
        stage = Staged(call, st.rank, call.stream)
    except PycollError:
        raise
    except Exception as exc:  # noqa: BLE001 - numba's CUDA errors have no common base
        raise st.owner.error(DeviceError, f"staging the device buffers failed ({type(exc).__name__}: {exc})") from None
    try:
        host = stage.call
        if call.reproducible:  # the owner's rank-order fold: doubling and ring add partial sums
            yield from owner_fallback("allreduce")(st, host)
        elif call.size_bytes <= _SMALL:
            yield from allreduce_doubling(st, host)
        else:
            yield from allreduce_ring(st, host)
    except BaseException:
        stage.discard()
        raise
    stage.finish()


def _ipc_call(st: Steps, call: Call, body: Any) -> Schedule:
    """Take an arena number and the IPC buffers (set up or grown if need be), copy the input in and meet the
    peers, then run ``body``; where there are no IPC buffers for this call, stage it instead."""
    assert call.recv is not None and call.send is not None and call.op is not None
    number = call_number(st)
    harena = yield from arena_ready(st)
    if harena is None:
        yield from _staged(st, call)
        return
    op = yield from take_turn(st, harena, number)
    arena = None
    try:
        if _kernels_refuse(call) is None and st.ipc is not None:
            arena = yield from _prepared(st, st.ipc, call.recv.nbytes)
        if arena is not None:
            others = [q for q in range(st.size) if q != st.rank]
            dev = _Device(st, call)
            dev.copy_in(arena, op)
            mine = post_call(harena, op, st.sig)
            yield from meet_peers(st, harena, op, others)
            check_posts(st, harena, op, others, mine)
            yield from body(st, harena, op, arena, dev, others)
    finally:
        harena.set_done(op)
    if arena is None:
        yield from _staged(st, call)


@register(
    "allreduce",
    "ipc_oneshot",
    "Device buffers on one host: each rank copies its vector into its CUDA IPC buffer; after one meeting every rank "
    "reduces all ranks' buffers, in rank order, with one kernel. Small messages.",
    steps="1 meeting",
    bytes="n copied in; (p-1) n read from peers' GPU memory",
    refuse=_refuse_ipc,
    cost=_oneshot_cost,
    memory="cuda",
    reproducible="one kernel folds the ranks' buffers in rank order, rounding each step to the dtype",
)
def allreduce_ipc_oneshot(st: Steps, call: Call) -> Schedule:
    yield from _ipc_call(st, call, _oneshot)


def _oneshot(st: Steps, harena: Any, op: int, arena: Any, dev: _Device, others: list[int]) -> Schedule:
    """Every rank's slot, in rank order, reduced into recv."""
    recv = dev.call.recv
    assert recv is not None
    with dev.failing("reducing the peers' IPC buffers"):
        if recv.nbytes:
            srcs = [arena.slot(q, op, recv.nbytes, dev.storage) for q in range(st.size)]
            dev.reduce(dev.view(recv, dev.storage), srcs)
        dev.mem.synchronize()
    yield from ()  # no further meeting: a schedule all the same


@register(
    "allreduce",
    "ipc_twoshot",
    "Device buffers on one host: each rank copies its vector into its CUDA IPC buffer, reduces its 1/p block from "
    "every rank's buffer into its own, and after a second meeting copies every rank's reduced block. Medium messages.",
    steps="2 meetings",
    bytes="n copied in; 2(p-1)/p n read from peers' GPU memory",
    refuse=_refuse_ipc,
    cost=_twoshot_cost,
    memory="cuda",
    reproducible="each block's owner folds the ranks' buffers in rank order, rounding each step to the dtype; the "
                 "blocks are then copied out",
)
def allreduce_ipc_twoshot(st: Steps, call: Call) -> Schedule:
    yield from _ipc_call(st, call, _twoshot)


def _twoshot(st: Steps, harena: Any, op: int, arena: Any, dev: _Device, others: list[int]) -> Schedule:
    """Reduce-scatter into this rank's own slot, meet again, allgather every rank's reduced block into recv."""
    recv = dev.call.recv
    assert recv is not None
    p, r = st.size, st.rank
    isz = recv.dtype.itemsize
    counts = even_counts(recv.size, p)
    displs = offsets(counts)
    with dev.failing("reducing this rank's block of the IPC buffers"):  # peers read the result from this slot
        nb, start = counts[r] * isz, displs[r] * isz
        if nb:
            srcs = [arena.slot(q, op, nb, dev.storage, start) for q in range(p)]
            dev.reduce(srcs[r], srcs)
        dev.mem.synchronize()
    harena.set_ready(op)
    yield from meet_peers(st, harena, op, others, "ready")
    with dev.failing("copying the reduced blocks from the IPC buffers"):
        out = dev.view(recv) if recv.nbytes else None
        for q in range(p):
            lo, nb = displs[q] * isz, counts[q] * isz
            if nb:
                dev.copy(out[lo : lo + nb], arena.slot(q, op, nb, np.uint8, lo))
        dev.mem.synchronize()
