"""Buffers of derived datatypes: a view of the user's buffer where a datatype's elements are one run, else a packed
copy, written back once a receiving call completes."""

from __future__ import annotations

from contextlib import contextmanager
import threading
from typing import Any, Iterator, Optional

import numpy as np

from .datatypes import Datatype
from .errors import InvalidArgumentError
from .arrays import Buf, DeviceArray, VBuf, as_flat_array, check_disjoint, check_supported, int_list


class Packed:
    """A packed copy of a datatype's elements, taken from the user's buffer; ``unpack`` writes it back there."""

    __slots__ = ("access", "raw", "array")

    def __init__(self, access: Any, raw: np.ndarray, array: np.ndarray) -> None:
        self.access, self.raw, self.array = access, raw, array

    def unpack(self) -> None:
        self.access.write(self.raw, self.array)


class Unpacking:
    """The writable packed buffers of one collective call, written back into the user's buffers once the call
    completes (the executor holds this as the call's stage, as it holds a device call's staging)."""

    def __init__(self) -> None:
        self.packed: list[Packed] = []

    def finish(self) -> None:
        for p in self.packed:
            p.unpack()

    def discard(self) -> None:
        self.packed.clear()


collecting = threading.local()


@contextmanager
def collecting_packed() -> Iterator[Unpacking]:
    """Collect the writable packed buffers the specs parsed inside the ``with`` make (one collective's build)."""
    outer = getattr(collecting, "current", None)
    current = collecting.current = Unpacking()
    try:
        yield current
    finally:
        collecting.current = outer


def raw_bytes(obj: Any, what: str, op: str) -> np.ndarray:
    """The user's buffer as flat bytes (host memory only: derived datatypes are laid out with NumPy)."""
    arr = as_flat_array(obj, what, op)
    if isinstance(arr, DeviceArray):
        raise InvalidArgumentError(f"{what}: derived datatypes take host buffers; pass device memory with a named "
                                   "datatype", op=op)
    if arr.dtype.hasobject:
        raise InvalidArgumentError(f"{what}: dtype {arr.dtype} holds Python objects, not data", op=op)
    return arr.view(np.uint8) if arr.size else np.empty(0, np.uint8)


def _layout_of(datatype: Datatype, what: str, op: str) -> Any:
    try:
        return datatype._live(what)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(err.cause, op=op) from None


def _with_access(raw: np.ndarray, layout: Any, access: Any, datatype: Datatype, what: str, op: str,
                 writable: bool) -> Buf:
    """The Buf of a message's elements: a view where they are one run, else a packed copy (written back on finish)."""
    if writable and not raw.flags.writeable:
        raise InvalidArgumentError(f"{what} is read-only", op=op)
    check_supported(layout.base, what, op)
    flat, is_view = access.read(raw)
    packed = None
    if not is_view:
        packed = Packed(access, raw, flat)
        if writable:
            current = getattr(collecting, "current", None)
            if current is not None:
                current.packed.append(packed)
    return Buf(flat, layout.base, "host", datatype, layout.elements, packed)


def parse_derived(obj: Any, count: Optional[int], datatype: Datatype, what: str, op: str, writable: bool,
                  blocks: int) -> Buf:
    """``[buf, count, derived]``: ``count`` (per block) elements of a derived datatype, flattened to its element type."""
    layout = _layout_of(datatype, what, op)
    raw = raw_bytes(obj, what, op)
    if count is None:
        if layout.extent <= 0:
            raise InvalidArgumentError(f"{what}: cannot infer a count from a datatype of extent {layout.extent}", op=op)
        if raw.size % layout.extent or (raw.size // layout.extent) % blocks:
            raise InvalidArgumentError(
                f"{what}: {raw.size} bytes are not a whole number of {blocks if blocks > 1 else ''} datatype elements "
                f"of extent {layout.extent}".replace("  ", " "), op=op)
        count = raw.size // layout.extent // blocks
    elif count < 0:
        raise InvalidArgumentError(f"{what}: count {count} is negative", op=op)
    try:
        access = layout.access(count * blocks, raw.size)
    except ValueError as exc:
        raise InvalidArgumentError(f"{what}: {count * blocks} elements of the datatype do not fit the buffer ({exc})",
                                   op=op) from None
    return _with_access(raw, layout, access, datatype, what, op, writable)


def parse_derived_vector(obj: Any, counts_spec: Any, displs_spec: Any, datatype: Datatype, what: str, op: str,
                         size: int, writable: bool) -> VBuf:
    """``[buf, counts, displs, derived]``: blocks of derived elements, flattened (counts and displacements scaled)."""
    if counts_spec is None:  # [buf, derived]: the buffer's elements split evenly over the ranks
        whole = parse_derived(obj, None, datatype, what, op, writable, size)
        each = whole.count // size
        return VBuf(whole.array, whole.dtype, [each] * size, [i * each for i in range(size)])
    layout = _layout_of(datatype, what, op)
    raw = raw_bytes(obj, what, op)
    counts = int_list(counts_spec, size, "counts", what, op)
    displs = (int_list(displs_spec, size, "displs", what, op) if displs_spec is not None
              else [int(x) for x in np.concatenate(([0], np.cumsum(counts)[:-1]))] if size else [])
    if any(c < 0 or d < 0 for c, d in zip(counts, displs)):
        raise InvalidArgumentError(f"{what}: counts and displacements must be non-negative ({counts}, {displs})", op=op)
    if writable:
        check_disjoint(counts, displs, what, op)
    k = layout.elements
    if layout.dense and layout.lb >= 0:  # element j is elements j*k .. (j+1)*k-1 of the buffer from lb: a view
        if writable and not raw.flags.writeable:
            raise InvalidArgumentError(f"{what} is read-only", op=op)
        check_supported(layout.base, what, op)
        isz = layout.base.itemsize
        room = max(raw.size - layout.lb, 0) // layout.extent
        for i, (c, d) in enumerate(zip(counts, displs)):
            if d + c > room:
                raise InvalidArgumentError(
                    f"{what}: rank {i}'s block (count {c}, displacement {d}) does not fit in {room} datatype elements",
                    op=op)
        flat = raw[layout.lb:layout.lb + room * k * isz].view(layout.base)
        return VBuf(flat, layout.base, [c * k for c in counts], [d * k for d in displs])
    elements = np.concatenate([np.arange(d, d + c, dtype=np.int64) for c, d in zip(counts, displs)] or
                              [np.zeros(0, np.int64)])
    try:
        access = layout.access_elements(elements, raw.size)
    except ValueError as exc:
        raise InvalidArgumentError(f"{what}: the blocks of the datatype do not fit the buffer ({exc})", op=op) from None
    buf = _with_access(raw, layout, access, datatype, what, op, writable)
    packed_displs = [int(x) for x in np.concatenate(([0], np.cumsum(counts)[:-1]))] if size else []
    return VBuf(buf.array, buf.dtype, [c * k for c in counts], [d * k for d in packed_displs])
