"""How fast two processes on one host move one buffer between them, by who copies: the receiver alone pulling it by
cross-memory attach, the sender pushing part while the receiver pulls the rest, and two copies through shared memory.

Two forked processes, no pycoll communicator: each way is timed between two spin barriers on a shared page (the
barrier's own time is reported and included). Ways, per size:
- ``local copy``: one process copies its own buffer (``copy_at``, the compiled copy pycoll's kernels use);
- ``one pull``: rank 1 reads rank 0's buffer with process_vm_readv (pycoll's rendezvous and cma algorithms today);
- ``both pull``: each rank reads the other's buffer at once (a Sendrecv, a 2-rank Allgather);
- ``one push``, ``both push``: the same with the sender writing (process_vm_writev) instead;
- ``split 1/2``, ``split 1/3``: rank 0 writes that share of the buffer into rank 1's with process_vm_writev while
  rank 1 reads the rest;
- ``two copies``: rank 0 copies chunks into a shared ring while rank 1 copies them out (MPICH's default
  intranode path, CMA being off in its build);
- ``two copies, both ways``: the same in both directions at once.

    python perf/cross_copy_split.py --out perf/results/cross-copy-split
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import time
from pathlib import Path

import numpy as np
from numba import njit

from pycoll.transport.atomics import copy_at, cpu_relax, cross_copy, load_acquire, store_seq_cst

PAGE = 4096
SLOTS = 16
# words of the shared control page
_BAR, _PUT, _GOT, _ADDR, _PID, _DST = 0, 16, 32, 64, 72, 80


@njit(cache=False, nogil=True)
def _barrier(ctl, me, gen):
    store_seq_cst(ctl, _BAR + 8 * me, gen)
    while load_acquire(ctl, _BAR + 8 * (1 - me)) < gen:
        cpu_relax()


@njit(cache=False, nogil=True)
def _vm(fn, pid, local, remote, n, reading):
    return cross_copy(fn, pid, local, remote, n, reading)


@njit(cache=False, nogil=True)
def _local(dst, src, n):
    copy_at(dst, src, n)


@njit(cache=False, nogil=True)
def _ring(ctl, me, sent, received, src, dst, ring_out, ring_in, n, chunk, send, recv):
    """Chunks of ``src`` into this rank's ring (``send``) and the peer's chunks out of its ring into ``dst``
    (``recv``), interleaved; each direction's counters are monotonic, from ``sent`` and ``received`` chunks."""
    nch = (n + chunk - 1) // chunk
    put = nch if not send else 0
    got = nch if not recv else 0
    peer = 1 - me
    while put < nch or got < nch:
        moved = False
        if put < nch and sent + put - np.int64(load_acquire(ctl, _GOT + 8 * peer)) < SLOTS:
            m = min(chunk, n - put * chunk)
            copy_at(ring_out + ((sent + put) % SLOTS) * chunk, src + put * chunk, m)
            put += 1
            store_seq_cst(ctl, _PUT + 8 * me, sent + put)
            moved = True
        if got < nch and np.int64(load_acquire(ctl, _PUT + 8 * peer)) > received + got:
            m = min(chunk, n - got * chunk)
            copy_at(dst + got * chunk, ring_in + ((received + got) % SLOTS) * chunk, m)
            got += 1
            store_seq_cst(ctl, _GOT + 8 * me, received + got)
            moved = True
        if not moved:
            cpu_relax()


def _aligned(n: int, fill: int) -> np.ndarray:
    a = np.empty(n + PAGE, np.uint8)
    off = (-a.ctypes.data) % PAGE
    a = a[off:off + n]
    a[:] = fill
    return a


def _rank(me: int, shm: mmap.mmap, sizes: list[int], iters: int, chunk: int, out: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    readv = ctypes.cast(libc.process_vm_readv, ctypes.c_void_p).value
    writev = ctypes.cast(libc.process_vm_writev, ctypes.c_void_p).value
    ctl = np.frombuffer(shm, np.uint64, count=PAGE // 8)
    base = np.frombuffer(shm, np.uint8).ctypes.data
    ring_out = base + PAGE + me * SLOTS * chunk
    ring_in = base + PAGE + (1 - me) * SLOTS * chunk
    gen = [0]
    chunks_from = [0, 0]  # chunks each rank has sent through its ring

    def bar() -> None:
        gen[0] += 1
        _barrier(ctl, me, gen[0])

    results = []
    for n in sizes:
        src, dst = _aligned(n, me + 1), _aligned(n, 0)
        ctl[_ADDR + me], ctl[_PID + me], ctl[_DST + me] = src.ctypes.data, os.getpid(), dst.ctypes.data
        bar()
        peer_src, peer_pid, peer_dst = int(ctl[_ADDR + 1 - me]), int(ctl[_PID + 1 - me]), int(ctl[_DST + 1 - me])

        def split(frac: int):
            pushed = (n // frac) & ~(PAGE - 1)
            if me == 1:
                return lambda: _vm(readv, peer_pid, dst.ctypes.data, peer_src, n - pushed, True)
            return lambda: _vm(writev, peer_pid, src.ctypes.data + n - pushed, peer_dst + n - pushed, pushed, False)

        def ring(both: bool):
            send, recv = both or me == 0, both or me == 1

            def go():
                _ring(ctl, me, chunks_from[me], chunks_from[1 - me], src.ctypes.data, dst.ctypes.data, ring_out,
                      ring_in, n, chunk, send, recv)
                nch = (n + chunk - 1) // chunk
                chunks_from[0] += nch
                chunks_from[1] += nch if both else 0
            return go

        ways = {
            "barrier alone": lambda: None,
            "local copy": lambda: _local(dst.ctypes.data, src.ctypes.data, n),
            "one pull": (lambda: _vm(readv, peer_pid, dst.ctypes.data, peer_src, n, True)) if me else (lambda: None),
            "both pull": lambda: _vm(readv, peer_pid, dst.ctypes.data, peer_src, n, True),
            "one push": (lambda: _vm(writev, peer_pid, src.ctypes.data, peer_dst, n, False)) if me == 0 else (lambda: None),
            "both push": lambda: _vm(writev, peer_pid, src.ctypes.data, peer_dst, n, False),
            "split 1/2": split(2),
            "split 1/3": split(3),
            "two copies": ring(False),
            "two copies, both ways": ring(True),
        }
        for way, fn in ways.items():
            for _ in range(5):
                bar()
                fn()
            times = []
            for _ in range(iters):
                bar()
                t = time.perf_counter()
                fn()
                bar()
                times.append(time.perf_counter() - t)
            if way != "local copy" and way != "barrier alone":
                expect = 1 if me == 1 else 2  # what the peer's buffer holds
                if way in ("one pull", "one push", "split 1/2", "split 1/3", "two copies") and me == 0:
                    expect = None
                if expect is not None and not (dst[0] == expect and dst[-1] == expect):
                    raise SystemExit(f"{way} at {n} B: rank {me} holds {dst[0]}..{dst[-1]}, not {expect}")
            dst[:] = 0
            results.append({"bytes": n, "way": way, "rank": me, "median_us": float(np.median(times) * 1e6),
                            "p10_us": float(np.percentile(times, 10) * 1e6)})
    (out / f"rank{me}.json").write_text(json.dumps(results))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="65536,1048576,4194304", help="buffer sizes")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--chunk", type=int, default=64 << 10, help="ring chunk of the two-copy ways")
    ap.add_argument("--out", default=None, help="folder for cross-copy-split.md and .json")
    args = ap.parse_args()
    sizes = [int(x) for x in args.bytes.split(",")]
    tmp = Path(args.out or ".") / ".ranks"
    tmp.mkdir(parents=True, exist_ok=True)
    shm = mmap.mmap(-1, PAGE + 2 * SLOTS * args.chunk)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _rank(1, shm, sizes, args.iters, args.chunk, tmp)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    _rank(0, shm, sizes, args.iters, args.chunk, tmp)
    os.waitpid(pid, 0)
    rows = json.loads((tmp / "rank0.json").read_text()) + json.loads((tmp / "rank1.json").read_text())
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    # a way's time: the slower rank's median (both ranks time the same barrier-to-barrier span)
    table: dict = {}
    for r in rows:
        key = (r["bytes"], r["way"])
        table[key] = max(table.get(key, 0.0), r["median_us"])
    lines = ["# Who copies: one buffer between two processes\n",
             f"`python perf/cross_copy_split.py --bytes {args.bytes} --iters {args.iters}`, {started}, "
             f"{_cpu_model()}, {os.cpu_count()} CPUs\n",
             "| way | " + " | ".join(f"{n >> 10} KiB" for n in sizes) + " |",
             "|---|" + "---:|" * len(sizes)]
    for way in dict.fromkeys(r["way"] for r in rows):
        lines.append(f"| {way} | " + " | ".join(f"{table[(n, way)]:.1f}" for n in sizes) + " |")
    text = "\n".join(lines) + "\n\nMedian µs per transfer, barrier to barrier, the slower rank's.\n"
    print(text)
    if args.out:
        out = Path(args.out)
        (out / "cross-copy-split.md").write_text(text)
        (out / "cross-copy-split.json").write_text(json.dumps({"started": started, "argv": vars(args), "rows": rows},
                                                              indent=1))


if __name__ == "__main__":
    main()
