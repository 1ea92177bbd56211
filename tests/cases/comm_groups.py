"""Groups, Create / Create_group, Split_type, Compare, Cartesian topologies (Create_cart, Shift, Sub) and the
features pycoll refuses, with collectives on every new communicator checked against NumPy.

Expectations are computed here independently of pycoll (grids through NumPy's reshape, sets through Python's),
so the cases also run under mpi4py with MPICH (``--impl mpi4py``) to show they encode MPI's behaviour."""

from __future__ import annotations

import pickle

import numpy as np

from . import case, reduce_ref


def _world_ranks(ctx, group):
    """A group's processes as world ranks (through Translate_ranks, which both implementations have)."""
    world = ctx.comm.Get_group()
    out = ctx.MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
    world.Free()
    return list(out)


def _check_group(ctx, label, group, expected):
    """``group`` holds world ranks ``expected``, in order, and reports this rank's place in it."""
    MPI = ctx.MPI
    ctx.check_equal(f"{label}: members", _world_ranks(ctx, group), expected)
    ctx.check_equal(f"{label}: size", (group.Get_size(), group.size), (len(expected), len(expected)))
    rank = expected.index(ctx.rank) if ctx.rank in expected else MPI.UNDEFINED
    ctx.check_equal(f"{label}: rank", (group.Get_rank(), group.rank), (rank, rank))


def _allreduce_check(ctx, label, comm, world_members, salt):
    """Allreduce (SUM, float64) and allgather on ``comm``, whose ranks are the world ranks ``world_members``."""
    MPI = ctx.MPI
    ins = {q: ctx.data(np.float64, 33, q, salt) for q in world_members}
    out = np.zeros(33)
    comm.Allreduce(ins[ctx.rank], out, op=MPI.SUM)
    ctx.check(f"{label}: Allreduce", out, reduce_ref("SUM", [ins[q] for q in world_members], np.float64))
    ctx.check_equal(f"{label}: allgather gives the world ranks in rank order", comm.allgather(ctx.rank), world_members)
    ctx.check_equal(f"{label}: rank/size", (comm.Get_rank(), comm.Get_size()), (world_members.index(ctx.rank), len(world_members)))


# ---- groups ---------------------------------------------------------------------------------------
@case
def case_group_algebra(ctx):
    MPI = ctx.MPI
    n = ctx.size
    world = ctx.comm.Get_group()
    _check_group(ctx, "Get_group", world, list(range(n)))
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    reverse = list(range(n - 1, -1, -1))

    g_even = world.Incl(evens)
    _check_group(ctx, "Incl(evens)", g_even, evens)
    g_odd = world.Excl(evens)
    _check_group(ctx, "Excl(evens)", g_odd, odds)
    g_rev = world.Incl(reverse)
    _check_group(ctx, "Incl(reversed)", g_rev, reverse)
    g_range = world.Range_incl([(n - 1, 0, -2)])
    _check_group(ctx, "Range_incl((n-1, 0, -2))", g_range, list(range(n - 1, -1, -2)))
    g_rexcl = world.Range_excl([(0, n - 1, 2)])
    _check_group(ctx, "Range_excl((0, n-1, 2))", g_rexcl, odds)
    # set algebra keeps the first group's order, then appends
    _check_group(ctx, "Union(odd, even)", MPI.Group.Union(g_odd, g_even), odds + evens)
    _check_group(ctx, "Union(rev, even)", MPI.Group.Union(g_rev, g_even), reverse)
    _check_group(ctx, "Intersection(rev, even)", MPI.Group.Intersection(g_rev, g_even), [q for q in reverse if q % 2 == 0])
    _check_group(ctx, "Difference(rev, odd)", MPI.Group.Difference(g_rev, g_odd), [q for q in reverse if q % 2 == 0])
    _check_group(ctx, "Difference(world, world)", MPI.Group.Difference(world, world), [])
    _check_group(ctx, "Incl([]) (empty)", world.Incl([]), [])

    # Translate_ranks: positions in another group, UNDEFINED where absent, PROC_NULL kept
    got = MPI.Group.Translate_ranks(g_rev, list(range(n)), g_even)
    want = [evens.index(q) if q in evens else MPI.UNDEFINED for q in reverse]
    ctx.check_equal("Translate_ranks(rev -> even)", list(got), want)
    ctx.check_equal("Translate_ranks(PROC_NULL)", list(world.Translate_ranks([MPI.PROC_NULL], g_even)), [MPI.PROC_NULL])
    ctx.check_equal("Translate_ranks() defaults to every rank into the world group", list(g_rev.Translate_ranks()), reverse)

    # Compare: IDENT same order, SIMILAR same set, UNEQUAL otherwise
    ctx.check_equal("Compare(world, world.Dup())", world.Compare(world.Dup()), MPI.IDENT)
    ctx.check_equal("Compare(world, rev)", MPI.Group.Compare(world, g_rev), MPI.IDENT if n == 1 else MPI.SIMILAR)
    ctx.check_equal("Compare(Difference(world, odd), even)", MPI.Group.Compare(MPI.Group.Difference(world, g_odd), g_even), MPI.IDENT)
    ctx.check_equal("Compare(even, odd)", MPI.Group.Compare(g_even, g_odd), MPI.UNEQUAL)
    ctx.check_equal("Intersect is Intersection", MPI.Group.Compare(MPI.Group.Intersect(world, g_odd), g_odd), MPI.IDENT)

    # the predefined and freed groups
    ctx.check_equal("GROUP_EMPTY size/rank", (MPI.GROUP_EMPTY.Get_size(), MPI.GROUP_EMPTY.Get_rank()), (0, MPI.UNDEFINED))
    ctx.expect(MPI.Group() == MPI.GROUP_NULL and not MPI.GROUP_NULL, "Group() is GROUP_NULL", "Group() != GROUP_NULL or GROUP_NULL true")
    ctx.expect(MPI.Group(world) == world, "Group(g) == g", "a second reference to a group compares unequal")
    ctx.expect(pickle.loads(pickle.dumps(MPI.GROUP_EMPTY)) is MPI.GROUP_EMPTY, "pickle GROUP_EMPTY", "not the same object")
    g_odd.Free()
    ctx.expect(g_odd == MPI.GROUP_NULL, "freed group", "a freed group is not GROUP_NULL")
    for g in (world, g_even, g_rev, g_range, g_rexcl):
        g.Free()


@case
def case_group_errors(ctx):
    """Bad group arguments raise ValueError-derived errors (pycoll: InvalidArgumentError) on the calling rank."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll's error classes")
    from pycoll.errors import InvalidArgumentError

    n = ctx.size
    world = ctx.comm.Get_group()
    ctx.raises("Incl with a rank twice", InvalidArgumentError, world.Incl, [0, 0])
    ctx.raises("Incl past the group", InvalidArgumentError, world.Incl, [n])
    ctx.raises("Excl of a negative rank", InvalidArgumentError, world.Excl, [-1])
    ctx.raises("Range_incl with stride 0", InvalidArgumentError, world.Range_incl, [(0, 0, 0)])
    ctx.raises("Range_incl running backwards", InvalidArgumentError, world.Range_incl, [(n - 1, 0, 1)] if n > 1 else [(0, -1, 1)])
    ctx.raises("Translate_ranks past the group", InvalidArgumentError, world.Translate_ranks, [n], world)
    ctx.raises("Union with a non-group", InvalidArgumentError, ctx.MPI.Group.Union, world, ctx.comm)
    err = ctx.raises("pickling a live group", ValueError, pickle.dumps, world)
    world.Free()
    ctx.raises("Get_size on a freed group", InvalidArgumentError, world.Get_size)
    if err is not None:
        ctx.expect("group" in str(err), "pickling a live group", "the message does not say why", got=str(err))


@case
def case_collective_argument_errors(ctx):
    """A rank's bad argument to a collective constructor makes every rank raise (that rank InvalidArgumentError,
    the others RemoteError naming it); ranks that disagree all raise MismatchError; the parent stays usable."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll's error classes")
    from pycoll.errors import InvalidArgumentError, MismatchError, RemoteError

    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    culprit = n - 1
    want = InvalidArgumentError if r == culprit else RemoteError
    err = ctx.raises("Split_type with a bad type on one rank", want, comm.Split_type, 77 if r == culprit else MPI.COMM_TYPE_SHARED)
    if err is not None:
        ctx.expect(err.op == "Split_type" and "split_type 77" in str(err) and (r == culprit or culprit in err.peers),
                   "Split_type error", "does not name the call, the cause and the rank", got=str(err))
    ctx.raises("Split with a negative color on one rank", want, comm.Split, -3 if r == culprit else 0)
    if n > 1:
        err = ctx.raises("Create_cart with different dims", MismatchError, comm.Create_cart, [n] if r else [1])
        if err is not None:
            ctx.expect(err.op == "Create_cart", "Create_cart mismatch", "does not name the call", got=str(err))
        cart = comm.Create_cart([1, n])
        ctx.raises("Sub with different remain_dims", MismatchError, cart.Sub, [r == 0, True])
        cart.Free()
        world = comm.Get_group()
        order = list(range(n)) if r == 0 else list(range(n - 1, -1, -1))
        ctx.raises("Create with groups that disagree", MismatchError, comm.Create, world.Incl(order))
        world.Free()
    ctx.check_equal("the parent still works", comm.allreduce(1, op=MPI.SUM), n)


# ---- communicators from groups --------------------------------------------------------------------
@case
def case_create(ctx):
    """Comm.Create (collective over the parent): a subset, a reordered whole, and disjoint groups."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    world = comm.Get_group()
    evens = list(range(0, n, 2))
    sub = comm.Create(world.Incl(evens))
    if r in evens:
        _allreduce_check(ctx, "Create(evens)", sub, evens, "even")
        ctx.check_equal("Compare(world, Create(evens))", comm.Compare(sub), MPI.CONGRUENT if n == 1 else MPI.UNEQUAL)
        sub.Free()
    else:
        ctx.expect(sub == MPI.COMM_NULL, "Create(evens) outside the group", "did not give COMM_NULL", got=repr(sub))
    reverse = list(range(n - 1, -1, -1))
    rev = comm.Create(world.Incl(reverse))
    _allreduce_check(ctx, "Create(reversed)", rev, reverse, "rev")
    ctx.check_equal("Compare(world, Create(reversed))", comm.Compare(rev), MPI.CONGRUENT if n == 1 else MPI.SIMILAR)
    whole = comm.Create(world)
    ctx.check_equal("Compare(world, Create(world group))", MPI.Comm.Compare(comm, whole), MPI.CONGRUENT)
    # disjoint groups (MPI-2.2): each rank passes the group it belongs to
    mine = [q for q in range(n) if q % 2 == r % 2]
    part = comm.Create(world.Incl(mine))
    _allreduce_check(ctx, "Create(own parity group)", part, mine, "parity")
    for c in (rev, whole, part):
        c.Free()
    world.Free()
    comm.Barrier()


@case
def case_create_group(ctx):
    """Create_group is collective over the group only: the other ranks do not call it."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    world = comm.Get_group()
    high = list(range(n // 2, n))  # the upper half (everyone on one rank)
    if r in high:
        # two communicators over the same group, told apart by tag, used interleaved
        a = comm.Create_group(world.Incl(high), tag=1)
        b = comm.Create_group(world.Incl(high[::-1]), tag=2)
        _allreduce_check(ctx, "Create_group(upper half)", a, high, "a")
        _allreduce_check(ctx, "Create_group(upper half reversed)", b, high[::-1], "b")
        buf = np.arange(5, dtype=np.int32) * (high[-1] + 1) if r == high[-1] else np.zeros(5, np.int32)
        a.Bcast(buf, root=len(high) - 1)
        ctx.check("Bcast on Create_group", buf, np.arange(5, dtype=np.int32) * (high[-1] + 1))
        a.Free()
        b.Free()
    elif n > 1:
        # the lower half meanwhile builds its own, from the same parent
        low = list(range(n // 2))
        c = comm.Create_group(world.Incl(low))
        _allreduce_check(ctx, "Create_group(lower half)", c, low, "c")
        c.Free()
    outside = comm.Create_group(world.Incl([0])) if r != 0 else None
    if outside is not None:
        ctx.expect(outside == MPI.COMM_NULL, "Create_group outside the group", "did not give COMM_NULL", got=repr(outside))
    world.Free()
    comm.Barrier()


@case
def case_split_type_shared(ctx):
    """Split_type(COMM_TYPE_SHARED): one host here, so every rank, ordered by key; UNDEFINED opts out."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    _allreduce_check(ctx, "Split_type(SHARED)", node, list(range(n)), "node")
    node.Free()
    rnode = comm.Split_type(MPI.COMM_TYPE_SHARED, key=-r)
    _allreduce_check(ctx, "Split_type(SHARED, key=-rank)", rnode, list(range(n - 1, -1, -1)), "rnode")
    rnode.Free()
    for root in range(n):
        c = comm.Split_type(MPI.COMM_TYPE_SHARED if r == root else MPI.UNDEFINED)
        if r == root:
            ctx.check_equal(f"Split_type only at rank {root}: size/rank", (c.Get_size(), c.Get_rank()), (1, 0))
            c.Free()
        else:
            ctx.expect(c == MPI.COMM_NULL, f"Split_type(UNDEFINED), root {root}", "did not give COMM_NULL", got=repr(c))
    self_node = MPI.COMM_SELF.Split_type(MPI.COMM_TYPE_SHARED)
    ctx.check_equal("COMM_SELF.Split_type", (self_node.Get_size(), self_node.Get_rank()), (1, 0))
    self_node.Free()


@case
def case_compare(ctx):
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    dup = comm.Dup()
    rev = comm.Split(0, key=-r)
    par = comm.Split(r % 2, key=r)
    ctx.check_equal("Compare(comm, comm)", comm.Compare(comm), MPI.IDENT)
    ctx.check_equal("Compare(comm, Dup)", MPI.Comm.Compare(comm, dup), MPI.CONGRUENT)
    ctx.check_equal("Compare(comm, reversed Split)", comm.Compare(rev), MPI.CONGRUENT if n == 1 else MPI.SIMILAR)
    ctx.check_equal("Compare(comm, parity Split)", comm.Compare(par), MPI.CONGRUENT if n == 1 else MPI.UNEQUAL)
    alone = len(range(r % 2, n, 2)) == 1
    ctx.check_equal("Compare(COMM_SELF, parity Split)", MPI.COMM_SELF.Compare(par), MPI.CONGRUENT if alone else MPI.UNEQUAL)
    ctx.check_equal("Get_topology of a plain communicator", comm.Get_topology(), MPI.UNDEFINED)
    # mpi4py's object model: another reference to a communicator is equal; a freed one equals COMM_NULL
    ctx.expect(MPI.Intracomm(dup) == dup, "Intracomm(dup) == dup", "a second reference compares unequal")
    ctx.expect(MPI.Comm() == MPI.COMM_NULL, "Comm() == COMM_NULL", "Comm() is not a null communicator")
    for c in (dup, rev, par):
        c.Free()
    ctx.expect(dup == MPI.COMM_NULL and MPI.COMM_NULL == dup, "freed communicator == COMM_NULL", "it compares unequal")
    ctx.expect(pickle.loads(pickle.dumps(comm)) is comm, "pickle COMM_WORLD", "does not come back as COMM_WORLD")


# ---- Cartesian topologies -------------------------------------------------------------------------
def _grid(dims):
    """The rank at every coordinate: NumPy's C-order reshape of 0..N-1, as MPI's row-major numbering."""
    return np.arange(int(np.prod(dims, dtype=np.int64)), dtype=np.int64).reshape(dims)


def _neighbor(grid, coords, axis, disp, periodic, proc_null):
    c = list(coords)
    c[axis] += disp
    if periodic:
        c[axis] %= grid.shape[axis]
    elif not 0 <= c[axis] < grid.shape[axis]:
        return proc_null
    return int(grid[tuple(c)])


def _check_cart(ctx, label, cart, dims, periods, base_members):
    """Everything about ``cart`` (ranks base_members[0..], laid out on dims): topology queries, shifts, a halo
    exchange through Shift and Sendrecv, an Allreduce, and every one-dimension-dropped Sub."""
    MPI = ctx.MPI
    grid = _grid(dims)
    me = cart.Get_rank()
    mine = [int(x) for x in np.argwhere(grid == me)[0]] if dims else []
    flags = [1 if p else 0 for p in periods]
    ctx.check_equal(f"{label}: Get_topology", (cart.Get_topology(), cart.topology, cart.is_topo), (MPI.CART, MPI.CART, True))
    ctx.check_equal(f"{label}: Get_dim/dim/ndim", (cart.Get_dim(), cart.dim, cart.ndim), (len(dims),) * 3)
    dims_got, periods_got, coords_got = cart.Get_topo()
    ctx.check_equal(f"{label}: Get_topo", (list(dims_got), [int(bool(p)) for p in periods_got], list(coords_got)), (list(dims), flags, mine))
    ctx.check_equal(f"{label}: dims/periods/coords properties",
                    (cart.dims, [int(bool(p)) for p in cart.periods], cart.coords), (list(dims), flags, mine))
    for q in range(cart.Get_size()):
        want = [int(x) for x in np.argwhere(grid == q)[0]] if dims else []
        ctx.check_equal(f"{label}: Get_coords({q})", list(cart.Get_coords(q)), want)
        ctx.check_equal(f"{label}: Get_cart_rank({want})", cart.Get_cart_rank(want), q)
    edges = []
    for axis in range(len(dims)):
        for disp in (1, -1, 2):
            want = (_neighbor(grid, mine, axis, -disp, flags[axis], MPI.PROC_NULL),
                    _neighbor(grid, mine, axis, disp, flags[axis], MPI.PROC_NULL))
            ctx.check_equal(f"{label}: Shift({axis}, {disp})", tuple(cart.Shift(axis, disp)), want)
        edges += [_neighbor(grid, mine, axis, -1, flags[axis], MPI.PROC_NULL), _neighbor(grid, mine, axis, 1, flags[axis], MPI.PROC_NULL)]
    ctx.check_equal(f"{label}: inoutedges", [list(e) for e in cart.inoutedges], [edges, edges])
    # a halo exchange: send my value forward along each axis, receive the one from behind (PROC_NULL leaves it)
    for axis in range(len(dims)):
        source, dest = cart.Shift(axis, 1)
        got = np.full(4, -1.0)
        cart.Sendrecv(np.full(4, float(me)), dest=dest, sendtag=axis, recvbuf=got, source=source, recvtag=axis)
        behind = _neighbor(grid, mine, axis, -1, flags[axis], None)
        ctx.check(f"{label}: halo along axis {axis}", got, np.full(4, -1.0 if behind is None else float(behind)))
    _allreduce_check(ctx, f"{label}: on the grid", cart, base_members, "cart")
    if len(dims) < 2:
        return
    for axis in range(len(dims)):
        keep = [i != axis for i in range(len(dims))]
        sub = cart.Sub(keep)
        kept = [d for i, d in enumerate(dims) if i != axis]
        ctx.check_equal(f"{label}: Sub({keep}).dims", sub.dims, kept)
        line = np.take(grid, mine[axis], axis=axis)  # the grid ranks sharing my coordinate on the dropped axis
        members = [base_members[int(q)] for q in line.reshape(-1)]
        _allreduce_check(ctx, f"{label}: Sub({keep})", sub, members, f"sub{axis}")
        ctx.check_equal(f"{label}: Sub({keep}).coords", sub.coords, [c for i, c in enumerate(mine) if i != axis])
        sub.Free()


@case
def case_cart_2d(ctx):
    comm, MPI = ctx.comm, ctx.MPI
    n = ctx.size
    dims = MPI.Compute_dims(n, 2)
    ctx.check_equal("Compute_dims(n, 2) multiplies to n, largest first", (int(np.prod(dims)), sorted(dims, reverse=True)), (n, dims))
    for periods in ([True, False], [False, True], None):
        cart = comm.Create_cart(dims, periods=periods)
        ctx.expect(isinstance(cart, MPI.Cartcomm) and isinstance(cart, MPI.Intracomm), "Create_cart type", "not a Cartcomm and Intracomm",
                   got=type(cart).__name__)
        _check_cart(ctx, f"cart {dims} periods {periods}", cart, dims, periods or [False, False], list(range(n)))
        dup = cart.Dup()
        ctx.check_equal(f"Dup of cart {dims} keeps the topology", (type(dup).__name__, dup.Get_topo()), ("Cartcomm", cart.Get_topo()))
        dup.Free()
        cart.Free()


@case
def case_cart_dims(ctx):
    """1 to 4 dimensions, all periodic (so every neighbor exists), as mpi4py's own topology test builds them."""
    comm, MPI = ctx.comm, ctx.MPI
    n = ctx.size
    for ndim in (1, 3, 4):
        dims = MPI.Compute_dims(n, [0] * ndim)
        cart = comm.Create_cart(dims, periods=True)
        _check_cart(ctx, f"cart {dims} periodic", cart, dims, [True] * ndim, list(range(n)))
        cart.Free()
    # a 0-dimensional grid has one process; Sub keeping nothing gives one-process grids
    zero = comm.Create_cart([])
    if ctx.rank == 0:
        ctx.check_equal("Create_cart([]) at rank 0", (zero.Get_size(), zero.Get_dim(), zero.Get_cart_rank([])), (1, 0, 0))
        zero.Free()
    else:
        ctx.expect(zero == MPI.COMM_NULL, "Create_cart([]) beyond rank 0", "did not give COMM_NULL", got=repr(zero))
    cart = comm.Create_cart([n])
    point = cart.Sub([False])
    ctx.check_equal("Sub([False])", (point.Get_size(), point.Get_dim(), point.dims), (1, 0, []))
    point.Free()
    cart.Free()


@case
def case_cart_subset(ctx):
    """A grid smaller than the communicator: the ranks past it get COMM_NULL; reorder keeps rank order (Cart_map)."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    m = max(1, n - 1)
    dims = MPI.Compute_dims(m, 2)
    ctx.check_equal(f"Cart_map({dims})", comm.Cart_map(dims), r if r < m else MPI.UNDEFINED)
    cart = comm.Create_cart(dims, periods=[False, True], reorder=True)
    if r < m:
        ctx.check_equal("reordered rank equals Cart_map", cart.Get_rank(), comm.Cart_map(dims, [False, True]))
        _check_cart(ctx, f"cart {dims} of {n}", cart, dims, [False, True], list(range(m)))
        cart.Free()
    else:
        ctx.expect(cart == MPI.COMM_NULL, "Create_cart past the grid", "did not give COMM_NULL", got=repr(cart))
    comm.Barrier()


@case
def case_compute_dims(ctx):
    """The MPI standard's MPI_Dims_create examples, and fixed entries kept."""
    MPI = ctx.MPI
    ctx.check_equal("Compute_dims(6, [0, 0])", MPI.Compute_dims(6, [0, 0]), [3, 2])
    ctx.check_equal("Compute_dims(7, [0, 0])", MPI.Compute_dims(7, [0, 0]), [7, 1])
    ctx.check_equal("Compute_dims(6, [0, 3, 0])", MPI.Compute_dims(6, [0, 3, 0]), [2, 3, 1])
    ctx.check_equal("Compute_dims(16, 3)", MPI.Compute_dims(16, 3), [4, 2, 2])
    ctx.check_equal("Compute_dims(24, [0, 0, 2])", MPI.Compute_dims(24, [0, 0, 2]), [4, 3, 2])
    ctx.check_equal("Compute_dims(1, [])", MPI.Compute_dims(1, []), [])
    ctx.raises("Compute_dims(7, [0, 3, 0])", (ValueError, MPI.Exception), MPI.Compute_dims, 7, [0, 3, 0])


@case
def case_cart_errors(ctx):
    """Bad Create_cart arguments raise on every rank alike (no rank is left waiting)."""
    comm, MPI = ctx.comm, ctx.MPI
    n = ctx.size
    ctx.raises("Create_cart periods too short", ValueError, comm.Create_cart, [n], [])
    ctx.raises("Create_cart periods too long", ValueError, comm.Create_cart, [n], [0, 0])
    ctx.raises("Create_cart larger than the communicator", (ValueError, MPI.Exception), comm.Create_cart, [n + 1])
    cart = comm.Create_cart([n], periods=[False])
    ctx.raises("Get_cart_rank past a non-periodic edge", (ValueError, MPI.Exception), cart.Get_cart_rank, [n])
    ctx.raises("Sub with the wrong length", ValueError, cart.Sub, [True, True])
    if ctx.impl == "pycoll":  # MPICH answers a bad direction with PROC_NULL; pycoll refuses it
        from pycoll.errors import InvalidArgumentError

        ctx.raises("Shift along a missing dimension", InvalidArgumentError, cart.Shift, 1, 1)
    cart.Free()
    comm.Barrier()


# ---- neighborhood collectives and graph topologies -------------------------------------------------
def _pair_blocks(me, ins, outs_of):
    """For each incoming slot i (from rank ins[i]), the sender's outgoing slot that lands there: the k-th
    message from s pairs with s's k-th outgoing slot naming this rank (MPI's message order)."""
    pairs = []
    for i, s in enumerate(ins):
        k = ins[:i].count(s)
        pairs.append([j for j, t in enumerate(outs_of(s)) if t == me][k])
    return pairs


def _neighbor_exchanges(ctx, label, topo, ins, outs, sender_slot, count=3):
    """Neighbor_allgather(v), Neighbor_alltoall(v, w), their nonblocking forms and the object forms on ``topo``,
    checked against blocks computed here: ``sender_slot[i]`` is the sender's outgoing slot that lands in incoming
    slot i."""
    MPI = ctx.MPI
    me = topo.Get_rank()
    ctx.check_equal(f"{label}: in/out edges", (list(topo.inedges), list(topo.outedges)), (ins, outs))
    ctx.check_equal(f"{label}: degrees", (topo.indegree, topo.outdegree), (len(ins), len(outs)))

    def block(src, slot):  # what rank src sends from its outgoing slot (slot -1: the allgather block)
        return np.arange(count, dtype=np.float64) + 1000 * src + 10 * (slot + 1)

    untouched = -7.0
    got = np.full(count * len(ins), untouched)
    topo.Neighbor_allgather(block(me, -1), got)
    want = np.concatenate([block(s, -1) if s != MPI.PROC_NULL else np.full(count, untouched) for s in ins] or [np.zeros(0)])
    ctx.check(f"{label}: Neighbor_allgather", got, want)

    send = np.concatenate([block(me, j) for j in range(len(outs))] or [np.zeros(0)])
    got = np.full(count * len(ins), untouched)
    topo.Neighbor_alltoall(send, got)
    want = np.concatenate([block(s, j) if s != MPI.PROC_NULL else np.full(count, untouched)
                           for s, j in zip(ins, sender_slot)] or [np.zeros(0)])
    ctx.check(f"{label}: Neighbor_alltoall", got, want)

    # the nonblocking forms, both started before either is waited for; null requests after
    got_gathered, got_swapped = np.full(count * len(ins), untouched), np.full(count * len(ins), untouched)
    requests = [topo.Ineighbor_allgather(block(me, -1), got_gathered), topo.Ineighbor_alltoall(send, got_swapped)]
    status = MPI.Status()
    requests[1].Wait(status)
    MPI.Request.Waitall(requests)
    ctx.check(f"{label}: Ineighbor_allgather", got_gathered,
              np.concatenate([block(s, -1) if s != MPI.PROC_NULL else np.full(count, untouched) for s in ins]
                             or [np.zeros(0)]))
    ctx.check(f"{label}: Ineighbor_alltoall", got_swapped, want)
    ctx.expect(all(r == MPI.REQUEST_NULL for r in requests), f"{label}: Ineighbor requests", "not null once waited")
    if ctx.impl == "pycoll":  # (MPI leaves a collective's status undefined)
        ctx.check_equal(f"{label}: Ineighbor_alltoall status", (status.Get_source(), status.Get_tag()),
                        (MPI.ANY_SOURCE, MPI.ANY_TAG))

    # Neighbor_alltoallw: a datatype and a byte displacement each; then into a strided datatype, nonblocking (each
    # block's elements land at every other place of a region twice as long, the places between left as they were)
    nin, nout = len(ins), len(outs)
    wsend = [send, [count] * nout, [j * count * 8 for j in range(nout)], [MPI.DOUBLE] * nout]
    got = np.full(count * nin, untouched)
    topo.Neighbor_alltoallw(wsend, [got, [count] * nin, [i * count * 8 for i in range(nin)], [MPI.DOUBLE] * nin])
    ctx.check(f"{label}: Neighbor_alltoallw", got, want)
    strided = MPI.DOUBLE.Create_vector(count, 1, 2).Commit()
    spread = np.full(2 * count * nin, untouched)
    topo.Ineighbor_alltoallw(wsend, [spread, [1] * nin, [i * 2 * count * 8 for i in range(nin)], [strided] * nin]).Wait()
    strided.Free()
    ctx.check(f"{label}: Ineighbor_alltoallw through a strided datatype", spread[::2], want)
    ctx.check(f"{label}: Ineighbor_alltoallw leaves the gaps", spread[1::2], np.full(count * nin, untouched))

    # v forms: slot i of this rank's recvbuf holds i+1 elements, at reversed positions
    rcounts = [i + 1 for i in range(len(ins))]
    rdispls = list(np.cumsum([0] + rcounts[::-1])[:-1][::-1]) if ins else []
    got = np.full(sum(rcounts), untouched)
    mine = np.arange(4, dtype=np.float64) + 100 * me
    if all(c == rcounts[0] for c in rcounts) or not ins:
        topo.Neighbor_allgatherv(mine[: rcounts[0]] if ins else mine[:1], [got, rcounts, [int(d) for d in rdispls]])
        want = np.full(sum(rcounts), untouched)
        for i, s in enumerate(ins):
            if s != MPI.PROC_NULL:
                want[rdispls[i]:rdispls[i] + rcounts[i]] = (np.arange(4, dtype=np.float64) + 100 * s)[: rcounts[i]]
        ctx.check(f"{label}: Neighbor_allgatherv", got, want)
    objs = topo.neighbor_allgather({"from": me})
    ctx.check_equal(f"{label}: neighbor_allgather", objs, [{"from": s} if s != MPI.PROC_NULL else None for s in ins])
    objs = topo.neighbor_alltoall([(me, j) for j in range(len(outs))])
    ctx.check_equal(f"{label}: neighbor_alltoall", objs,
                    [(s, j) if s != MPI.PROC_NULL else None for s, j in zip(ins, sender_slot)])


@case
def case_cart_neighbors(ctx):
    """Neighborhood collectives on Cartesian grids, periodic and not (PROC_NULL slots left as they are), including
    periodic dimensions of one or two ranks, where both neighbors are the same rank."""
    comm, MPI = ctx.comm, ctx.MPI
    n = ctx.size
    for dims, periods in (([n], [True]), ([n], [False]), (MPI.Compute_dims(n, 2), [True, False]), ([1, n], [True, True])):
        cart = comm.Create_cart(dims, periods=periods)
        grid = _grid(dims)
        me = cart.Get_rank()
        mine = [int(x) for x in np.argwhere(grid == me)[0]]
        edges = []
        for axis in range(len(dims)):
            edges += [_neighbor(grid, mine, axis, d, periods[axis], MPI.PROC_NULL) for d in (-1, 1)]
        # slot 2d (from one step back) is filled by that rank's forward slot 2d+1, and the other way round
        _neighbor_exchanges(ctx, f"cart {dims} periods {periods}", cart, edges, edges, [i ^ 1 for i in range(len(edges))])
        cart.Free()


@case
def case_graph(ctx):
    """Create_graph of a ring (as mpi4py's test builds it), queries, Graph_map, and neighborhood collectives."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    index, edges = [0], []
    for i in range(n):
        index.append(index[-1] + 2)
        edges += [(i - 1) % n, (i + 1) % n]
    for form in (index, index[1:]):  # with and without the leading 0
        graph = comm.Create_graph(form, edges)
        ctx.check_equal("Create_graph: topology", (graph.Get_topology(), graph.is_topo), (MPI.GRAPH, True))
        ctx.check_equal("Create_graph: dims/topo", (tuple(graph.dims), graph.index, graph.edges), ((n, 2 * n), index[1:], edges))
        for q in range(n):
            ctx.check_equal(f"Get_neighbors({q})", graph.Get_neighbors(q), [(q - 1) % n, (q + 1) % n])
        ctx.check_equal("Graph_map", comm.Graph_map(form, edges), r)
        graph.Free()
    graph = comm.Create_graph(index, edges)
    nbrs = [(r - 1) % n, (r + 1) % n]
    _neighbor_exchanges(ctx, "ring graph", graph, nbrs, nbrs, _pair_blocks(r, nbrs, lambda q: [(q - 1) % n, (q + 1) % n]))
    _allreduce_check(ctx, "ring graph", graph, list(range(n)), "graph")
    dup = graph.Dup()
    ctx.check_equal("Dup keeps the graph", (type(dup).__name__, dup.Get_topo()), ("Graphcomm", graph.Get_topo()))
    dup.Free()
    graph.Free()
    # a graph on fewer nodes than ranks: the rest get COMM_NULL
    small = comm.Create_graph([1], [0])
    if r == 0:
        ctx.check_equal("one-node graph", (small.Get_size(), small.neighbors), (1, [0]))
        small.Free()
    else:
        ctx.expect(small == MPI.COMM_NULL, "one-node graph beyond rank 0", "did not give COMM_NULL", got=repr(small))


@case
def case_dist_graph(ctx):
    """Create_dist_graph_adjacent (weighted and not) and Create_dist_graph, with neighborhood collectives."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    srcs_of = lambda q: [(q - 1) % n, (q - 2) % n]  # noqa: E731
    dsts_of = lambda q: [(q + 1) % n, (q + 2) % n]  # noqa: E731
    graph = comm.Create_dist_graph_adjacent(srcs_of(r), dsts_of(r))
    ctx.check_equal("adjacent: topology", graph.Get_topology(), MPI.DIST_GRAPH)
    ctx.check_equal("adjacent: counts", graph.Get_dist_neighbors_count(), (2, 2, False))
    ctx.check_equal("adjacent: neighbors", graph.Get_dist_neighbors(), (srcs_of(r), dsts_of(r), None))
    _neighbor_exchanges(ctx, "adjacent dist graph", graph, srcs_of(r), dsts_of(r), _pair_blocks(r, srcs_of(r), dsts_of))
    graph.Free()
    graph = comm.Create_dist_graph_adjacent(srcs_of(r), dsts_of(r), [1, 2], [3, 4])
    ctx.check_equal("adjacent weighted", (graph.Get_dist_neighbors_count(), graph.Get_dist_neighbors()),
                    ((2, 2, True), (srcs_of(r), dsts_of(r), ([1, 2], [3, 4]))))
    graph.Free()
    graph = comm.Create_dist_graph_adjacent([], [], MPI.WEIGHTS_EMPTY, MPI.WEIGHTS_EMPTY)
    ctx.check_equal("adjacent, no neighbors, WEIGHTS_EMPTY", graph.Get_dist_neighbors(), ([], [], ([], [])))
    graph.Free()
    ctx.raises("WEIGHTS_EMPTY with neighbors", ValueError, comm.Create_dist_graph_adjacent, [0], [0], MPI.WEIGHTS_EMPTY, MPI.WEIGHTS_EMPTY)
    # every rank contributes the edges from itself to r+1 and r+3; the order of neighbors is the library's
    dests = [(r + 1) % n, (r + 3) % n]
    graph = comm.Create_dist_graph([r], [2], dests, [5, 6])
    sources, destinations, weights = graph.Get_dist_neighbors()
    want_in = sorted(q for q in range(n) for d in ((q + 1) % n, (q + 3) % n) if d == r)
    ctx.check_equal("Create_dist_graph: sources (as a multiset)", sorted(sources), want_in)
    ctx.check_equal("Create_dist_graph: destinations (as a multiset)", sorted(destinations), sorted(dests))
    ctx.check_equal("Create_dist_graph: weighted", graph.Get_dist_neighbors_count()[2], True)
    got = np.full(2 * len(sources), -1.0)
    graph.Neighbor_allgather(np.array([r, r + 0.5]), got)
    ctx.check("Create_dist_graph: Neighbor_allgather", got, np.array([x for s in sources for x in (s, s + 0.5)], dtype=np.float64))
    graph.Free()


# ---- what pycoll does not provide -----------------------------------------------------------------
@case
def case_not_provided(ctx):
    """Intercommunicators, windows, files and dynamic processes raise
    NotImplementedError (also an MPI.Exception) with a message saying pycoll does not provide them."""
    if ctx.impl != "pycoll":
        ctx.skip("MPICH provides these")
    comm, MPI = ctx.comm, ctx.MPI
    calls = {
        "Create_intercomm": lambda: comm.Create_intercomm(0, comm, 0),
        "Intercomm.Create_from_groups": lambda: MPI.Intercomm.Create_from_groups(comm.Get_group(), 0, comm.Get_group(), 0),
        "Win.Create": lambda: MPI.Win.Create(None, 1, None, MPI.COMM_SELF),
        "Win.Allocate": lambda: MPI.Win.Allocate(8, 1, None, comm),
        "File.Open": lambda: MPI.File.Open(comm, "/tmp/x"),
        "Spawn": lambda: comm.Spawn("python"),
        "Get_parent": lambda: MPI.Comm.Get_parent(),
        "Open_port": lambda: MPI.Open_port(),
    }
    for name, call in calls.items():
        err = ctx.raises(name, NotImplementedError, call)
        if err is not None:
            ctx.expect("pycoll does not provide" in str(err) and isinstance(err, MPI.Exception), name,
                       "the error does not say pycoll does not provide it, or is not an MPI.Exception", got=repr(err))
    ctx.raises("Intercomm(intracomm)", TypeError, MPI.Intercomm, comm)
    ctx.expect(MPI.Intercomm() == MPI.COMM_NULL, "Intercomm()", "is not a null communicator")
    comm.Barrier()
