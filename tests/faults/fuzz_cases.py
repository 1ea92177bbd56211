"""Argument fuzzing of pycoll's buffer API: hypothesis strategies for good and bad calls, who must reject them, NumPy references.

An example is one collective call (blocking or ``I...``) with at most one defect. ``build`` turns it into one
rank's arguments and says whether that rank must reject them; ``run_one`` makes the call and checks that a
rank with a defect raises InvalidArgumentError naming the call with every buffer unchanged, and that with no
defect anywhere the result equals NumPy's and nothing else in the buffers changed. The same examples run
in-process on a 1-rank communicator (tests/faults/test_fuzz_args.py) and on every rank of a job (``main``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

# ---------------------------------------------------------------------------------------------
# what is generated
# ---------------------------------------------------------------------------------------------

COLLS = (
    "Allreduce", "Reduce", "Reduce_scatter", "Reduce_scatter_block", "Allgather", "Allgatherv", "Bcast",
    "Gather", "Gatherv", "Scatter", "Scatterv", "Alltoall", "Alltoallv",
)
VECTOR = {"Allgatherv", "Gatherv", "Scatterv", "Alltoallv"}
ROOTED = {"Reduce", "Bcast", "Gather", "Gatherv", "Scatter", "Scatterv"}
REDUCING = {"Allreduce", "Reduce", "Reduce_scatter", "Reduce_scatter_block"}

DTYPES = ("float32", "float64", "int32", "int64", "uint8", "int8", "complex128", "bool", "float16")

# The element classes each op reduces (pycoll's table; AVG is pycoll's own op).
_INT, _FLOAT, _CPLX, _BOOL = "int", "float", "complex", "bool"
OP_CLASSES = {
    "SUM": (_INT, _FLOAT, _CPLX), "PROD": (_INT, _FLOAT, _CPLX), "MIN": (_INT, _FLOAT), "MAX": (_INT, _FLOAT),
    "AVG": (_FLOAT, _CPLX), "BAND": (_INT, _BOOL), "BOR": (_INT, _BOOL), "BXOR": (_INT, _BOOL),
    "LAND": (_INT, _BOOL), "LOR": (_INT, _BOOL), "LXOR": (_INT, _BOOL),
}
UFUNCS = {
    "SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum, "BAND": np.bitwise_and,
    "BOR": np.bitwise_or, "BXOR": np.bitwise_xor, "LAND": np.logical_and, "LOR": np.logical_or,
    "LXOR": np.logical_xor,
}


def dclass(dt: Any) -> str:
    return {"i": _INT, "u": _INT, "f": _FLOAT, "c": _CPLX, "b": _BOOL}.get(np.dtype(dt).kind, "other")


def op_ok(op: str, dt: Any) -> bool:
    return dclass(dt) in OP_CLASSES[op]


# Defects of one buffer argument: any spec, simple specs only, vector specs only, written buffers only.
BUF_DEFECTS = ("noncontig", "readonly", "bytes", "nonbuffer", "unsupported", "cuda", "dtype_name")
SIMPLE_ONLY = ("count_big", "count_neg", "count_bad", "spec_items")
VEC_DEFECTS = ("vlen", "vneg", "vfloat", "vstr", "vdispl_oob", "vdispl_neg", "voverlap", "vitems")
WRITE_ONLY = ("readonly", "bytes", "voverlap")
RC_DEFECTS = ("rc_len", "rc_neg", "rc_float", "rc_str", "rc_scalar")  # Reduce_scatter's recvcounts


class FakeCuda:
    """Claims to be a CUDA array."""

    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}


class BrokenArrayInterface:
    """An __array_interface__ that NumPy cannot read."""

    __array_interface__ = {"shape": (4,), "typestr": "<f4"}  # no "data"


class BrokenDlpack:
    """A CPU DLPack producer whose export fails, as for a torch tensor that requires grad."""

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, *args, **kwargs):
        raise RuntimeError("cannot export this tensor")


class RaisingDevice:
    """A __dlpack_device__ that raises."""

    def __dlpack_device__(self):
        raise ValueError("no device")

    def __dlpack__(self, *args, **kwargs):
        raise ValueError("no device")


def nonbuffers() -> list:
    # no None: mpi4py reads it as IN_PLACE in send positions and as an empty buffer in point-to-point
    return [7, 2.5, "buf", object(), {"a": 1}, [], [1, 2, 3, 4], [[1, 2]], FakeCuda(),
            BrokenArrayInterface(), BrokenDlpack(), RaisingDevice(), range(4), {1, 2}]


BAD_DTYPES = ("nonsense", "U", "S", str, dict, "O", "M8[s]", "(2,)f4", "f4,i4", "V3", ">f4", "c32", "")
BAD_COUNTS = (1.5, "2", [1, 2, 3], (1, 2), np.float64(2.0), 1j)
BAD_ROOTS = (-1, "size", "size+2", 1.5, "0", None, "np_size", [0], -100)
BAD_OPS = ("nosuch", 7, None, np.add, "", "sum ")


def unsupported(n: int, variant: int) -> np.ndarray:
    kinds = ("datetime64[s]", object, "U3", [("a", "<i4"), ("b", "<f4")], ">i4", "timedelta64[s]", np.clongdouble)
    return np.zeros(n, kinds[variant % len(kinds)])


@dataclass(frozen=True)
class Ex:
    """One fuzzed call: the collective, its form, sizes and values, and at most one defect."""

    coll: str
    nb: bool  # the I... form, then Wait
    dtype: str
    n: int  # elements per rank (per block)
    counts: tuple  # per-rank counts (v-variants, Reduce_scatter); Alltoallv: the size x size matrix, row-major
    root: int
    op: str
    op_as_str: bool
    in_place: bool
    send_form: str
    recv_form: str
    ignored_none: bool  # pass None for arguments the rank ignores (Reduce/Gather recvbuf, Scatter sendbuf)
    defect: str  # "" when valid
    role: str  # the argument it hits: send, recv, buf, op, root, counts
    variant: int
    delta: int
    other_dtype: str
    seed: int

    def short(self) -> str:
        bits = [("I" if self.nb else "") + self.coll, self.dtype, f"n={self.n}"]
        if self.counts:
            bits.append(f"counts={list(self.counts)}")
        if self.coll in ROOTED:
            bits.append(f"root={self.root}")
        if self.coll in REDUCING:
            bits.append(f"op={self.op}")
        if self.in_place:
            bits.append("IN_PLACE")
        bits.append(f"forms={self.send_form}/{self.recv_form}")
        if self.defect:
            bits.append(f"defect={self.defect}@{self.role} variant={self.variant} delta={self.delta} other={self.other_dtype}")
        return " ".join(bits)


SIMPLE_FORMS = ("array", "array", "2d", "fortran", "count", "count_type", "type", "tuple_count", "memoryview", "tuple_spec")
VFORMS = ("v_counts", "v_counts_displs", "v_tuple", "v_type4", "v_type3", "v_plain", "v_ndarray")


def vector_role(coll: str, role: str) -> bool:
    return (coll in ("Allgatherv", "Gatherv") and role == "recv") or (coll == "Scatterv" and role == "send") or coll == "Alltoallv"


def defects_for(coll: str) -> list:
    """(defect, role) pairs for a collective; ("", "") is a valid call."""
    out = [("", "")] * 8
    roles = ("buf",) if coll == "Bcast" else ("send", "recv")
    for role in roles:
        for d in BUF_DEFECTS + (VEC_DEFECTS if vector_role(coll, role) else SIMPLE_ONLY):
            if d in WRITE_ONLY and role == "send":
                continue
            out.append((d, role))
        if coll != "Bcast" and not vector_role(coll, role):
            out.append(("count", role))
        if coll != "Bcast" and not (coll == "Alltoallv" and role == "recv"):
            out.append(("dtype", role))
    out.append(("inplace_bad", "buf" if coll == "Bcast" else "recv"))
    if coll in ("Reduce", "Gather", "Gatherv", "Scatter", "Scatterv"):
        out.append(("inplace_bad", "send"))
    if coll != "Bcast":
        out += [("alias", "send")] * 2
    if coll in ROOTED:
        out += [("root", "root")] * 2
    if coll in REDUCING:
        out += [("op", "op")] * 3
    if coll == "Reduce_scatter":
        out += [(d, "counts") for d in RC_DEFECTS]
    return out


@st.composite
def examples(draw, size: int, colls: tuple = COLLS) -> Ex:
    """A fuzzed call on a ``size``-rank communicator (identical on every rank)."""
    coll = draw(st.sampled_from(colls))
    defect, role = draw(st.sampled_from(defects_for(coll)))
    if defect == "voverlap" and size < 2:
        defect, role = "", ""
    dtype = draw(st.sampled_from(DTYPES))
    op = draw(st.sampled_from([o for o in OP_CLASSES if op_ok(o, dtype)]))
    lo = 2 if defect in ("noncontig", "alias") else (1 if defect == "voverlap" else 0)
    n = draw(st.integers(lo, 5))
    counts: tuple = ()
    if coll in VECTOR or coll == "Reduce_scatter":
        k = size * size if coll == "Alltoallv" else size
        counts = tuple(draw(st.lists(st.integers(lo, 3), min_size=k, max_size=k)))
    in_place = (coll != "Bcast" and defect in ("", "op", "root") + BUF_DEFECTS + SIMPLE_ONLY + VEC_DEFECTS + RC_DEFECTS
                and role != "send" and draw(st.integers(0, 3)) == 0)
    if coll == "Alltoallv" and in_place:  # in place, what I send to q is what q sends me: symmetric counts
        m = np.array(counts).reshape(size, size)
        counts = tuple(int(x) for x in np.maximum(m, m.T).reshape(-1))
    return Ex(
        coll=coll,
        nb=draw(st.booleans()),
        dtype=dtype,
        n=n,
        counts=counts,
        root=draw(st.integers(0, size - 1)),
        op=op,
        op_as_str=draw(st.integers(0, 4)) == 0,
        in_place=in_place,
        send_form=draw(st.sampled_from(VFORMS if vector_role(coll, "send") else SIMPLE_FORMS)),
        recv_form=draw(st.sampled_from(VFORMS if vector_role(coll, "recv") else SIMPLE_FORMS)),
        ignored_none=draw(st.booleans()),
        defect=defect,
        role=role,
        variant=draw(st.integers(0, 40)),
        delta=draw(st.sampled_from([-2, -1, 1, 2, 3])),
        other_dtype=draw(st.sampled_from([d for d in DTYPES if d != dtype])),
        seed=draw(st.integers(0, 2**31)),
    )


# ---------------------------------------------------------------------------------------------
# values and references
# ---------------------------------------------------------------------------------------------


def values(dt: Any, n: int, seed: int, rank: int, salt: int) -> np.ndarray:
    """Small integral values: sums and products stay exact in every dtype used here."""
    dt = np.dtype(dt)
    rng = np.random.default_rng([seed, rank + 1, salt])
    if dt.kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    if dt.kind == "u":
        return rng.integers(0, 4, n).astype(dt)
    if dt.kind == "c":
        return (rng.integers(-3, 4, n) + 1j * rng.integers(-3, 4, n)).astype(dt)
    return rng.integers(-3, 4, n).astype(dt)


def reduce_ref(op: str, arrays: list, dt: np.dtype) -> np.ndarray:
    if op == "AVG":
        wide = np.complex128 if dt.kind == "c" else np.float64
        return (np.sum([a.astype(wide) for a in arrays], axis=0) / len(arrays)).astype(dt)
    acc = arrays[0].copy()
    for a in arrays[1:]:
        acc = np.asarray(UFUNCS[op](acc, a)).astype(dt)
    return acc


def datatype_of(dt: np.dtype) -> Any:
    from pycoll import datatypes

    return datatypes.from_numpy(dt)


# ---------------------------------------------------------------------------------------------
# one rank's arguments
# ---------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """One rank's call: the arguments, the memory behind them, whether it must reject, what success looks like."""

    method: str
    args: tuple = ()
    bad: list = field(default_factory=list)  # why this rank must reject (empty: it must accept)
    inputs: list = field(default_factory=list)  # (label, base) the call never changes
    outputs: list = field(default_factory=list)  # (label, base) changed only inside result regions
    regions: list = field(default_factory=list)  # (label, view, expected or None for "anything")


class Builder:
    """Builds the ``Plan`` of one rank for an example."""

    def __init__(self, ex: Ex, rank: int, size: int, MPI: Any) -> None:
        self.ex, self.rank, self.size, self.MPI = ex, rank, size, MPI
        self.dt = np.dtype(ex.dtype)
        self.plan = Plan(("I" + ex.coll[0].lower() + ex.coll[1:]) if ex.nb else ex.coll)

    def vals(self, q: int, n: int, salt: int, dt: Any = None) -> np.ndarray:
        return values(self.dt if dt is None else dt, max(n, 0), self.ex.seed, q, salt)

    def hit(self, role: str, *defects: str) -> bool:
        return self.ex.role == role and self.ex.defect in defects

    def bad(self, why: str, applies: bool = True) -> None:
        if applies:
            self.plan.bad.append(why)

    def keep(self, label: str, base: Any, written: bool) -> None:
        if isinstance(base, np.ndarray):
            (self.plan.outputs if written else self.plan.inputs).append((label, base))

    def result(self, label: str, view: Any, expected: Optional[np.ndarray]) -> None:
        if view is not None:
            self.plan.regions.append((label, view, expected))

    # -- buffers ----------------------------------------------------------------------------
    def wrap(self, vals: np.ndarray, form: str, blocks: int) -> tuple:
        """(spec, base, view): the argument, the memory it owns, the elements the call uses."""
        n = vals.size
        if form == "2d" and n >= 2 and n % 2 == 0:
            base = vals.copy().reshape(2, n // 2)
            return base, base, base.reshape(-1)
        if form == "fortran" and n >= 2 and n % 2 == 0:
            base = vals.copy().reshape(n // 2, 2).T  # Fortran order; memory in the order of vals
            return base, base, base.reshape(-1, order="A")
        if form in ("count", "count_type", "tuple_count", "tuple_spec"):
            base = np.concatenate([vals, self.vals(self.rank, 2, 77, vals.dtype)])  # two spare elements past the count
            count = n // blocks
            spec: Any = {
                "count": lambda: [base, count],
                "count_type": lambda: [base, count, datatype_of(self.dt)],
                "tuple_count": lambda: [base, (count, 0)],
                "tuple_spec": lambda: (base, count),
            }[form]()
            return spec, base, base[:n]
        base = vals.copy()
        if form == "type":
            return [base, datatype_of(self.dt)], base, base
        if form == "memoryview":
            return memoryview(base), base, base
        return base, base, base

    def bad_buffer(self, defect: str, vals: np.ndarray, blocks: int) -> tuple:
        """(spec, base) of a defective buffer holding ``vals``."""
        v, n = self.ex.variant, vals.size
        if defect == "noncontig":
            if n < 2:
                vals, n = np.concatenate([vals, self.vals(self.rank, 2 - n, 78, vals.dtype)]), 2
            k = v % 4
            if k == 0:
                big = np.zeros(2 * n, vals.dtype)
                big[::2] = vals
                return big[::2], big
            if k == 1:
                big = np.zeros((n, 2), vals.dtype)
                big[:, 0] = vals
                return big[:, :1], big
            if k == 2:
                big = np.zeros((n, 2), vals.dtype)
                big[:, 0] = vals
                return big.T[:1], big  # a row of a transposed array
            big = vals.copy()
            return big[::-1], big
        if defect == "readonly":
            base = vals.copy()
            base.flags.writeable = False
            return base, base
        if defect == "bytes":
            return vals.tobytes(), None
        if defect == "nonbuffer":
            objs = nonbuffers()
            return objs[v % len(objs)], None
        if defect == "unsupported":
            base = unsupported(n, v)
            if base.dtype.hasobject and v % 2:  # object memory is never a buffer, even with a datatype
                return [base, datatype_of(self.dt)], base
            return base, base
        if defect == "cuda":
            return FakeCuda(), None
        base = vals.copy()
        if defect == "dtype_name":
            return [base, BAD_DTYPES[v % len(BAD_DTYPES)]], base
        count = n // blocks
        if defect == "count_big":
            return [base, count + 1 + v % 3], base
        if defect == "count_neg":
            return [base, -1 - v % 3], base
        if defect == "count_bad":
            return [base, BAD_COUNTS[v % len(BAD_COUNTS)]], base
        if defect == "spec_items":
            return ([] if v % 3 == 0 else [base, count, datatype_of(self.dt), 0] if v % 3 == 1 else (base, 1, 2)), base
        raise AssertionError(defect)

    def simple(self, role: str, n: int, salt: int, *, written: bool, parsed: bool = True, blocks: int = 1,
               vals: Optional[np.ndarray] = None, q: Optional[int] = None, delta: Optional[int] = None) -> tuple:
        """A simple-spec argument of n elements (per-rank total) with this role's defects: (spec, view or None).

        The count defect adds ``delta`` to n; the dtype defect uses the other dtype; both return view None.
        """
        ex = self.ex
        q = self.rank if q is None else q
        if self.hit(role, "inplace_bad"):
            return self.MPI.IN_PLACE, None
        changed = False
        if self.hit(role, "count"):
            n2 = n + (ex.delta if delta is None else delta)
            n, changed = (n2 if n2 >= 0 else n + 1), True
        if self.hit(role, "dtype"):
            vals, changed = self.vals(q, n, salt, ex.other_dtype), True
        elif vals is None or changed:
            vals = self.vals(q, n, salt)
        if self.hit(role, *BUF_DEFECTS, *SIMPLE_ONLY):
            spec, base = self.bad_buffer(ex.defect, vals, blocks)
            self.bad(f"{role}: {ex.defect}", parsed)
            self.keep(role, base, False)  # a rejected buffer is never written
            return spec, None
        form = ex.send_form if role == "send" else ex.recv_form
        if form.startswith("v_") or (self.hit(role, "dtype") and form in ("type", "count_type")):
            form = "array"  # (a datatype would reinterpret the other dtype's bytes as the right one)
        if vals.size % blocks and form in ("count", "count_type", "tuple_count", "tuple_spec"):
            form = "array"  # a per-block count would round the changed length away
        spec, base, view = self.wrap(vals, form, blocks)
        self.keep(role, base, written and parsed)
        return spec, (None if changed else view)

    def vector(self, role: str, blocks: list, *, written: bool, parsed: bool = True, salt: int = 79) -> tuple:
        """A vector-spec argument whose block q holds ``blocks[q]``: (spec, block views or None, flat length)."""
        ex, v = self.ex, self.ex.variant
        if self.hit(role, "inplace_bad"):
            return self.MPI.IN_PLACE, None, 0
        if self.hit(role, "dtype"):
            blocks = [b.astype(ex.other_dtype) for b in blocks]
        form = ex.send_form if role == "send" else ex.recv_form
        if not form.startswith("v_"):
            form = "v_counts_displs"
        counts = [b.size for b in blocks]
        if form == "v_plain" and len(set(counts)) > 1:
            form = "v_counts"
        gap = 1 if form in ("v_counts_displs", "v_tuple", "v_type4", "v_ndarray") else 0
        displs, at = [], 0
        for c in counts:
            displs.append(at)
            at += c + gap
        dt = blocks[0].dtype if blocks else self.dt
        base = self.vals(self.rank, at, salt, dt)
        for d, blk in zip(displs, blocks):
            base[d : d + blk.size] = blk
        defect = ex.defect if ex.role == role else ""
        obj: Any = base
        if defect in BUF_DEFECTS:
            obj, bad_base = self.bad_buffer(defect, base, 1)
            self.bad(f"{role}: {defect}", parsed)
            self.keep(role, bad_base, False)
            if defect == "dtype_name":
                obj, form = bad_base, "bad_type"
            elif form in ("v_type4", "v_type3") and not (isinstance(bad_base, np.ndarray) and bad_base.dtype.hasobject):
                form = "v_counts_displs"  # a datatype would reinterpret the bytes: fine for any plain memory
        c_spec: Any = list(counts)
        d_spec: Any = list(displs)
        k = v % max(len(counts), 1)
        if defect in VEC_DEFECTS:
            self.bad(f"{role}: {defect}", parsed)
            if form in ("v_plain", "v_counts", "v_type3"):
                form = "v_counts_displs"  # a spec with both lists to break
            if defect == "vlen":
                c_spec, d_spec = (c_spec + [0], d_spec + [at]) if v % 2 or not c_spec else (c_spec[:-1], d_spec[:-1])
            elif defect == "vneg":
                c_spec[k] = -1 - v % 2
            elif defect == "vfloat":
                c_spec[k] = c_spec[k] + 0.5
            elif defect == "vstr":
                c_spec[k] = ("x", None, "1", [1])[v % 4]
            elif defect == "vdispl_oob":
                d_spec[k] = at + 1 + v % 3
            elif defect == "vdispl_neg":
                d_spec[k] = -1 - v % 2
            elif defect == "voverlap":  # two non-empty blocks on the same elements
                d_spec[(k + 1) % len(counts)] = d_spec[k]
            elif defect == "vitems":
                form = "v_items5"
        spec: Any = {
            "bad_type": lambda: [obj, c_spec, d_spec, BAD_DTYPES[v % len(BAD_DTYPES)]],
            "v_counts": lambda: [obj, c_spec],
            "v_counts_displs": lambda: [obj, c_spec, d_spec],
            "v_tuple": lambda: [obj, (c_spec, d_spec)],
            "v_type4": lambda: [obj, c_spec, d_spec, datatype_of(dt)],
            "v_type3": lambda: [obj, c_spec, datatype_of(dt)],
            "v_plain": lambda: obj,
            "v_ndarray": lambda: [obj, np.array(c_spec, dtype=object if defect == "vstr" else None), np.array(d_spec)],
            "v_items5": lambda: [obj, c_spec, d_spec, datatype_of(dt), 0],
        }[form]()
        if defect in BUF_DEFECTS:
            return spec, None, at
        self.keep(role, base, written and parsed and not defect)
        if defect or self.hit(role, "dtype"):
            return spec, None, at
        return spec, [base[d : d + c] for d, c in zip(displs, counts)], at

    def op(self, checked: Any, applies: bool = True) -> Any:
        """The op argument; bad where it cannot reduce ``checked`` (the dtype the call checks it against)."""
        ex, v = self.ex, self.ex.variant
        if ex.role == "op":
            if v % 2:
                wrong = [o for o in OP_CLASSES if not op_ok(o, self.dt)]
                name = wrong[v % len(wrong)]
                self.bad(f"op {name} on {self.dt.name}", applies)
                return getattr(self.MPI, name)
            self.bad("op is not an op", applies)
            return BAD_OPS[v % len(BAD_OPS)]
        if not op_ok(ex.op, checked):
            self.bad(f"op {ex.op} on {np.dtype(checked).name}", applies)
        return ex.op.lower() if ex.op_as_str else getattr(self.MPI, ex.op)

    def root(self) -> tuple:
        """(root argument, rank whose data is the root's, whether this rank is the root)."""
        ex = self.ex
        if ex.role != "root":
            return ex.root, ex.root, self.rank == ex.root
        self.bad("bad root")
        r = BAD_ROOTS[ex.variant % len(BAD_ROOTS)]
        if isinstance(r, str) and r in ("size", "size+2", "np_size"):
            r = {"size": self.size, "size+2": self.size + 2, "np_size": np.int64(self.size)}[r]
        return r, 0, False


# ---------------------------------------------------------------------------------------------
# the collectives
# ---------------------------------------------------------------------------------------------


def _mismatch(b: Builder, applies: bool = True) -> None:
    """Count and dtype defects break a call wherever both sides are compared."""
    if b.ex.defect in ("count", "dtype"):
        b.bad(f"{b.ex.role}: {b.ex.defect} differs", applies)


def _alias(b: Builder, base: np.ndarray, applies: bool, written: bool) -> None:
    """Send and recv share ``base``: bad where both are used and overlap; ``written`` if the call may write it."""
    b.plan.inputs[:] = []
    b.plan.outputs[:] = []
    b.plan.regions[:] = []
    b.keep("shared", base, written)
    b.bad("sendbuf and recvbuf overlap", applies)


def build_allreduce(b: Builder) -> None:
    ex, r, p, n = b.ex, b.rank, b.size, b.ex.n
    inputs = [b.vals(q, n, 1) for q in range(p)]
    want = reduce_ref(ex.op, inputs, b.dt)
    if ex.in_place:
        recv, view = b.simple("recv", n, 1, vals=inputs[r], written=True)
        send = b.MPI.IN_PLACE
    else:
        recv, view = b.simple("recv", n, 2, written=True)
        send, _ = b.simple("send", n, 1, vals=inputs[r], written=False)
        _mismatch(b)
        if b.hit("recv", "inplace_bad"):
            b.bad("recvbuf is IN_PLACE")
    if ex.defect == "alias":
        base = b.vals(r, 2 * n - 1, 1)
        send, recv = (base[:n], base[n - 1 :]) if ex.variant % 2 else (base[:n], base[:n])
        _alias(b, base, True, False)
        view = None
    b.result("recv", view, want)
    b.plan.args = (send, recv, b.op(b.dt if not b.hit("recv", "dtype") else ex.other_dtype))


def build_reduce(b: Builder) -> None:
    ex, r, p, n = b.ex, b.rank, b.size, b.ex.n
    root, rr, at_root = b.root()
    inputs = [b.vals(q, n, 1) for q in range(p)]
    want = reduce_ref(ex.op, inputs, b.dt)
    recv: Any = None
    view = None
    if ex.in_place and at_root:
        recv, view = b.simple("recv", n, 1, vals=inputs[r], written=True)
        send = b.MPI.IN_PLACE
    else:
        send, _ = b.simple("send", n, 1, vals=inputs[r], written=False)
        if at_root or not ex.ignored_none:
            recv, view = b.simple("recv", n, 2, written=True, parsed=at_root)
        if b.hit("send", "inplace_bad"):
            b.bad("IN_PLACE sendbuf off the root", not at_root)
            want = None  # at the root: in place after all, over whatever recvbuf holds
        elif b.hit("recv", "inplace_bad"):
            b.bad("recvbuf is IN_PLACE", at_root and recv is not None)
        else:
            _mismatch(b, at_root)
    if ex.defect == "alias":
        base = b.vals(r, 2 * n - 1, 1)
        send, recv = base[:n], base[n - 1 :]
        _alias(b, base, at_root, False)
        view = None
    if at_root:
        b.result("recv", view, want)
    sdt = ex.other_dtype if b.hit("send", "dtype") else b.dt
    b.plan.args = (send, recv, b.op(sdt), root)


def build_reduce_scatter(b: Builder, block: bool) -> None:
    ex, r, p = b.ex, b.rank, b.size
    counts = [ex.n] * p if block else list(ex.counts)
    total, mine = sum(counts), sum(counts[:r])
    inputs = [b.vals(q, total, 1) for q in range(p)]
    want = reduce_ref(ex.op, inputs, b.dt)[mine : mine + counts[r]]
    recvcounts: Any = list(counts)
    if ex.role == "counts":
        b.bad(f"recvcounts: {ex.defect}")
        v, rc = ex.variant, list(counts)
        if ex.defect == "rc_len":
            rc = rc + [0] if v % 2 or not rc else rc[:-1]
        elif ex.defect == "rc_neg":
            rc[v % p] = -1
        elif ex.defect == "rc_float":
            rc[v % p] = rc[v % p] + 0.5
        elif ex.defect == "rc_str":
            rc[v % p] = ("x", None, "2", [1])[v % 4]
        elif ex.defect == "rc_scalar":
            rc = counts[0]
        recvcounts = rc
    elif not block and not ex.in_place and ex.variant % 3 == 0 and ex.role != "recv":
        recvcounts = None  # each rank's recvbuf length is its count
    if ex.in_place:  # Reduce_scatter_block's recvbuf holds every block: a spec's count is per block (as mpi4py)
        recv, view = b.simple("recv", total, 1, vals=inputs[r], written=True, blocks=p if block else 1)
        send = b.MPI.IN_PLACE
        if view is not None:
            b.result("recv", view[: counts[r]], want)
            b.result("rest of recv", view[counts[r] :], None)
    else:
        if b.hit("recv", "count") and not block:
            # a longer recvbuf is allowed here (only counts[rank] elements are written): make it shorter
            shorter = min(abs(ex.delta), counts[r]) if counts[r] else -1
            recv, view = b.simple("recv", counts[r], 2, written=True, delta=-shorter)
            b.bad("recvbuf shorter than its count", counts[r] > 0)
        else:
            recv, view = b.simple("recv", counts[r], 2, written=True)
            _mismatch(b)
        send, _ = b.simple("send", total, 1, vals=inputs[r], written=False, blocks=p if block else 1)
        if b.hit("recv", "inplace_bad"):
            b.bad("recvbuf is IN_PLACE")
        b.result("recv", view, want)
    if ex.defect == "alias":
        base = b.vals(r, total, 1)
        send, recv = base, base[mine : mine + counts[r]]
        _alias(b, base, counts[r] > 0, False)
    odt = ex.other_dtype if b.hit("recv", "dtype") else b.dt
    b.plan.args = (send, recv, b.op(odt)) if block else (send, recv, recvcounts, b.op(odt))


def build_allgather(b: Builder, vector: bool) -> None:
    ex, r, p = b.ex, b.rank, b.size
    counts = list(ex.counts) if vector else [ex.n] * p
    inputs = [b.vals(q, counts[q], 1) for q in range(p)]
    junk = [b.vals(r, c, 2 + q) for q, c in enumerate(counts)]
    if ex.in_place:
        junk[r] = inputs[r]
    if vector:
        recv, views, _ = b.vector("recv", junk, written=True)
    else:
        recv, view = b.simple("recv", p * ex.n, 2, vals=np.concatenate(junk), written=True, blocks=p)
        views = None if view is None else [view[q * ex.n : (q + 1) * ex.n] for q in range(p)]
    if b.hit("recv", "inplace_bad"):
        b.bad("recvbuf is IN_PLACE")
    if ex.in_place:
        send = b.MPI.IN_PLACE
    else:
        send, _ = b.simple("send", counts[r], 1, vals=inputs[r], written=False)
        if not (vector and b.hit("recv", "count")):
            _mismatch(b)
    if ex.defect == "alias":
        base = np.concatenate(junk)
        at = sum(counts[:r])
        send, recv = base[at : at + counts[r]], ([base, counts] if vector else base)
        _alias(b, base, counts[r] > 0, counts[r] == 0)
        views = [base[sum(counts[:q]) : sum(counts[: q + 1])] for q in range(p)] if counts[r] == 0 else None
    for q in range(p) if views is not None else ():
        b.result(f"recv block {q}", views[q], inputs[q])
    b.plan.args = (send, recv)


def build_bcast(b: Builder) -> None:
    n = b.ex.n
    root, rr, at_root = b.root()
    data = b.vals(rr, n, 1)
    if at_root:
        buf, _ = b.simple("buf", n, 1, vals=data, written=False)
        b.plan.bad = [w for w in b.plan.bad if w not in ("buf: readonly", "buf: bytes")]  # fine at the root
    else:
        buf, view = b.simple("buf", n, 2, written=True)
        b.result("buf", view, data)
    if b.hit("buf", "inplace_bad"):
        b.bad("buf is IN_PLACE")
    b.plan.args = (buf, root)


def build_gather(b: Builder, vector: bool) -> None:
    ex, r, p = b.ex, b.rank, b.size
    root, rr, at_root = b.root()
    counts = list(ex.counts) if vector else [ex.n] * p
    inputs = [b.vals(q, counts[q], 1) for q in range(p)]
    junk = [b.vals(r, c, 2 + q) for q, c in enumerate(counts)]
    if ex.in_place and at_root:
        junk[r] = inputs[r]
    recv: Any = None
    views = None
    if at_root or not ex.ignored_none:
        if vector:
            recv, views, _ = b.vector("recv", junk, written=True, parsed=at_root)
        else:
            recv, view = b.simple("recv", p * ex.n, 2, vals=np.concatenate(junk), written=True, parsed=at_root, blocks=p)
            views = None if view is None else [view[q * ex.n : (q + 1) * ex.n] for q in range(p)]
        if b.hit("recv", "inplace_bad"):
            b.bad("recvbuf is IN_PLACE", at_root)
    if ex.in_place and at_root:
        send = b.MPI.IN_PLACE
    else:
        send, _ = b.simple("send", counts[r], 1, vals=inputs[r], written=False)
        if b.hit("send", "inplace_bad"):
            b.bad("IN_PLACE sendbuf off the root", not at_root)
            views = None  # at the root: in place after all, its block is whatever recvbuf held
        elif not (vector and b.hit("recv", "count")):
            _mismatch(b, at_root)
    if ex.defect == "alias":
        base = np.concatenate(junk)
        at = sum(counts[:r])
        send, recv = base[at : at + counts[r]], ([base, counts] if vector else base)
        _alias(b, base, at_root and counts[r] > 0, at_root and counts[r] == 0)
        views = [base[sum(counts[:q]) : sum(counts[: q + 1])] for q in range(p)] if counts[r] == 0 else None
    if at_root:
        for q in range(p) if views is not None else ():
            b.result(f"recv block {q}", views[q], inputs[q])
    b.plan.args = (send, recv, root)


def build_scatter(b: Builder, vector: bool) -> None:
    ex, r, p = b.ex, b.rank, b.size
    root, rr, at_root = b.root()
    counts = list(ex.counts) if vector else [ex.n] * p
    blocks = [b.vals(rr, c, 10 + q) for q, c in enumerate(counts)]
    send: Any = None
    if at_root or not ex.ignored_none:
        if vector:
            send, _, _ = b.vector("send", blocks, written=False, parsed=at_root)
        else:
            send, _ = b.simple("send", p * ex.n, 1, vals=np.concatenate(blocks), written=False, parsed=at_root, blocks=p)
        if b.hit("send", "inplace_bad"):
            b.bad("IN_PLACE sendbuf at the root", at_root)
    if ex.in_place and at_root:
        recv, view = b.MPI.IN_PLACE, None
    else:
        recv, view = b.simple("recv", counts[r], 2, written=True)
        if b.hit("recv", "inplace_bad"):
            b.bad("IN_PLACE recvbuf off the root", not at_root)
        elif not (vector and b.hit("send", "count")):
            _mismatch(b, at_root)
    if ex.defect == "alias":
        base = np.concatenate(blocks)
        at = sum(counts[:r])
        send = ([base, counts] if vector else base) if at_root or not ex.ignored_none else None
        recv = base[at : at + counts[r]]
        # the recv block is written with what the root sends, which is what it holds already
        _alias(b, base, at_root and counts[r] > 0, not (at_root and counts[r] > 0))
        view = recv if not (at_root and counts[r] > 0) else None
    b.result("recv", view, blocks[r])
    b.plan.args = (send, recv, root)


def build_alltoall(b: Builder, vector: bool) -> None:
    ex, r, p = b.ex, b.rank, b.size
    mat = np.array(ex.counts).reshape(p, p) if vector else np.full((p, p), ex.n)
    blk = [[b.vals(q, int(mat[q, j]), 10 + j) for j in range(p)] for q in range(p)]  # what q sends to j
    junk = [b.vals(r, int(mat[q, r]), 30 + q) for q in range(p)]
    if ex.in_place:
        junk = [x.copy() for x in blk[r]]  # symmetric counts: my outgoing blocks have the incoming sizes
    if vector:
        recv, views, length = b.vector("recv", junk, written=True, salt=81)
    else:
        length = p * ex.n
        recv, view = b.simple("recv", length, 2, vals=np.concatenate(junk), written=True, blocks=p)
        views = None if view is None else [view[q * ex.n : (q + 1) * ex.n] for q in range(p)]
    if b.hit("recv", "inplace_bad"):
        b.bad("recvbuf is IN_PLACE")
    if ex.in_place:
        send = b.MPI.IN_PLACE
    elif vector:
        send, _, _ = b.vector("send", blk[r], written=False, salt=82)
        _mismatch(b)
    else:
        send, _ = b.simple("send", p * ex.n, 1, vals=np.concatenate(blk[r]), written=False, blocks=p)
        _mismatch(b)
    if ex.defect == "alias":
        send = recv  # the very same argument on both sides
        b.plan.regions[:] = []
        if length > 0:
            b.bad("sendbuf is recvbuf")
            b.plan.inputs += b.plan.outputs
            b.plan.outputs[:] = []
            views = None
        else:
            b.plan.inputs[:] = []
    for q in range(p) if views is not None else ():
        b.result(f"recv block {q}", views[q], blk[q][r])
    b.plan.args = (send, recv)


BUILDERS: dict = {
    "Allreduce": build_allreduce,
    "Reduce": build_reduce,
    "Reduce_scatter": lambda b: build_reduce_scatter(b, False),
    "Reduce_scatter_block": lambda b: build_reduce_scatter(b, True),
    "Allgather": lambda b: build_allgather(b, False),
    "Allgatherv": lambda b: build_allgather(b, True),
    "Bcast": build_bcast,
    "Gather": lambda b: build_gather(b, False),
    "Gatherv": lambda b: build_gather(b, True),
    "Scatter": lambda b: build_scatter(b, False),
    "Scatterv": lambda b: build_scatter(b, True),
    "Alltoall": lambda b: build_alltoall(b, False),
    "Alltoallv": lambda b: build_alltoall(b, True),
}


def build(ex: Ex, rank: int, size: int, MPI: Any) -> Plan:
    b = Builder(ex, rank, size, MPI)
    BUILDERS[ex.coll](b)
    return b.plan


# ---------------------------------------------------------------------------------------------
# running and judging one call
# ---------------------------------------------------------------------------------------------


def _bytes(base: np.ndarray) -> bytes:
    if base.dtype.hasobject:
        return repr(base.tolist()).encode()
    return np.ascontiguousarray(base).view(np.uint8).tobytes() if base.size else b""


def _equal(got: np.ndarray, want: np.ndarray, op: str) -> bool:
    if got.shape != want.shape:
        return False
    if op == "AVG" and got.dtype.kind in "fc":
        return bool(np.allclose(got.astype(np.complex128), want.astype(np.complex128), rtol=1e-2, atol=1e-2))
    return bool(np.array_equal(got, want))


def names_call(exc: BaseException, method: str) -> Optional[str]:
    """None if the error names the call (``.op`` is "<method> #<seq>" or "<method>" and str() shows it)."""
    op = getattr(exc, "op", None)
    if not op or op.split(" #")[0] != method:
        return f".op is {op!r}, expected {method!r} #<seq>"
    if op not in str(exc):
        return f"str() does not show .op {op!r}: {exc}"
    return None


OUTCOMES: dict = {}  # how the calls ended: rejected here / accepted and checked / ... (for the report)


def _tally(key: str) -> None:
    OUTCOMES[key] = OUTCOMES.get(key, 0) + 1


def run_one(comm: Any, MPI: Any, ex: Ex, symmetric: bool = False) -> list:
    """Make this rank's call of ``ex`` and judge it; returns the problems (empty when pycoll behaved).

    With ``symmetric``, calls that some ranks must reject and others accept are skipped (every rank
    builds every rank's plan, so all of them skip the same calls).
    """
    from pycoll.errors import InvalidArgumentError, MismatchError, PycollError

    size, rank = comm.Get_size(), comm.Get_rank()
    plans = [build(ex, q, size, MPI) for q in range(size)]
    me = plans[rank]
    others_bad = any(p.bad for q, p in enumerate(plans) if q != rank)
    if symmetric and len({bool(p.bad) for p in plans}) > 1:
        _tally("skipped (ranks would disagree)")
        return []
    before = [(label, base, _bytes(base)) for label, base in me.inputs + me.outputs]
    saved = [view.copy() for _, view, _ in me.regions]
    err: Optional[BaseException] = None
    try:
        out = getattr(comm, me.method)(*me.args)
        if ex.nb:
            out.Wait()
    except Exception as exc:  # noqa: BLE001 - judged below
        err = exc
    where = f"rank {rank}: {me.method} [{ex.short()}]"
    problems = []
    local = isinstance(err, InvalidArgumentError) and not isinstance(err, MismatchError)
    _tally("rejected" if local else "accepted, result checked" if err is None and not others_bad
           else "accepted, a peer rejected" if err is None else f"{type(err).__name__} (a peer rejected)")
    if me.bad:
        if not local:
            problems.append(f"{where}: must raise InvalidArgumentError ({'; '.join(me.bad)}), got {err!r}")
        else:
            why = names_call(err, me.method)
            if why:
                problems.append(f"{where}: {why}")
    elif err is not None and (local or not (others_bad and isinstance(err, PycollError))):
        tb = "".join(traceback.format_exception(type(err), err, err.__traceback__)[-3:])
        problems.append(f"{where}: valid arguments raised {err!r}\n{tb}")
    # what may have changed: nothing if this rank rejected; inputs never; outputs only in result regions
    checked_outputs = me.bad or err is None
    if err is None and not others_bad:
        for (label, view, want), old in zip(me.regions, saved):
            if want is not None and not _equal(view, want, ex.op):
                problems.append(f"{where}: {label} is {view.tolist()}, NumPy says {want.tolist()}")
            view[...] = old  # put it back: the rest must be as it was
    for label, base, old in before:
        is_output = any(base is o for _, o in me.outputs)
        if is_output and not checked_outputs:
            continue
        if is_output and err is None and others_bad:
            continue  # peers rejected: this rank's results are not defined
        if _bytes(base) != old:
            problems.append(f"{where}: {label} changed ({'output' if is_output else 'input'}; error {err!r})")
    return problems


# ---------------------------------------------------------------------------------------------
# Allreduce on the same arrays, changed between calls (the cached-plan fast path)
# ---------------------------------------------------------------------------------------------

STEPS = ("call", "call", "readonly", "writable", "bad_op", "reshape", "dtype_view", "alias", "shorter", "in_place")


def run_plan_steps(comm: Any, MPI: Any, steps: list, dtype: str, n: int, seed: int) -> list:
    """Repeat Allreduce on one pair of arrays while steps change them; each call is judged as in run_one."""
    from pycoll.errors import InvalidArgumentError

    size = comm.Get_size()
    dt = np.dtype(dtype)
    n = max(n, 2) if n % 2 == 0 else n + 1
    send, recv = values(dt, n, seed, comm.Get_rank(), 1), np.zeros(n, dt)
    op = MPI.SUM if op_ok("SUM", dt) else MPI.BOR
    problems: list = []
    s, rcv = send, recv
    for i, step in enumerate(steps):
        use_op, bad = op, ""
        if step == "readonly":
            recv.flags.writeable = False
        elif step == "writable":
            recv.flags.writeable = True
        elif step == "reshape":
            send.shape = (2, n // 2) if send.ndim == 1 else (n,)
        elif step == "dtype_view" and dt.itemsize in (4, 8):
            alt = np.dtype(np.int32 if dt.itemsize == 4 else np.int64) if dt.kind != "i" else np.dtype(np.float32 if dt.itemsize == 4 else np.float64)
            recv.dtype = alt if recv.dtype == dt else dt
        s, rcv = send, recv
        if step == "bad_op":
            use_op = MPI.MAX if dt.kind in "cb" else MPI.BAND if dt.kind == "f" else MPI.AVG
            bad = "op"
        elif step == "alias":
            s = rcv = recv
            bad = "alias"
        elif step == "shorter":
            rcv = recv[: n - 1]
            bad = "count"
        elif step == "in_place":
            s = MPI.IN_PLACE
        if not recv.flags.writeable:
            bad = bad or "readonly"
        if recv.dtype != dt and s is not MPI.IN_PLACE:
            bad = bad or "dtype"
        if recv.dtype != dt and step == "in_place" and not op_ok("SUM" if op is MPI.SUM else "BOR", recv.dtype):
            bad = bad or "op"
        before = (_bytes(send), _bytes(recv))
        expect_vals = [values(dt, n, seed, q, 1) for q in range(size)]
        err = None
        try:
            comm.Allreduce(s, rcv, use_op)
        except Exception as exc:  # noqa: BLE001
            err = exc
        where = f"rank {comm.Get_rank()}: Allreduce step {i} {step} of {steps} ({dtype}, n={n})"
        if bad:
            if not isinstance(err, InvalidArgumentError):
                problems.append(f"{where}: must raise InvalidArgumentError ({bad}), got {err!r}")
            elif names_call(err, "Allreduce"):
                problems.append(f"{where}: {names_call(err, 'Allreduce')}")
            if (_bytes(send), _bytes(recv)) != before:
                problems.append(f"{where}: a buffer changed although the call was rejected")
        elif err is not None:
            problems.append(f"{where}: valid arguments raised {err!r}")
        elif s is not MPI.IN_PLACE:
            if _bytes(send) != before[0]:
                problems.append(f"{where}: sendbuf changed")
            want = reduce_ref("SUM" if op is MPI.SUM else "BOR", expect_vals, dt)
            if recv.dtype == dt and not _equal(recv.reshape(-1), want, "SUM"):
                problems.append(f"{where}: result {recv.tolist()}, NumPy says {want.tolist()}")
        if s is MPI.IN_PLACE:  # in place reduced the old contents: start again from zeros
            recv.flags.writeable = True
            recv.dtype = dt
            recv[...] = 0
    return problems


# ---------------------------------------------------------------------------------------------
# the rank side of the multi-rank job
# ---------------------------------------------------------------------------------------------

FUZZ_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.generate],  # no shrinking: every rank must make the same calls, failing or not
    print_blob=False,
)


def main(argv: Optional[list] = None) -> int:
    """Fuzz every collective on MPI.COMM_WORLD; write OUT/rank<R>.json with the count and the problems."""
    import argparse

    ap = argparse.ArgumentParser(description="pycoll argument fuzzing, one rank")
    ap.add_argument("--out", required=True)
    ap.add_argument("--examples", type=int, default=300)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--symmetric", action="store_true", help="skip calls that only some ranks must reject")
    args = ap.parse_args(argv)
    from pycoll import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    problems: list = []
    tried = [0]
    trace = open(os.path.join(args.out, f"trace{rank}.txt"), "w") if os.environ.get("PYCOLL_FUZZ_TRACE") else None

    drawn: list = []

    # Rank 0 draws every example first and the others take its list: Hypothesis may draw differently on ranks whose
    # test runs took different paths or times, and every rank must make the same calls.
    @settings(max_examples=max(args.examples, 1), **FUZZ_SETTINGS)
    @given(ex=examples(size))
    def draw(ex: Ex) -> None:
        drawn.append(ex)

    def collectives() -> None:
        if rank == 0:
            draw()
        for ex in comm.bcast(drawn if rank == 0 else None, root=0):
            tried[0] += 1
            if trace is not None:
                trace.write(f"{tried[0]} {ex.short()}\n")
                trace.flush()
            try:
                problems.extend(run_one(comm, MPI, ex, args.symmetric))
            except Exception:  # noqa: BLE001 - a broken test must still report
                problems.append(f"rank {rank}: {ex.short()}: the fuzz harness failed:\n{traceback.format_exc()}")

    drawn_steps: list = []

    @settings(max_examples=max(args.steps, 1), **FUZZ_SETTINGS)
    @given(steps=st.lists(st.sampled_from(STEPS), min_size=1, max_size=8), dtype=st.sampled_from(DTYPES),
           n=st.integers(1, 6), seed=st.integers(0, 2**31))
    def draw_steps(steps: list, dtype: str, n: int, seed: int) -> None:
        drawn_steps.append((steps, dtype, n, seed))

    def plan_steps() -> None:
        if rank == 0:
            draw_steps()
        for steps, dtype, n, seed in comm.bcast(drawn_steps if rank == 0 else None, root=0):
            tried[0] += 1
            try:
                problems.extend(run_plan_steps(comm, MPI, steps, dtype, n, seed))
            except Exception:  # noqa: BLE001
                problems.append(f"rank {rank}: steps {steps}: the fuzz harness failed:\n{traceback.format_exc()}")

    if args.examples:
        collectives()
    if args.steps:
        plan_steps()
    out = np.zeros(4, np.int64)  # the communicator still works
    try:
        comm.Allreduce(np.full(4, rank + 1, np.int64), out, op=MPI.SUM)
        if out.tolist() != [size * (size + 1) // 2] * 4:
            problems.append(f"rank {rank}: Allreduce after the fuzzing gave {out.tolist()}")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"rank {rank}: Allreduce after the fuzzing raised {exc!r}")
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        tried[0] -= OUTCOMES.get("skipped (ranks would disagree)", 0)
        json.dump({"rank": rank, "size": size, "tried": tried[0], "problems": problems[:200],
                   "n_problems": len(problems), "outcomes": OUTCOMES}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
