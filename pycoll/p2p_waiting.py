"""The engine's waits: running schedules and requests to completion within a timeout, spinning, yielding and
sleeping on doorbells and sockets, and the flush and close at shutdown."""

from __future__ import annotations

import json
import os
import select
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from .errors import PeerFailureError
from .p2p_protocol import (
    GOODBYE_TAG,
    OVERSUBSCRIBED_SPIN_US,
    CONTROL_CTX,
    P2P_SIG,
    PROBE_AFTER_S,
    SPIN_US,
    STALL_WARN,
    YIELD_US,
    Owner,
    RecvRequest,
    Request,
    Schedule,
    SendRequest,
)


def _common_bell(waits: Iterable[Any]) -> Any:
    """The doorbell shared by every pending wait (arena flag waits carry one), else None."""
    bell = None
    for w in waits:
        b = getattr(w, "bell", None)
        if b is None or (bell is not None and b is not bell):
            return None
        bell = b
    return bell


class Waiting:
    """The engine's blocking waits and its shutdown (mixed into ``p2p.Engine``)."""

    def start(self, sched: Schedule, direct: bool = False) -> Schedule:
        """Begin a schedule; it runs in the background of every later wait. A ``direct`` one (its first messages
        straight through the sockets) skips the first progress pass: a peer's notice that it skipped the call
        is a frame its receives do not take, so the schedule then waits, and the wait's progress reads it."""
        if not direct:
            self.progress()  # a notice that a peer skipped this call may be waiting
        skipped = self._skipped.pop((sched.owner.ctx, sched.owner.tag), None)
        if skipped is not None:
            sched.fail(self._with_rank(skipped, sched.owner))
            return sched
        broken = self._broken.get(sched.owner.ctx & ~1)
        if broken is not None and self._is_broken_for(sched.owner):
            # a peer's report came while this call ran inline (its kernel does not read reports): it fails as the
            # calls pending then did
            sched.fail(self._with_rank(broken[0], sched.owner))
            return sched
        if self._dead:  # a member already died: this collective cannot finish
            dead = [m for m in sched.owner.members if m in self._dead and m not in self._left]
            if dead:
                err = sched.owner.error(PeerFailureError, self._dead[dead[0]], dead)
                sched.fail(err)
                self.break_ctx(sched.owner.ctx & ~1, err, sched.owner.tag)
                return sched
        sched.advance()
        if not sched.done:
            self._schedules.append(sched)
        return sched

    def wait_schedule(self, sched: Schedule, timeout: float) -> None:
        self._wait(lambda: sched.done, lambda: sched.steps, timeout, sched.owner, lambda: sched.waiting)
        if sched in self._schedules:
            self._schedules.remove(sched)

    def wait_requests(self, reqs: Sequence[Request], timeout: float, owner: Owner) -> None:
        """Wait for all of ``reqs``; each one that completes earns a fresh timeout. Their completions are counted from
        a pointer past the done prefix (requests mostly complete in order), the rest looked at only when the prefix
        did not move, so a long window costs no pass over all of it per message."""
        n = len(reqs)
        front = 0  # reqs[:front] are done
        beyond: set[int] = set()  # indices past the front seen done
        last_front = 0
        observed = 0  # changes whenever a completion was seen

        def finished() -> bool:
            nonlocal front
            while front < n and reqs[front].done:
                front += 1
            return front == n

        def completed() -> int:
            nonlocal last_front, observed
            finished()
            if front != last_front:  # the request at the last front completed: that alone tells a change
                last_front = front
                observed += 1
            else:
                new = [i for i in range(front + 1, n) if reqs[i].done and i not in beyond]
                if new:
                    beyond.update(new)
                    observed += 1
            return observed

        self._wait(finished, completed, timeout, owner, lambda: reqs)

    def wait_one(self, req: Request, timeout: float) -> None:
        """Wait for one point-to-point request: a short tight poll of the channels, then the general wait."""
        if self._kernels is not None and type(req) is SendRequest and req.rdv and not req.done and self._await_ack(req):
            return
        if not self._abort_requests and self.lock.acquire(blocking=False):
            try:
                if type(req) is RecvRequest and self.take_posted_from_socket(req):
                    return
                progress = self.progress
                for _ in range(self._tight_polls if not self.oversubscribed else 4):
                    progress()
                    if req.done:
                        return
            finally:
                self.lock.release()
        if not req.done:
            self._wait(lambda: req.done, lambda: req.done, timeout, req.owner, lambda: (req,))

    def _input_ready(self) -> bool:
        return any(f() for f in self._inputs.values())

    def run_until(self, ready: Callable[[], bool], seconds: float) -> None:
        """Make progress until ``ready()`` or ``seconds`` pass, sleeping (never spinning) when idle; no timeout error.

        For a progress thread beside the user's: it must not hold the GIL or a core while idle.
        """
        self._wait(ready, lambda: 0, seconds, None, lambda: (), spin=False)

    def _wait(
        self,
        finished: Callable[[], bool],
        marker: Callable[[], int],
        timeout: float,
        owner: Optional[Owner],
        pending: Callable[[], Iterable[Request]],
        spin: bool = True,
    ) -> None:
        with self.lock:
            if owner is not None:
                self._waits.append(owner)
            try:
                self._wait_locked(finished, marker, timeout, owner, pending, spin)
            finally:
                if owner is not None:
                    self._waits.remove(owner)

    def _wait_locked(
        self,
        finished: Callable[[], bool],
        marker: Callable[[], int],
        timeout: float,
        owner: Optional[Owner],
        pending: Callable[[], Iterable[Request]],
        spin: bool,
    ) -> None:
        # ranks sharing cores spin only briefly (unless PYCOLL_SPIN_US says otherwise): the core may be needed
        spin_us = SPIN_US.get() if not self.oversubscribed or SPIN_US.is_set() else OVERSUBSCRIBED_SPIN_US
        spin_s = spin_us * 1e-6 if spin else 0.0
        yield_s = spin_s + YIELD_US.get() * 1e-6 if spin else 0.0
        start = idle_since = time.monotonic()
        deadline = start + timeout
        stall_s = STALL_WARN.get() if owner is not None else 0.0
        stall_at = start + stall_s if stall_s > 0 else float("inf")
        probed = False
        last_mark = marker()
        nap = 20e-6
        while not finished():
            if self._abort_requests:
                self.take_aborts()
                continue
            if self.progress():
                idle_since = time.monotonic()
                nap = 20e-6
                mark = marker()
                if mark != last_mark:  # each completed step earns a fresh timeout
                    last_mark, deadline = mark, idle_since + timeout
                continue
            now = time.monotonic()
            if now > deadline:
                if owner is None:  # run_until: the time is up, nothing failed
                    return
                self._timed_out(owner, timeout, pending())
            idle = now - idle_since
            if idle < spin_s:
                continue
            bell = _common_bell(pending())
            if bell is None and self._stream_bell is not None and not self._schedules:
                bell = self._stream_bell  # point-to-point only: a peer's write into our rings wakes us
            if idle < yield_s and (bell is None or not self.oversubscribed):
                os.sched_yield()
                continue
            if now - self._last_liveness > 0.25:
                self._last_liveness = now
                self._check_liveness()
                self._check_strays()
                if owner is not None and not probed and now - start > PROBE_AFTER_S and owner.sig is not None and owner.tag >= 0:
                    probed = True
                    self._ask(owner, pending(), quiet=True)
                if now > stall_at:
                    assert owner is not None
                    self._report_stall(owner, pending(), now - start)
                    stall_at = now + stall_s
            if bell is not None and bell is self._stream_bell:
                bell.sleep(min(0.002, max(deadline - now, 0)), self._input_ready)
                continue
            if bell is not None:  # every wait is on one arena's flags: block on its doorbell, a peer's ring wakes us
                waits = pending()
                bell.sleep(min(0.001, max(deadline - now, 0)), lambda: all(w.done for w in waits))
                continue
            peers = self._pending_peers(pending()) if not self._only_sockets else ()
            if peers and self._shm_bell is not None and self._shm_peers.issuperset(peers):
                # waits on this host's peers only: their writes into our rings (or space freed in theirs) ring our bell
                self._shm_bell.sleep(min(0.002, max(deadline - now, 0)), self._input_ready)
                continue
            remote = self._only_sockets or (bool(peers) and self._tcp_peers.issuperset(peers))
            nap = min(nap * 2, 0.05 if (remote and spin) else 0.001, max(deadline - now, 0))
            self._sleep(nap)

    def _sleep(self, seconds: float) -> None:
        """Sleep up to ``seconds``, woken at once by input on a socket (or room to send on one) where there are any;
        a peer on this host writing to us does not end it early (``seconds`` stays short while one may)."""
        if self._tcp_fds:
            live = [fd for fd, ch in self._tcp_fds.items() if ch.peer not in self._dead]
            writers = [fd for fd in live if self._sendq[self._tcp_fds[fd].peer]]
            if live:
                select.select(live, writers, [], seconds)
                return
        time.sleep(seconds)

    def flush(self, timeout: float, delivered: bool = False) -> None:
        """Push out queued sends (e.g. before exit), for at most ``timeout`` seconds; with ``delivered``, also
        until every live peer holds them (a report sent just before an exit must not die in a socket buffer)."""
        deadline = time.monotonic() + timeout

        def pending() -> bool:
            live = [p for p in self._sendq if p not in self._dead]
            return any(self._sendq[p] for p in live) or (delivered and any(self.channels[p].unsafe_to_exit() for p in live))

        while pending() and time.monotonic() < deadline:
            if not self.progress():
                time.sleep(0.0005)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        owner = Owner("shutdown", CONTROL_CTX, self.rank, lambda w: w, (), tag=-1)
        bye = np.frombuffer(json.dumps({"ctx": 0, "rank": self.rank}).encode(), np.uint8)
        for peer in self._order:  # before the streams end, so that peers do not take this for a death
            if peer not in self._dead and peer != self.rank and self.channels[peer].kind != "self":
                self.isend(peer, bye, CONTROL_CTX, GOODBYE_TAG, P2P_SIG, owner)
        self.flush(0.5)
        for peer in self.channels:
            self._drop_lane(peer)
        for ch in self.channels.values():
            try:
                ch.close()
            except Exception:  # best effort at exit
                pass
