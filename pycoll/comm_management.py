"""Communicator management as mpi4py has it: comparison, pickling, Split, Dup, Create*, groups, topologies,
info hints, Free, Abort; COMM_NULL and the refused intercommunicator forms; the registries of the predefined
communicators and of the topology constructors."""

from __future__ import annotations

import hashlib
import os
import sys
import types
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional, Sequence

import numpy as np

from . import not_provided
from .errors import AbortedError, InvalidArgumentError
from .request import Request
from .status import UNDEFINED

if TYPE_CHECKING:  # annotations only: the mixins are bases of Comm
    from .comm import Comm


_WORLD_CTX = 2


def _child_ctx(parent: int, counter: int, tag: Any) -> int:
    digest = hashlib.blake2b(repr((parent, counter, tag)).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & ~1) % ((1 << 63) - 2) + 4  # even, never the world or control ctx


class CommManagement:
    """The management methods of ``Comm`` (a mixin: ``Comm`` holds the state they use)."""

    # ---- communicator management ---------------------------------------------------------------
    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """mpi4py's constructor forms besides pycoll's own: ``Comm()`` and ``Comm(COMM_NULL)`` give a null
        communicator; ``Comm(comm)`` (or ``Intracomm(comm)``, ``Cartcomm(cart)``) another reference to ``comm``:
        a new object sharing its state, equal to it, as mpi4py's objects share one MPI handle."""
        if not kwargs and len(args) <= 1:
            comm = args[0] if args else None
            if comm is None or isinstance(comm, _NullComm):
                return _NullComm()
            if not isinstance(comm, cls):
                raise TypeError(f"expecting {'an' if cls.__name__[0] in 'AEIOU' else 'a'} {cls.__name__}, got {type(comm).__name__}")
            ref = super().__new__(cls)
            ref.__dict__ = comm.__dict__
            return ref
        return super().__new__(cls)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _NullComm):
            return self._freed  # a freed communicator equals COMM_NULL, as in mpi4py
        return isinstance(other, CommManagement) and other.__dict__ is self.__dict__

    def __hash__(self) -> int:
        return id(self.__dict__)

    def __reduce__(self) -> Any:
        """COMM_WORLD and COMM_SELF pickle by name; any other communicator cannot leave its process (mpi4py)."""
        for name, key in (("COMM_WORLD", "world"), ("COMM_SELF", "self")):
            if _PREDEFINED.get(key) is self and _predefined_by_name:
                return (_predefined_by_name[0], (name,))
            if _PREDEFINED.get(key) == self:  # another reference to it: unpickles as another reference
                return (type(self), (_PREDEFINED[key],))
        raise ValueError(f"cannot pickle {self!r}: a communicator is local to its process")

    def _derived(self, members: list[int], what: tuple, name: str) -> "Comm":
        """A communicator over ``members`` (ranks here, in order) that every rank knows without asking the others
        (from the layout, say): no agreement round. Collective in that every rank of this one calls it, members or
        not, in the same order with the same arguments; ``what`` tells it from its siblings. COMM_NULL outside."""
        self._children += 1
        if self._rank not in members:
            return COMM_NULL  # type: ignore[return-value]
        return self._child([self._world[r] for r in members], _child_ctx(self._ctx, self._children, what), name)

    def _copy(self, ctx: int, name: str) -> "Comm":
        """Dup's communicator: the same ranks (a topology communicator also keeps its topology)."""
        return self._child(list(self._world), ctx, name)

    def _agreed(self, opname: str, mine: Any, problem: str = "", same: bool = False) -> list[Any]:
        """Every rank's ``mine``, by one allgather. A rank that found its arguments bad passes ``problem``: it
        raises InvalidArgumentError, the others RemoteError naming it. With ``same``, ranks that passed different
        values all raise MismatchError."""
        from .errors import MismatchError, RemoteError

        table = self.allgather((problem, mine))
        bad = [r for r, (p, _) in enumerate(table) if p]
        if problem:
            raise InvalidArgumentError(problem, op=opname, rank=self._rank, peers=[r for r in bad if r != self._rank])
        if bad:
            raise RemoteError(f"rank {bad[0]} rejected its arguments ({table[bad[0]][0]})", op=opname, rank=self._rank, peers=bad)
        values = [m for _, m in table]
        if same and any(v != values[0] for v in values):
            odd = [r for r, v in enumerate(values) if v != values[0]]
            raise MismatchError(f"ranks passed different arguments: rank 0 {values[0]!r}, rank {odd[0]} {values[odd[0]]!r}",
                                op=opname, rank=self._rank, peers=odd)
        return values

    def Split(self, color: int = 0, key: int = 0) -> "Comm":  # noqa: N802
        """Collective: one communicator per color (a non-negative int), ranks ordered by (key, rank here);
        ``color=UNDEFINED`` gives COMM_NULL."""
        return self._split(color, key, "Split")

    def _split(self, color: Any, key: Any, opname: str, problem: str = "") -> "Comm":
        self._live(opname)
        self._children += 1
        if color is None:
            color = UNDEFINED
        if not problem:
            for what, value in (("color", color), ("key", key)):
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                    problem = f"{what} {value!r} is not an integer"
            if not problem and color < 0 and color != UNDEFINED:
                problem = f"color {color} is negative (colors are >= 0, or MPI.UNDEFINED)"
        mine = (int(color), int(key)) if not problem else None
        table = self._agreed(opname, mine, problem)
        if color == UNDEFINED:
            return COMM_NULL  # type: ignore[return-value]
        members = sorted((k, r) for r, (c, k) in enumerate(table) if c == color)
        world = [self._world[r] for _, r in members]
        ctx = _child_ctx(self._ctx, self._children, ("split", int(color)))
        return self._child(world, ctx, f"{self._name}.split({color})")

    def Split_type(self, split_type: int, key: int = 0, info: Any = None) -> "Comm":  # noqa: N802
        """Collective: ``COMM_TYPE_SHARED`` groups the ranks of one host (the runtime's host identity: ranks that
        share memory); ``UNDEFINED`` gives COMM_NULL. Other split types are refused on every rank."""
        problem = ""
        if split_type == UNDEFINED:
            color = UNDEFINED
        elif split_type == COMM_TYPE_SHARED:
            host = self._rt.peers[self._rt.rank].host_id
            color = min(p.rank for p in self._rt.peers if p.host_id == host)  # the same number on every rank of a host
        else:
            color, problem = UNDEFINED, f"split_type {split_type!r} is not MPI.COMM_TYPE_SHARED or MPI.UNDEFINED"
        child = self._split(color, key, "Split_type", problem)
        if child is not COMM_NULL:
            child._name = f"{self._name}.split_type(shared)"
        return child

    def Create(self, group: Any) -> "Comm":  # noqa: N802
        """Collective over this communicator: a communicator over ``group`` (processes of this one, in the
        group's order). Every rank passes the same group, or each the group it belongs to (disjoint groups);
        ranks outside their group get COMM_NULL."""
        op = "Create"
        self._live(op)
        self._children += 1
        problem, members = self._group_members(group, op)
        table = self._agreed(op, members, problem)
        for r, g in enumerate(table):
            if self._world[r] in g:
                odd = [self._to_comm[w] for w in g if table[self._to_comm[w]] != g]
                if odd:
                    from .errors import MismatchError

                    raise MismatchError(f"rank {r} passed group {list(g)} but its member rank {odd[0]} passed "
                                        f"{list(table[odd[0]])}", op=op, rank=self._rank, peers=[r] + odd)
        if self._rt.rank not in members:
            return COMM_NULL  # type: ignore[return-value]
        return self._child(list(members), _child_ctx(self._ctx, self._children, ("create", members)), f"{self._name}.create")

    def Create_group(self, group: Any, tag: int = 0) -> "Comm":  # noqa: N802
        """Collective over ``group`` only (the other ranks of this communicator do not call, or get COMM_NULL):
        a communicator over the group's processes. Concurrent calls with overlapping groups differ by ``tag``."""
        op = "Create_group"
        self._live(op)
        problem, members = self._group_members(group, op)
        if not problem and (isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or tag < 0):
            problem = f"tag {tag!r} must be a non-negative integer"
        if problem:
            raise InvalidArgumentError(problem, op=op, rank=self._rank)
        if self._rt.rank not in members:
            return COMM_NULL  # type: ignore[return-value]
        made = self.__dict__.setdefault("_group_children", {})  # calls so far per (group, tag): the same on every member
        made[(members, int(tag))] = count = made.get((members, int(tag)), 0) + 1
        return self._child(list(members), _child_ctx(self._ctx, 0, ("create_group", members, int(tag), count)),
                           f"{self._name}.create_group")

    def _group_members(self, group: Any, opname: str) -> tuple[str, tuple[int, ...]]:
        return _group_world(group, self._world, opname)

    def Get_group(self) -> Any:  # noqa: N802
        """A new group of this communicator's processes, in rank order."""
        from .group import Group

        self._live("Get_group")
        return Group._of(self._world, self._rt.rank)

    @property
    def group(self) -> Any:
        return self.Get_group()

    def Compare(self, comm: "Comm") -> int:  # noqa: N802
        """IDENT (the same communicator), CONGRUENT (same ranks in the same order), SIMILAR (same processes,
        other order) or UNEQUAL."""
        from .group import CONGRUENT, IDENT, compare_members

        if not isinstance(comm, CommManagement):
            raise InvalidArgumentError(f"cannot compare a communicator with {comm!r}", op="Compare", rank=self._rank)
        if comm is self:
            return IDENT
        result = compare_members(self._world, comm._world)
        return CONGRUENT if result == IDENT else result

    def Get_topology(self) -> int:  # noqa: N802
        return UNDEFINED  # a topology communicator answers its kind

    @property
    def topology(self) -> int:
        return self.Get_topology()

    @property
    def is_topo(self) -> bool:
        return False

    @property
    def is_inter(self) -> bool:
        return False

    @property
    def is_intra(self) -> bool:
        return True

    @property
    def name(self) -> str:
        return self.Get_name()

    @name.setter
    def name(self, value: str) -> None:
        self.Set_name(value)

    def toint(self) -> int:
        """-1: a pycoll communicator has no integer (C or Fortran) handle, which mpi4py's callers check for."""
        return -1

    py2f = toint

    # The topology communicators (pycoll.cart_comm, pycoll.graph_comm) subclass Comm, so this module cannot import
    # them; those modules register their constructors here when imported (pycoll.MPI imports them).
    def Create_cart(self, dims: Sequence[int], periods: Any = None, reorder: bool = False) -> Any:  # noqa: N802
        """Collective: a Cartcomm laying the first prod(dims) ranks out on the grid, in rank order (``reorder``
        is accepted; pycoll keeps the order); the other ranks get COMM_NULL."""
        return _topologies("Create_cart").create_cart(self, dims, periods)

    def Cart_map(self, dims: Sequence[int], periods: Any = None) -> int:  # noqa: N802
        """The rank this process would have in ``Create_cart(dims, periods, reorder=True)``: its own, or
        UNDEFINED past the grid."""
        return _topologies("Cart_map").cart_map(self, dims, periods)

    def Create_graph(self, index: Sequence[int], edges: Sequence[int], reorder: bool = False) -> Any:  # noqa: N802
        """Collective: a Graphcomm over the first len(index) ranks (node i's neighbors are
        edges[index[i-1]:index[i]]); the other ranks get COMM_NULL. ``reorder`` is accepted; the order stays."""
        return _topologies("Create_graph").create_graph(self, index, edges)

    def Graph_map(self, index: Sequence[int], edges: Sequence[int]) -> int:  # noqa: N802
        return _topologies("Graph_map").graph_map(self, index, edges)

    def Create_dist_graph_adjacent(  # noqa: N802
        self, sources: Optional[Sequence[int]], destinations: Optional[Sequence[int]], sourceweights: Any = None,
        destweights: Any = None, info: Any = None, reorder: bool = False,
    ) -> Any:
        """Collective: a Distgraphcomm in which each rank names its own incoming and outgoing neighbors."""
        return _topologies("Create_dist_graph_adjacent").create_dist_graph_adjacent(
            self, sources, destinations, sourceweights, destweights)

    def Create_dist_graph(  # noqa: N802
        self, sources: Sequence[int], degrees: Sequence[int], destinations: Sequence[int], weights: Any = None,
        info: Any = None, reorder: bool = False,
    ) -> Any:
        """Collective: a Distgraphcomm from edges any rank may contribute (sources[i] to degrees[i] destinations)."""
        return _topologies("Create_dist_graph").create_dist_graph(self, sources, degrees, destinations, weights)

    def Dup(self, info: Any = None) -> "Comm":  # noqa: N802
        """A communicator over the same ranks with contexts of its own (a topology communicator keeps its
        topology). Its info hints: this one's (``info`` None), else those of the ``MPI.Info`` given
        (``INFO_NULL``: none), as Dup_with_info. pycoll keeps hints for Get_info; none changes what it does."""
        self._live("Dup")
        hints = dict(self._hints) if info is None else _info_items(info, "Dup", self._rank)
        self._children += 1
        child = self._copy(_child_ctx(self._ctx, self._children, "dup"), f"{self._name}.dup")
        child._hints = hints
        return child

    Clone = Dup

    def Dup_with_info(self, info: Any) -> "Comm":  # noqa: N802
        """Dup with the hints of ``info`` (an MPI.Info; INFO_NULL for none) instead of this communicator's."""
        self._live("Dup_with_info")
        if info is None:
            raise InvalidArgumentError("info must be an MPI.Info (MPI.INFO_NULL for no hints), not None",
                                       op="Dup_with_info", rank=self._rank)
        _info_items(info, "Dup_with_info", self._rank)
        return self.Dup(info)

    def Idup(self, info: Any = None) -> tuple["Comm", Request]:  # noqa: N802
        """Dup, and a request that is already complete (Dup sends nothing)."""
        return self.Dup(info), Request.completed()

    def Idup_with_info(self, info: Any) -> tuple["Comm", Request]:  # noqa: N802
        """Dup_with_info, and a request that is already complete."""
        return self.Dup_with_info(info), Request.completed()

    # ---- info hints: kept per communicator (shared by its references), returned by Get_info ----
    @property
    def _hints(self) -> dict[str, str]:
        return self.__dict__.setdefault("_hint_items", {})

    @_hints.setter
    def _hints(self, value: dict[str, str]) -> None:
        self.__dict__["_hint_items"] = value

    def Set_info(self, info: Any) -> None:  # noqa: N802
        """Add the hints of ``info`` (an MPI.Info) to this communicator's, a key set again taking the new
        value (INFO_NULL adds none). pycoll keeps them for Get_info; none changes what it does."""
        self._live("Set_info")
        if info is None:
            raise InvalidArgumentError("info must be an MPI.Info, not None", op="Set_info", rank=self._rank)
        self._hints.update(_info_items(info, "Set_info", self._rank))

    def Get_info(self) -> Any:  # noqa: N802
        """A new MPI.Info holding this communicator's hints (the caller frees it)."""
        from .info import Info

        self._live("Get_info")
        return Info.Create(self._hints)

    @property
    def info(self) -> Any:
        """Info hints: ``comm.info`` is Get_info(), ``comm.info = info`` Set_info(info)."""
        return self.Get_info()

    @info.setter
    def info(self, value: Any) -> None:
        self.Set_info(value)

    def Free(self) -> None:  # noqa: N802
        """Release the communicator: later calls on it raise, and it compares equal to COMM_NULL."""
        self._live("Free")
        self._freed = True
        self._x.clear()
        if self._arena is not None:
            self._arena.close()
        if self._ipc is not None:
            self._ipc.close()

    def free(self) -> None:
        """``Free`` unless already freed or predefined (COMM_WORLD, COMM_SELF)."""
        if not self._freed and not _is_predefined(self):
            self.Free()

    # the MPI features pycoll does not provide: each raises NotProvidedError (a NotImplementedError)
    def Create_intercomm(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        not_provided.refuse(not_provided.INTERCOMM, "Create_intercomm")

    def Spawn(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        not_provided.refuse(not_provided.DYNAMIC, "Spawn")

    def Spawn_multiple(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        not_provided.refuse(not_provided.DYNAMIC, "Spawn_multiple")

    def Accept(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        not_provided.refuse(not_provided.DYNAMIC, "Accept")

    def Connect(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        not_provided.refuse(not_provided.DYNAMIC, "Connect")

    def Disconnect(self) -> None:  # noqa: N802
        not_provided.refuse(not_provided.DYNAMIC, "Disconnect")

    @classmethod
    def Get_parent(cls) -> Any:  # noqa: N802
        not_provided.refuse(not_provided.DYNAMIC, "Get_parent")

    @classmethod
    def Join(cls, fd: int) -> Any:  # noqa: N802
        not_provided.refuse(not_provided.DYNAMIC, "Join")

    def Abort(self, errorcode: int = 1, *, terminate: bool = True) -> None:  # noqa: N802
        """Tear this communicator down, from any thread, without waiting for anyone.

        Calls waiting on it in other threads raise ``AbortedError`` within 50 ms, its peers raise an error
        naming this rank, and later calls on it raise ``AbortedError``. With ``terminate`` (MPI's meaning,
        the default) the process then exits with ``errorcode`` and the launcher stops the others; with
        ``terminate=False`` (NCCL's ncclCommAbort) the process and its other communicators live on.
        """
        err = AbortedError(f"Comm.Abort({errorcode}) was called on rank {self._rank}", op=f"Abort of {self._name}", rank=self._rank)
        self._aborted = err
        if terminate:  # the peers see this process go (closed sockets, exited pid) within their liveness check
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # exiting regardless
                    pass
            os._exit(errorcode)
        if self._size > 1:
            self._engine.request_abort(self._ctx & ~1, err, self._world)


class _NullComm:
    """``MPI.COMM_NULL``: equal to every null communicator (``MPI.Comm()``) and to freed ones; any call on it
    is an error."""

    def __repr__(self) -> str:
        return "<pycoll.MPI.COMM_NULL>"

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _NullComm):
            return True
        return other._freed if isinstance(other, CommManagement) else NotImplemented

    def __hash__(self) -> int:
        return hash(_NullComm)

    def __reduce__(self) -> Any:
        return "COMM_NULL" if self is COMM_NULL else (_NullComm, ())

    def Get_name(self) -> str:  # noqa: N802
        return "MPI_COMM_NULL"

    def free(self) -> None:
        """Nothing to free (mpi4py's ``free`` skips null communicators)."""

    def __getattr__(self, name: str) -> Any:
        raise InvalidArgumentError(f"{name} called on MPI.COMM_NULL")


COMM_NULL = _NullComm()


class Intercomm:
    """mpi4py's intercommunicator class. ``Intercomm()`` is a null communicator, as in mpi4py; nothing makes
    a live one, since pycoll does not provide intercommunicators."""

    def __new__(cls, comm: Any = None) -> Any:
        if comm is None or isinstance(comm, _NullComm):
            return _NullComm()
        raise TypeError("expecting an intercommunicator (pycoll does not provide intercommunicators)")

    @classmethod
    def Create_from_groups(cls, *args: Any, **kwargs: Any) -> NoReturn:  # noqa: N802
        not_provided.refuse(not_provided.INTERCOMM, "Intercomm.Create_from_groups")


# ---- communicator management helpers ---------------------------------------------------------------
COMM_TYPE_SHARED = 1  # Split_type: the ranks of one host (MPICH's value)
_FROM_GROUP: dict[tuple[int, tuple[int, ...], str], int] = {}  # Create_from_group calls per (runtime, group, tag)


def _group_world(group: Any, world: Sequence[int], opname: str) -> tuple[str, tuple[int, ...]]:
    """``group``'s members (world ranks) and, when it cannot be used over ``world``, why ("" when it can)."""
    from .group import Group

    if not isinstance(group, Group):
        return f"expected an MPI.Group, got {type(group).__name__}", ()
    if not group:
        return "the group is MPI.GROUP_NULL", ()
    members = group.members
    allowed = set(world)
    outside = [w for w in members if w not in allowed]
    if outside:
        return f"the group holds processes outside this communicator (world ranks {outside})", ()
    return "", members


def _info_items(info: Any, opname: str, rank: Optional[int] = None) -> dict[str, str]:
    """The (key, value) items of an MPI.Info, as a dict ({} for INFO_NULL); anything else is refused."""
    from .info import Info

    if not isinstance(info, Info):
        raise InvalidArgumentError(f"info must be an MPI.Info, not {type(info).__name__}", op=opname, rank=rank)
    return dict(info.items())


# The constructors of Cartcomm (pycoll.cart_comm), Graphcomm and Distgraphcomm (pycoll.graph_comm), by their method's
# name in lower case; each module registers its own when imported
_topology_constructors = types.SimpleNamespace()


def register_topologies(**constructors: Callable[..., Any]) -> None:
    """Called by the topology modules: functions that build topology communicators from a Comm."""
    for name, fn in constructors.items():
        setattr(_topology_constructors, name, fn)


def _topologies(op: str) -> Any:
    if not hasattr(_topology_constructors, op.lower()):
        raise InvalidArgumentError("topology communicators come with pycoll.MPI: import it first", op=op)
    return _topology_constructors


# COMM_WORLD and COMM_SELF ("world", "self") once ``pycoll.MPI`` made them, and its function that returns one by
# its MPI name, which a pickled one calls to unpickle: both set there, the only place they are made
_PREDEFINED: dict[str, Comm] = {}
_predefined_by_name: list[Callable[[str], Comm]] = []


def _is_predefined(comm: Comm) -> bool:
    return any(c == comm for c in _PREDEFINED.values())


