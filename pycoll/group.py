"""MPI.Group: ordered sets of processes (world ranks) and the set algebra that builds communicators from them."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

from .errors import InvalidArgumentError
from .p2p_protocol import PROC_NULL
from .status import UNDEFINED


# results of Group.Compare and Comm.Compare (MPICH's values)
IDENT, CONGRUENT, SIMILAR, UNEQUAL = 0, 1, 2, 3


def compare_members(a: Sequence[int], b: Sequence[int]) -> int:
    """IDENT for the same processes in the same order, SIMILAR for the same processes in another order, else UNEQUAL."""
    if list(a) == list(b):
        return IDENT
    return SIMILAR if len(a) == len(b) and set(a) == set(b) else UNEQUAL


class _Handle:
    """What every copy of one group shares (``Group(g)`` copies share it, and so compare equal)."""

    __slots__ = ("members", "me", "index", "name")

    def __init__(self, members: Sequence[int], me: Optional[int], name: str = "") -> None:
        self.members = tuple(int(m) for m in members)  # world ranks, in group rank order
        self.me = me  # this process's world rank (None when unknown: the predefined empty group)
        self.index = {w: i for i, w in enumerate(self.members)}
        self.name = name  # set for the predefined groups


def _as_int(value: Any, what: str, opname: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidArgumentError(f"{what} {value!r} is not an integer", op=opname)
    return value.__index__()


class Group:
    """An ordered set of processes. ``Group()`` is a null group (equal to ``GROUP_NULL``); ``Group(g)`` is
    another reference to ``g``'s group (equal to it, as in mpi4py). Groups come from ``Comm.Get_group()``."""

    def __init__(self, group: Optional["Group"] = None) -> None:
        if group is not None and not isinstance(group, Group):
            raise TypeError(f"Group() takes a Group, not {type(group).__name__}")
        self._h: Optional[_Handle] = group._h if group is not None else None

    @classmethod
    def _of(cls, members: Iterable[int], me: Optional[int]) -> "Group":
        g = cls.__new__(cls)
        g._h = _Handle(list(members), me)
        return g

    # ---- handle semantics ----------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Group):
            return NotImplemented
        return self._h is other._h

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        return self._h is not None

    def __repr__(self) -> str:
        h = self._h
        if h is None:
            return "<pycoll.MPI.Group GROUP_NULL>"
        return f"<pycoll.MPI.Group {h.name or 'of world ranks'} {list(h.members)}>"

    def __reduce__(self) -> Any:
        """The predefined groups pickle by name; a copy of one as a new reference; any other group cannot be
        sent (its ranks mean nothing in another process), as in mpi4py."""
        if self is GROUP_NULL or self is GROUP_EMPTY:
            return "GROUP_NULL" if self is GROUP_NULL else "GROUP_EMPTY"
        if self._h is None:
            return (Group, ())
        if self._h is GROUP_EMPTY._h:
            return (Group, (GROUP_EMPTY,))
        raise ValueError(f"cannot pickle {self!r}: a group is local to its process")

    def _handle(self, opname: str) -> _Handle:
        if self._h is None:
            raise InvalidArgumentError("the group is MPI.GROUP_NULL (freed or never made)", op=opname)
        return self._h

    # ---- accessors -----------------------------------------------------------------------
    def Get_size(self) -> int:  # noqa: N802
        return len(self._handle("Group.Get_size").members)

    def Get_rank(self) -> int:  # noqa: N802
        """This process's rank in the group, or ``UNDEFINED`` when it is not a member."""
        h = self._handle("Group.Get_rank")
        return h.index.get(h.me, UNDEFINED) if h.me is not None else UNDEFINED

    @property
    def size(self) -> int:
        return self.Get_size()

    @property
    def rank(self) -> int:
        return self.Get_rank()

    @property
    def members(self) -> tuple[int, ...]:
        """The world ranks of the group's processes, in group rank order (a pycoll extension)."""
        return self._handle("Group.members").members

    def Translate_ranks(self, ranks: Optional[Sequence[int]] = None, group: Optional["Group"] = None) -> list[int]:  # noqa: N802
        """The ranks in ``group`` (default: the world group) of this group's ``ranks`` (default: all of them);
        ``UNDEFINED`` where a process is not in ``group``, ``PROC_NULL`` stays ``PROC_NULL``."""
        op = "Group.Translate_ranks"
        h = self._handle(op)
        if group is None:
            from . import runtime as _runtime

            rt = _runtime.current()
            target: dict[int, int] = {w: w for w in range(rt.size)} if rt is not None else {}
        else:
            if not isinstance(group, Group):
                raise InvalidArgumentError(f"group must be an MPI.Group, not {type(group).__name__}", op=op)
            target = group._handle(op).index
        if ranks is None:
            ranks = range(len(h.members))
        out = []
        for r in ranks:
            r = _as_int(r, "rank", op)
            if r == PROC_NULL:
                out.append(PROC_NULL)
                continue
            if not 0 <= r < len(h.members):
                raise InvalidArgumentError(f"rank {r} is not in this {len(h.members)}-process group", op=op)
            out.append(target.get(h.members[r], UNDEFINED))
        return out

    def Compare(self, group: "Group") -> int:  # noqa: N802
        """``IDENT`` (same processes, same order), ``SIMILAR`` (same processes, other order) or ``UNEQUAL``."""
        if not isinstance(group, Group):
            raise InvalidArgumentError(f"cannot compare a group with {type(group).__name__}", op="Group.Compare")
        return compare_members(self._handle("Group.Compare").members, group._handle("Group.Compare").members)

    # ---- constructors --------------------------------------------------------------------
    def _derived(self, members: Iterable[int], *others: "Group") -> "Group":
        me = next((g._h.me for g in (self, *others) if g._h is not None and g._h.me is not None), None)
        return type(self)._of(members, me)

    def Dup(self) -> "Group":  # noqa: N802
        """A new group with the same processes in the same order (Compare gives IDENT; == gives False)."""
        return self._derived(self._handle("Group.Dup").members)

    @classmethod
    def Union(cls, group1: "Group", group2: "Group") -> "Group":  # noqa: N802
        """group1's processes, then group2's that are not in group1, each in its own order."""
        a, b = _pair(group1, group2, "Group.Union")
        return group1._derived(list(a.members) + [w for w in b.members if w not in a.index], group2)

    @classmethod
    def Intersection(cls, group1: "Group", group2: "Group") -> "Group":  # noqa: N802
        """group1's processes that are also in group2, in group1's order."""
        a, b = _pair(group1, group2, "Group.Intersection")
        return group1._derived([w for w in a.members if w in b.index], group2)

    Intersect = Intersection

    @classmethod
    def Difference(cls, group1: "Group", group2: "Group") -> "Group":  # noqa: N802
        """group1's processes that are not in group2, in group1's order."""
        a, b = _pair(group1, group2, "Group.Difference")
        return group1._derived([w for w in a.members if w not in b.index], group2)

    def _ranks(self, ranks: Sequence[int], opname: str) -> list[int]:
        """``ranks`` checked: integers, each a rank of this group, none twice."""
        h = self._handle(opname)
        try:
            items = list(ranks)
        except TypeError:
            raise InvalidArgumentError(f"ranks must be a sequence of integers, got {ranks!r}", op=opname) from None
        out = [_as_int(r, "rank", opname) for r in items]
        for r in out:
            if not 0 <= r < len(h.members):
                raise InvalidArgumentError(f"rank {r} is not in this {len(h.members)}-process group", op=opname)
        if len(set(out)) != len(out):
            raise InvalidArgumentError(f"ranks {out} name a process more than once", op=opname)
        return out

    def Incl(self, ranks: Sequence[int]) -> "Group":  # noqa: N802
        """The processes at ``ranks``, in that order."""
        members = self._handle("Group.Incl").members
        return self._derived([members[r] for r in self._ranks(ranks, "Group.Incl")])

    def Excl(self, ranks: Sequence[int]) -> "Group":  # noqa: N802
        """The processes not at ``ranks``, in this group's order."""
        gone = set(self._ranks(ranks, "Group.Excl"))
        return self._derived([w for i, w in enumerate(self._handle("Group.Excl").members) if i not in gone])

    def _expand(self, ranges: Sequence[Sequence[int]], opname: str) -> list[int]:
        """The ranks of ``(first, last, stride)`` triplets, last included, in order."""
        out: list[int] = []
        try:
            triplets = [tuple(t) for t in ranges]
        except TypeError:
            raise InvalidArgumentError(f"ranges must be (first, last, stride) triplets, got {ranges!r}", op=opname) from None
        for t in triplets:
            if len(t) != 3:
                raise InvalidArgumentError(f"range {t!r} is not a (first, last, stride) triplet", op=opname)
            first, last, stride = (_as_int(v, "range value", opname) for v in t)
            if stride == 0:
                raise InvalidArgumentError(f"range {t!r} has stride 0", op=opname)
            if (last - first) * stride < 0:
                raise InvalidArgumentError(f"range {t!r} runs away from its last rank", op=opname)
            out.extend(range(first, last + (1 if stride > 0 else -1), stride))
        return self._ranks(out, opname)

    def Range_incl(self, ranks: Sequence[Sequence[int]]) -> "Group":  # noqa: N802
        members = self._handle("Group.Range_incl").members
        return self._derived([members[r] for r in self._expand(ranks, "Group.Range_incl")])

    def Range_excl(self, ranks: Sequence[Sequence[int]]) -> "Group":  # noqa: N802
        gone = set(self._expand(ranks, "Group.Range_excl"))
        return self._derived([w for i, w in enumerate(self._handle("Group.Range_excl").members) if i not in gone])

    # ---- destructor ----------------------------------------------------------------------
    def Free(self) -> None:  # noqa: N802
        """Release this reference: it becomes equal to ``GROUP_NULL`` (the predefined groups stay as they are)."""
        self._handle("Group.Free")
        if self is not GROUP_EMPTY:
            self._h = None

    def free(self) -> None:
        """``Free`` unless null or predefined."""
        if self._h is not None and self is not GROUP_EMPTY:
            self.Free()


def _pair(group1: Any, group2: Any, opname: str) -> tuple[_Handle, _Handle]:
    for g in (group1, group2):
        if not isinstance(g, Group):
            raise InvalidArgumentError(f"expected an MPI.Group, got {type(g).__name__}", op=opname)
    return group1._handle(opname), group2._handle(opname)


GROUP_NULL = Group()
GROUP_EMPTY = Group._of((), None)
GROUP_EMPTY._h.name = "GROUP_EMPTY"  # type: ignore[union-attr]
