"""What the per-call mismatch check costs: Allreduce with the signature checks on and patched out, interleaved.

Every message header and every arena post carries the call's signature (collective, dtype, op, root, count,
sequence number as the tag); receivers compare it with their own. This script times Allreduce at 4 KiB and
16 MiB on 2 ranks with the comparisons as shipped and with them replaced by no-ops (header packing stays:
the header is needed for framing anyway), alternating call by call, and reports medians per variant.

    pycoll run -n 2 python perf/mismatch_cost.py --json perf/results/reliability/mismatch_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import timeit

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycoll import MPI  # noqa: E402
from pycoll.algorithms import shared  # noqa: E402
from pycoll.p2p import Engine  # noqa: E402
from pycoll.p2p_protocol import Sig  # noqa: E402

_REAL_CHECK, _REAL_POSTS = Engine._check, shared.check_posts


def _no_sig_check(self, req, src, sig, nbytes):
    """Engine._check without the signature comparison (the size check stays: it guards memory)."""
    saved, req.sig = req.sig, None
    try:
        return _REAL_CHECK(self, req, src, sig, nbytes)
    finally:
        req.sig = saved


def _set(checked: bool) -> None:
    Engine._check = _REAL_CHECK if checked else _no_sig_check
    shared.check_posts = _REAL_POSTS if checked else (lambda *a, **k: None)


def measure(comm, nbytes: int, iters: int, algo: str) -> dict:
    os.environ["PYCOLL_ALGO"] = algo
    send = np.ones(nbytes // 4, np.float32)
    recv = np.empty_like(send)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(iters + 10):
        checked = i % 2 == 0
        _set(checked)
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(send, recv)
        dt = time.perf_counter() - t0
        if i >= 10:
            times[checked].append(dt)
    _set(True)
    os.environ.pop("PYCOLL_ALGO", None)
    worst = {k: comm.allreduce(float(np.median(v)), op=MPI.MAX) for k, v in times.items()}
    return {"bytes": nbytes, "algo": algo or "default", "iters": iters,
            "checked_us": round(worst[True] * 1e6, 3), "unchecked_us": round(worst[False] * 1e6, 3),
            "cost_us": round((worst[True] - worst[False]) * 1e6, 3),
            "cost_pct": round(100 * (worst[True] - worst[False]) / worst[False], 2)}


def micro() -> dict:
    """The comparisons alone, in ns: one header's signature, one arena post's four words (Python)."""
    a, b = Sig(1, 2, 3, 0, 1024, 77), Sig(1, 2, 3, 0, 1024, 77)
    words_a, words_b = (1, 2, 3, 4), (1, 2, 3, 4)
    n = 200_000
    return {
        "header_compare_ns": round(timeit.timeit(lambda: a != b, number=n) / n * 1e9, 1),
        "post_compare_ns": round(timeit.timeit(lambda: words_a != words_b, number=n) / n * 1e9, 1),
        "empty_lambda_ns": round(timeit.timeit(lambda: None, number=n) / n * 1e9, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--small-iters", type=int, default=4000)
    ap.add_argument("--large-iters", type=int, default=60)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rows = []
    for nbytes, iters in ((4 << 10, args.small_iters), (16 << 20, args.large_iters)):
        # the default choice (arena paths), and the ring (stream messages, a header per chunk)
        for algo in ("", "allreduce:ring"):
            rows.append(measure(comm, nbytes, iters, algo))
    if comm.rank == 0:
        out = {"ranks": comm.size, "rows": rows, "micro": micro(),
               "command": "pycoll run -n 2 python perf/mismatch_cost.py --json perf/results/reliability/mismatch_cost.json"}
        print(json.dumps(out, indent=1))
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
