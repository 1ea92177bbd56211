"""The data-moving collectives of mpi4py's communicator: each one's argument checks (``_*_call``, returning the
call the executor runs) and its blocking and ``I`` forms: Bcast, the gathers, the scatters, the all-to-alls
(Alltoallw among them) and Barrier. The reductions are in ``comm_reductions``."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import arrays, buffers, datatypes, derived_buffers, errors, typemap
from .algorithms.base import Call
from .buffers import IN_PLACE
from .errors import InvalidArgumentError
from .p2p_protocol import Sig, counts_hash
from .request import Request


class _WSide:
    """One side of an Alltoallw: the user's buffer as bytes and each rank's block in it (byte displacement, the
    datatype elements' ``Access`` or None for an empty block, bytes)."""

    __slots__ = ("raw", "blocks")

    def __init__(self, raw: np.ndarray, blocks: list[tuple[int, Any, int]]) -> None:
        self.raw, self.blocks = raw, blocks

    @property
    def nbytes(self) -> list[int]:
        return [n for _, _, n in self.blocks]

    def _direct(self) -> Optional[tuple[np.ndarray, list[int], list[int]]]:
        """The buffer itself with byte counts and displacements, where every block is one contiguous run."""
        if not all(a is None or a.contiguous for _, a, _ in self.blocks):
            return None
        return self.raw, self.nbytes, [d + (a.offset if a is not None else 0) for d, a, _ in self.blocks]

    def gathered(self) -> tuple[np.ndarray, list[int], list[int]]:
        """The blocks to send: the buffer itself where it can be, else a packed copy of them in rank order."""
        direct = self._direct()
        if direct is not None:
            return direct
        pieces = [a.read(self.raw[d:])[0].view(np.uint8) for d, a, _ in self.blocks if a is not None]
        packed = np.concatenate(pieces) if pieces else np.empty(0, np.uint8)
        counts = self.nbytes
        return packed, counts, [int(x) for x in np.cumsum([0] + counts[:-1])]

    def landing(self, fill: bool) -> tuple[np.ndarray, list[int], list[int], Optional["_WriteBack"]]:
        """Where the blocks are received, with byte counts and displacements: the buffer itself where it can be
        (no write-back), else a staging copy (holding the blocks now if ``fill``: in place, they are sent from there
        too) and the ``_WriteBack`` that scatters it into the user's buffer once the blocks are in."""
        direct = self._direct()
        if direct is not None:
            return (*direct, None)
        counts = self.nbytes
        stage = self.gathered()[0].copy() if fill else np.empty(sum(counts), np.uint8)
        return stage, counts, [int(x) for x in np.cumsum([0] + counts[:-1])], _WriteBack(self.raw, self.blocks, stage)

    def target(self, fill: bool) -> tuple[np.ndarray, list[int], list[int]]:
        """``landing``, its write-back left to the call's ``Unpacking`` when the call completes."""
        stage, counts, displs, back = self.landing(fill)
        if back is not None:
            current = getattr(derived_buffers.collecting, "current", None)  # the executor's collector of packed receive buffers
            if current is None:
                raise InvalidArgumentError("recvbuf: derived datatypes with gaps need the executor's write-back")
            current.packed.append(back)
        return stage, counts, displs


class _WriteBack:
    """Alltoallw's staged receive blocks, scattered into the user's buffer by ``unpack`` (as ``derived_buffers.Packed``)."""

    __slots__ = ("raw", "blocks", "stage")

    def __init__(self, raw: np.ndarray, blocks: list[tuple[int, Any, int]], stage: np.ndarray) -> None:
        self.raw, self.blocks, self.stage = raw, blocks, stage

    def unpack(self) -> None:
        off = 0
        for d, a, n in self.blocks:
            if a is None:
                continue
            piece, sub = self.stage[off:off + n], self.raw[d:]
            if a.contiguous:
                sub[a.offset:a.offset + n] = piece
            else:
                a.write(sub, piece.view(a.base))
            off += n


class _WPlan:
    """A checked Alltoallw: both sides (the same one in place) and whether the call is in place."""

    __slots__ = ("send", "recv", "in_place")

    def __init__(self, send: _WSide, recv: _WSide, in_place: bool) -> None:
        self.send, self.recv, self.in_place = send, recv, in_place


class CollectiveCalls:
    """The data-moving collectives of ``Comm`` (a mixin: ``Comm`` holds the state they use)."""

    # ---- data movement -------------------------------------------------------------------------
    def _bcast_call(self, buf: Any, root: int) -> tuple[Call, Sig]:
        name = "Bcast"
        root = self._check_root(root, name)
        b = buffers.parse(buf, "buf", name, writable=self._rank != root)
        call = Call("broadcast", b.dtype, recv=b.array, root=root)
        return call, self._sig(call, b.count)

    def Bcast(self, buf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Bcast", self._bcast_call, (buf, root), stream)

    def Ibcast(self, buf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Ibcast", self._bcast_call, (buf, root), stream)

    def _allgather_call(self, sendbuf: Any, recvbuf: Any, vector: bool) -> tuple[Call, Sig]:
        name = "Allgatherv" if vector else "Allgather"
        rv = self._per_rank(recvbuf, "recvbuf", name, vector, writable=True)
        mine = rv.counts[self._rank]
        send_arr = None
        if sendbuf is None:  # mpi4py reads None as IN_PLACE here
            sendbuf = IN_PLACE
        if sendbuf is not IN_PLACE:
            s = self._send(sendbuf, name)
            self._same_type(s.dtype, rv.dtype, name)
            if s.count != mine:
                raise InvalidArgumentError(f"sendbuf has {s.count} elements, recvbuf expects {mine} from this rank", op=name, rank=self._rank)
            self._distinct(s.array, rv.array, name)
            send_arr = s.array
        call = Call("allgather", rv.dtype, send_arr, rv.array, counts=rv.counts, displs=rv.displs, in_place=sendbuf is IN_PLACE)
        return call, self._sig(call, sum(rv.counts), counts_hash(rv.counts) if vector else 0)

    def Allgather(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Allgather", self._allgather_call, (sendbuf, recvbuf, False), stream)

    def Iallgather(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Iallgather", self._allgather_call, (sendbuf, recvbuf, False), stream)

    def Allgatherv(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Allgatherv", self._allgather_call, (sendbuf, recvbuf, True), stream)

    def Iallgatherv(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Iallgatherv", self._allgather_call, (sendbuf, recvbuf, True), stream)

    def _gather_call(self, sendbuf: Any, recvbuf: Any, root: int, vector: bool) -> tuple[Call, Sig]:
        name = "Gatherv" if vector else "Gather"
        root = self._check_root(root, name)
        at_root = self._rank == root
        if sendbuf is None and at_root:  # mpi4py reads the root's None sendbuf as IN_PLACE
            sendbuf = IN_PLACE
        if sendbuf is IN_PLACE and not at_root:
            raise InvalidArgumentError("MPI.IN_PLACE is only allowed at the root", op=name, rank=self._rank)
        send = None if sendbuf is IN_PLACE else self._send(sendbuf, name)
        recv_arr, counts, displs = None, [], []
        dtype = send.dtype if send is not None else None
        if at_root:
            rv = self._per_rank(recvbuf, "recvbuf", name, vector, writable=True)
            recv_arr, counts, displs, dtype = rv.array, rv.counts, rv.displs, rv.dtype
            if send is not None:
                self._same_type(send.dtype, rv.dtype, name)
                if send.count != counts[root]:
                    raise InvalidArgumentError(f"sendbuf has {send.count} elements, recvbuf expects {counts[root]}", op=name, rank=self._rank)
                self._distinct(send.array, rv.array, name)
        assert dtype is not None
        total = -1 if vector else (sum(counts) if at_root else self._size * send.count)  # type: ignore[union-attr]
        call = Call(
            "gather", dtype, send.array if send else None, recv_arr, root=root, counts=counts, displs=displs, in_place=send is None,
            vector=vector, total=total,
        )
        return call, self._sig(call)

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Gather", self._gather_call, (sendbuf, recvbuf, root, False), stream)

    def Igather(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Igather", self._gather_call, (sendbuf, recvbuf, root, False), stream)

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Gatherv", self._gather_call, (sendbuf, recvbuf, root, True), stream)

    def Igatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Igatherv", self._gather_call, (sendbuf, recvbuf, root, True), stream)

    def _scatter_call(self, sendbuf: Any, recvbuf: Any, root: int, vector: bool) -> tuple[Call, Sig]:
        name = "Scatterv" if vector else "Scatter"
        root = self._check_root(root, name)
        at_root = self._rank == root
        if recvbuf is None and at_root:  # mpi4py reads the root's None recvbuf as IN_PLACE
            recvbuf = IN_PLACE
        if recvbuf is IN_PLACE and not at_root:
            raise InvalidArgumentError("MPI.IN_PLACE is only allowed at the root", op=name, rank=self._rank)
        recv = None if recvbuf is IN_PLACE else buffers.parse(recvbuf, "recvbuf", name, writable=True)
        send_arr, counts, displs = None, [], []
        dtype = recv.dtype if recv is not None else None
        if at_root:
            sv = self._per_rank(sendbuf, "sendbuf", name, vector, writable=False)
            send_arr, counts, displs, dtype = sv.array, sv.counts, sv.displs, sv.dtype
            if recv is not None:
                self._same_type(sv.dtype, recv.dtype, name)
                if recv.count != counts[root]:
                    raise InvalidArgumentError(f"recvbuf has {recv.count} elements, sendbuf gives {counts[root]}", op=name, rank=self._rank)
                self._distinct(sv.array, recv.array, name)
        assert dtype is not None
        total = -1 if vector else (sum(counts) if at_root else self._size * recv.count)  # type: ignore[union-attr]
        call = Call(
            "scatter", dtype, send_arr, recv.array if recv else None, root=root, counts=counts, displs=displs, in_place=recv is None,
            vector=vector, total=total,
        )
        return call, self._sig(call)

    def Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Scatter", self._scatter_call, (sendbuf, recvbuf, root, False), stream)

    def Iscatter(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Iscatter", self._scatter_call, (sendbuf, recvbuf, root, False), stream)

    def Scatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Scatterv", self._scatter_call, (sendbuf, recvbuf, root, True), stream)

    def Iscatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Iscatterv", self._scatter_call, (sendbuf, recvbuf, root, True), stream)

    def _alltoall_call(self, sendbuf: Any, recvbuf: Any, vector: bool) -> tuple[Call, Sig]:
        name = "Alltoallv" if vector else "Alltoall"
        rv = self._per_rank(recvbuf, "recvbuf", name, vector, writable=True)
        sv = rv if sendbuf is IN_PLACE else self._per_rank(sendbuf, "sendbuf", name, vector, writable=False)
        if not vector and sv.counts != rv.counts:
            raise InvalidArgumentError(
                f"sendbuf has {sum(sv.counts)} elements, recvbuf {sum(rv.counts)}", op=name, rank=self._rank
            )
        if sv is not rv:
            self._same_type(sv.dtype, rv.dtype, name)
            self._distinct(sv.array, rv.array, name)
        call = Call(
            "alltoall",
            rv.dtype,
            sv.array,
            rv.array,
            counts=rv.counts,
            displs=rv.displs,
            send_counts=sv.counts,
            send_displs=sv.displs,
            in_place=sendbuf is IN_PLACE,
            vector=vector,
        )
        return call, self._sig(call, 0 if vector else rv.counts[0])

    def Alltoall(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Alltoall", self._alltoall_call, (sendbuf, recvbuf, False), stream)

    def Ialltoall(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Ialltoall", self._alltoall_call, (sendbuf, recvbuf, False), stream)

    def Alltoallv(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Alltoallv", self._alltoall_call, (sendbuf, recvbuf, True), stream)

    def Ialltoallv(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Ialltoallv", self._alltoall_call, (sendbuf, recvbuf, True), stream)

    # ---- Alltoallw: per-peer datatypes and byte displacements, moved as bytes by the Alltoallv machinery ------
    def _w_side(self, spec: Any, what: str, name: str, writable: bool, blocks: Optional[int] = None) -> "_WSide":
        """Resolve ``[buf, counts, displs, datatypes]``, ``[buf, (counts, displs), datatypes]`` or
        ``[buf, datatypes]`` (one element of each rank's datatype at byte 0): displacements in bytes. ``blocks``:
        how many blocks the side holds where not one a rank (a neighborhood call's, one a neighbor)."""
        size = self._size if blocks is None else blocks
        if not isinstance(spec, (list, tuple)) or not 2 <= len(spec) <= 4:
            raise InvalidArgumentError(
                f"{what} must be [buf, counts, displs, datatypes], [buf, (counts, displs), datatypes] or [buf, datatypes]",
                op=name, rank=self._rank)
        counts: Any = None
        displs: Any = None
        if len(spec) == 2:
            obj, types = spec
        elif len(spec) == 3:
            obj, pair, types = spec
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise InvalidArgumentError(f"{what}: the middle item must be (counts, displs)", op=name, rank=self._rank)
            counts, displs = pair
        else:
            obj, counts, displs, types = spec
        if obj is None:  # MPI.BOTTOM: absolute addresses
            if counts is None or displs is None:
                raise InvalidArgumentError(f"{what}: MPI.BOTTOM needs counts and displacements", op=name, rank=self._rank)
        if (counts is None) != (displs is None):
            raise InvalidArgumentError(f"{what}: give both counts and displacements, or neither", op=name, rank=self._rank)
        try:
            if counts is None:
                counts, displs = [1] * size, [0] * size
            else:
                counts = arrays.int_list(counts, size, "counts", what, name)
                displs = arrays.int_list(displs, size, "displs", what, name)
            if isinstance(types, (list, tuple)):
                if len(types) != size:
                    raise InvalidArgumentError(f"{what}: datatypes has {len(types)} entries for {size} ranks", op=name)
            else:
                types = [types] * size
            layouts = [t._live(what) if isinstance(t, datatypes.Datatype) else
                       typemap.Layout.basic(arrays.dtype_of(t, what, name)) for t in types]
            if obj is None:  # MPI.BOTTOM: the datatypes' displacements are absolute addresses
                return self._w_bottom(counts, displs, layouts, what, name)
            flat = arrays.as_flat_array(obj, what, name)
            device = isinstance(flat, arrays.DeviceArray)
            raw = flat.view(np.uint8) if device else derived_buffers.raw_bytes(obj, what, name)
        except InvalidArgumentError as err:
            raise InvalidArgumentError(err.cause, op=name, rank=self._rank) from None
        if writable and not arrays.is_writable(raw):
            raise InvalidArgumentError(f"{what} is read-only", op=name, rank=self._rank)
        nbytes = int(raw.shape[0])
        blocks: list[tuple[int, Any, int]] = []  # per rank: (byte displacement, Access or None, bytes)
        for i, (c, d, layout) in enumerate(zip(counts, displs, layouts)):
            if c < 0 or d < 0:
                raise InvalidArgumentError(f"{what}: rank {i}'s count {c} or displacement {d} is negative", op=name,
                                           rank=self._rank)
            if c == 0 or layout.elements == 0:
                blocks.append((d, None, 0))
                continue
            try:
                if d > nbytes:
                    raise ValueError(f"displacement {d} is past the end")
                access = layout.access(c, nbytes - d)
            except ValueError as exc:
                raise InvalidArgumentError(
                    f"{what}: rank {i}'s block ({c} elements at byte {d}) does not fit the {nbytes}-byte buffer ({exc})",
                    op=name, rank=self._rank) from None
            if device and not access.contiguous:
                raise InvalidArgumentError(f"{what}: rank {i}'s datatype has gaps; derived datatypes with gaps take host "
                                           "buffers", op=name, rank=self._rank)
            blocks.append((d, access, access.count * layout.base.itemsize))
        if writable:  # contiguous blocks written twice: MPI forbids it
            spans = [(d + a.offset, n) for d, a, n in blocks if a is not None and a.contiguous]
            try:
                arrays.check_disjoint([n for _, n in spans], [s for s, _ in spans], what, name)
            except InvalidArgumentError as err:
                raise InvalidArgumentError(err.cause.replace("elements", "bytes"), op=name, rank=self._rank) from None
        return _WSide(raw, blocks)

    def _w_bottom(self, counts: list, displs: list, layouts: list, what: str, name: str) -> "_WSide":
        """An Alltoallw side at MPI.BOTTOM: each block's bytes lie at absolute host addresses (its datatype's
        displacements from ``MPI.Get_address``, plus its byte displacement). The side's buffer is a byte array
        made over the span from the lowest to the highest address touched, kept only for the call."""
        runs: list = []  # per rank: (absolute starts, lengths, layout) or None
        lo, hi = None, None
        for i, (c, d, layout) in enumerate(zip(counts, displs, layouts)):
            if c < 0 or d < 0:
                raise InvalidArgumentError(f"{what}: rank {i}'s count {c} or displacement {d} is negative", op=name,
                                           rank=self._rank)
            if c == 0 or layout.elements == 0:
                runs.append(None)
                continue
            starts, lengths = layout._runs(np.arange(c, dtype=np.int64))
            starts = starts + d
            first, last = int(starts.min()), int((starts + lengths * layout.base.itemsize).max())
            if first <= 0:
                raise InvalidArgumentError(f"{what}: rank {i}'s block starts at address {first}; with MPI.BOTTOM the "
                                           "datatype's displacements must be absolute addresses (MPI.Get_address)",
                                           op=name, rank=self._rank)
            lo = first if lo is None else min(lo, first)
            hi = last if hi is None else max(hi, last)
            runs.append((starts, lengths, layout))
        if lo is None:
            return _WSide(np.empty(0, np.uint8), [(0, None, 0) for _ in runs])
        import ctypes
        span = hi - lo
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(lo))
        blocks: list[tuple[int, Any, int]] = []
        for r in runs:
            if r is None:
                blocks.append((0, None, 0))
                continue
            starts, lengths, layout = r
            access = typemap.Access(layout.base, *typemap._merge(starts - lo, lengths, layout.base.itemsize), span)
            blocks.append((0, access, access.count * layout.base.itemsize))
        return _WSide(raw, blocks)

    def _alltoallw_plan(self, sendbuf: Any, recvbuf: Any, name: str) -> "_WPlan":
        """Check both sides here, then agree with every rank on the byte counts (one small Allgather), so that a
        mismatch, or a rank whose arguments were wrong, makes every rank raise before any data moves."""
        size = self._size
        plan: Optional[_WPlan] = None
        failure: Optional[BaseException] = None
        try:
            recv = self._w_side(recvbuf, "recvbuf", name, writable=True)
            if sendbuf is IN_PLACE:
                send = recv
            else:
                send = self._w_side(sendbuf, "sendbuf", name, writable=False)
                if arrays.overlaps(send.raw, recv.raw):
                    raise InvalidArgumentError("sendbuf and recvbuf overlap; pass MPI.IN_PLACE instead", op=name,
                                               rank=self._rank)
            plan = _WPlan(send, recv, sendbuf is IN_PLACE)
            mine = np.array(send.nbytes + recv.nbytes, np.int64)
        except (InvalidArgumentError, errors.NotProvidedError) as err:
            failure = err
            mine = np.full(2 * size, -1, np.int64)
        table = np.empty((size, 2 * size), np.int64)
        self.Allgather(mine, table)
        if failure is not None:
            raise failure
        assert plan is not None
        bad = [j for j in range(size) if table[j, 0] < 0]
        if bad:
            raise errors.RemoteError(f"rank {bad[0]} rejected its own arguments to this call", op=name, rank=self._rank,
                                     peers=bad)
        for j in range(size):  # j sends table[j, i] bytes to i, which expects table[i, size + j]
            for i in range(size):
                sent, expected = int(table[j, i]), int(table[i, size + j])
                if sent != expected:
                    raise errors.MismatchError(
                        f"rank {j} sends {sent} bytes to rank {i}, which expects {expected} bytes from it", op=name,
                        rank=self._rank, peers=sorted({i, j} - {self._rank}))
        return plan

    def _alltoallw_call(self, plan: "_WPlan") -> tuple[Call, Sig]:
        recv_arr, rcounts, rdispls = plan.recv.target(fill=plan.in_place)
        if plan.in_place:  # each block is sent from where the block from that rank is received
            send_arr, scounts, sdispls = recv_arr, rcounts, rdispls
        else:
            send_arr, scounts, sdispls = plan.send.gathered()
        call = Call("alltoall", np.dtype(np.uint8), send_arr, recv_arr, counts=rcounts, displs=rdispls,
                    send_counts=scounts, send_displs=sdispls, in_place=plan.in_place, vector=True)
        return call, self._sig(call, 0)

    def Alltoallw(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802
        self._x.run("Alltoallw", self._alltoallw_call, (self._alltoallw_plan(sendbuf, recvbuf, "Alltoallw"),))

    def Ialltoallw(self, sendbuf: Any, recvbuf: Any) -> Request:  # noqa: N802
        return self._x.start("Ialltoallw", self._alltoallw_call, (self._alltoallw_plan(sendbuf, recvbuf, "Ialltoallw"),))

    def _barrier_call(self) -> tuple[Call, Sig]:
        call = Call("barrier", np.dtype(np.uint8))
        return call, self._sig(call)

    def Barrier(self) -> None:  # noqa: N802
        self._x.run("Barrier", self._barrier_call, ())

    def Ibarrier(self) -> Request:  # noqa: N802
        return self._x.start("Ibarrier", self._barrier_call, ())

