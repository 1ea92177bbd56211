"""The schedule checker: runs every rank's schedule of one call in this process, over an in-memory network.

It proves what a schedule must guarantee before it meets a real transport: every send meets a
receive of the same size, nothing is left unmatched, and no rank waits forever. Messages between two
ranks on one (context, tag) match in posting order, as in the engine; a send completes only when its
receive is posted and the data is copied then, so a schedule that reuses a buffer too early shows.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..memory import HostMemory
from ..p2p_protocol import Owner, Request, Schedule, Sig
from .base import Call, Layout, Steps
from ..config import SHM_DIR
from .registry import ALGORITHMS, Algorithm
from .arena_meeting import ArenaState, arena_enabled

_SIM_ARENAS = itertools.count()


class ScheduleError(AssertionError):
    """A schedule that cannot run on a real network: unmatched, mis-sized or deadlocked messages."""


class _Msg(Request):
    __slots__ = ("data", "sig")

    def __init__(self, owner: Owner, peer: int, ctx: int, tag: int, data: np.ndarray, sig: Sig) -> None:
        super().__init__(owner, peer, ctx, tag)
        self.data, self.sig = data, sig


class _Recv(Request):
    __slots__ = ("dst", "local", "ufunc", "sig")

    def __init__(self, owner: Owner, peer: int, ctx: int, tag: int, dst: np.ndarray, sig: Optional[Sig], local: Any, ufunc: Any) -> None:
        super().__init__(owner, peer, ctx, tag)
        self.dst, self.sig, self.local, self.ufunc = dst, sig, local, ufunc


class Network:
    """Queues of posted sends and receives per (source, destination, ctx, tag)."""

    def __init__(self) -> None:
        self.sends: dict[tuple, deque[_Msg]] = {}
        self.recvs: dict[tuple, deque[_Recv]] = {}
        self.messages = 0
        self.bytes = 0

    def endpoint(self, rank: int) -> "_Endpoint":
        return _Endpoint(self, rank)

    def _match(self, key: tuple) -> None:
        sends, recvs = self.sends.get(key), self.recvs.get(key)
        while sends and recvs:
            msg, rec = sends.popleft(), recvs.popleft()
            src, dst = key[0], key[1]
            if msg.data.nbytes != rec.dst.nbytes:
                raise ScheduleError(
                    f"rank {src} sends {msg.data.nbytes} bytes to rank {dst}, which receives {rec.dst.nbytes} (tag {key[3]})"
                )
            if rec.sig is not None and msg.sig != rec.sig:
                raise ScheduleError(f"rank {src} sends with {msg.sig} but rank {dst} expects {rec.sig}")
            incoming = msg.data.view(np.uint8)
            if rec.ufunc is not None:
                rec.ufunc(rec.local, incoming.view(rec.dst.dtype), out=rec.dst)
            elif rec.dst.nbytes:
                rec.dst.view(np.uint8)[...] = incoming
            msg.done = rec.done = True
            self.messages += 1
            self.bytes += msg.data.nbytes

    def pending(self) -> list[str]:
        out = [f"rank {k[0]} -> rank {k[1]}: {len(q)} send(s) never received (tag {k[3]})" for k, q in self.sends.items() if q]
        out += [f"rank {k[1]} waits for {len(q)} message(s) rank {k[0]} never sends (tag {k[3]})" for k, q in self.recvs.items() if q]
        return out


class _Endpoint:
    """The engine calls Steps makes, for one simulated rank."""

    def __init__(self, net: Network, rank: int) -> None:
        self.net, self.rank = net, rank

    def dead_peers(self) -> dict[int, str]:
        return {}

    def unexpected_in(self, ctx: int, lo: int, hi: int) -> None:
        return None

    def isend(self, peer: int, data: np.ndarray, ctx: int, tag: int, sig: Sig, owner: Owner) -> Request:
        key = (self.rank, peer, ctx, tag)
        self.net.sends.setdefault(key, deque()).append(_Msg(owner, peer, ctx, tag, data, sig))
        self.net._match(key)
        return self.net.sends[key][-1] if self.net.sends[key] else _done(owner)

    def irecv(self, peer: int, dst: Optional[np.ndarray], ctx: int, tag: int, sig: Optional[Sig], owner: Owner,
              local: Optional[np.ndarray] = None, ufunc: Any = None) -> Request:
        assert dst is not None, "collective receives always name their buffer"
        key = (peer, self.rank, ctx, tag)
        req = _Recv(owner, peer, ctx, tag, dst, sig, local, ufunc)
        self.net.recvs.setdefault(key, deque()).append(req)
        self.net._match(key)
        return req


def _done(owner: Owner) -> Request:
    req = Request(owner, -1, 0, 0)
    req.done = True
    return req


def run_schedules(
    algorithm: Algorithm | Callable,
    calls: Sequence[Call],
    layout: Optional[Layout] = None,
    chunk_bytes: Optional[int] = None,
    seq: int = 1,
    arena: bool = True,
) -> Network:
    """Run one call on every rank (``calls[r]`` is rank r's) to completion; raises ScheduleError on a bad schedule.

    On one host (and unless ``arena`` is False) the ranks share a real arena: one segment mapped once per
    simulated rank in this process, so the arena algorithms run for real (cross-memory attach reads this
    process's own memory).
    """
    p = len(calls)
    layout = layout or Layout.flat(p)
    run = algorithm.run if isinstance(algorithm, Algorithm) else algorithm
    net = Network()
    mem = HostMemory()
    scheds = []
    states = []
    if arena and p > 1 and layout.hosts == 1 and arena_enabled():
        path = os.path.join(SHM_DIR.get(), f"pycoll-sim-{os.getpid()}-{next(_SIM_ARENAS)}")
        states = [ArenaState(path) for _ in range(p)]
    try:
        for r, call in enumerate(calls):
            owner = Owner(f"simulated {call.coll} #{seq}", 1, r, lambda w: w, list(range(p)), tag=seq)
            st = Steps(net.endpoint(r), r, p, list(range(p)), 1, seq, Sig(), owner, mem, layout,  # type: ignore[arg-type]
                       states[r] if states else None)
            if chunk_bytes is not None:
                st.chunk_bytes = chunk_bytes
            scheds.append(Schedule(run(st, call), owner))
        _drive(scheds, net)
    finally:
        for state in states:
            state.close()
        if states and os.path.exists(states[0].path):
            os.unlink(states[0].path)
    left = net.pending()
    if left:
        raise ScheduleError("; ".join(left))
    return net


def _drive(scheds: list[Schedule], net: Network) -> None:
    while True:
        moved = False
        for s in scheds:
            moved |= s.advance()
        errors = [s.error for s in scheds if s.error is not None]
        if errors:
            raise errors[0]
        if all(s.done for s in scheds):
            break
        if not moved:
            stuck = [r for r, s in enumerate(scheds) if not s.done]
            raise ScheduleError(f"deadlock: ranks {stuck} wait forever; " + "; ".join(net.pending() or ["nothing in flight"]))


def algorithm(collective: str, name: str) -> Algorithm:
    return ALGORITHMS[collective][name]
