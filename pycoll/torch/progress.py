"""The background thread that starts and completes the torch backend's operations, so they overlap compute."""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
from typing import Any, Callable, ContextManager, Optional

from torch.futures import Future

from ..p2p import Engine
from ..request import Request


class Job:
    """One torch call: ``start`` issues its pycoll requests, ``finish`` turns their completion into the result.

    ``scope`` (a CUDA call's device and stream) is entered around everything the thread does for the job:
    pycoll copies a device result back while a request completes, so the device must be current then too."""

    __slots__ = ("name", "start", "finish", "future", "requests", "deadline", "timeout", "scope", "blocking", "settled")

    def __init__(self, name: str, start: Callable[[], list[Request]], finish: Callable[[], Any], timeout: float,
                 scope: Optional[Callable[[], ContextManager[Any]]] = None,
                 blocking: Optional[Callable[[], None]] = None) -> None:
        self.name, self.start, self.finish, self.timeout = name, start, finish, timeout
        self.scope = scope or contextlib.nullcontext
        # the same call as one blocking pycoll call (compiled, inline on the arena where it can be), for when
        # nothing else is in flight: nonblocking calls run as schedules of the progress engine, far slower
        self.blocking = blocking
        self.future: Future = Future()
        self.requests: list[Request] = []
        self.deadline = 0.0
        # called once, just before the future completes: a caller woken by it sees the job counted out
        self.settled: Optional[Callable[[], None]] = None

    def _settle(self) -> None:
        settled, self.settled = self.settled, None
        if settled is not None:
            settled()

    def succeed(self, result: Any) -> None:
        self._settle()
        self.future.set_result(result)

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self._settle()
            self.future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))


class ProgressThread:
    """Runs every pycoll call of the torch backend, in submission order, on one daemon thread.

    pycoll's engine belongs to one thread; this is that thread. Calls are started in the order they
    were submitted (which is what keeps collectives matched across ranks) and complete in any order,
    so a pending receive never holds back a later collective. While idle it sleeps, never spins: the
    user's thread keeps the core and the GIL.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._queue: queue.SimpleQueue[Optional[Job]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="pycoll-torch-progress", daemon=True)
        self._stopping = False
        # held while a job starts, on the thread or inline in the caller's: one call at a time starts, in order
        self._start_lock = threading.Lock()
        self._inflight = 0  # jobs submitted and not finished (changed under _count_lock: two threads change it)
        self._count_lock = threading.Lock()
        self._thread.start()
        atexit.register(self.stop)  # before pycoll's runtime closes the engine (atexit runs last-in, first-out)

    def submit(self, job: Job) -> Future:
        if self._stopping or not self._thread.is_alive():
            job.fail(RuntimeError(f"pycoll backend: {job.name} after the process group was shut down"))
            return job.future
        with self._count_lock:
            self._inflight += 1
        # counted out before its future completes (a done-callback would run after the waiter wakes, and a blocking
        # call made at once would still see it in flight)
        job.settled = self._finished
        self._queue.put(job)
        return job.future

    def _finished(self) -> None:
        with self._count_lock:
            self._inflight -= 1

    def run_now(self, call: Callable[..., Any], *args: Any) -> bool:
        """Make the blocking ``call(*args)`` now, in the caller's thread, if nothing is in flight and no job is
        starting; False, having done nothing, otherwise. Its errors are raised here."""
        if self._inflight or self._stopping or not self._start_lock.acquire(blocking=False):
            return False
        try:
            if self._inflight:
                return False
            call(*args)
            return True
        finally:
            self._start_lock.release()

    def run_inline(self, job: Job) -> bool:
        """Run ``job``'s blocking form now, in the caller's thread, if nothing is in flight and no job is starting
        (a small call then pays no thread hop); False, having done nothing, otherwise."""
        return job.blocking is not None and self.run_now(lambda: _complete_blocking(job))

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive() and not self._stopping:
            self._stopping = True
            self._queue.put(None)
            self._thread.join(timeout)

    # ---- the loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        running: list[Job] = []
        while True:
            if not running:
                job = self._queue.get()
                if job is None:
                    return
                with self._start_lock:
                    self._begin(job, running)
            while True:  # start everything submitted so far, in order
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._drain(running)
                    return
                with self._start_lock:
                    self._begin(job, running)
            running = self._advance(running)
            if running:
                now = time.monotonic()
                wait = max(min(j.deadline for j in running) - now, 0.0)
                self._engine.run_until(lambda: not self._queue.empty() or any(_ready(j) for j in running), min(wait, 1.0))

    def _begin(self, job: Job, running: list[Job]) -> None:
        if job.blocking is not None and not running:  # nothing in flight to progress meanwhile: the blocking form
            _complete_blocking(job)
            return
        try:
            with job.scope():
                job.requests = job.start()
        except BaseException as exc:  # a bad argument, a broken communicator: this call fails alone
            job.fail(exc)
            return
        job.deadline = time.monotonic() + job.timeout
        running.append(job)

    def _advance(self, running: list[Job]) -> list[Job]:
        """Complete the jobs whose requests are done (or whose time is up); return the others."""
        still = []
        now = time.monotonic()
        for job in running:
            try:
                with job.scope():
                    if all(r.Test() for r in job.requests):
                        pass
                    elif now >= job.deadline:
                        for r in job.requests:  # the group's timeout, not the communicator's: abort and raise now
                            r._expire(job.timeout)
                        for r in job.requests:
                            r.Wait()  # all completed meanwhile: their statuses and errors
                    else:
                        still.append(job)
                        continue
                    result = job.finish()
                job.succeed(result)
            except BaseException as exc:
                job.fail(exc)
        return still

    def _drain(self, running: list[Job]) -> None:
        while running:
            for job in running:
                job.deadline = min(job.deadline, time.monotonic())
            running = self._advance(running)


def _complete_blocking(job: Job) -> None:
    """Make ``job``'s blocking call and settle its future with the result or the error."""
    try:
        with job.scope():
            job.blocking()  # type: ignore[misc]
            result = job.finish()
        job.succeed(result)
    except BaseException as exc:
        job.fail(exc)


def _ready(job: Job) -> bool:
    return all(r.Get_status() for r in job.requests)
