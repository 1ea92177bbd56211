"""How derived datatypes are made: mpi4py's ``Create_*`` constructors (contiguous, vector, indexed, struct,
subarray, resized) over the typemaps of ``typemap``, and how a pickled one is made again."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .errors import InvalidArgumentError, NotProvidedError
from .typemap import Layout

if TYPE_CHECKING:
    from .datatypes import Datatype

ORDER_C, ORDER_FORTRAN = 0, 1  # MPI.ORDER_C and MPI.ORDER_FORTRAN (MPI.ORDER_F), for Create_subarray


def count_arg(value: Any, name: str, what: str) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"{what}: {name} must be a non-negative integer, got {value!r}")
    return int(value)


def block_displacements(starts: np.ndarray, blocklength: int, extent: int) -> np.ndarray:
    """Byte displacements of ``blocklength`` consecutive elements at each of ``starts``, block by block."""
    return (starts[:, None] + np.arange(blocklength, dtype=np.int64)[None, :] * extent).reshape(-1)


def rebuild(old: Datatype, combiner: str, params: dict) -> Datatype:
    """A derived datatype made again from its parts (how derived types unpickle)."""
    if combiner == "DUP":
        return old.Dup()
    if combiner == "STRUCT":
        return old.Create_struct(**params)
    maker = {"CONTIGUOUS": "Create_contiguous", "VECTOR": "Create_vector", "HVECTOR": "Create_hvector",
             "INDEXED": "Create_indexed", "HINDEXED": "Create_hindexed", "INDEXED_BLOCK": "Create_indexed_block",
             "HINDEXED_BLOCK": "Create_hindexed_block", "SUBARRAY": "Create_subarray", "RESIZED": "Create_resized"}
    return getattr(old, maker[combiner])(**params)


class DerivedTypes:
    """Datatype's constructors of derived datatypes (mixed into ``datatypes.Datatype``)."""

    __slots__ = ()

    def Dup(self) -> "Datatype":  # noqa: N802
        lay = self._live("Datatype.Dup")
        return self._derived(self, lay, "DUP", {})

    Create_dup = Dup

    def Create_contiguous(self, count: int) -> "Datatype":  # noqa: N802
        count = count_arg(count, "count", "Create_contiguous")
        return self._derived(self, self._live("Create_contiguous").contiguous(count), "CONTIGUOUS", {"count": count})

    def Create_vector(self, count: int, blocklength: int, stride: int) -> "Datatype":  # noqa: N802
        """``count`` blocks of ``blocklength`` elements, block starts ``stride`` elements apart."""
        lay = self._live("Create_vector")
        count, blocklength = count_arg(count, "count", "Create_vector"), count_arg(blocklength, "blocklength", "Create_vector")
        disps = block_displacements(np.arange(count, dtype=np.int64) * int(stride) * lay.extent, blocklength, lay.extent)
        return self._derived(self, lay.replicate(disps), "VECTOR",
                             {"count": count, "blocklength": blocklength, "stride": int(stride)})

    def Create_hvector(self, count: int, blocklength: int, stride: int) -> "Datatype":  # noqa: N802
        """As ``Create_vector`` with ``stride`` in bytes."""
        lay = self._live("Create_hvector")
        count, blocklength = count_arg(count, "count", "Create_hvector"), count_arg(blocklength, "blocklength", "Create_hvector")
        disps = block_displacements(np.arange(count, dtype=np.int64) * int(stride), blocklength, lay.extent)
        return self._derived(self, lay.replicate(disps), "HVECTOR",
                             {"count": count, "blocklength": blocklength, "stride": int(stride)})

    def Create_indexed(self, blocklengths: Sequence[int], displacements: Sequence[int]) -> "Datatype":  # noqa: N802
        """Blocks of ``blocklengths[i]`` elements at ``displacements[i]`` elements."""
        return self._indexed("Create_indexed", blocklengths, displacements, True, "INDEXED")

    def Create_hindexed(self, blocklengths: Sequence[int], displacements: Sequence[int]) -> "Datatype":  # noqa: N802
        """As ``Create_indexed`` with displacements in bytes."""
        return self._indexed("Create_hindexed", blocklengths, displacements, False, "HINDEXED")

    def Create_indexed_block(self, blocklength: int, displacements: Sequence[int]) -> "Datatype":  # noqa: N802
        """Blocks of ``blocklength`` elements at ``displacements[i]`` elements."""
        return self._indexed("Create_indexed_block", blocklength, displacements, True, "INDEXED_BLOCK")

    def Create_hindexed_block(self, blocklength: int, displacements: Sequence[int]) -> "Datatype":  # noqa: N802
        """As ``Create_indexed_block`` with displacements in bytes."""
        return self._indexed("Create_hindexed_block", blocklength, displacements, False, "HINDEXED_BLOCK")

    def _indexed(self, what: str, lengths: Any, displs: Sequence[int], in_elements: bool, combiner: str) -> "Datatype":
        lay = self._live(what)
        displs = [int(d) for d in displs]
        block = not isinstance(lengths, (list, tuple, np.ndarray))
        if block:
            params: dict = {"blocklength": count_arg(lengths, "blocklength", what)}
            lens = [params["blocklength"]] * len(displs)
        else:
            lens = [count_arg(b, "blocklengths", what) for b in lengths]
            params = {"blocklengths": lens}
        if len(lens) != len(displs):
            raise InvalidArgumentError(f"{what}: {len(lens)} block lengths for {len(displs)} displacements")
        scale = lay.extent if in_elements else 1
        parts = [np.arange(n, dtype=np.int64) * lay.extent + d * scale for n, d in zip(lens, displs)]
        disps = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        params["displacements"] = displs
        return self._derived(self, lay.replicate(disps), combiner, params)

    def Create_subarray(self, sizes: Sequence[int], subsizes: Sequence[int], starts: Sequence[int],  # noqa: N802
                        order: int = ORDER_C) -> "Datatype":
        """The box ``starts .. starts + subsizes`` of an array of shape ``sizes`` (C or Fortran order)."""
        lay = self._live("Create_subarray")
        sizes, subsizes, starts = ([int(x) for x in v] for v in (sizes, subsizes, starts))
        if not (len(sizes) == len(subsizes) == len(starts)) or not sizes:
            raise InvalidArgumentError("Create_subarray: sizes, subsizes and starts need one entry per dimension")
        if any(not (0 <= s and 0 <= b and s + b <= n) for n, b, s in zip(sizes, subsizes, starts)):
            raise InvalidArgumentError(f"Create_subarray: box {subsizes} at {starts} does not fit in {sizes}")
        if order not in (ORDER_C, ORDER_FORTRAN):
            raise InvalidArgumentError(f"Create_subarray: order must be MPI.ORDER_C or MPI.ORDER_FORTRAN, got {order!r}")
        fortran = order == ORDER_FORTRAN
        dims = list(zip(sizes, subsizes, starts))
        if fortran:
            dims.reverse()
        index = np.zeros(1, np.int64)
        for n, b, s in dims:  # slowest dimension first: the typemap's order
            index = (index[:, None] * n + np.arange(s, s + b, dtype=np.int64)[None, :]).reshape(-1)
        full = int(np.prod(sizes, dtype=np.int64)) * lay.extent
        sub = lay.replicate(index * lay.extent)
        sub = Layout(sub.base, sub.starts, sub.lengths, 0, full, sub.true_lb, sub.true_ub) if index.size else \
            Layout(lay.base, [], [], 0, full, 0, 0)
        return self._derived(self, sub, "SUBARRAY",
                             {"sizes": sizes, "subsizes": subsizes, "starts": starts, "order": order})

    def Create_resized(self, lb: int, extent: int) -> "Datatype":  # noqa: N802
        """The same data with lower bound ``lb`` and extent ``extent`` (bytes)."""
        lay = self._live("Create_resized")
        return self._derived(self, lay.resized(int(lb), int(extent)), "RESIZED", {"lb": int(lb), "extent": int(extent)})

    @classmethod
    def Create_struct(cls, blocklengths: Sequence[int], displacements: Sequence[int],  # noqa: N802
                      datatypes: Sequence["Datatype"]) -> "Datatype":
        """Blocks of ``blocklengths[i]`` elements of ``datatypes[i]`` at byte ``displacements[i]`` (absolute
        addresses from ``MPI.Get_address`` when the type is used with ``MPI.BOTTOM``). pycoll's typemaps hold one
        element type, so every block's type must be made of the same named type."""
        what = "Create_struct"
        lens = [count_arg(b, "blocklengths", what) for b in blocklengths]
        displs = [int(d) for d in displacements]
        types = list(datatypes)
        if not (len(lens) == len(displs) == len(types)):
            raise InvalidArgumentError(f"{what}: {len(lens)} block lengths, {len(displs)} displacements and "
                                       f"{len(types)} datatypes; give one of each per block")
        if not types:
            raise InvalidArgumentError(f"{what}: needs at least one block")
        for t in types:
            if not isinstance(t, DerivedTypes):
                raise InvalidArgumentError(f"{what}: datatypes must be Datatype objects, got {type(t).__name__}")
        layouts = [t._live(what) for t in types]
        bases = {t._base().code for t in types}
        if len(bases) > 1:
            raise NotProvidedError(f"{what}: blocks of different element types "
                                   f"({', '.join(sorted({t._base().name for t in types}))}) are not supported; "
                                   "pycoll's typemaps hold one element type")
        parts = [lay.replicate(d + np.arange(n, dtype=np.int64) * lay.extent)
                 for n, d, lay in zip(lens, displs, layouts) if n > 0]
        base = layouts[0].base
        if not parts:
            lay = Layout(base, [], [], 0, 0, 0, 0)
        else:
            lb = min(p.lb for p in parts)
            ub = max(p.lb + p.extent for p in parts)
            if all(t._combiner == "NAMED" for t in types):  # MPI pads a struct's extent to its alignment
                align = max(1, base.alignment)
                ub = lb + -(-(ub - lb) // align) * align
            live = [p for p in parts if p.elements]
            tlb = min((p.true_lb for p in live), default=0)
            tub = max((p.true_ub for p in live), default=0)
            lay = Layout(base, np.concatenate([p.starts for p in parts]), np.concatenate([p.lengths for p in parts]),
                         lb, ub - lb, tlb, tub)
        return cls._derived(types[0], lay, "STRUCT",
                            {"blocklengths": lens, "displacements": displs, "datatypes": types})
