"""Cases about where ranks live: host placement as pycoll sees it, and which algorithm each collective chose."""

from __future__ import annotations

import os

import numpy as np

from . import case


@case
def placement(ctx):
    """Record this rank's host index and the transport to every peer (pycoll only)."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll internals")
    from pycoll import runtime

    rt = runtime.current()
    ctx.record("host_of", list(ctx.comm._layout.host_of))
    ctx.record("transports", [rt.transport_of[r] for r in range(ctx.size)])


@case
def chosen_algorithms(ctx):
    """Run a 1 MiB allreduce, reduce-scatter and allgather; record the algorithm each one used."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll internals")
    from pycoll.algorithms import last_choice

    p, comm = ctx.size, ctx.comm
    n = (1 << 18) // p * p
    data = np.arange(n, dtype=np.float32) + ctx.rank
    out = np.empty(n, np.float32)
    comm.Allreduce(data, out)
    ctx.check("allreduce 1 MiB", out, p * np.arange(n, dtype=np.float32) + p * (p - 1) / 2, rtol=1e-6)
    ctx.record("allreduce", last_choice.algorithm)
    block = np.empty(n // p, np.float32)
    comm.Reduce_scatter_block(data, block)
    lo = ctx.rank * (n // p)
    ctx.check("reduce_scatter 1 MiB", block, p * np.arange(lo, lo + n // p, dtype=np.float32) + p * (p - 1) / 2, rtol=1e-6)
    ctx.record("reduce_scatter", last_choice.algorithm)
    gathered = np.empty(n, np.float32)
    comm.Allgather(data[: n // p], gathered)
    want = np.concatenate([np.arange(n // p, dtype=np.float32) + r for r in range(p)])
    ctx.check("allgather 1 MiB", gathered, want)
    ctx.record("allgather", last_choice.algorithm)


@case
def composed_repeats(ctx):
    """Composed Barrier, Bcast and Reduce from every root, Allreduce in and out of place and Reduce_scatter_block,
    each plan called three times with fresh arrays and buffer specs: from its second call a plan runs from its
    closure, where a host's other ranks call their host's communicator straight away (``HostComposition._part``);
    every result is checked, and whether the plans made closures is recorded."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll internals")
    comm, p, me, MPI = ctx.comm.Dup(), ctx.size, ctx.rank, ctx.MPI  # its plans are this case's alone
    for repeat in range(3):
        comm.Barrier()
        for root in range(p):
            buf = np.arange(7, dtype=np.int32) * (root + 2) if me == root else np.full(7, -1, np.int32)
            comm.Bcast([buf, MPI.INT], root=root)
            ctx.check(f"bcast from {root}, call {repeat}", buf, np.arange(7, dtype=np.int32) * (root + 2))
            out = np.full(5, -1.0)
            comm.Reduce([np.arange(5.0) * (me + 1), MPI.DOUBLE], [out, MPI.DOUBLE] if me == root else None,
                        op=MPI.SUM, root=root)
            want = np.arange(5.0) * p * (p + 1) / 2 if me == root else np.full(5, -1.0)
            ctx.check(f"reduce to {root}, call {repeat}", out, want)
        out = np.full(3, -1.0)
        comm.Allreduce([np.full(3, me + 1.0), MPI.DOUBLE], [out, MPI.DOUBLE], op=MPI.MAX)
        ctx.check(f"allreduce, call {repeat}", out, np.full(3, float(p)))
        inout = np.full(4, me + 1, np.int64)
        comm.Allreduce(MPI.IN_PLACE, [inout, MPI.INT64_T])
        ctx.check(f"allreduce in place, call {repeat}", inout, np.full(4, p * (p + 1) // 2, np.int64))
        block = np.full(3, -1.0)
        comm.Reduce_scatter_block([np.arange(3.0 * p) * (me + 1), MPI.DOUBLE], [block, MPI.DOUBLE], op=MPI.SUM)
        ctx.check(f"reduce_scatter_block, call {repeat}", block, np.arange(3.0 * me, 3.0 * me + 3) * p * (p + 1) / 2)
    closures = {label: all(plan.fast for (name, _), plan in comm._x.plans.items() if name == label)
                for label in ("Barrier", "Bcast", "Reduce", "Allreduce")}
    ctx.record("closures", closures)
    composed = comm._x.composed
    ctx.record("leader", composed is not None and composed.leader)
    # composed only where every host holds as many ranks, numbered host by host
    ctx.record("even", composed is not None and composed.even)
    ctx.record("reduce_scatter_block closure",
               all(plan.fast for (name, _), plan in comm._x.plans.items() if name == "Reduce_scatter_block"))
    comm.Free()


@case
def host_composition(ctx):
    """Small Allreduce and Barrier on a communicator across hosts: run on a host and a leaders' communicator
    (pycoll.composed) when some host holds several ranks; record whether they were made and their sizes."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll internals")
    comm, p = ctx.comm, ctx.size
    for count in (1, 7, 1000):
        data = np.arange(count, dtype=np.float64) * (ctx.rank + 1)
        out = np.full(count, -1.0)
        comm.Allreduce(data, out)
        ctx.check(f"allreduce {count}", out, np.arange(count, dtype=np.float64) * (p * (p + 1) / 2))
    comm.Barrier()
    from pycoll.algorithms import last_choice

    buf = np.arange(5.0) * 3 if ctx.rank == p - 1 else np.zeros(5)
    comm.Bcast(buf, p - 1)
    ctx.check("bcast from the last rank", buf, np.arange(5.0) * 3)
    ctx.record("bcast by", last_choice.algorithm)
    out = np.full(5, -1.0)
    comm.Reduce(np.arange(5.0) + ctx.rank, out, root=p - 1)
    ctx.check("reduce to the last rank", out, np.arange(5.0) * p + p * (p - 1) / 2 if ctx.rank == p - 1 else np.full(5, -1.0))
    ctx.record("reduce by", last_choice.algorithm)
    gathered = np.empty(2 * p)
    comm.Allgather(np.array([ctx.rank, -ctx.rank], dtype=np.float64), gathered)
    ctx.check("allgather", gathered, np.array([[r, -r] for r in range(p)], dtype=np.float64).ravel())
    ctx.record("allgather by", last_choice.algorithm)
    blocks = np.array([100 * ctx.rank + d for d in range(p)], dtype=np.int64)
    swapped = np.full(p, -1, np.int64)
    comm.Alltoall(blocks, swapped)
    ctx.check("alltoall", swapped, np.array([100 * s + ctx.rank for s in range(p)], dtype=np.int64))
    ctx.record("alltoall by", last_choice.algorithm)
    # repeated with fresh arrays and buffer specs: the plan runs the composition from its closure (``Plan.fast``),
    # which steps aside, alike on every rank, once the environment says otherwise between calls
    MPI, want = ctx.MPI, np.arange(6.0) * p + p * (p - 1) / 2
    runs = []
    for env in ({}, {}, {}, {"PYCOLL_SMP_BYTES": "0"}, {"PYCOLL_ALGO": "allreduce:ring"}, {}, {}):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            out = np.full(6, -1.0)
            comm.Allreduce([np.arange(6.0) + ctx.rank, MPI.DOUBLE], [out, MPI.DOUBLE])
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        ctx.check(f"allreduce, call {len(runs)} of the plan", out, want)
        runs.append(last_choice.algorithm == "composed")
    ctx.record("repeated composed", runs)
    ctx.record("plan closure", any(plan.fast for (label, _), plan in comm._x.plans.items() if label == "Allreduce"))
    big = np.ones((128 << 10) // 8)
    comm.Allreduce(big, big.copy())  # above PYCOLL_SMP_BYTES: the flat path
    composed = comm._x.composed
    made = composed is not None and composed.host_comm is not None
    ctx.record("made", made)
    if made:
        ctx.record("host_size", composed.host_comm.Get_size())
        ctx.record("leaders", composed.leaders.Get_size() if composed.leaders is not None else 0)
    sub = comm.Split(0, ctx.rank)  # a child communicator composes on its own, and Free releases its parts
    sub.Allreduce(np.ones(3), np.empty(3))
    parts = sub._x.composed
    sub.Free()
    ctx.record("child_freed", parts is None or parts.host_comm is None)


@case
def paired_calls(ctx):
    """Two ranks on different hosts: each small collective repeated with fresh arrays and buffer specs goes
    straight through the socket (``pycoll.paired``) once its shape is known, matches NumPy, and still meets a
    peer whose same call waits through the engine (a receive it had posted keeps it off the direct path)."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll internals")
    comm, me, peer = ctx.comm, ctx.rank, 1 - ctx.rank
    if ctx.size != 2:
        ctx.skip("two ranks")
    MPI = ctx.MPI
    engine = comm._engine
    calls = {
        "Allreduce": lambda k, v: (comm.Allreduce([v, MPI.DOUBLE], [out := np.empty(k), MPI.DOUBLE]), out)[1],
        "Allreduce in place": lambda k, v: (comm.Allreduce(MPI.IN_PLACE, [w := v.copy(), MPI.DOUBLE]), w)[1],
        "Bcast": lambda k, v: (comm.Bcast([w := (v.copy() if me == 0 else np.full(k, -1.0)), MPI.DOUBLE], root=0), w)[1],
        "Reduce": lambda k, v: (comm.Reduce([v, MPI.DOUBLE], [out := np.full(k, -1.0), MPI.DOUBLE], op=MPI.MAX, root=1),
                                out)[1],
        "Allgather": lambda k, v: (comm.Allgather([v, MPI.DOUBLE], [out := np.empty(2 * k), MPI.DOUBLE]), out)[1],
        "Alltoall": lambda k, v: (comm.Alltoall([np.concatenate([v, v + 100]), MPI.DOUBLE],
                                                [out := np.empty(2 * k), MPI.DOUBLE]), out)[1],
        "Reduce_scatter_block": lambda k, v: (comm.Reduce_scatter_block([np.concatenate([v, -v]), MPI.DOUBLE],
                                                                        [out := np.empty(k), MPI.DOUBLE]), out)[1],
    }
    mine = lambda r, k: np.arange(k, dtype=np.float64) * (r + 2) + r  # noqa: E731
    want = {
        "Allreduce": lambda k: mine(0, k) + mine(1, k),
        "Allreduce in place": lambda k: mine(0, k) + mine(1, k),
        "Bcast": lambda k: mine(0, k),
        "Reduce": lambda k: np.maximum(mine(0, k), mine(1, k)) if me == 1 else np.full(k, -1.0),
        "Allgather": lambda k: np.concatenate([mine(0, k), mine(1, k)]),
        "Alltoall": lambda k: np.concatenate([mine(0, k) + 100 * me, mine(1, k) + 100 * me]),
        "Reduce_scatter_block": lambda k: (mine(0, k) + mine(1, k)) * (1 if me == 0 else -1),
    }
    sends = engine.tcp_eager_sends
    for name, call in calls.items():
        for k in (1, 5, 300, 5000):  # 5000 doubles: above the 16 KiB a frame is copied for, sent by sendmsg
            for i in range(4):
                got = call(k, mine(me, k))
                ctx.check(f"{name} {k} #{i}", got, want[name](k))
        plan_fast = [p.fast for (label, _), p in comm._x.plans.items() if label == name.split()[0]]
        ctx.record(f"fast {name}", any(callable(f) for f in plan_fast))
    for i in range(3):
        comm.Barrier()
    ctx.record("socket sends", engine.tcp_eager_sends - sends)
    # one rank with a receive posted (another tag) takes the engine's path for its half; the other goes direct
    k = 7
    pending = comm.Irecv(np.empty(1), source=peer, tag=77) if me == 1 else None
    got = calls["Allreduce"](k, mine(me, k))
    ctx.check("Allreduce beside a posted receive", got, want["Allreduce"](k))
    if me == 0:
        comm.Send(np.zeros(1), dest=peer, tag=77)
    else:
        pending.Wait()
    comm.Barrier()
    # whole buffers past the socket's staging area whose blocks fit in it: still straight through, one frame each way;
    # blocks past it but within the algorithms' chunk: one exchange in C straight into place (its count recorded);
    # blocks past the chunk: the schedule, which cuts them
    from pycoll.algorithms.base import CHUNK_SIZE
    from pycoll.config import environ

    room, chunk = engine.frame_room(comm._world[peer]), CHUNK_SIZE.get()
    exchanged, copied = engine.block_exchanges, engine.copies_in_exchanges
    for name in ("Allgather", "Alltoall", "Reduce_scatter_block"):
        for k, kind in ((room // 8 * 3 // 4, "fitting"), (room // 8 + 64, "larger"), (chunk // 8 + 64, "chunk-sized")):
            spanned = comm._x.span_calls
            for i in range(3):
                ctx.check(f"{name} {k} #{i}", calls[name](k, mine(me, k)), want[name](k))
            # its own plan's fast path, or its size span's (the same form, made for another length of the call)
            fast = [p.fast for (label, _), p in comm._x.plans.items()
                    if label == name and p.template.counts and p.template.counts[0] == k]
            ctx.record(f"fast {name} of {kind} blocks", any(callable(f) for f in fast)
                       or comm._x.span_calls - spanned == 3)
    ctx.record("block exchanges", engine.block_exchanges - exchanged)
    ctx.record("own blocks copied in exchanges", engine.copies_in_exchanges - copied)  # the Allgather's, out of place
    # a Bcast past the chunk: the two-rank chain sends it whole (one hop, nothing to pipeline), so it stays direct
    k, before = chunk // 8 * 2 + 3, engine.frames_exchanged
    for i in range(3):
        ctx.check(f"Bcast {k} #{i}", calls["Bcast"](k, mine(me, k)), want["Bcast"](k))
    ctx.record("Bcast past the chunk: frames exchanged in C", engine.frames_exchanged - before)
    comm.Barrier()
    # in place past the chunk: the Reduce_scatter_block's sums kept apart from the inputs still to send
    k = chunk // 8 + 64

    def rsb_in_place(k: int, v: np.ndarray) -> np.ndarray:
        buf = np.concatenate([v, -v])
        comm.Reduce_scatter_block(MPI.IN_PLACE, [buf, MPI.DOUBLE])
        return buf[:k]

    def allgather_in_place(k: int, v: np.ndarray) -> np.ndarray:
        buf = np.full(2 * k, -1.0)
        buf[me * k:(me + 1) * k] = v
        comm.Allgather(MPI.IN_PLACE, [buf, MPI.DOUBLE])
        return buf

    for name, call in (("Reduce_scatter_block", rsb_in_place), ("Allgather", allgather_in_place)):
        for i in range(3):
            ctx.check(f"{name} in place {k} #{i}", call(k, mine(me, k)), want[name](k))
    # an Allreduce past the chunk, where the two-rank ring runs: its chunks both ways in one call into C each, in
    # the ring's order of frames (an odd count: blocks of unequal sizes, cut into equal numbers of chunks)
    k, known = chunk // 8 * 3 + 5, set(comm._x.plans)
    for name in ("Allreduce", "Allreduce in place"):
        for i in range(3):
            ctx.check(f"{name} {k} #{i}", calls[name](k, mine(me, k)), want[name](k))
    used = comm._x.ran.get("allreduce", ("", 0))[0]
    ctx.record("Allreduce past the chunk: algorithm", used)
    fast = [p.fast for key, p in comm._x.plans.items() if key[0] == "Allreduce" and key not in known]
    ctx.record("fast Allreduce past the chunk", len(fast) == 2 and all(callable(f) for f in fast))
    # beside a peer that runs the ring's schedule (a receive posted there), the frames still match
    pending = comm.Irecv(np.empty(1), source=peer, tag=78) if me == 1 else None
    ctx.check("Allreduce past the chunk beside a posted receive", calls["Allreduce"](k, mine(me, k)), want["Allreduce"](k))
    if me == 0:
        comm.Send(np.zeros(1), dest=peer, tag=78)
    else:
        pending.Wait()
    comm.Barrier()
    # a Reduce past the chunk: the two-rank chain's chunks one way through C, each folded at the root as it comes in;
    # beside a root that runs the chain's schedule (a receive posted there), and a sender that does, they still match
    known = set(comm._x.plans)
    for i in range(3):
        ctx.check(f"Reduce {k} #{i}", calls["Reduce"](k, mine(me, k)), want["Reduce"](k))
    fast = [p.fast for key, p in comm._x.plans.items() if key[0] == "Reduce" and key not in known]
    ctx.record("fast Reduce past the chunk", len(fast) == 1 and callable(fast[0]))
    for waits in (0, 1):
        pending = comm.Irecv(np.empty(1), source=peer, tag=79) if me == waits else None
        ctx.check(f"Reduce past the chunk beside a posted receive on rank {waits}", calls["Reduce"](k, mine(me, k)),
                  want["Reduce"](k))
        if me != waits:
            comm.Send(np.zeros(1), dest=peer, tag=79)
        else:
            pending.Wait()
    comm.Barrier()
    # the chunk changed under a shape whose direct form was made: that form steps aside and the call is cut at the
    # new chunk, as the peer's new plan of the same call (another form of buffer spec, so another shape) cuts it
    k = chunk // 8 // 2  # a block within the old chunk, four of the new
    for i in range(2):
        ctx.check(f"Allgather {k} under the old chunk #{i}", calls["Allgather"](k, mine(me, k)), want["Allgather"](k))
    with environ({"PYCOLL_CHUNK_SIZE": str(chunk // 8)}):
        v, out = mine(me, k), np.full(2 * k, -1.0)
        comm.Allgather([v, MPI.DOUBLE] if me == 0 else [v, k, MPI.DOUBLE], [out, MPI.DOUBLE])
        ctx.check(f"Allgather {k} under a new chunk, a new plan on one rank", out, want["Allgather"](k))
        comm.Barrier()


@case
def large_composed(ctx):
    """Reduce_scatter_block and Allgather above PYCOLL_SMP_BYTES on hosts of equal size, where the cost model composes
    them: a Reduce_scatter_block by rails (each host's run of blocks reduce-scattered in the host, then each rail's
    ranks across the hosts), an Allgather with the host's blocks gathered to all its ranks first. Ops x dtypes, odd
    block counts, in place and out of place, each plan three times with fresh arrays and buffer specs (from the
    second call, the plan's closure), a host's run of blocks within a host arena's slot and past it (in pieces, the
    last one shorter): every result matches NumPy and the input is left as it was; records the
    algorithm of each call and how many calls went by rails. Then Reduce above it, to each host's leader and to
    another rank, composed where the model prices it so: the same checks."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll internals")
    from pycoll.algorithms import last_choice

    from . import reduce_ref, tolerance

    comm, p, me, MPI = ctx.comm.Dup(), ctx.size, ctx.rank, ctx.MPI
    named = {"float32": MPI.FLOAT, "int64": MPI.INT64_T, "float64": MPI.DOUBLE, "complex64": MPI.C_FLOAT_COMPLEX,
             "int32": MPI.INT}
    chosen = []
    for op, dt, block in (("SUM", np.dtype(np.float32), 20011), ("MAX", np.dtype(np.int64), 16411),
                          ("PROD", np.dtype(np.float64), 16411), ("SUM", np.dtype(np.complex64), 9001),
                          ("BXOR", np.dtype(np.int32), 70001), ("SUM", np.dtype(np.float32), 150001)):
        if not ctx.supports(op, dt):
            continue
        for repeat in range(3):
            inputs = [ctx.data(dt, p * block, q, op=op) for q in range(p)]
            want = reduce_ref(op, inputs, dt)[me * block:(me + 1) * block]
            rtol, atol = tolerance(op, dt)
            lab = f"Reduce_scatter_block op={op} dtype={dt.name} block={block} call {repeat}"
            mine = inputs[me].copy()
            out = np.full(block, 7, dt)
            comm.Reduce_scatter_block([mine, named[dt.name]], [out, named[dt.name]], op=ctx.op(op))
            chosen.append(last_choice.algorithm)
            ctx.record(f"{dt.name} {block}", last_choice.algorithm)
            ctx.check(lab, out, want, rtol, atol)
            ctx.check(lab + " (sendbuf unchanged)", mine, inputs[me])
            if op == "SUM":
                inout = inputs[me].copy()
                comm.Reduce_scatter_block(MPI.IN_PLACE, inout, op=ctx.op(op))
                chosen.append(last_choice.algorithm)
                ctx.check(lab + " in place", inout[:block], want, rtol, atol)
    ctx.record("chosen", sorted(set(chosen)))
    composed = comm._x.composed
    scattered = composed.by_rails if composed is not None else 0
    ctx.record("by rails", scattered)
    ctx.record("in pieces", composed.rails_in_pieces if composed is not None else 0)
    # Allgather likewise: blocks of odd counts from fresh arrays, in and out of place
    gathered = []
    for dt, block in ((np.dtype(np.float32), 20011), (np.dtype(np.int64), 16411), (np.dtype(np.complex64), 9001)):
        for repeat in range(3):
            blocks = [ctx.data(dt, block, q, repeat) for q in range(p)]
            want = np.concatenate(blocks)
            lab = f"Allgather dtype={dt.name} block={block} call {repeat}"
            mine = blocks[me].copy()
            out = np.full(p * block, 7, dt)
            comm.Allgather([mine, named[dt.name]], [out, named[dt.name]])
            gathered.append(last_choice.algorithm)
            ctx.check(lab, out, want)
            ctx.check(lab + " (sendbuf unchanged)", mine, blocks[me])
            inout = np.full(p * block, 7, dt)
            inout[me * block:(me + 1) * block] = blocks[me]
            comm.Allgather(MPI.IN_PLACE, [inout, named[dt.name]])
            gathered.append(last_choice.algorithm)
            ctx.check(lab + " in place", inout, want)
    ctx.record("allgather chosen", sorted(set(gathered)))
    ctx.record("by rails after the allgathers", composed.by_rails if composed is not None else 0)
    # Reduce likewise, to each host's leader and to another rank (whose leader hands it the result), from odd counts
    reduced = []
    leaders = [g[0] for g in comm._layout.groups]
    for op, dt, count in (("SUM", np.dtype(np.float32), 20011), ("MAX", np.dtype(np.int64), 65543),
                          ("PROD", np.dtype(np.float64), 262147)):
        if not ctx.supports(op, dt):
            continue
        rtol, atol = tolerance(op, dt)
        inputs = [ctx.data(dt, count, q, op=op) for q in range(p)]
        want = reduce_ref(op, inputs, dt)
        for root in leaders + [1]:
            lab = f"Reduce op={op} dtype={dt.name} count={count} root={root}"
            mine = inputs[me].copy()
            out = np.full(count, 7, dt)
            comm.Reduce([mine, named[dt.name]], [out, named[dt.name]] if me == root else None, op=ctx.op(op), root=root)
            reduced.append(last_choice.algorithm)
            ctx.check(lab + " (sendbuf unchanged)", mine, inputs[me])
            if me == root:
                ctx.check(lab, out, want, rtol, atol)
                inout = inputs[me].copy()
                comm.Reduce(MPI.IN_PLACE, [inout, named[dt.name]], op=ctx.op(op), root=root)
                ctx.check(lab + " in place", inout, want, rtol, atol)
            else:
                comm.Reduce([mine, named[dt.name]], None, op=ctx.op(op), root=root)
            reduced.append(last_choice.algorithm)
    ctx.record("reduce chosen", sorted(set(reduced)))
    ctx.record("closure", {label: any(plan.fast for (name, _), plan in comm._x.plans.items() if name == label)
                           for label in ("Reduce_scatter_block", "Allgather")})
    comm.Free()


@case
def segmented_composed(ctx):
    """Allreduce, Bcast and Reduce above PYCOLL_SMP_BYTES between two hosts whose link the cost model knows to be slow
    (the job's PYCOLL_LINK_RATE): composed in segments, the leaders sending each segment as the host has it. Ops x
    dtypes, odd counts, in place and out of place, Bcast and Reduce from each host's leader and from another rank,
    each plan three times with fresh arrays and buffer specs: every result matches NumPy and the input is left as it
    was; records the algorithms chosen and how many calls ran in segments."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll internals")
    from pycoll.algorithms import last_choice

    from . import reduce_ref, tolerance

    comm, p, me, MPI = ctx.comm.Dup(), ctx.size, ctx.rank, ctx.MPI
    named = {"float32": MPI.FLOAT, "int64": MPI.INT64_T, "float64": MPI.DOUBLE, "complex64": MPI.C_FLOAT_COMPLEX,
             "int32": MPI.INT}
    chosen: dict[str, set] = {"Allreduce": set(), "Bcast": set(), "Reduce": set()}
    leaders = [g[0] for g in comm._layout.groups]  # each host's first rank; rank 1 is another rank of the first host
    # about 4 MiB each (odd counts): at 1 Gbit/s the model segments every one of these calls from a leader
    for op, dt, count in (("SUM", np.dtype(np.float32), 1000003), ("MAX", np.dtype(np.int64), 524309),
                          ("PROD", np.dtype(np.float64), 500009), ("SUM", np.dtype(np.complex64), 500029),
                          ("BXOR", np.dtype(np.int32), 1000033)):
        if not ctx.supports(op, dt):
            continue
        rtol, atol = tolerance(op, dt)
        for repeat in range(3):
            inputs = [ctx.data(dt, count, q, repeat, op=op) for q in range(p)]
            want = reduce_ref(op, inputs, dt)
            lab = f"op={op} dtype={dt.name} count={count} call {repeat}"
            mine, out = inputs[me].copy(), np.full(count, 7, dt)
            comm.Allreduce([mine, named[dt.name]], [out, named[dt.name]], op=ctx.op(op))
            chosen["Allreduce"].add(last_choice.algorithm)
            ctx.check("Allreduce " + lab, out, want, rtol, atol)
            ctx.check("Allreduce " + lab + " (sendbuf unchanged)", mine, inputs[me])
            inout = inputs[me].copy()
            comm.Allreduce(MPI.IN_PLACE, [inout, named[dt.name]], op=ctx.op(op))
            ctx.check("Allreduce " + lab + " in place", inout, want, rtol, atol)
            for root in leaders + [1]:
                out = np.full(count, 7, dt)
                comm.Reduce([mine, named[dt.name]], [out, named[dt.name]] if me == root else None, op=ctx.op(op),
                            root=root)
                chosen["Reduce"].add(last_choice.algorithm)
                ctx.check(f"Reduce root={root} " + lab + " (sendbuf unchanged)", mine, inputs[me])
                if me == root:
                    ctx.check(f"Reduce root={root} " + lab, out, want, rtol, atol)
                    inout = inputs[me].copy()
                    comm.Reduce(MPI.IN_PLACE, [inout, named[dt.name]], op=ctx.op(op), root=root)
                    ctx.check(f"Reduce root={root} " + lab + " in place", inout, want, rtol, atol)
                else:
                    comm.Reduce([mine, named[dt.name]], None, op=ctx.op(op), root=root)
        for root in leaders + [1]:
            for repeat in range(3):
                data = ctx.data(dt, count, root, repeat)
                buf = data.copy() if me == root else np.full(count, 7, dt)
                comm.Bcast([buf, named[dt.name]], root=root)
                chosen["Bcast"].add(last_choice.algorithm)
                ctx.check(f"Bcast root={root} dtype={dt.name} count={count} call {repeat}", buf, data)
    for name, algos in chosen.items():
        ctx.record(name + " chosen", sorted(algos))
    composed = comm._x.composed
    ctx.record("in segments", composed.in_segments if composed is not None else 0)
    ctx.record("closure", {label: any(plan.fast for (name, _), plan in comm._x.plans.items() if name == label)
                           for label in ("Allreduce", "Bcast", "Reduce")})
    comm.Free()
