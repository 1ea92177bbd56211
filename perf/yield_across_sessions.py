"""Whether sched_yield hands a shared core over: one process works while another, pinned to the same core, yields in
a loop until the work is done; the work's time per item, with both in one session and in two (Linux puts each session
in a scheduler autogroup of its own, and a yield only moves a task back within its group).

    python perf/yield_across_sessions.py [--items 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import time

_LIBC = ctypes.CDLL(None, use_errno=True)


def _work_item() -> int:
    total = 0
    for j in range(50):  # a few microseconds of interpreter work
        total += j
    return total


def one_run(items: int, sessions: int, cpu: int) -> float:
    """The worker's µs per item while a yielding peer shares its core (sessions: 0 = no peer, 1 or 2)."""
    shared = mmap.mmap(-1, 8)
    done = ctypes.c_uint64.from_buffer(shared)
    pid = os.fork()
    if pid == 0:  # the run's own process: a new session, so that its groups do not depend on the caller's
        try:
            os.setsid()
            os.sched_setaffinity(0, {cpu})
            peer = os.fork() if sessions else -1
            if peer == 0:
                if sessions == 2:
                    os.setsid()
                while done.value < items:
                    _LIBC.sched_yield()
                os._exit(0)
            time.sleep(0.05)
            t0 = time.perf_counter()
            for i in range(items):
                _work_item()
                done.value = i + 1
            elapsed = time.perf_counter() - t0
            if peer > 0:
                os.waitpid(peer, 0)
            done.value = int(elapsed / items * 1e9)  # ns per item, handed back through the mapping
            os._exit(0)
        except BaseException:  # noqa: BLE001 - the child must not return into the caller
            os._exit(1)
    os.waitpid(pid, 0)
    return done.value / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu", type=int, default=0)
    args = ap.parse_args()
    for label, sessions in (("alone", 0), ("peer in the same session", 1), ("peer in another session", 2)):
        times = [one_run(args.items, sessions, args.cpu) for _ in range(args.rounds)]
        print(f"{label:26s} " + " ".join(f"{t:5.2f}" for t in times) + "  µs per item")


if __name__ == "__main__":
    main()
