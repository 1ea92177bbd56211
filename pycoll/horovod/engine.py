"""Horovod's background engine on a pycoll communicator: named requests, negotiation, a response cache, fusion.

One thread per process set runs cycles. In each, every rank contributes one row to an ``Allgather``: flags (it has
requests the cache does not know, it has joined, it is shutting down) and two bit sets over the response cache
(the cached requests it has ready; the cache entries its requests contradict). A cached request runs once every
rank that has not joined has set its bit: the whole negotiation is that one small call per cycle. Requests the
cache does not know go to rank 0 (the coordinator) by an object gather; it keeps them by name until every rank
that has not joined submitted the name, checks that they agree (kind, dtype, shape, op, root, scales), and
broadcasts the responses in the order they completed. Every rank runs the cycle's responses in the same order,
allreduces that follow each other with the same dtype, op and scales packed into one fusion buffer up to the
threshold, and enters each completed cacheable response into the cache at the same slot.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from .. import MPI, machine
from ..algorithms.registry import last_choice
from ..config import parse_bool, float_param, int_param, parse_size, size_param, str_param
from ..errors import MismatchError, PycollError
from . import timeline as tl

log = logging.getLogger("pycoll.horovod")

FUSION_THRESHOLD = size_param(
    "PYCOLL_HVD_FUSION_THRESHOLD", 64 << 20,
    "Horovod engine: the most bytes of allreduce tensors packed into one call per cycle (default 64M; 0: no fusion). "
    "HOROVOD_FUSION_THRESHOLD is read where this is not set.",
)
CYCLE_TIME = float_param(
    "PYCOLL_HVD_CYCLE_TIME", 1.0,
    "Horovod engine: milliseconds from the start of one background cycle to the next while requests are in flight "
    "(default 1). HOROVOD_CYCLE_TIME is read where this is not set.",
)
OVERLAP = str_param(
    "PYCOLL_HVD_OVERLAP", "auto",
    "Horovod engine: whether the background thread reduces while the training thread computes. on: a cycle every "
    "cycle time (Horovod's way); off: cycles run when a caller waits for a result (synchronize, step, a blocking "
    "call), the background thread only 1 s after the last cycle; auto (default): on where this host has a core "
    "beyond its ranks, off where the ranks fill its cores (there a background reduction takes a core from the "
    "computation).",
)
TIMELINE = str_param(
    "PYCOLL_HVD_TIMELINE", "",
    "Horovod engine: a file for rank 0's Chrome-trace timeline (every tensor's phases). HOROVOD_TIMELINE is read "
    "where this is not set.",
)
STALL_CHECK = float_param(
    "PYCOLL_HVD_STALL_CHECK_TIME", 60.0,
    "Horovod engine: seconds a tensor may wait for ranks that have not submitted it before rank 0 warns, naming "
    "them (default 60; 0: never). HOROVOD_STALL_CHECK_TIME_SECONDS is read where this is not set.",
)
CACHE_CAPACITY = int_param(
    "PYCOLL_HVD_CACHE_CAPACITY", 1024,
    "Horovod engine: response cache entries (default 1024; 0: every request negotiated through rank 0). "
    "HOROVOD_CACHE_CAPACITY is read where this is not set.",
)


def _knob(p: Any, horovod_name: str, parse: Any) -> Any:
    """A knob's value: pycoll's if set, else Horovod's variable of the same meaning, else pycoll's default."""
    if not p.is_set() and os.environ.get(horovod_name, "").strip():
        return parse(os.environ[horovod_name])
    return p.get()


CACHEABLE = frozenset({"allreduce", "broadcast", "reducescatter", "barrier"})  # every rank's metadata is the same
OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}

_HAS_NEW, _JOINED, _SHUTDOWN = 1, 2, 4
# Seconds between cycles while this rank has nothing in flight: a peer waiting on its requests waits for this rank's
# submission anyway; its cycles then only keep the peers' waits short of pycoll's timeout.
_IDLE_CYCLE_S = 0.02
# Seconds from the last cycle (any thread's) to the background thread's next where it does not overlap the
# computation: the callers' waits run the cycles, each training step's at least; these only move requests nobody
# waits for (a poll loop). Longer than a step, so that they do not land in one: a background cycle in the middle of
# the computation waits for the other ranks' and holds back this rank's own.
_BACKSTOP_CYCLE_S = 1.0


def overlap_wanted() -> bool:
    """PYCOLL_HVD_OVERLAP: whether the background thread cycles while requests are in flight (``auto``: where the
    job's ranks on this host leave a core free)."""
    mode = OVERLAP.get()
    if mode.strip().lower() == "auto":
        return machine.free_cores() > 0
    try:
        return parse_bool(mode)  # on / off, and the spellings every boolean knob takes
    except ValueError:
        raise ValueError(f"PYCOLL_HVD_OVERLAP={mode!r}: expected on, off or auto") from None


class HorovodError(PycollError):
    """A request the engine could not carry out (the engine stopped, a root that has joined, a duplicate name)."""


class Done:
    """A request's completion, as ``threading.Event`` offers it, for a fraction of its cost (a gradient hook makes
    one per tensor): a flag, and one condition that every waiter of the process shares."""

    __slots__ = ("flag",)
    _cond = threading.Condition(threading.Lock())

    def __init__(self) -> None:
        self.flag = False

    def is_set(self) -> bool:
        return self.flag

    def set(self) -> None:
        with Done._cond:
            self.flag = True
            Done._cond.notify_all()

    def wait(self, timeout: Optional[float] = None) -> bool:
        if self.flag:
            return True
        with Done._cond:
            return Done._cond.wait_for(self.is_set, timeout)


@dataclass(eq=False)
class Request:
    """One submitted tensor operation. ``array`` is its input (C-ordered); ``out``, where given, receives the
    result (the input itself for an in-place call). ``extra`` is what differs by rank: an allgather's first
    dimension, an alltoall's splits."""

    name: str
    kind: str
    array: Optional[np.ndarray] = None
    out: Optional[np.ndarray] = None
    op: str = "sum"
    root: int = 0
    prescale: float = 1.0
    postscale: float = 1.0
    extra: Any = None
    fn: Optional[Callable[[], Any]] = None  # a "call": run on the loop's thread at the agreed point
    result: Any = None
    error: Optional[BaseException] = None
    done: Done = field(default_factory=Done)
    submitted_us: float = 0.0
    agreed_us: float = 0.0

    def meta(self) -> tuple:
        """What every rank must agree on: kind, dtype, shape (an allgather's and alltoall's without the first
        dimension), op, root and scales."""
        a = self.array
        dtype = a.dtype if a is not None else None
        shape = tuple(a.shape) if a is not None else ()
        if self.kind in ("allgather", "alltoall"):
            shape = shape[1:]
        return (self.kind, dtype, shape, self.op, self.root, self.prescale, self.postscale)

    def finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self.result, self.error = result, error
        self.done.set()


@dataclass
class Response:
    """A negotiated operation, the same on every rank: its name, the agreed metadata, each rank's ``extra``
    (None for a rank that has joined), or the error every rank that submitted it raises."""

    name: str
    meta: tuple
    extras: Optional[list] = None
    error: Optional[str] = None
    peers: tuple = ()

    @property
    def kind(self) -> str:
        return self.meta[0]


_FIELDS = ("kind", "dtype", "shape", "op", "root", "prescale factor", "postscale factor")


def _mismatch(name: str, metas: dict[int, tuple]) -> tuple[str, tuple]:
    """What differs between the ranks' submissions of ``name``: the message and the ranks that differ."""
    ranks = sorted(metas)
    ref = metas[ranks[0]]
    for i, what in enumerate(_FIELDS):
        values: dict[Any, list[int]] = {}
        for r in ranks:
            values.setdefault(metas[r][i], []).append(r)
        if len(values) > 1:
            parts = "; ".join(f"ranks {', '.join(map(str, rs))}: {v}" for v, rs in values.items())
            return f"tensor {name!r}: the ranks submitted different {what}s ({parts})", tuple(r for r in ranks if metas[r][i] != ref[i]) or tuple(ranks)
    return f"tensor {name!r}: the ranks' submissions differ", tuple(ranks)


def _identity(op: str, dtype: np.dtype) -> Any:
    """The value a joined rank contributes to a reduction: it changes nobody's result."""
    if op == "sum":
        return 0
    if op == "product":
        return 1
    if dtype.kind == "f" or dtype.name == "bfloat16":
        return np.inf if op == "min" else -np.inf
    if dtype.kind == "b":
        return op == "min"
    info = np.iinfo(dtype)
    return info.max if op == "min" else info.min


def _scale_into(out: np.ndarray, src: np.ndarray, factor: float) -> None:
    """``out`` = ``src`` * ``factor`` in one pass (a copy where the factor is 1; integers truncated, as Horovod)."""
    if factor == 1.0:
        np.copyto(out, src)
    elif out.dtype.kind in "iub":
        np.multiply(src, factor, out=out, casting="unsafe")
    else:
        np.multiply(src, out.dtype.type(factor), out=out)


class Engine:
    """One process set's negotiation and execution (``comm``: a communicator only the loop's thread uses); its
    cycles run on the ``Loop``'s thread."""

    def __init__(self, comm: Any, loop: "Loop", label: str = "global") -> None:
        self.comm, self.loop, self.label = comm, loop, label
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.threshold = _knob(FUSION_THRESHOLD, "HOROVOD_FUSION_THRESHOLD", parse_size)
        self.stall_s = _knob(STALL_CHECK, "HOROVOD_STALL_CHECK_TIME_SECONDS", float)
        capacity = max(0, _knob(CACHE_CAPACITY, "HOROVOD_CACHE_CAPACITY", int))
        self.timeline = loop.timeline if label == "global" else None
        self.words = max(1, -(-capacity // 64))
        self.capacity = capacity
        # the response cache, the same on every rank: slot -> (name, meta), and name -> slot
        self.slots: list[Optional[tuple[str, tuple]]] = [None] * capacity
        self.cached: dict[str, int] = {}
        self._lock = loop.cond
        self._queue: list[Request] = []
        self._queued: set[str] = set()  # the names in _queue
        self.pending: dict[str, Request] = {}  # submitted here, not finished
        self._to_send: list[Request] = []  # not known to the cache: for the coordinator
        self._bits: dict[int, Request] = {}  # cache slot -> the ready request here
        self._invalid: set[int] = set()
        self._joined = False
        self._join_req: Optional[Request] = None
        self._join_cycle: dict[int, int] = {}
        self._last_joined: tuple = ()
        self._shutdown = False
        self.stopped = False
        self.broken: Optional[BaseException] = None
        self.cycles = 0
        self.negotiations = 0  # cycles that went through the coordinator
        self.fused_calls = 0  # allreduce calls made for more than one tensor
        # the coordinator's table (rank 0): name -> {rank: (meta, extra)}, in order of first arrival
        self._table: dict[str, dict[int, tuple]] = {}
        self._first_seen: dict[str, float] = {}
        self._bit_seen: dict[int, float] = {}
        self._next_stall_check = 0.0
        self._warned: set = set()
        self._fusion = np.empty(0, np.uint8)

    def idle(self) -> bool:
        """Whether this rank has nothing in flight (nothing it waits for can complete before it submits again)."""
        return not (self.pending or self._queue or self._joined or self._join_req is not None or self._shutdown)

    # ---- submission (any thread) ------------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        with self._lock:
            if self.broken is not None:
                raise HorovodError(f"the Horovod engine stopped: {self.broken}", op=f"{req.kind} {req.name!r}",
                                   rank=self.rank) from self.broken
            if self._shutdown:
                raise HorovodError("the Horovod engine was shut down", op=f"{req.kind} {req.name!r}", rank=self.rank)
            if req.name in self.pending or req.name in self._queued:
                raise HorovodError(f"a request named {req.name!r} is still in flight on this rank; names must be "
                                   "unique among the requests in flight", op=f"{req.kind} {req.name!r}", rank=self.rank)
            req.submitted_us = self.timeline.now_us() if self.timeline else 0.0
            if not self.pending and not self._queue:
                self._lock.notify_all()  # the first in flight: the loop leaves its idle pace now, not in 20 ms
            self._queued.add(req.name)
            self._queue.append(req)  # the next cycle takes it: the loop's, or a waiting caller's at once
        return req

    def join(self) -> Request:
        """This rank has no more requests: it takes part in the others' reductions with values that change nothing
        until every rank has joined. The request's result is the rank that joined last."""
        req = Request(name="join", kind="join")
        with self._lock:
            if self._join_req is not None:
                raise HorovodError("join() is already in flight on this rank", op="join", rank=self.rank)
            self._join_req = req
            self._lock.notify_all()
        return req

    def shutdown(self) -> None:
        """Stop once every rank of the set has asked to (until then the loop serves the others' requests)."""
        with self._lock:
            self._shutdown = True
            self._lock.notify_all()

    # ---- the cycle (the loop's thread) ---------------------------------------------------------------------
    def _break(self, exc: BaseException, clean: bool = False) -> None:
        with self._lock:
            self.stopped = True
            if not clean:
                self.broken = exc
                log.error("pycoll.horovod: engine %s stopped: %s", self.label, exc)
            waiting = list(self.pending.values()) + self._queue
            if self._join_req is not None:
                waiting.append(self._join_req)
            self.pending.clear()
            self._queue.clear()
            self._queued.clear()
            self._join_req = None
        for req in waiting:
            if not req.done.is_set():
                req.finish(error=exc)

    def _take_new(self) -> None:
        with self._lock:
            new, self._queue = self._queue, []
            self._queued.clear()
            for req in new:
                self.pending[req.name] = req
            if self._join_req is not None and not self._joined:
                self._joined = True
        for req in new:
            slot = self.cached.get(req.name)
            if slot is None:
                self._to_send.append(req)
            elif self.slots[slot][1] == req.meta():  # type: ignore[index]
                self._bits[slot] = req
            else:  # the cache says otherwise: every rank drops the entry, this request is negotiated
                self._invalid.add(slot)
                self._to_send.append(req)

    def _row(self) -> np.ndarray:
        """This rank's row: flags, then the ready and the contradicted cache slots as bit sets (little-endian words)."""
        w = self.words
        flags = (_HAS_NEW if self._to_send else 0) | (_JOINED if self._joined else 0) | (_SHUTDOWN if self._shutdown else 0)
        ready = sum(1 << slot for slot in self._bits)
        contradicted = sum(1 << slot for slot in self._invalid)
        raw = flags.to_bytes(8, "little") + ready.to_bytes(8 * w, "little") + contradicted.to_bytes(8 * w, "little")
        return np.frombuffer(bytearray(raw), np.uint64)

    @staticmethod
    def _slots_of(bits: int) -> list[int]:
        out = []
        while bits:
            low = bits & -bits
            out.append(low.bit_length() - 1)
            bits ^= low
        return out

    def _cycle(self) -> bool:
        """One cycle; True once every rank has shut down."""
        self._take_new()
        w, size = self.words, self.size
        rows = np.empty((size, 1 + 2 * w), np.uint64)
        self.comm.Allgather(self._row(), rows)
        self.cycles += 1
        self._invalid.clear()
        raw = rows.tobytes()
        stride = 8 * (1 + 2 * w)
        flags, ready_of, contradicted = [], [], 0
        for r in range(size):
            at = r * stride
            flags.append(int.from_bytes(raw[at:at + 8], "little"))
            ready_of.append(int.from_bytes(raw[at + 8:at + 8 + 8 * w], "little"))
            contradicted |= int.from_bytes(raw[at + 8 + 8 * w:at + stride], "little")
        joined = [bool(f & _JOINED) for f in flags]
        for r in range(size):
            if joined[r] and r not in self._join_cycle:
                self._join_cycle[r] = self.cycles
        active = [r for r in range(size) if not joined[r]]
        # cache entries some rank contradicted: dropped everywhere; requests waiting on them are negotiated
        for slot in self._slots_of(contradicted):
            name = self.slots[slot][0]  # type: ignore[index]
            self.slots[slot] = None
            self.cached.pop(name, None)
            self._bit_seen.pop(slot, None)
            req = self._bits.pop(slot, None)
            if req is not None:
                self._to_send.append(req)
        responses: list[Response] = []
        if active:
            ready = -1
            for r in active:
                ready &= ready_of[r]
            for slot in self._slots_of(ready & ~contradicted):
                if self.slots[slot] is not None:
                    name, meta = self.slots[slot]  # type: ignore[misc]
                    responses.append(Response(name, meta))
                    self._bit_seen.pop(slot, None)
                    self._bits.pop(slot, None)
        if self.rank == 0 and self.stall_s > 0 and time.monotonic() >= self._next_stall_check:
            self._next_stall_check = time.monotonic() + min(1.0, self.stall_s / 4)
            self._check_cached_stalls(ready_of, active, {r.name for r in responses})
            self._check_table_stalls(active)
        # every rank decides this from the same rows: the gather and broadcast are collective
        if any(f & _HAS_NEW for f in flags) or self._table_may_complete(joined):
            responses += self._negotiate(joined)
        self._execute(responses, joined)
        if all(joined) and self._join_req is not None:
            last = max(range(size), key=lambda r: (self._join_cycle.get(r, 0), r))
            req, self._join_req = self._join_req, None
            self._joined = False
            self._join_cycle.clear()
            req.finish(result=last)
        return all(f & _SHUTDOWN for f in flags)

    def _table_may_complete(self, joined: list[bool]) -> bool:
        """Whether the set of joined ranks changed this cycle (the coordinator's waiting names may now complete)."""
        key = tuple(joined)
        changed = bool(self._last_joined) and key != self._last_joined
        self._last_joined = key
        return changed

    # ---- negotiation --------------------------------------------------------------------------------------
    def _negotiate(self, joined: list[bool]) -> list[Response]:
        """The coordinator's round: every rank's new requests to rank 0, the completed responses back."""
        self.negotiations += 1
        mine = [(req.name, req.meta(), req.extra) for req in self._to_send]
        self._to_send = []
        gathered = self.comm.gather(mine, root=0)
        out = self._coordinate(gathered, joined) if self.rank == 0 else None
        responses: list[Response] = self.comm.bcast(out, root=0)
        now = self.timeline.now_us() if self.timeline else 0.0
        for resp in responses:
            req = self.pending.get(resp.name)
            if req is not None:
                req.agreed_us = now
        return responses

    def _coordinate(self, gathered: list, joined: list[bool]) -> list[Response]:
        now = time.monotonic()
        for r, msgs in enumerate(gathered):
            for name, meta, extra in msgs:
                entry = self._table.setdefault(name, {})
                self._first_seen.setdefault(name, now)
                entry[r] = (meta, extra)
        active = [r for r in range(self.size) if not joined[r]]
        out = []
        for name in list(self._table):
            entry = self._table[name]
            if not active or any(r not in entry for r in active):
                continue
            del self._table[name]
            self._first_seen.pop(name, None)
            self._warned.discard(name)
            metas = {r: m for r, (m, _) in entry.items()}
            ref = metas[min(metas)]
            extras = [entry[r][1] if r in entry else None for r in range(self.size)]
            if any(m != ref for m in metas.values()):
                cause, peers = _mismatch(name, metas)
                out.append(Response(name, ref, extras, cause, peers))
            elif ref[0] == "broadcast" and joined[ref[4]]:
                out.append(Response(name, ref, extras, f"tensor {name!r}: broadcast from rank {ref[4]}, which has "
                                    "joined", (ref[4],)))
            else:
                out.append(Response(name, ref, extras))
        return out

    def _check_table_stalls(self, active: list[int]) -> None:
        """The coordinator's warning for names some ranks submitted and others have not, once per name."""
        now = time.monotonic()
        for name, since in self._first_seen.items():
            if now - since > self.stall_s and name not in self._warned:
                self._warned.add(name)
                missing = [r for r in active if r not in self._table[name]]
                log.warning("pycoll.horovod: stall: tensor %r was submitted by ranks %s %.0f s ago; ranks %s have "
                            "not submitted it", name, sorted(self._table[name]), now - since, missing)

    def _check_cached_stalls(self, ready_of: list[int], active: list[int], ran: set) -> None:
        """The coordinator's warning for cached requests some ranks have ready and others have not submitted
        (sampled every quarter of the stall time: the first sighting is that coarse)."""
        now = time.monotonic()
        seen = 0
        for r in active:
            seen |= ready_of[r]
        for slot in self._slots_of(seen):
            self._bit_seen.setdefault(slot, now)
        for slot, since in list(self._bit_seen.items()):
            entry = self.slots[slot]
            if entry is None or entry[0] in ran or not seen >> slot & 1:
                self._bit_seen.pop(slot, None)
                continue
            if now - since > self.stall_s and ("bit", slot, since) not in self._warned:
                self._warned.add(("bit", slot, since))
                missing = [r for r in active if not ready_of[r] >> slot & 1]
                log.warning("pycoll.horovod: stall: tensor %r has waited %.0f s for ranks %s to submit it",
                            entry[0], now - since, missing)

    # ---- execution ----------------------------------------------------------------------------------------
    def _execute(self, responses: list[Response], joined: list[bool]) -> None:
        i = 0
        while i < len(responses):
            resp = responses[i]
            if resp.error is not None:
                req = self.pending.pop(resp.name, None)
                if req is not None:
                    req.finish(error=MismatchError(resp.error, op=f"horovod {req.kind} {resp.name!r}", rank=self.rank,
                                                   peers=resp.peers))
                i += 1
                continue
            group = [resp]
            if resp.kind == "allreduce":  # the allreduces after it with the same dtype, op and scales, fused
                key, nbytes = self._fusion_key(resp), self._nbytes(resp)
                while self.threshold > 0 and i + len(group) < len(responses):
                    nxt = responses[i + len(group)]
                    size = self._nbytes(nxt)
                    if nxt.error is not None or nxt.kind != "allreduce" or self._fusion_key(nxt) != key \
                            or nbytes + size > self.threshold:
                        break
                    group.append(nxt)
                    nbytes += size
                self._allreduce(group)
            else:
                getattr(self, "_" + resp.kind)(resp, joined)
            for done in group:
                self._remember(done)
            i += len(group)

    @staticmethod
    def _fusion_key(resp: Response) -> tuple:
        kind, dtype, _, op, _, prescale, postscale = resp.meta
        return dtype, op, prescale, postscale

    def _remember(self, resp: Response) -> None:
        """Enter a negotiated response into the cache, at the same slot on every rank."""
        if resp.kind not in CACHEABLE or resp.name in self.cached or not self.capacity:
            return
        try:
            slot = self.slots.index(None)
        except ValueError:
            return  # full: later requests are negotiated
        self.slots[slot] = (resp.name, resp.meta)
        self.cached[resp.name] = slot

    @staticmethod
    def _nbytes(resp: Response) -> int:
        _, dtype, shape = resp.meta[:3]
        return math.prod(shape) * dtype.itemsize

    def _span(self, name: str, phase: str, t0: float, args: Optional[dict] = None) -> float:
        """Record ``phase`` of ``name`` from ``t0`` to now; now."""
        now = self.timeline.now_us() if self.timeline else 0.0
        if self.timeline is not None:
            self.timeline.span(name, phase, t0, now, args)
        return now

    def _negotiated(self, req: Optional[Request], name: str, kind: str) -> None:
        if self.timeline is not None and req is not None:
            agreed = req.agreed_us or self.timeline.now_us()
            self.timeline.span(name, tl.NEGOTIATE + "_" + kind.upper(), req.submitted_us, agreed)
            self.timeline.span(name, tl.QUEUE, agreed, self.timeline.now_us())

    def _allreduce(self, group: list[Response]) -> None:
        _, dtype, _, op, _, prescale, postscale = group[0].meta
        reqs = [self.pending.pop(r.name, None) for r in group]
        for resp, req in zip(group, reqs):
            self._negotiated(req, resp.name, "allreduce")
        sizes = [math.prod(r.meta[2]) for r in group]
        total = sum(sizes)
        t0 = self.timeline.now_us() if self.timeline else 0.0
        alone = len(group) == 1 and reqs[0] is not None and reqs[0].out is not None and reqs[0].out.flags.c_contiguous
        # the scale factors ride on the copies into and out of the fusion buffer (one pass each)
        if alone:
            req = reqs[0]
            buf = req.out.reshape(-1)  # type: ignore[union-attr]
            if req.out is not req.array or prescale != 1.0:
                _scale_into(buf, req.array.reshape(-1), prescale)  # type: ignore[union-attr]
        else:
            raw = self._fusion if self._fusion.nbytes >= total * dtype.itemsize else np.empty(total * dtype.itemsize, np.uint8)
            self._fusion = raw
            buf = raw[:total * dtype.itemsize].view(dtype)
            if prescale == 1.0 and None not in reqs:  # one call packs them all
                np.concatenate([req.array.reshape(-1) for req in reqs], out=buf)  # type: ignore[union-attr]
            else:
                off = 0
                for n, req in zip(sizes, reqs):
                    if req is not None:
                        _scale_into(buf[off:off + n], req.array.reshape(-1), prescale)  # type: ignore[union-attr]
                    else:  # this rank joined: a value that changes nobody's result
                        buf[off:off + n] = _identity(op, dtype)
                    off += n
        if len(group) > 1:
            self.fused_calls += 1
        t1 = self._span_all(group, tl.MEMCPY_IN, t0) if not alone else t0
        self.comm.Allreduce(MPI.IN_PLACE, buf, OPS[op])
        if alone and postscale != 1.0:
            _scale_into(buf, buf, postscale)
        t2 = self._span_all(group, "ALLREDUCE", t1, {"algorithm": last_choice.algorithm, "tensors": len(group),
                                                     "bytes": total * dtype.itemsize})
        off = 0
        for n, resp, req in zip(sizes, group, reqs):
            if req is not None:
                if alone:
                    result = req.out
                else:
                    seg = buf[off:off + n].reshape(resp.meta[2])
                    result = req.out if req.out is not None else np.empty_like(seg)
                    _scale_into(result, seg, postscale)
                req.finish(result)
            off += n
        if not alone:
            self._span_all(group, tl.MEMCPY_OUT, t2)

    def _span_all(self, group: list[Response], phase: str, t0: float, args: Optional[dict] = None) -> float:
        if self.timeline is None:
            return 0.0
        now = self.timeline.now_us()
        for resp in group:
            self.timeline.span(resp.name, phase, t0, now, args)
        return now

    def _allgather(self, resp: Response, joined: list[bool]) -> None:
        req = self.pending.pop(resp.name, None)
        self._negotiated(req, resp.name, "allgather")
        _, dtype, rest, *_ = resp.meta
        row = math.prod(rest)
        firsts = [int(e) if e is not None else 0 for e in resp.extras]  # type: ignore[union-attr]
        out = np.empty((sum(firsts),) + tuple(rest), dtype)
        send = req.array.reshape(-1) if req is not None else np.empty(0, dtype)  # type: ignore[union-attr]
        t0 = self.timeline.now_us() if self.timeline else 0.0
        self.comm.Allgatherv(send, [out.reshape(-1), [f * row for f in firsts]])
        self._span(resp.name, "ALLGATHER", t0, {"algorithm": last_choice.algorithm})
        if req is not None:
            req.finish((out, firsts))

    def _broadcast(self, resp: Response, joined: list[bool]) -> None:
        req = self.pending.pop(resp.name, None)
        self._negotiated(req, resp.name, "broadcast")
        _, dtype, shape, _, root, *_ = resp.meta
        if req is None:
            buf = np.empty(shape, dtype)
        elif req.out is not None and req.out.flags.c_contiguous:
            buf = req.out
            if req.out is not req.array:
                np.copyto(buf, req.array)
        else:
            buf = np.array(req.array, copy=True, order="C")
        t0 = self.timeline.now_us() if self.timeline else 0.0
        self.comm.Bcast(buf.reshape(-1), root=root)
        self._span(resp.name, "BROADCAST", t0, {"algorithm": last_choice.algorithm})
        if req is not None:
            if req.out is not None and buf is not req.out:
                np.copyto(req.out, buf)
                buf = req.out
            req.finish(buf)

    def _alltoall(self, resp: Response, joined: list[bool]) -> None:
        req = self.pending.pop(resp.name, None)
        self._negotiated(req, resp.name, "alltoall")
        _, dtype, rest, *_ = resp.meta
        row = math.prod(rest)
        splits = [list(e) if e is not None else [0] * self.size for e in resp.extras]  # type: ignore[union-attr]
        sends = splits[self.rank]
        recvs = [splits[s][self.rank] for s in range(self.size)]
        out = np.empty((sum(recvs),) + tuple(rest), dtype)
        send = req.array.reshape(-1) if req is not None else np.empty(0, dtype)  # type: ignore[union-attr]
        t0 = self.timeline.now_us() if self.timeline else 0.0
        self.comm.Alltoallv([send, [k * row for k in sends]], [out.reshape(-1), [k * row for k in recvs]])
        self._span(resp.name, "ALLTOALL", t0, {"algorithm": last_choice.algorithm})
        if req is not None:
            req.finish((out, recvs))

    def _reducescatter(self, resp: Response, joined: list[bool]) -> None:
        req = self.pending.pop(resp.name, None)
        self._negotiated(req, resp.name, "reducescatter")
        _, dtype, shape, op, _, prescale, postscale = resp.meta
        rows = rows_of(shape[0] if shape else 0, self.size)
        row = math.prod(shape[1:])
        if req is not None:
            send = np.empty(math.prod(shape), dtype)
            _scale_into(send, req.array.reshape(-1), prescale)
        else:
            send = np.full(math.prod(shape), _identity(op, dtype), dtype)
        out = np.empty((rows[self.rank],) + tuple(shape[1:]), dtype)
        t0 = self.timeline.now_us() if self.timeline else 0.0
        self.comm.Reduce_scatter(send, out.reshape(-1), [k * row for k in rows], OPS[op])
        self._span(resp.name, "REDUCESCATTER", t0, {"algorithm": last_choice.algorithm})
        _scale_into(out, out, postscale)
        if req is not None:
            req.finish(out)

    def _call(self, resp: Response, joined: list[bool]) -> None:
        """Something every rank runs at the same point of the loop (making a process set's communicator)."""
        req = self.pending.pop(resp.name, None)
        if req is not None and req.fn is not None:
            try:
                result = req.fn()
            except Exception as exc:  # noqa: BLE001 - the caller's error
                req.finish(error=exc)
                return
            req.finish(result)

    def _barrier(self, resp: Response, joined: list[bool]) -> None:
        req = self.pending.pop(resp.name, None)
        self._negotiated(req, resp.name, "barrier")
        if req is not None:
            req.finish(None)


class Loop:
    """The one background thread of a process: a cycle of every process set's engine in turn, in the order they
    were added (the same on every rank), so only this thread ever calls pycoll."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.drive = threading.Lock()  # held by whichever thread runs the cycles: only one calls pycoll
        self.cycle_s = _knob(CYCLE_TIME, "HOROVOD_CYCLE_TIME", float) / 1e3
        self.overlap = overlap_wanted()
        self.last_cycle = 0.0  # when the last cycle started, in whichever thread
        self.engines: list[Engine] = []
        self.timeline: Optional[tl.Timeline] = None
        self._thread: Optional[threading.Thread] = None

    def open_timeline(self, rank: int) -> None:
        path = _knob(TIMELINE, "HOROVOD_TIMELINE", str)
        if path and rank == 0:
            self.timeline = tl.Timeline(path)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pycoll-horovod", daemon=True)
        self._thread.start()

    def add(self, engine: Engine) -> None:
        """Called on the loop's thread (a negotiated call) or before it starts: every rank adds at the same point."""
        self.engines.append(engine)

    def iterate(self) -> bool:
        """One cycle of every live engine (the caller holds ``drive``); True once every engine has stopped."""
        self.last_cycle = time.monotonic()
        for engine in list(self.engines):
            if engine.stopped:
                continue
            try:
                if engine._cycle():
                    engine._break(HorovodError("the Horovod engine was shut down", op="shutdown", rank=engine.rank),
                                  clean=True)
            except BaseException as exc:  # noqa: BLE001 - every waiting caller gets the cause
                engine._break(exc)
        return all(e.stopped for e in self.engines)

    def _run(self) -> None:
        while True:
            tried = time.monotonic()
            if self.drive.acquire(False):  # else a waiting caller runs the cycles: no second cycle behind it
                try:
                    if self.iterate():
                        break
                finally:
                    self.drive.release()
            elif all(e.stopped for e in self.engines):
                break
            with self.cond:
                while True:  # a submission or a shutdown wakes the wait; the pace decides whether to cycle now
                    wait = self._pace() - (time.monotonic() - max(tried, self.last_cycle))
                    if wait <= 0:
                        break
                    self.cond.wait(wait)
        if self.timeline is not None:
            self.timeline.close()

    def _pace(self) -> float:
        """Seconds from one background cycle's start to the next (the loop's lock held)."""
        live = [e for e in self.engines if not e.stopped]
        if not live:
            return 0.0
        if any(e._shutdown for e in live):
            return self.cycle_s
        if not self.overlap:
            return _BACKSTOP_CYCLE_S
        return _IDLE_CYCLE_S if all(e.idle() for e in live) else self.cycle_s

    def drive_until(self, reqs: list[Request]) -> None:
        """Wait for ``reqs``, running the cycles in this (the waiting) thread whenever the loop's thread is not:
        a blocking call then needs no hand-over to the loop's thread and back, each a wake-up of tens of µs."""
        for req in reqs:
            while not req.done.is_set():
                if self.drive.acquire(False):
                    try:
                        if req.done.is_set():
                            break
                        if self.iterate():
                            break
                    finally:
                        self.drive.release()
                else:
                    req.done.wait(0.001)
            req.done.wait()

    def shutdown(self, timeout: float) -> None:
        """Every engine asks to stop; wait (at most ``timeout`` s) for the others' ranks to ask too."""
        for engine in list(self.engines):
            engine.shutdown()
        if self._thread is not None and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)


def rows_of(first: int, size: int) -> list[int]:
    """How a reducescatter splits ``first`` rows over ``size`` ranks, as Horovod does: the first ranks one more."""
    base, more = divmod(first, size)
    return [base + (1 if r < more else 0) for r in range(size)]
