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
import time
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from ..config import parse_size
from .execution import Execution
from .knobs import CACHE_CAPACITY, FUSION_THRESHOLD, STALL_CHECK, knob_value
from .submissions import HorovodError, Request, Response

if TYPE_CHECKING:
    from .loop import Loop


log = logging.getLogger("pycoll.horovod")

_HAS_NEW, _JOINED, _SHUTDOWN = 1, 2, 4
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


class Engine(Execution):
    """One process set's negotiation and execution (``comm``: a communicator only the loop's thread uses); its
    cycles run on the ``Loop``'s thread."""

    def __init__(self, comm: Any, loop: "Loop", label: str = "global") -> None:
        self.comm, self.loop, self.label = comm, loop, label
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.threshold = knob_value(FUSION_THRESHOLD, "HOROVOD_FUSION_THRESHOLD", parse_size)
        self.stall_s = knob_value(STALL_CHECK, "HOROVOD_STALL_CHECK_TIME_SECONDS", float)
        capacity = max(0, knob_value(CACHE_CAPACITY, "HOROVOD_CACHE_CAPACITY", int))
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

