"""MAXLOC/MINLOC on value-index pairs, user-defined ops (commutative or not), derived datatypes in buffer specs and
object reductions with them, through every collective that reduces, checked against NumPy folds in rank order."""

from __future__ import annotations

import functools

import numpy as np

from . import Env, case, seed_of

# the C layout of {value; int}: what MPI.FLOAT_INT ... MPI.LONG_DOUBLE_INT describe in every MPI
PAIRS = {"FLOAT_INT": np.float32, "DOUBLE_INT": np.float64, "LONG_INT": np.int64, "INT_INT": np.intc,
         "SHORT_INT": np.int16, "LONG_DOUBLE_INT": np.longdouble}
COUNTS = (0, 1, 7, 33)
BIG = np.iinfo(np.intc).max


def pair_dtype(value) -> np.dtype:
    return np.dtype([("f0", value), ("f1", np.intc)], align=True)


def _chosen(ctx):
    if ctx.impl != "pycoll":
        return None
    from pycoll.algorithms import last_choice

    return last_choice.algorithm


# ---- references -----------------------------------------------------------------------------------------------

def loc_fold(maximum: bool):
    """MAXLOC/MINLOC of two pair arrays, NumPy only: the better value, the lower index on a tie."""
    def fold(a, b):
        better = (b["f0"] > a["f0"]) if maximum else (b["f0"] < a["f0"])
        take = better | ((b["f0"] == a["f0"]) & (b["f1"] < a["f1"]))
        out = a.copy()
        out["f0"] = np.where(take, b["f0"], a["f0"])
        out["f1"] = np.where(take, b["f1"], a["f1"])
        return out
    return fold


def affine_fold(a, b):
    """x -> f0 x + f1 maps composed, a's first: (a0 b0, f1 of a times b0 plus b1). Associative, not commutative."""
    out = a.copy()
    out["f0"] = a["f0"] * b["f0"]
    out["f1"] = (a["f1"] * b["f0"] + b["f1"]).astype(np.intc)
    return out


def matmul_fold(a, b):
    """Elementwise 2x2 integer matrix products, a on the left (int64 arrays of 4 per element)."""
    return np.einsum("nij,njk->nik", a.reshape(-1, 2, 2), b.reshape(-1, 2, 2)).reshape(-1)


# ---- the user functions (mpi4py's signature: invec, inoutvec, datatype) ----------------------------------------

def affine_op(invec, inoutvec, datatype):
    dt = pair_dtype(np.float64 if datatype.Get_size() == 12 else np.float32)  # DOUBLE_INT or FLOAT_INT
    a = np.frombuffer(invec, dt)
    b = np.frombuffer(inoutvec, dt)
    out = affine_fold(a, b)
    b["f0"], b["f1"] = out["f0"], out["f1"]  # fields only: MPI may give the last pair no padding bytes


def matmul_op(invec, inoutvec, datatype):
    a = np.frombuffer(invec, np.int64)
    b = np.frombuffer(inoutvec, np.int64)
    b[...] = matmul_fold(a, b)


def sum_op(invec, inoutvec, datatype):
    a = np.frombuffer(invec, np.float64)
    b = np.frombuffer(inoutvec, np.float64)
    b += a


def _named(prefix, name):
    """The method name of a collective's form: Allreduce, or its nonblocking Iallreduce."""
    return prefix + (name[0].lower() + name[1:] if prefix else name)


def _same(ctx, label, got, want):
    if got.dtype.names:
        for f in got.dtype.names:
            ctx.check(f"{label} [{f}]", got[f], want[f])
    else:
        ctx.check(label, got, want)


# ---- one reduction through every collective ---------------------------------------------------------------------

def run_all(ctx, label, xs, op, fold, mtype=None, per=1, nonblocking=True, roots=None):
    """Every reducing collective on rank inputs ``xs`` (one array per rank, ``per`` array elements per datatype
    element), in place and out of place, checked against ``fold`` applied left to right in rank order."""
    comm, MPI, r, p = ctx.comm, ctx.MPI, ctx.rank, ctx.size
    mine = xs[r]
    n = mine.shape[0] // per

    def spec(buf, count=None):
        if mtype is None:
            return buf
        return [buf, n if count is None else count, mtype]

    def sentinel(k):
        out = np.zeros(k * per, mine.dtype)
        if mine.dtype.names:
            out["f1"] = -7
        else:
            out[...] = 99
        return out

    whole = functools.reduce(fold, xs)
    forms = [("", False)] + ([("I", True)] if nonblocking else [])
    for prefix, nb in forms:
        def call(name, *args, **kw):
            fn = getattr(comm, _named(prefix, name))
            req = fn(*args, **kw)
            if nb:
                req.Wait()

        # Allreduce
        for inplace in (False, True):
            lab = f"{label} {prefix}Allreduce {'in place' if inplace else ''}"
            if inplace:
                buf = mine.copy()
                call("Allreduce", MPI.IN_PLACE, spec(buf), op)
            else:
                buf = sentinel(n)
                call("Allreduce", spec(mine), spec(buf), op)
            _same(ctx, lab, buf, whole)
        # Reduce at every root
        for root in (range(p) if roots is None else roots):
            for inplace in (False, True):
                lab = f"{label} {prefix}Reduce root={root} {'in place' if inplace else ''}"
                if r == root:
                    if inplace:
                        buf = mine.copy()
                        call("Reduce", MPI.IN_PLACE, spec(buf), op, root)
                    else:
                        buf = sentinel(n)
                        call("Reduce", spec(mine), spec(buf), op, root)
                    _same(ctx, lab, buf, whole)
                else:
                    call("Reduce", spec(mine), None, op, root)
        # Scan and Exscan
        for name, k in (("Scan", r + 1), ("Exscan", r)):
            for inplace in (False, True):
                lab = f"{label} {prefix}{name} {'in place' if inplace else ''}"
                buf = mine.copy() if inplace else sentinel(n)
                before = buf.copy()
                if inplace:
                    call(name, MPI.IN_PLACE, spec(buf), op)
                else:
                    call(name, spec(mine), spec(buf), op)
                if k:
                    _same(ctx, lab, buf, functools.reduce(fold, xs[:k]))
                elif ctx.impl == "pycoll":  # Exscan leaves rank 0's recvbuf alone
                    _same(ctx, lab + " (rank 0 untouched)", buf, before)
    # Reduce_scatter_block and Reduce_scatter: blocks of the whole vector (one input of p * m elements per rank)
    m = max(n // p, 0)
    if m * p * per:
        big = [x[: m * p * per] for x in xs]
        total = functools.reduce(fold, big)
        for prefix, nb in forms:
            for inplace in (False, True):
                lab = f"{label} {prefix}Reduce_scatter_block {'in place' if inplace else ''}"
                fn = getattr(comm, _named(prefix, "Reduce_scatter_block"))
                if inplace:
                    buf = big[r].copy()
                    req = fn(MPI.IN_PLACE, spec(buf, m), op)
                    got = buf[: m * per]
                else:
                    got = sentinel(m)
                    req = fn(spec(big[r], m), spec(got, m), op)  # sendbuf's count is per block, as recvbuf's
                if nb:
                    req.Wait()
                _same(ctx, lab, got, total[r * m * per:(r + 1) * m * per])
    counts = [(n + q) % 3 for q in range(p)]  # uneven, some empty
    tot = sum(counts)
    if tot and tot <= n:
        ins = [x[: tot * per] for x in xs]
        total = functools.reduce(fold, ins)
        off = sum(counts[:r])
        for inplace in (False, True):
            lab = f"{label} Reduce_scatter counts={counts} {'in place' if inplace else ''}"
            if inplace:
                buf = ins[r].copy()
                comm.Reduce_scatter(MPI.IN_PLACE, spec(buf, tot), counts, op)
                got = buf[: counts[r] * per]
            else:
                got = sentinel(counts[r])
                comm.Reduce_scatter(spec(ins[r], tot), spec(got, counts[r]), counts, op)
            _same(ctx, lab, got, total[off * per:(off + counts[r]) * per])
    # Reduce_local: this rank's input into the next rank's
    nxt = xs[(r + 1) % p].copy()
    red = getattr(comm, "Reduce_local", None) if ctx.impl == "pycoll" else None
    if red is not None:
        red(spec(mine), spec(nxt), op)
    else:
        op.Reduce_local(spec(mine), spec(nxt))
    _same(ctx, f"{label} Reduce_local", nxt, fold(mine, xs[(r + 1) % p]))


def _pairs_input(ctx, name, count, r, ties=True):
    value = PAIRS[name]
    rng = np.random.default_rng(seed_of(ctx.case_id, name, count, r))
    out = np.zeros(count, pair_dtype(value))
    out["f0"] = rng.integers(-2, 3 if ties else 1000, count).astype(value)  # few values: many ties
    out["f1"] = rng.integers(0, 4, count) * 10 + r  # the index: ties between ranks too
    return out


@case
def case_maxloc_minloc(ctx):
    """MAXLOC and MINLOC on every pair datatype, every reducing collective and its I-form, counts 0..33."""
    MPI = ctx.MPI
    for name in PAIRS:
        mtype = getattr(MPI, name)
        for opname, maximum in (("MAXLOC", True), ("MINLOC", False)):
            for count in COUNTS:
                xs = [_pairs_input(ctx, name, count, q) for q in range(ctx.size)]
                run_all(ctx, f"{opname} {name} n={count}", xs, getattr(MPI, opname), loc_fold(maximum), mtype,
                        nonblocking=count in (0, 7), roots=None if count == 7 else (0, ctx.size - 1))


_UNORDERED_OK = {  # what each collective's algorithms may be forced to with MAXLOC (one host)
    "allreduce": ("ring", "tree", "rabenseifner", "doubling", "oneshot", "cma", "staged"),
    "reduce_scatter": ("ring", "halving", "cma", "staged", "slots"),
    "reduce": ("chain", "tree", "slots"),
    "scan": ("linear", "doubling", "slots"),
    "exscan": ("linear", "doubling", "slots"),
}


@case
def case_maxloc_every_algorithm(ctx):
    """MAXLOC on DOUBLE_INT through every host algorithm of every reducing collective (PYCOLL_ALGO), in 64-byte
    chunks so the pipelines cut the pairs into many pieces; the compiled kernels must never run it."""
    if ctx.impl != "pycoll":
        ctx.skip("PYCOLL_ALGO is pycoll's")
    MPI = ctx.MPI
    for coll, names in _UNORDERED_OK.items():
        for algo in names:
            with Env(PYCOLL_ALGO=f"{coll}:{algo}", PYCOLL_CHUNK_SIZE="64", PYCOLL_ARENA_PIPE_CHUNK="64"):
                for count in (5, 40):
                    xs = [_pairs_input(ctx, "DOUBLE_INT", count, q) for q in range(ctx.size)]
                    fold = loc_fold(True)
                    whole, r = functools.reduce(fold, xs), ctx.rank
                    got = np.zeros_like(xs[r])
                    lab = f"{coll}:{algo} n={count}"
                    if coll == "allreduce":
                        ctx.comm.Allreduce([xs[r], MPI.DOUBLE_INT], [got, MPI.DOUBLE_INT], MPI.MAXLOC)
                        _same(ctx, lab, got, whole)
                    elif coll == "reduce":
                        ctx.comm.Reduce([xs[r], MPI.DOUBLE_INT], [got, MPI.DOUBLE_INT], MPI.MAXLOC, ctx.size - 1)
                        if r == ctx.size - 1:
                            _same(ctx, lab, got, whole)
                    elif coll == "reduce_scatter":
                        counts = [count // ctx.size + (q < count % ctx.size) for q in range(ctx.size)]
                        off = sum(counts[:r])
                        ctx.comm.Reduce_scatter([xs[r], MPI.DOUBLE_INT], [got, counts[r], MPI.DOUBLE_INT], counts,
                                                MPI.MAXLOC)
                        _same(ctx, lab, got[: counts[r]], whole[off:off + counts[r]])
                    else:
                        fn = ctx.comm.Scan if coll == "scan" else ctx.comm.Exscan
                        k = r + 1 if coll == "scan" else r
                        fn([xs[r], MPI.DOUBLE_INT], [got, MPI.DOUBLE_INT], MPI.MAXLOC)
                        if k:
                            _same(ctx, lab, got, functools.reduce(fold, xs[:k]))
                    if ctx.size > 1 and algo not in ("oneshot", "cma", "staged", "slots"):
                        ctx.check_equal(lab + " (algorithm)", _chosen(ctx), algo)


def _affine_pair(ctx):
    """DOUBLE_INT (padded) for pycoll; FLOAT_INT for MPICH, whose user-op buffers may end before the last pair's
    padding (it corrupts its heap with DOUBLE_INT)."""
    return "DOUBLE_INT" if ctx.impl == "pycoll" else "FLOAT_INT"


def _affine_inputs(ctx, count, r):
    rng = np.random.default_rng(seed_of(ctx.case_id, "affine", count, r))
    out = np.zeros(count, pair_dtype(PAIRS[_affine_pair(ctx)]))
    out["f0"] = rng.choice(np.array([-1.0, 1.0, 2.0]), count)
    out["f1"] = rng.integers(-3, 4, count)
    return out


def _matrix_inputs(ctx, count, r):
    rng = np.random.default_rng(seed_of(ctx.case_id, "matrix", count, r))
    return rng.integers(-1, 3, 4 * count).astype(np.int64)


@case
def case_user_ops(ctx):
    """Op.Create: a commutative sum, and two non-commutative ops (affine maps on value-index pairs, 2x2 matrix
    products on a contiguous datatype of 4 INT64_T): MPI's rank order in every reducing collective."""
    MPI = ctx.MPI
    plus = MPI.Op.Create(sum_op, commute=True)
    affine = MPI.Op.Create(affine_op, commute=False)
    matmul = MPI.Op.Create(matmul_op, commute=False)
    mat = MPI.INT64_T.Create_contiguous(4).Commit()
    try:
        ctx.check_equal("Is_commutative", (plus.Is_commutative(), affine.Is_commutative()), (True, False))
        for count in COUNTS:
            rng = [np.random.default_rng(seed_of(ctx.case_id, count, q)) for q in range(ctx.size)]
            xs = [g.integers(-9, 10, count).astype(np.float64) for g in rng]
            run_all(ctx, f"sum n={count}", xs, plus, np.add, MPI.DOUBLE, nonblocking=count == 7)
            xs = [_affine_inputs(ctx, count, q) for q in range(ctx.size)]
            run_all(ctx, f"affine n={count}", xs, affine, affine_fold, getattr(MPI, _affine_pair(ctx)),
                    nonblocking=count == 7)
            xs = [_matrix_inputs(ctx, count, q) for q in range(ctx.size)]
            run_all(ctx, f"matmul n={count}", xs, matmul, matmul_fold, mat, per=4, nonblocking=count == 7)
            if ctx.impl == "pycoll" and ctx.size > 1 and count:
                from pycoll.algorithms import ALGORITHMS, last_choice

                algo = ALGORITHMS[last_choice.collective][last_choice.algorithm]
                ctx.expect(algo.ordered, f"non-commutative op on {algo.key}", "chose an algorithm without rank order")
        # the call form: function(x, y, None), here on arrays it updates in place
        y = np.arange(4, dtype=np.int64)
        ctx.check_equal("op(x, y) returns the function's result", matmul(np.array([0, 1, 1, 0], np.int64), y), None)
        ctx.check("op(x, y) updates y", y, np.array([2, 3, 0, 1], np.int64))
    finally:
        mat.Free()
        for op in (plus, affine, matmul):
            op.Free()


@case
def case_user_ops_forced(ctx):
    """A non-commutative op with an algorithm forced that does not keep rank order (ring, tree, ...): selection
    falls back to one that does; the ordered algorithms forced in small chunks; the slots fold."""
    if ctx.impl != "pycoll":
        ctx.skip("PYCOLL_ALGO is pycoll's")
    MPI = ctx.MPI
    affine = MPI.Op.Create(affine_op, commute=False)
    try:
        forced = ("allreduce:ring,reduce:tree,reduce_scatter:halving,scan:linear,exscan:doubling",
                  "allreduce:ordered,reduce:ordered,reduce_scatter:ordered",
                  "allreduce:tree,reduce:slots,reduce_scatter:slots,scan:slots,exscan:slots")
        for algos in forced:
            with Env(PYCOLL_ALGO=algos, PYCOLL_CHUNK_SIZE="64"):
                for count in (3, 50):
                    xs = [_affine_inputs(ctx, count, q) for q in range(ctx.size)]
                    run_all(ctx, f"[{algos}] n={count}", xs, affine, affine_fold, MPI.DOUBLE_INT, nonblocking=False,
                            roots=(0, ctx.size - 1))
                    if ctx.size > 1:
                        from pycoll.algorithms import ALGORITHMS, last_choice

                        algo = ALGORITHMS[last_choice.collective][last_choice.algorithm]
                        ctx.expect(algo.ordered, f"[{algos}] chose {algo.key}", "an algorithm without rank order")
    finally:
        affine.Free()


@case
def case_derived_datatypes(ctx):
    """Derived datatypes in buffer specs: Bcast of an indexed block (mpi4py's test), reductions over vectors,
    subarrays, resized and contiguous types, in place and nonblocking (packed, then written back)."""
    MPI, comm, r, p = ctx.MPI, ctx.comm, ctx.rank, ctx.size
    for root in range(p):
        for first in (0, 1):
            buf = np.arange(10, dtype=np.int32) if r == root else np.full(10, -1, np.int32)
            t = MPI.INT.Create_indexed_block(1, list(range(first, 10, 2))).Commit()
            comm.Bcast((buf, 1, t), root=root)
            t.Free()
            want = np.where(np.arange(10) % 2 == first, np.arange(10), -1).astype(np.int32)
            ctx.check(f"Bcast indexed_block root={root} first={first}", buf, want if r != root else np.arange(10, dtype=np.int32))
    vec = MPI.DOUBLE.Create_vector(4, 2, 3).Commit()  # elements 0,1, 3,4, 6,7, 9,10
    sub = MPI.DOUBLE.Create_subarray([4, 5], [2, 3], [1, 1]).Commit()
    res = MPI.DOUBLE.Create_resized(0, 16).Commit()  # every other double
    con = MPI.DOUBLE.Create_contiguous(3).Commit()
    reductions = (("vector", vec, [0, 1, 3, 4, 6, 7, 9, 10], 11), ("subarray", sub, [6, 7, 8, 11, 12, 13], 20),
                  ("resized", res, [0], 2), ("contiguous", con, [0, 1, 2], 3))
    if ctx.impl != "pycoll":  # MPICH refuses predefined ops on derived datatypes ("not defined for this datatype")
        reductions = ()
    for label, t, per_elem, total in reductions:
        for count in (1, 2):
            idx = np.concatenate([np.array(per_elem) + j * (t.extent // 8) for j in range(count)])
            size = max(total, (count - 1) * (t.extent // 8) + total)
            xs = [np.arange(size, dtype=np.float64) * (q + 1) for q in range(p)]
            want_sel = sum(x[idx] for x in xs)
            for inplace in (False, True):
                for nb in (False, True):
                    lab = f"Allreduce {label} count={count} {'in place ' if inplace else ''}{'I' if nb else ''}"
                    out = xs[r].copy() if inplace else np.full(size, -5.0)
                    args = (MPI.IN_PLACE, [out, count, t]) if inplace else ([xs[r], count, t], [out, count, t])
                    if nb:
                        comm.Iallreduce(*args, op=MPI.SUM).Wait()
                    else:
                        comm.Allreduce(*args, op=MPI.SUM)
                    ctx.check(lab, out[idx], want_sel)
                    untouched = np.setdiff1d(np.arange(size), idx)
                    ctx.check(lab + " (gaps untouched)", out[untouched], (xs[r] if inplace else np.full(size, -5.0))[untouched])
    if ctx.impl == "pycoll":  # Reduce_scatter_block over a contiguous type: flattened counts
        xs = [np.arange(3 * p * 2, dtype=np.float64) + q for q in range(p)]
        got = np.zeros(6)
        comm.Reduce_scatter_block([xs[r], 2, con], [got, 2, con], MPI.SUM)
        ctx.check("Reduce_scatter_block contiguous(3)", got, sum(xs)[r * 6:(r + 1) * 6])
    # Allgather of a vector type into a plain buffer: the packed elements land in rank order
    src = np.arange(11, dtype=np.float64) + 100 * r
    gathered = np.zeros(8 * p)
    comm.Allgather([src, 1, vec], [gathered, 8, MPI.DOUBLE])
    want = np.concatenate([(np.arange(11.0) + 100 * q)[[0, 1, 3, 4, 6, 7, 9, 10]] for q in range(p)])
    ctx.check("Allgather vector -> DOUBLE", gathered, want)
    for t in (vec, sub, res, con):
        t.Free()


@case
def case_objects(ctx):
    """Lowercase reductions of objects: MAXLOC/MINLOC on (value, index) tuples, REPLACE, NO_OP, user-defined ops
    (commutative or not) in rank order, as mpi4py's test_cco_obj."""
    MPI, comm, r, p = ctx.MPI, ctx.comm, ctx.rank, ctx.size
    ctx.check_equal("allreduce MAXLOC", comm.allreduce((r % 2, r), MPI.MAXLOC), (1 if p > 1 else 0, 1 if p > 1 else 0))
    ctx.check_equal("allreduce MINLOC", comm.allreduce((r % 2, p - r), MPI.MINLOC), (0, p - 2 * ((p - 1) // 2)))
    ctx.check_equal("scan MINLOC", comm.scan((r, r), MPI.MINLOC), (0, 0))
    ctx.check_equal("scan MAXLOC", comm.scan((r, r), MPI.MAXLOC), (r, r))
    ctx.check_equal("exscan MAXLOC", comm.exscan((r, r), MPI.MAXLOC), (r - 1, r - 1) if r else None)
    ctx.check_equal("allreduce REPLACE", comm.allreduce(r, MPI.REPLACE), p - 1)
    ctx.check_equal("allreduce NO_OP", comm.allreduce(r, MPI.NO_OP), 0)
    for root in range(p):
        got = comm.reduce(r, MPI.REPLACE, root)
        ctx.check_equal(f"reduce REPLACE root={root}", got, p - 1 if r == root else None)
    concat = MPI.Op.Create(lambda x, y, dt: x + y, commute=False)  # lists: concatenation in rank order
    try:
        ctx.check_equal("allreduce concat", comm.allreduce([r], concat), list(range(p)))
        ctx.check_equal("scan concat", comm.scan([r], concat), list(range(r + 1)))
        ctx.check_equal("exscan concat", comm.exscan([r], concat), list(range(r)) if r else None)
        ctx.check_equal("reduce concat", comm.reduce([r], concat, root=p - 1), list(range(p)) if r == p - 1 else None)
    finally:
        concat.Free()
