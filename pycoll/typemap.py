"""Layouts of MPI datatypes as runs of one element type, and the view, strided view or gather a message makes of a buffer."""

from __future__ import annotations

from typing import Optional

import numpy as np

_I64 = np.int64
_ACCESS_CACHE = 32  # access patterns kept per layout (per count and buffer size)


class Layout:
    """A datatype's typemap: ``lengths[i]`` elements of ``base`` at byte offset ``starts[i]``, in typemap order.

    ``lb`` and ``extent`` place consecutive datatype elements of a message (element j starts ``j * extent``
    bytes after the buffer); ``true_lb``/``true_ub`` bound the bytes one element really touches.
    """

    __slots__ = ("base", "starts", "lengths", "lb", "extent", "true_lb", "true_ub", "elements", "_accesses")

    def __init__(self, base: np.dtype, starts, lengths, lb: int, extent: int, true_lb: int, true_ub: int) -> None:
        self.base = np.dtype(base)
        self.starts, self.lengths = _merge(np.asarray(starts, _I64).reshape(-1), np.asarray(lengths, _I64).reshape(-1),
                                           self.base.itemsize)
        self.lb, self.extent = int(lb), int(extent)
        self.true_lb, self.true_ub = int(true_lb), int(true_ub)
        self.elements = int(self.lengths.sum())  # base elements in one datatype element
        self._accesses: dict = {}

    @classmethod
    def basic(cls, dtype: np.dtype, true_lb: int = 0, true_ub: Optional[int] = None) -> "Layout":
        """One element of ``dtype`` (its padding included in the extent, as a C struct's)."""
        dtype = np.dtype(dtype)
        isz = dtype.itemsize
        return cls(dtype, [0], [1], 0, isz, true_lb, isz if true_ub is None else true_ub)

    @property
    def dense(self) -> bool:
        """One run that fills the whole extent: a message of these is one contiguous run."""
        isz = self.base.itemsize
        return self.starts.size == 1 and self.starts[0] == self.lb and self.lengths[0] * isz == self.extent

    # ---- constructors: copies of this layout at byte displacements -------------------------------------
    def replicate(self, disps) -> "Layout":
        """The layout of copies of this one at byte displacements ``disps`` (typemap order), bounds as MPI sets them."""
        disps = np.asarray(disps, _I64).reshape(-1)
        if disps.size == 0 or self.elements == 0:
            lo = int(disps.min()) if disps.size else 0
            hi = int(disps.max()) if disps.size else 0
            lb, ub = (lo + self.lb, hi + self.lb + self.extent) if disps.size else (0, 0)
            return Layout(self.base, [], [], lb, ub - lb, 0, 0)
        lo, hi = int(disps.min()), int(disps.max())
        starts = (disps[:, None] + self.starts[None, :]).reshape(-1)
        lengths = np.tile(self.lengths, disps.size)
        return Layout(self.base, starts, lengths, lo + self.lb, hi - lo + self.extent,
                      lo + self.true_lb, hi + self.true_ub)

    def contiguous(self, count: int) -> "Layout":
        if self.dense and count > 0:  # one long run, whatever the count (BYTE.Create_contiguous(2**31))
            return Layout(self.base, [self.lb], [count * int(self.lengths[0])], self.lb, count * self.extent,
                          self.true_lb, (count - 1) * self.extent + self.true_ub)
        return self.replicate(np.arange(count, dtype=_I64) * self.extent)

    def resized(self, lb: int, extent: int) -> "Layout":
        return Layout(self.base, self.starts, self.lengths, lb, extent, self.true_lb, self.true_ub)

    # ---- messages -------------------------------------------------------------------------------------
    def access(self, count: int, nbytes: int) -> "Access":
        """How ``count`` consecutive elements of this datatype lie in a buffer of ``nbytes`` bytes (cached)."""
        key = (count, nbytes)
        hit = self._accesses.get(key)
        if hit is None:
            if self.dense:
                runs = (np.array([self.lb], _I64), np.array([count * int(self.lengths[0])], _I64)) if count else _NO_RUNS
            else:
                runs = self._runs(np.arange(count, dtype=_I64))
            hit = Access(self.base, *runs, nbytes)
            if len(self._accesses) >= _ACCESS_CACHE:
                self._accesses.clear()
            self._accesses[key] = hit
        return hit

    def access_elements(self, elements: np.ndarray, nbytes: int) -> "Access":
        """How the datatype elements numbered ``elements`` (in this order) lie in a buffer of ``nbytes`` bytes."""
        return Access(self.base, *self._runs(np.asarray(elements, _I64)), nbytes)

    def _runs(self, elements: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if elements.size == 0 or self.elements == 0:
            return _NO_RUNS
        starts = (elements[:, None] * self.extent + self.starts[None, :]).reshape(-1)
        return _merge(starts, np.tile(self.lengths, elements.size), self.base.itemsize)


_NO_RUNS = (np.zeros(0, _I64), np.zeros(0, _I64))


def _merge(starts: np.ndarray, lengths: np.ndarray, isz: int) -> tuple[np.ndarray, np.ndarray]:
    """Drop empty runs and join each run to the next where that one starts right after it."""
    keep = lengths > 0
    if not keep.all():
        starts, lengths = starts[keep], lengths[keep]
    if starts.size < 2:
        return starts, lengths
    joins = starts[1:] == starts[:-1] + lengths[:-1] * isz
    if not joins.any():
        return starts, lengths
    head = np.concatenate(([True], ~joins))
    group = np.cumsum(head) - 1
    return starts[head], np.bincount(group, weights=lengths).astype(_I64)


def _grid(starts: np.ndarray) -> Optional[tuple[int, list[tuple[int, int]]]]:
    """(origin, [(n, step), ...] outermost first) when ``starts`` is a regular grid of offsets, else None."""
    dims: list[tuple[int, int]] = []
    s = starts
    while s.size > 1:
        step = int(s[1] - s[0])
        off = np.flatnonzero(np.diff(s) != step)
        n = int(off[0]) + 1 if off.size else int(s.size)
        if s.size % n:
            return None
        rows = s.reshape(-1, n)
        if n < s.size and not np.array_equal(rows - rows[:, :1], np.broadcast_to(rows[0] - rows[0, 0], rows.shape)):
            return None
        dims.insert(0, (n, step))
        s = rows[:, 0]
    return int(s[0]), dims


class Access:
    """A message's elements in a buffer: one contiguous run (a view), a regular grid (a strided view) or a gather."""

    __slots__ = ("base", "count", "offset", "shape", "strides", "index", "contiguous")

    def __init__(self, base: np.dtype, starts: np.ndarray, lengths: np.ndarray, nbytes: int) -> None:
        isz = base.itemsize
        self.base = base
        self.count = int(lengths.sum())  # base elements in the message
        self.offset, self.shape, self.strides, self.index = 0, None, None, None
        self.contiguous = starts.size <= 1
        if starts.size:
            lo, hi = int(starts.min()), int((starts + lengths * isz).max())
            if lo < 0 or hi > nbytes:
                raise ValueError(f"the datatype reaches bytes {lo} to {hi} of a {nbytes}-byte buffer")
        if starts.size == 1:
            self.offset = int(starts[0])
            return
        if starts.size == 0:
            return
        grid = _grid(starts) if (lengths == lengths[0]).all() else None
        if grid is not None:
            self.offset = grid[0]
            self.shape = tuple(n for n, _ in grid[1]) + (int(lengths[0]),)
            self.strides = tuple(s for _, s in grid[1]) + (isz,)
            return
        nb = lengths * isz  # every byte the message touches, in order
        first = np.repeat(starts - (np.cumsum(nb) - nb), nb)
        self.index = first + np.arange(first.size, dtype=_I64)

    def read(self, raw: np.ndarray) -> tuple[np.ndarray, bool]:
        """(a flat array of the message's elements, whether it is a view of ``raw``, the buffer's bytes)."""
        isz = self.base.itemsize
        if self.contiguous:
            return raw[self.offset:self.offset + self.count * isz].view(self.base), True
        if self.index is None:
            return np.ascontiguousarray(self.grid(raw)).reshape(-1), False
        return raw[self.index].view(self.base), False

    def grid(self, raw: np.ndarray) -> np.ndarray:
        """The strided view of a grid access over the buffer's bytes."""
        return np.ndarray(self.shape, self.base, buffer=raw, offset=self.offset, strides=self.strides)

    def write(self, raw: np.ndarray, packed: np.ndarray) -> None:
        """Scatter a packed array (from ``read``) back into the buffer's bytes."""
        if self.contiguous:
            return
        if self.index is None:
            self.grid(raw)[...] = packed.reshape(self.shape)
        else:
            raw[self.index] = packed.view(np.uint8)
