"""The Horovod engine's one background thread per process: cycles of every process set's engine in turn, paced by
the cycle time, or run by a waiting caller's own thread."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Optional

from . import timeline as tl
from .knobs import CYCLE_TIME, TIMELINE, knob_value, overlap_wanted
from .submissions import HorovodError, Request

if TYPE_CHECKING:
    from .engine import Engine


# Seconds between cycles while this rank has nothing in flight: a peer waiting on its requests waits for this rank's
# submission anyway; its cycles then only keep the peers' waits short of pycoll's timeout.
_IDLE_CYCLE_S = 0.02
# Seconds from the last cycle (any thread's) to the background thread's next where it does not overlap the
# computation: the callers' waits run the cycles, each training step's at least; these only move requests nobody
# waits for (a poll loop). Longer than a step, so that they do not land in one: a background cycle in the middle of
# the computation waits for the other ranks' and holds back this rank's own.
_BACKSTOP_CYCLE_S = 1.0


class Loop:
    """The one background thread of a process: a cycle of every process set's engine in turn, in the order they
    were added (the same on every rank), so only this thread ever calls pycoll."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.drive = threading.Lock()  # held by whichever thread runs the cycles: only one calls pycoll
        self.cycle_s = knob_value(CYCLE_TIME, "HOROVOD_CYCLE_TIME", float) / 1e3
        self.overlap = overlap_wanted()
        self.last_cycle = 0.0  # when the last cycle started, in whichever thread
        self.engines: list[Engine] = []
        self.timeline: Optional[tl.Timeline] = None
        self._thread: Optional[threading.Thread] = None

    def open_timeline(self, rank: int) -> None:
        path = knob_value(TIMELINE, "HOROVOD_TIMELINE", str)
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
