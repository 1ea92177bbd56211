"""Vector collectives whose blocks shrink to zero: a one-element call, then a zero-count call (issue 24).

mpi4py's testGatherv3 / testScatterv do this with fresh arrays each time, the root moving, in mpi4py's spec forms
(``[buf, count]`` at the root and None elsewhere, ``[buf, (count, displ), TYPE]``); a zero-count call that met the
earlier call's one-element message failed with "message of 1 bytes ... does not fit the 0-byte receive buffer".
"""

from __future__ import annotations

import numpy as np

from . import case

_DTYPES = (np.int8, np.int32, np.float64)
_MPI_NAMES = {"int8": "SIGNED_CHAR", "int32": "INT", "float64": "DOUBLE"}
_ROUNDS = 10  # each round passes every root and dtype through one, zero, one, zero, zero


def _blocking_and_not(comm, name):
    """(label, function) for the blocking call and its nonblocking form, waited at once."""
    call, icall = getattr(comm, name), getattr(comm, "I" + name[0].lower() + name[1:])
    return [(name, call), ("I" + name[0].lower() + name[1:], lambda *a: icall(*a).Wait())]


@case
def case_vector_one_then_zero(ctx):
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    for k in range(_ROUNDS):
        for dt in _DTYPES:
            mtype = getattr(MPI, _MPI_NAMES[np.dtype(dt).name], None)
            for root in range(n):
                for count in (1, 0, 1, 0, 0):
                    lab = f"round {k} dtype={np.dtype(dt).name} root={root} count={count}"
                    for name, gatherv in _blocking_and_not(comm, "Gatherv"):
                        sbuf = np.full(count, root, dt)
                        rbuf = np.full(count * n, -1, dt) if r == root else None
                        gatherv(sbuf, [rbuf, count] if r == root else None, root)
                        if r == root:
                            ctx.check(f"{name} {lab}", rbuf, np.full(count * n, root, dt))
                    for name, scatterv in _blocking_and_not(comm, "Scatterv"):
                        sbuf = np.full(n * n, root, dt)
                        rbuf = np.full(count, -1, dt)
                        spec = [sbuf, ([count] * n, list(range(0, n * n, n)))]
                        if mtype is not None:
                            spec.append(mtype)
                        scatterv(spec if r == root else None, rbuf, root)
                        ctx.check(f"{name} {lab}", rbuf, np.full(count, root, dt))
                    for name, alltoallv in _blocking_and_not(comm, "Alltoallv"):
                        sbuf = np.full(n * n, r, dt)
                        rbuf = np.full(n * n, -1, dt)
                        alltoallv([sbuf, (count, n)], [rbuf, (count, n)])
                        expected = np.full(n * n, -1, dt)
                        for q in range(n):
                            expected[q * n:q * n + count] = q
                        ctx.check(f"{name} {lab}", rbuf, expected)
