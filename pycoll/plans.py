"""Plans by call shape: the key a call's arguments make apart from their addresses, how a planned call's flat views
are found again in a later call's arguments, and what a plan holds (the executor's cache, ``pycoll.executor``); and
per family of calls that differ in their arrays' lengths alone, a checked plan to scale and the fast paths that
run any length of a size span (``pycoll.span_runners``)."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np

from . import arrays
from .algorithms.base import Call
from .algorithms.registry import size_span
from .buffers import IN_PLACE
from .datatypes import Datatype
from .memory import host_address
from .ops import Op
from .p2p_protocol import Sig, counts_hash
from .p2p_specs import call_key_module

_SCALARS = (int, str, bool, float, type(None), Op, Datatype, np.dtype)


def shape_key_python(args: tuple) -> Optional[tuple]:
    """What a call's arguments are, apart from buffer addresses: None where an argument is of a kind not planned.

    One entry per argument; a list or tuple becomes a tuple of its type and its items' entries, so no two different
    argument lists share a key. The usual buffer specs, ``[buf, count, type]`` and ``[buf, type]``, get one flat
    entry each (an array's entry is its shape, dtype and C-order and writable flags, a Datatype stands bare), which
    no other argument list can produce. Built without recursion or per-item calls: it runs on every call.
    ``shape_key`` is this function's C form (``pycoll/_callkey.c``) where it was compiled at install.
    """
    key = []
    add = key.append
    for a in args:
        t = type(a)
        if t is list or t is tuple:
            n = len(a)
            if n == 3:
                b, c, d = a
                if type(b) is _NDARRAY and type(c) is int and type(d) is Datatype:
                    f = b.flags
                    add((t, b.shape, b.dtype, f.c_contiguous, f.writeable, c, d))
                    continue
            elif n == 2:
                b, d = a
                if type(b) is _NDARRAY and type(d) is Datatype:
                    f = b.flags
                    add((t, b.shape, b.dtype, f.c_contiguous, f.writeable, d))
                    continue
            item = _describe_items(t, a)
            if item is None:
                return None
            add(item)
        elif t is _NDARRAY:  # C order says the strides (a plan never takes an array in another order)
            f = a.flags
            add((a.shape, a.dtype, f.c_contiguous, f.writeable))
        elif t is int or t is Op or t is str or a is IN_PLACE or a is None:  # no other entry equals these
            add(a)
        elif t is bool:  # True == 1: a flag gets an entry no int equals
            add(_TRUE if a else _FALSE)
        else:
            item = _describe_scalar(t, a)
            if item is None:
                return None
            add(item)
    return tuple(key)


_NDARRAY = np.ndarray
_TRUE, _FALSE = object(), object()


def _describe_items(t: type, items: Any) -> Optional[tuple]:
    """The key entry of a list or tuple argument (a buffer spec, counts, displacements), None if not planned."""
    out: list = [t]
    for a in items:
        ta = type(a)
        if ta is np.ndarray:
            f = a.flags
            out.append((a.shape, a.dtype, f.c_contiguous, f.writeable))
        elif ta is Datatype:
            out.append((ta, a))
        elif ta is int or a is IN_PLACE:
            out.append(a)
        elif ta is list or ta is tuple:
            inner = _describe_items(ta, a)
            if inner is None:
                return None
            out.append(inner)
        else:
            inner = _describe_scalar(ta, a)
            if inner is None:
                return None
            out.append(inner)
    return tuple(out)


def _describe_scalar(t: type, a: Any) -> Any:
    """A scalar's entry, with its type (True == 1 == 1.0, but only the int is a valid count or root); None for other
    buffer kinds (memoryview, bytearray, device arrays, ...), which are checked on every call."""
    if t in _SCALARS:
        return (t, a)
    if isinstance(a, np.integer):
        return int(a)
    return None


def _compiled_shape_key() -> Optional[Callable[[tuple], Optional[tuple]]]:
    """The C form of ``shape_key_python``, or None where it was not built (PYCOLL_CALL_KEY=python: never used)."""
    _callkey = call_key_module()
    if _callkey is None:
        return None
    _callkey.configure(Datatype, Op, IN_PLACE, _TRUE, _FALSE, _describe_items, _describe_scalar)
    return _callkey.shape_key


shape_key: Callable[[tuple], Optional[tuple]] = _compiled_shape_key() or shape_key_python


def resize_key(args: tuple) -> Optional[tuple[tuple, int]]:
    """(what a call's arguments are apart from addresses and their arrays' scale, that scale), where every array among
    them is one-dimensional and C-ordered, bare or as ``[arr, T]`` or ``[arr, count, T]`` with a ``Datatype`` T, at
    least one element long (a count at least 1); else None. The scale is the greatest common divisor of the arrays'
    lengths and the specs' counts, and the key holds each over it: two calls with one key differ in their arrays'
    lengths (and counts) by one factor (the executor plans the second from the first: ``Plan.resizable``)."""
    key = []
    add = key.append
    lengths = []
    for a in args:
        t = type(a)
        count = None
        if t is _NDARRAY:
            arr, named = a, None
        elif (t is list or t is tuple) and len(a) == 2 and type(a[0]) is _NDARRAY and type(a[1]) is Datatype:
            arr, named = a
        elif (t is list or t is tuple) and len(a) == 3 and type(a[0]) is _NDARRAY and type(a[1]) is int \
                and type(a[2]) is Datatype:
            arr, count, named = a
            if count <= 0:
                return None
        elif t is int or t is Op or t is str or a is IN_PLACE or a is None:
            add(a)
            continue
        elif t is bool:  # True == 1: a flag gets an entry no int equals
            add(_TRUE if a else _FALSE)
            continue
        else:
            return None
        flags = arr.flags
        if arr.ndim != 1 or not flags.c_contiguous or not arr.shape[0]:
            return None
        lengths.append(arr.shape[0])
        if count is not None:  # a spec's count scales with its array
            lengths.append(count)
        add((t, named, arr.dtype, flags.writeable, count is None))
    if not lengths:
        return None
    scale = lengths[0] if len(lengths) == 1 else math.gcd(*lengths)
    add(tuple([n // scale for n in lengths]))
    return tuple(key), scale


def _arrays(args: tuple):
    """(path, array) of every NumPy array among the arguments, one level into buffer specs."""
    for i, a in enumerate(args):
        if type(a) is np.ndarray:
            yield (i, -1), a
        elif type(a) in (list, tuple) and a and type(a[0]) is np.ndarray:
            yield (i, 0), a[0]


class Rebind:
    """How a call's flat view is found again in a later call of the same shape: which argument, dtype, element range.

    ``view`` is made for the shape: a whole one-dimensional array is fetched from the arguments and nothing more."""

    __slots__ = ("index", "item", "dtype", "start", "stop", "whole", "view")

    def __init__(self, index: int, item: int, dtype: np.dtype, start: int, stop: int, whole: bool, ndim: int = 1) -> None:
        self.index, self.item, self.dtype, self.start, self.stop, self.whole = index, item, dtype, start, stop, whole
        if whole and ndim == 1:
            i, j = index, item
            self.view = (lambda args: args[i]) if j < 0 else (lambda args: args[i][j])
        else:  # a closure, not a bound method: the rebind holding its own method would be a cycle
            self.view = _ranged_view(index, item, dtype, start, stop, whole)

    @staticmethod
    def find(view: Optional[np.ndarray], args: tuple) -> Any:
        """The recipe for ``view`` (a flat view into one of ``args``), None for no view, False if it is not one."""
        if view is None:
            return None
        if type(view) is not np.ndarray or not view.flags.c_contiguous:
            return False
        if view.size and not view.dtype.hasobject:
            for (i, j), a in _arrays(args):  # the usual case: an argument's array itself
                if a is view:
                    return Rebind(i, j, view.dtype, 0, view.size, True, view.ndim)
        addr = host_address(view) if view.size else -1
        for (i, j), a in _arrays(args):
            if not a.flags.c_contiguous or a.dtype.hasobject:
                continue
            base = host_address(a)
            isz = view.dtype.itemsize
            if view.size == 0:
                if a.size == 0 or a.nbytes % isz:
                    continue
                return Rebind(i, j, view.dtype, 0, 0, False)
            if base <= addr and addr + view.nbytes <= base + a.nbytes and (addr - base) % isz == 0 and a.nbytes % isz == 0:
                start = (addr - base) // isz
                whole = start == 0 and view.nbytes == a.nbytes and view.dtype == a.dtype
                return Rebind(i, j, view.dtype, start, start + view.size, whole, a.ndim)
        return False


def _ranged_view(index: int, item: int, dtype: np.dtype, start: int, stop: int, whole: bool
                 ) -> Callable[[tuple], np.ndarray]:
    """A rebind's view of an argument that is not one whole one-dimensional array: flattened, seen as ``dtype``,
    elements ``start`` to ``stop``."""
    def view(args: tuple) -> np.ndarray:
        a = args[index] if item < 0 else args[index][item]
        if a.ndim != 1:
            a = a.reshape(-1)
        if whole:
            return a
        if a.dtype != dtype:
            a = a.view(dtype)
        return a[start:stop]

    return view


class Plan:
    """A checked call shape: its call template and signature, how to rebind its views, and its algorithm choice."""

    __slots__ = ("template", "sig", "send", "recv", "label", "algo", "algo_for", "inline", "fast", "flat_for")

    def __init__(self, label: str, call: Call, sig: Sig, send: Any, recv: Any) -> None:
        self.label = label
        self.template = call.without_buffers()  # a plan keeps no user memory alive
        self.sig = sig
        self.send, self.recv = send, recv
        self.algo: Any = None  # the Algorithm selected for it, valid while ``algo_for`` holds
        self.algo_for: tuple = ()
        self.inline: Any = None  # the algorithm's inline runner on the arena (see ``Runner``), or False: none
        # the runner's whole call for these arguments (``Runner.fast_path``): False where it has none, None untried
        self.fast: Any = None
        self.flat_for: tuple = ()  # the choice key (with PYCOLL_SMP_BYTES) under which it was found not composed

    def retire(self) -> None:
        """Drop the runner and fast path, which refer back to the plan: a plan the cache let go is then freed at
        once, not left (with the dozens of objects its closures hold) to the cyclic collector, whose collections a
        program of ever new shapes would pay for."""
        self.inline = self.fast = None

    def resizable(self) -> bool:
        """Whether this plan's call at other lengths (its arguments' ``resize_key`` the same, their scale another) is
        its call with every count scaled alike: true for the collectives whose counts follow from the arrays'
        lengths, linearly (``RESIZABLE``, one block size for every rank), with a predefined op, whose views are the
        arguments' arrays as they are. Their argument checks compare lengths and counts with each other: scaled
        alike, the checks still hold, where every scaled count is whole (``PlanCache.resized``)."""
        t, send, recv = self.template, self.send, self.recv
        return (self.label in RESIZABLE and not t.vector and self.sig.vhash in (0, self._counts_word(t.counts))
                and (t.op is None or t.op.is_predefined) and (send is not None or recv is not None)
                and (send is None or send.whole) and (recv is None or recv.whole) and one_block_size(t))

    def _counts_word(self, counts: list[int]) -> int:
        """The signature word of these counts, where this plan's signature carries its counts (else 0)."""
        return counts_hash(counts) if self.sig.vhash else 0

    def views(self, args: tuple) -> Optional[tuple[Optional[np.ndarray], Optional[np.ndarray]]]:
        """(send, recv) flat views for these arguments (same shape), or None if they now overlap (the checks name it)."""
        send = self.send.view(args) if self.send is not None else None
        recv = self.recv.view(args) if self.recv is not None else None
        if send is not None and recv is not None and not self.template.in_place and send.size and recv.size:
            # two distinct arrays that own their memory cannot overlap; the same array twice, or views, may
            if send is recv or send.base is not None or recv.base is not None:
                if arrays.overlaps(send, recv):
                    return None
        return send, recv

    def make_call(self, send: Optional[np.ndarray], recv: Optional[np.ndarray]) -> Call:
        t = self.template
        return Call(t.coll, t.dtype, send, recv, t.op, t.root, t.counts, t.displs, t.send_counts, t.send_displs,
                    t.in_place, t.vector, t.total)

    def call(self, args: tuple) -> Optional[Call]:
        """The call for these arguments (same shape), or None if its buffers now overlap (the checks name it)."""
        views = self.views(args)
        return None if views is None else self.make_call(*views)

    def scaled_call(self, send: Optional[np.ndarray], recv: Optional[np.ndarray], scale: int, was: int
                    ) -> Optional[tuple[Call, Sig]]:
        """(call, signature) of this resizable plan's call on ``send`` and ``recv``, arrays of its family at ``scale``
        where the plan's are at ``was``: every count (the signature's too) scaled alike; None where a scaled count is
        not whole."""
        t = self.template
        call = self.make_call(send, recv)
        try:
            count = _scaled(self.sig.count, scale, was)
            if t.counts or t.send_counts:
                call.counts, call.displs = _blocks_scaled(t.counts, t.displs, scale, was)
                call.send_counts, call.send_displs = _blocks_scaled(t.send_counts, t.send_displs, scale, was)
            if t.total >= 0:
                call.total = _scaled(t.total, scale, was)
        except _Unscalable:
            return None
        return call, self.sig._replace(count=count, vhash=self._counts_word(call.counts))


# the blocking collectives whose counts follow linearly from their arrays' lengths, one block size for every rank
RESIZABLE = frozenset({"Allreduce", "Reduce", "Bcast", "Scan", "Exscan", "Allgather", "Alltoall", "Reduce_scatter_block",
                       "Gather", "Scatter"})


def one_block_size(t: Call) -> bool:
    """Whether every rank's block of ``t`` has one size, one after another from the start, on both sides (or ``t``
    has no blocks): its arrays' lengths then give the block at any length."""
    return _uniform(t.counts, t.displs) and _uniform(t.send_counts, t.send_displs)


def _uniform(counts: list[int], displs: list[int]) -> bool:
    """Whether every rank's block has one size, one after another from the start (or there are no blocks)."""
    return all(c == counts[0] for c in counts) and all(d == i * counts[0] for i, d in enumerate(displs))


def _make_room(table: dict, key: Any, limit: int) -> None:
    """Drop ``table``'s oldest entry where it holds ``limit`` and ``key`` would be a new one."""
    if len(table) >= limit and key not in table:
        table.pop(next(iter(table)))


class _Unscalable(Exception):
    """A count that the new scale does not make whole: the call takes the checks."""


def _scaled(value: int, scale: int, base: int) -> int:
    q, r = divmod(value * scale, base)
    if r:
        raise _Unscalable
    return q


def _blocks_scaled(counts: list[int], displs: list[int], scale: int, base: int) -> tuple[list[int], list[int]]:
    """Uniform blocks (``_uniform``) with their size scaled (``_scaled``), one after another."""
    if not counts:
        return counts, displs
    each = _scaled(counts[0], scale, base)
    return [each] * len(counts), [i * each for i in range(len(displs))]


class PlanCache:
    """A communicator's plans by call shape, at most ``limit`` (the oldest dropped first, ``Plan.retire``), and per
    call whose arrays' length alone may change, the checked plan a new length is planned from (``Plan.resizable``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.plans: dict[tuple, Plan] = {}  # (label, shape_key) -> plan
        self.resizable: dict[tuple, tuple[Plan, int]] = {}  # (label, resize_key) -> a checked plan and its scale
        # (label, resize_key, the first size of a span) -> a function (args, scale) -> bool that runs any call of that
        # family whose size lies in the span, or declines having done nothing (``span_runners.keep``)
        self.spans: dict[tuple, Callable[[tuple, int], bool]] = {}
        self.units: dict[tuple, int] = {}  # (label, resize_key) -> the call's bytes per unit of scale
        # (label, resize_key) -> the family's latest span function and whether it holds for another span's size
        self.latest: dict[tuple, tuple[Callable[[tuple, int], bool], Callable[[int], bool]]] = {}
        self.unspanned: set[tuple] = set()  # spans whose plan's fast path could not take other lengths
        # (label, shape_key) -> the span function that last ran a call of that shape, and the call's scale: the shape's
        # next call goes straight to it (its family and span need not be worked out again)
        self.shaped: dict[tuple, tuple[Callable[[tuple, int], bool], int]] = {}

    def get(self, label: str, key: tuple) -> Optional[Plan]:
        try:
            return self.plans.get((label, key))
        except TypeError:  # an unhashable argument (the checks name it)
            return None

    def keep(self, label: str, key: tuple, plan: Plan) -> Plan:
        if len(self.plans) >= self.limit:
            self.plans.pop(next(iter(self.plans))).retire()
        self.plans[(label, key)] = plan
        return plan

    def remember(self, label: str, args: tuple, call: Call, sig: Sig, key: Optional[tuple],
                 sized: Optional[tuple[tuple, int]]) -> Optional[Plan]:
        """Keep a checked call as the plan of its shape (``key``: ``shape_key``), if its views can be found again in
        later calls (and as the plan its other lengths are made from, where it is ``resizable``; ``sized``: the
        arguments' ``resize_key``)."""
        if key is None:
            return None
        send_rb, recv_rb = Rebind.find(call.send, args), Rebind.find(call.recv, args)  # in place: views into recv
        if send_rb is False or recv_rb is False:
            return None
        try:
            hash(key)
        except TypeError:
            return None
        plan = self.keep(label, key, Plan(label, call, sig, send_rb, recv_rb))
        if sized is not None and plan.resizable():
            family = (label, sized[0])
            _make_room(self.resizable, family, self.limit)
            self.resizable[family] = (plan, sized[1])
        return plan

    def span_key(self, label: str, sized: tuple[tuple, int], nbytes: Optional[int] = None) -> Optional[tuple]:
        """The key of the size span a call of this family (``sized``: its ``resize_key``) falls in, from the family's
        bytes per unit of scale (learnt from ``nbytes``, a call's size, where given); None where not known."""
        family = (label, sized[0])
        unit = self.units.get(family)
        if unit is None:
            if nbytes is None or nbytes % sized[1]:
                return None
            if len(self.units) >= self.limit:  # the spans found unfit are keyed by family too
                self.unspanned.clear()
            _make_room(self.units, family, self.limit)
            unit = self.units[family] = nbytes // sized[1]
        return label, sized[0], size_span(unit * sized[1])[0]

    def run_spanned(self, label: str, args: tuple, sized: tuple[tuple, int], shaped: Optional[tuple] = None) -> bool:
        """Whether a span's function (``spans``) ran this call of a new shape (``shaped``: (label, its shape_key), where
        the function is then kept for that shape). A span without one takes its family's latest where that function's
        choice holds for this span too (``keep_span``'s ``holds``)."""
        try:
            key = self.span_key(label, sized)
            if key is None:
                return False
            run = self.spans.get(key)
            if run is None:
                latest = self.latest.get(key[:2])
                if latest is None or not latest[1](self.units[key[:2]] * sized[1]):
                    return False
                run = latest[0]
                self.keep_span(key, run, latest[1])
        except TypeError:  # an unhashable argument (the checks name it)
            return False
        if not run(args, sized[1]):
            return False
        if shaped is not None:
            _make_room(self.shaped, shaped, 4 * self.limit)
            self.shaped[shaped] = (run, sized[1])
        return True

    def keep_span(self, key: tuple, run: Callable[[tuple, int], bool], holds: Callable[[int], bool]) -> None:
        """``run`` as the function of the span ``key`` and its family's latest, good for another span whose calls
        of ``nbytes`` it ``holds(nbytes)`` for."""
        _make_room(self.spans, key, self.limit)
        self.spans[key] = run
        _make_room(self.latest, key[:2], self.limit)
        self.latest[key[:2]] = (run, holds)

    def resized(self, label: str, args: tuple, key: tuple, sized: tuple[tuple, int]) -> Optional[tuple[Plan, Call]]:
        """The plan of a new shape (``key``) whose arguments differ from a kept resizable plan's in their arrays'
        scale alone, kept, and its call on ``args``: the kept plan's call on the new arrays, every count (the
        signature's too) scaled alike. None where there is no such plan, a scaled count is not whole, or the new
        arrays overlap (the checks name each). ``sized``: the arguments' ``resize_key``."""
        try:
            found = self.resizable.get((label, sized[0]))
            hash(key)
        except TypeError:  # an unhashable argument (the checks name it)
            return None
        if found is None:
            return None
        base, was = found
        views = base.views(args)
        if views is None:
            return None
        scaled = base.scaled_call(views[0], views[1], sized[1], was)
        if scaled is None:
            return None
        call, sig = scaled
        return self.keep(label, key, Plan(label, call, sig, base.send, base.recv)), call

    def clear(self) -> None:
        self.plans.clear()
        self.resizable.clear()
        self.spans.clear()
        self.shaped.clear()
        self.units.clear()
        self.latest.clear()
        self.unspanned.clear()
