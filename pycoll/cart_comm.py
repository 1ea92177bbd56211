"""Cartesian topology communicators (MPI.Cartcomm): ranks on a grid with coordinates, shifts and sub-grids, and
Compute_dims, which balances a grid over a number of ranks."""

from __future__ import annotations

from math import prod
from typing import Any, Optional, Sequence

from .comm import Comm
from .comm_management import COMM_NULL, _child_ctx, register_topologies
from .errors import InvalidArgumentError
from .p2p_protocol import PROC_NULL
from .status import UNDEFINED
from .topology_comm import CART, Topocomm, agreed_layout, checked_index, int_list


def _divisors(m: int) -> list[int]:
    small = [d for d in range(1, int(m**0.5) + 1) if m % d == 0]
    return sorted(set(small + [m // d for d in small]), reverse=True)


def _balanced(m: int, k: int) -> list[int]:
    """The factorization of m into k factors, largest first, with the least spread (largest - smallest), then the
    least sum: the grid MPICH's MPI_Dims_create picks (checked for every m <= 256, k <= 5)."""
    divisors = _divisors(m)
    best: Optional[tuple[tuple[int, int], list[int]]] = None

    def walk(rest: int, left: int, cap: int, acc: list[int]) -> None:
        nonlocal best
        if left == 1:
            if rest <= cap:
                f = acc + [rest]
                score = (f[0] - f[-1], sum(f))
                if best is None or score < best[0]:
                    best = (score, f)
            return
        for d in divisors:
            if d > cap or rest % d:
                continue
            if d**left < rest:  # d is the largest factor still to come: too small, and so is every later one
                break
            walk(rest // d, left - 1, d, acc + [d])

    walk(m, k, m, [])
    assert best is not None
    return best[1]


def compute_dims(nnodes: int, dims: Any) -> list[int]:
    """``MPI.Compute_dims``: fill the zero entries of ``dims`` (or ``dims`` zeros, for an integer) with a grid of
    ``nnodes`` processes that is as square as it can be, in non-increasing order; nonzero entries stay."""
    op = "Compute_dims"
    n = checked_index(nnodes, "nnodes", op)
    if n < 0:
        raise InvalidArgumentError(f"nnodes must be non-negative, got {n}", op=op)
    if hasattr(dims, "__index__") and not isinstance(dims, bool):
        out = [0] * dims.__index__()
    else:
        out = int_list(dims, "dims", op)
    if any(d < 0 for d in out):
        raise InvalidArgumentError(f"dims {out} has a negative entry", op=op)
    free = [i for i, d in enumerate(out) if d == 0]
    fixed = prod(d for d in out if d)
    if n == 0:
        return out
    if n % fixed or (not free and fixed != n):
        raise InvalidArgumentError(f"cannot lay {n} processes out on a grid with dims {out}", op=op)
    if free:
        for i, d in zip(free, _balanced(n // fixed, len(free))):
            out[i] = d
    return out


def cart_args(dims: Any, periods: Any, opname: str) -> tuple[list[int], list[int]]:
    """Checked ``(dims, periods)`` of Create_cart and Cart_map: positive extents, one period flag (0/1) per
    dimension; ``periods`` may be None (none periodic) or one bool for all, as in mpi4py."""
    d = int_list(dims, "dims", opname)
    if any(x <= 0 for x in d):
        raise InvalidArgumentError(f"dims {d} must all be positive", op=opname)
    if periods is None:
        periods = False
    if isinstance(periods, bool):
        periods = [periods] * len(d)
    try:
        flags = list(periods)
    except TypeError:
        raise InvalidArgumentError(f"periods must be a bool or a sequence of bools, got {periods!r}", op=opname) from None
    if len(flags) != len(d):
        raise InvalidArgumentError(f"periods has {len(flags)} entries for {len(d)} dimensions", op=opname)
    return d, [1 if p else 0 for p in flags]


def coords_of(rank: int, dims: Sequence[int]) -> list[int]:
    """Row-major coordinates of ``rank`` on a grid of ``dims`` (the last dimension varies fastest)."""
    out = []
    for extent in reversed(dims):
        rank, c = divmod(rank, extent)
        out.append(c)
    return out[::-1]


def rank_of(coords: Sequence[int], dims: Sequence[int]) -> int:
    rank = 0
    for c, extent in zip(coords, dims):
        rank = rank * extent + c
    return rank


class Cartcomm(Topocomm):
    """A Cartesian grid of ranks (row-major: the last dimension varies fastest), periodic or not per dimension.
    Every collective and point-to-point call works on it as on any communicator."""

    _dims: tuple[int, ...] = ()
    _periods: tuple[int, ...] = ()
    _coords: tuple[int, ...] = ()

    @classmethod
    def _build(cls, parent: Comm, world: list[int], ctx: int, name: str, dims: Sequence[int], periods: Sequence[int]) -> "Cartcomm":
        cart = cls._made(parent, world, ctx, name)
        cart._dims, cart._periods = tuple(dims), tuple(periods)
        cart._coords = tuple(coords_of(cart._rank, cart._dims))
        return cart

    def _copy(self, ctx: int, name: str) -> "Cartcomm":  # Dup keeps the grid
        return Cartcomm._build(self, list(self._world), ctx, name, self._dims, self._periods)

    def __repr__(self) -> str:
        return f"<pycoll.Cartcomm {self._name} rank {self._rank}/{self._size} dims {list(self._dims)} coords {list(self._coords)}>"

    # ---- inquiry ---------------------------------------------------------------------------
    def Get_topology(self) -> int:  # noqa: N802
        return CART

    def Get_dim(self) -> int:  # noqa: N802
        return len(self._dims)

    @property
    def dim(self) -> int:
        return len(self._dims)

    @property
    def ndim(self) -> int:
        return len(self._dims)

    def Get_topo(self) -> tuple[list[int], list[int], list[int]]:  # noqa: N802
        """``(dims, periods, coords)`` of this rank, as new lists (periods as 0/1, as MPI gives them)."""
        return list(self._dims), list(self._periods), list(self._coords)

    @property
    def topo(self) -> tuple[list[int], list[int], list[int]]:
        return self.Get_topo()

    @property
    def dims(self) -> list[int]:
        return list(self._dims)

    @property
    def periods(self) -> list[int]:
        return list(self._periods)

    @property
    def coords(self) -> list[int]:
        return list(self._coords)

    # ---- translation -----------------------------------------------------------------------
    def Get_cart_rank(self, coords: Sequence[int]) -> int:  # noqa: N802
        """The rank at ``coords``; a coordinate outside a periodic dimension wraps around, outside a
        non-periodic one is an error."""
        op = "Get_cart_rank"
        c = int_list(coords, "coords", op)
        if len(c) != len(self._dims):
            raise InvalidArgumentError(f"coords {c} has {len(c)} entries for a {len(self._dims)}-dimensional grid", op=op, rank=self._rank)
        for i, (x, extent, periodic) in enumerate(zip(c, self._dims, self._periods)):
            if periodic:
                c[i] = x % extent
            elif not 0 <= x < extent:
                raise InvalidArgumentError(
                    f"coordinate {x} is outside non-periodic dimension {i} (extent {extent})", op=op, rank=self._rank
                )
        return rank_of(c, self._dims)

    def Get_coords(self, rank: int) -> list[int]:  # noqa: N802
        r = checked_index(rank, "rank", "Get_coords")
        if not 0 <= r < self._size:
            raise InvalidArgumentError(f"rank {r} is not in this {self._size}-rank grid", op="Get_coords", rank=self._rank)
        return coords_of(r, self._dims)

    def Shift(self, direction: int, disp: int) -> tuple[int, int]:  # noqa: N802
        """``(source, dest)``: the ranks ``disp`` steps back and forward along ``direction``; PROC_NULL past
        the edge of a non-periodic dimension."""
        op = "Shift"
        axis, step = checked_index(direction, "direction", op), checked_index(disp, "disp", op)
        if not 0 <= axis < len(self._dims):
            raise InvalidArgumentError(f"direction {axis} is not a dimension of this {len(self._dims)}-dimensional grid", op=op, rank=self._rank)
        extent, periodic = self._dims[axis], self._periods[axis]

        def moved(delta: int) -> int:
            c = list(self._coords)
            x = c[axis] + delta
            if periodic:
                x %= extent
            elif not 0 <= x < extent:
                return PROC_NULL
            c[axis] = x
            return rank_of(c, self._dims)

        return moved(-step), moved(step)

    @property
    def inoutedges(self) -> tuple[list[int], list[int]]:
        """For each dimension, the ranks one step back and one step forward (PROC_NULL past an edge)."""
        neighbors: list[int] = []
        for axis in range(len(self._dims)):
            neighbors.extend(self.Shift(axis, 1))
        return neighbors, list(neighbors)

    def _tags(self) -> tuple[list[int], list[int]]:
        # neighbor 2d is one step back along dimension d, 2d+1 one step forward: what goes forward arrives from
        # behind. Tagging by the receiver's slot keeps periodic dimensions of 1 or 2 ranks apart (MPI-4's rule).
        slots = list(range(2 * len(self._dims)))
        return slots, [j ^ 1 for j in slots]

    # ---- partition -------------------------------------------------------------------------
    def Sub(self, remain_dims: Sequence[bool]) -> "Cartcomm":  # noqa: N802
        """Collective: the sub-grid through this rank that keeps the dimensions ``remain_dims`` marks true (one
        communicator per combination of the dropped coordinates; none kept gives a 0-dimensional grid of one)."""
        op = "Sub"
        self._live(op)
        self._children += 1
        problem, keep = "", None
        try:
            flags = list(remain_dims)
            if len(flags) != len(self._dims):
                raise InvalidArgumentError(f"remain_dims has {len(flags)} entries for {len(self._dims)} dimensions", op=op)
            keep = tuple(bool(f) for f in flags)
        except (TypeError, InvalidArgumentError) as exc:
            problem = exc.cause if isinstance(exc, InvalidArgumentError) else f"remain_dims must be a sequence of bools, got {remain_dims!r}"
        self._agreed(op, keep, problem, same=True)
        assert keep is not None
        dropped = [i for i, k in enumerate(keep) if not k]
        mine = [self._coords[i] for i in dropped]
        members = [r for r in range(self._size) if [coords_of(r, self._dims)[i] for i in dropped] == mine]
        ctx = _child_ctx(self._ctx, self._children, ("sub", keep, tuple(mine)))
        kept = [i for i, k in enumerate(keep) if k]
        return Cartcomm._build(
            self, [self._world[r] for r in members], ctx, f"{self._name}.sub({''.join('1' if k else '0' for k in keep)})",
            [self._dims[i] for i in kept], [self._periods[i] for i in kept],
        )


def create_cart(parent: Comm, dims: Any, periods: Any) -> Any:
    """``Comm.Create_cart``: collective; the first prod(dims) ranks form the grid (rank order kept), the others
    get COMM_NULL."""
    op = "Create_cart"

    def check() -> Any:
        grid = cart_args(dims, periods, op)
        if prod(grid[0]) > parent._size:
            raise InvalidArgumentError(f"dims {grid[0]} need {prod(grid[0])} ranks; the communicator has {parent._size}", op=op)
        return grid

    grid = agreed_layout(parent, op, check)
    if parent._rank >= prod(grid[0]):
        return COMM_NULL
    ctx = _child_ctx(parent._ctx, parent._children, ("cart", tuple(grid[0]), tuple(grid[1])))
    name = f"{parent._name}.cart({'x'.join(map(str, grid[0]))})"
    return Cartcomm._build(parent, parent._world[: prod(grid[0])], ctx, name, grid[0], grid[1])


def cart_map(parent: Comm, dims: Any, periods: Any) -> int:
    """``Comm.Cart_map``: this rank in the grid pycoll would make (its own), or UNDEFINED past it."""
    d, _ = cart_args(dims, periods, "Cart_map")
    if prod(d) > parent._size:
        raise InvalidArgumentError(f"dims {d} need {prod(d)} ranks; the communicator has {parent._size}", op="Cart_map", rank=parent._rank)
    return parent._rank if parent._rank < prod(d) else UNDEFINED


register_topologies(create_cart=create_cart, cart_map=cart_map)
